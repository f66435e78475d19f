"""Coverage-guided fuzzing of the parsers that read what others hand over (atheris, libFuzzer).

    pip install atheris                                # bench only, not a project dependency
    python bench/fuzz.py --minutes 5                   # every target, 5 minutes each
    python bench/fuzz.py --target torch_file --minutes 1 --corpus /tmp/fuzz/corpus \\
        --crashes /tmp/fuzz/crashes
    python bench/fuzz.py --target vlm_reply --replay FILE ...   # one input each: its outcome
    python bench/fuzz.py --hypothesis 200     # no atheris: a hypothesis pass of 200 per target

One target per parser (`TARGETS`), each fed bytes:

    vlm_reply      data_prep.vlm.parse_response (the reply as UTF-8 text)    refuses ParseError
    loose_json     data_prep.loose_json.parse_at(text, 0)                    refuses nothing
    psg            data_prep.scene_graphs.psg.read (the bytes are psg.json)  refuses USER_ERRORS
    coco_captions  data_prep.scene_graphs.psg.read_captions                  refuses USER_ERRORS
    vg             data_prep.scene_graphs.vg.read (a JSON object {image_data, objects,
                   relationships, region_descriptions} written as the four files, or the bytes
                   as each of them)                                          refuses USER_ERRORS
    record         sclaro_jax.data.schema.decode + validate, then pipeline.sample_views (the
                   record's images decoded to arrays)                        refuses RecordError
    torch_file     sclaro_jax.models.torch_files.read_torch_file (shapes only) and
                   read_state_dict (bytes starting "PK": the file; else data.pkl, zipped here
                   with storages data/0..7 of 64 bytes each)                  refuses USER_ERRORS
    safetensors    torch_files.read_state_dict (safe_open, and its bfloat16 reader) and
                   hf_weights.read_safetensors (load_file)                   refuses USER_ERRORS
    selftest       not in "all": the harness's own check (inputs starting SEGV, HANG or RAISE
                   crash each way; REFUSE is refused)

USER_ERRORS are `sclaro_jax.cli.USER_ERRORS` (OSError, ValueError, KeyError: what the commands
report as one `error:` line); ParseError is what `annotate` catches around the reply parser and
RecordError what the input pipeline catches around a record. A *crash* is any other exception
(RecursionError, MemoryError and AssertionError included: the vlm_reply and loose_json targets
also check the documented shape of the result), a fatal signal (a segmentation fault), an input
that runs longer than --timeout seconds, or a process over --rss-mb MiB resident (libFuzzer's
limit; each process may also map only --rss-mb MiB more than it holds after its imports, so that
most huge allocations are MemoryErrors where they are asked for). Each target runs in its own
process: a Python exception is recorded there and fuzzing goes on (its first input saved as
`CRASHES/<target>/exception-<signature hash>-<sha1>`); a fatal signal, hang or memory blow-up
ends the process, libFuzzer saves the input (`crash-`, `timeout-`, `oom-<sha1>`), the input is
replayed in a fresh process (`--replay`, with faulthandler) for the Python stack it died in, and
the target is restarted for the time left. Printed per target: executions, executions/s (over
the target's wall time, process starts included), crashes (inputs) and distinct signatures.

Seeds (written under CORPUS/<target>/seed-*, where libFuzzer also keeps the inputs it finds):
the replies of tests/data/vlm_replies.json and scripted replies of the demo's annotations, the
prompt's own example, a PSG json of two entries and COCO captions as released, a Visual Genome
set, a version-1 and a version-2 record of tiny JPEGs (`schema.encode`), a `torch.save` zip and
its data.pkl, a safetensors file (`safetensors.numpy.save_file`) and one of bfloat16 tensors
written from the format's description. Exit status 1 when a target crashed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

USER_ERRORS = (OSError, ValueError, KeyError)  # sclaro_jax.cli.USER_ERRORS (not imported: jax)
PICKLE_STORAGES = 8  # storages data/0..7 the torch_file target zips with a bare data.pkl
STORAGE_BYTES = 64
VG_FILES = ("image_data", "objects", "relationships", "region_descriptions")


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    modules: tuple[str, ...]  # instrumented for coverage (imported inside atheris's hook)
    make: Callable[[Path], tuple[Callable[[bytes], object], tuple[type, ...]]]
    seeds: Callable[[], dict[str, bytes]]
    tokens: tuple[str, ...] = ()  # a libFuzzer dictionary


# ------------------------------------------------------------------------- the targets

def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _notes_known(notes) -> None:
    from data_prep.vlm_reply import RECOVERY_NOTES
    for note in notes:
        assert any(note == c or (c.endswith(":") and note.startswith(c))
                   for c in RECOVERY_NOTES), f"undocumented note {note!r}"


def _make_vlm_reply(scratch: Path):
    from data_prep import vlm

    def run(data: bytes):
        got = vlm.parse_response(_text(data))
        assert set(got) == {"action", "objects", "relations", "caption", "notes"}, got
        assert isinstance(got["action"], str) and isinstance(got["caption"], str)
        objects = got["objects"]
        assert len(objects) <= vlm.MAX_OBJECTS and all(isinstance(o, str) and o
                                                       for o in objects), objects
        assert len({o.lower() for o in objects}) == len(objects), objects
        for subject, predicate, obj in got["relations"]:
            assert subject in objects and obj in objects and predicate, got["relations"]
        _notes_known(got["notes"])
    return run, (vlm.ParseError,)


def _make_loose_json(scratch: Path):
    from data_prep import loose_json

    def run(data: bytes):
        text = _text(data)
        notes = loose_json.Notes()
        _, end = loose_json.parse_at(text, 0, notes)
        assert end is None or 0 < end <= len(text), end
        _notes_known(notes)
    return run, ()


def _make_psg(scratch: Path):
    from data_prep.scene_graphs import psg
    (scratch / "coco" / "annotations").mkdir(parents=True, exist_ok=True)
    (scratch / "coco" / "annotations" / "captions_train2017.json").write_bytes(
        _seeds_coco_captions()["captions"])

    def run(data: bytes):
        (scratch / "psg.json").write_bytes(data)
        psg.read(str(scratch))
    return run, USER_ERRORS


def _make_coco_captions(scratch: Path):
    from data_prep.scene_graphs import psg

    def run(data: bytes):
        path = scratch / "captions_train2017.json"
        path.write_bytes(data)
        psg.read_captions([str(path)])
    return run, USER_ERRORS


def _make_vg(scratch: Path):
    from data_prep.scene_graphs import vg

    def run(data: bytes):
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            doc = None
        for name in VG_FILES:
            part = (json.dumps(doc.get(name, [])).encode() if isinstance(doc, dict)
                    and set(doc) & set(VG_FILES) else data)
            (scratch / f"{name}.json").write_bytes(part)
        vg.read(str(scratch))
    return run, USER_ERRORS


def _make_record(scratch: Path):
    from sclaro_jax.data import pipeline, schema
    config = pipeline.PipelineConfig(image_size=16, train=False)

    def run(data: bytes):
        sample = schema.decode(data)
        schema.validate(sample, decode_images=False)
        pipeline.sample_views(sample, config)
    return run, (schema.RecordError,)


def _zip_pickle(pkl: bytes) -> bytes:
    """A torch.save-style zip of a bare data.pkl, with storages 0..7 to point at."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        for k in range(PICKLE_STORAGES):
            z.writestr(f"archive/data/{k}", bytes((k * 37 + i) % 256 for i in
                                                  range(STORAGE_BYTES)))
    return out.getvalue()


def _make_torch_file(scratch: Path):
    from sclaro_jax.models import torch_files

    def run(data: bytes):
        path = scratch / "weights.pt"
        path.write_bytes(data if data.startswith(b"PK") else _zip_pickle(data))
        torch_files.read_torch_file(path, shapes_only=True)
        torch_files.read_state_dict(path)
    return run, USER_ERRORS


def _make_safetensors(scratch: Path):
    from sclaro_jax.models import hf_weights, torch_files

    def run(data: bytes):
        path = scratch / hf_weights.WEIGHTS_NAME
        path.write_bytes(data)
        for reader in (lambda: torch_files.read_state_dict(path, shapes_only=True),
                       lambda: torch_files.read_state_dict(path),
                       lambda: hf_weights.read_safetensors(scratch)):
            try:
                reader()
            except USER_ERRORS:
                pass
    return run, USER_ERRORS


def _make_selftest(scratch: Path):
    """The harness's own check (not in "all"): each way of crashing on a marked input."""
    def run(data: bytes):
        if data.startswith(b"SEGV"):
            import ctypes
            ctypes.string_at(0)  # reads address 0: a segmentation fault
        elif data.startswith(b"HANG"):
            while True:
                pass
        elif data.startswith(b"RAISE"):
            raise RuntimeError("planted")
        elif data.startswith(b"REFUSE"):
            raise ValueError("refused")
    return run, (ValueError,)


# ------------------------------------------------------------------------- seeds

def _seeds_vlm_reply() -> dict[str, bytes]:
    from data_prep import testing, vlm
    seeds = {f"corpus-{i:03d}": e["reply"].encode() for i, e in enumerate(json.loads(
        (ROOT / "tests" / "data" / "vlm_replies.json").read_text(encoding="utf-8")))}
    seeds["prompt-example"] = vlm.PROMPT[vlm.PROMPT.index("{"):].encode()
    demo = json.loads((ROOT / "data_prep" / "demo" / "annotations.json").read_text())
    for image in demo["images"]:
        names = [o["name"] for o in image["objects"]]
        rels = [(names[r["subject"]], r["predicate"], names[r["object"]])
                for r in image["relations"]]
        seeds[f"demo-{image['id']}"] = testing.scripted_reply(
            image["action"], names, rels, image["caption"]).encode()
    return seeds


def _seeds_loose_json() -> dict[str, bytes]:
    seeds = _seeds_vlm_reply()
    seeds.update({"python": b"{'a': (1, 2.5e3, None, True), b: [..., \xe2\x80\x9cq\xe2\x80\x9d]}",
                  "comments": b"[1, // one\n 2 /* two */, -3,]", "nested": b"[[[[{}]]]]"})
    return seeds


PSG_THINGS, PSG_STUFF = ["person", "cup"], ["wall-other-merged", "sky-other-merged"]


def _seeds_psg() -> dict[str, bytes]:
    data = []
    for image_id, segments in (("1", [(1, 0, (0, 0, 32, 48)), (2, 2, (32, 0, 64, 48))]),
                               ("2", [(3, 1, (8, 8, 24, 24)), (4, 3, (0, 0, 64, 8))])):
        data.append({
            "file_name": f"train2017/{int(image_id):012d}.jpg", "image_id": image_id,
            "width": 64, "height": 48,
            "pan_seg_file_name": f"panoptic_train2017/{int(image_id):012d}.png",
            "segments_info": [{"id": sid, "category_id": c, "iscrowd": 0, "isthing": int(c < 2),
                               "area": 1, "bbox": [x0, y0, x1 - x0, y1 - y0]}
                              for sid, c, (x0, y0, x1, y1) in segments],
            "annotations": [{"bbox": list(box), "bbox_mode": 0, "category_id": c}
                            for _, c, box in segments],
            "relations": [[0, 1, 0], [1, 0, 1]]})
    doc = {"data": data, "thing_classes": PSG_THINGS, "stuff_classes": PSG_STUFF,
           "predicate_classes": ["over", "beside"], "test_image_ids": ["2"]}
    return {"psg": json.dumps(doc).encode()}


def _seeds_coco_captions() -> dict[str, bytes]:
    doc = {"images": [{"id": 1, "file_name": "000000000001.jpg"},
                      {"id": 2, "file_name": "000000000002.jpg"}],
           "annotations": [{"id": 7, "image_id": 1, "caption": "A person beside a wall."},
                           {"id": 3, "image_id": 1, "caption": "Someone in front of a wall"},
                           {"id": 9, "image_id": 2, "caption": "A cup under the sky"}]}
    return {"captions": json.dumps(doc).encode()}


def _seeds_vg() -> dict[str, bytes]:
    def obj(object_id, box, name, key="names"):
        return {"object_id": object_id, "x": box[0], "y": box[1], "w": box[2], "h": box[3],
                key: [name] if key == "names" else name}
    url = "https://cs.stanford.edu/people/rak248/VG_100K/{}.jpg"
    doc = {
        "image_data": [{"image_id": 10, "url": url.format(10), "width": 96, "height": 72},
                       {"id": 11, "width": 80, "height": 64}],
        "objects": [{"image_id": 10, "objects": [obj(100, (5, 6, 40, 50), "Man"),
                                                 obj(101, (50, 10, 40, 30), "horse")]},
                    {"image_id": 11, "objects": [obj(200, (20, 10, 30, 25), "cat", "name")]}],
        "relationships": [
            {"image_id": 10, "relationships": [
                {"predicate": "RIDING", "subject": {"object_id": 100},
                 "object": {"object_id": 101}},
                {"predicate": "wears", "subject": {"object_id": 100},
                 "object": obj(103, (10, 0, 20, 10), "cap", "name")}]},
            {"image_id": 11, "relationships": [
                {"predicate": "on", "subject": {"object_id": 200},
                 "object": {"object_id": 999}}]}],
        "region_descriptions": [{"id": 10, "regions": [{"phrase": "a man riding a horse"}]},
                                {"id": 11, "regions": [{"phrase": "cat on a table"}]}]}
    return {"vg": json.dumps(doc).encode(),
            "vg-image-data": json.dumps(doc["image_data"]).encode()}


def _jpeg(pixels, size) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.fromarray(pixels).resize(size).save(out, "JPEG", quality=90)
    return out.getvalue()


def _seeds_record() -> dict[str, bytes]:
    from data_prep.testing import photograph
    from sclaro_jax.data import schema
    photo, width, height, view = photograph("coffee"), 48, 32, 16
    objects = (schema.Object("cup", (4.0, 4.0, 30.0, 28.0)),
               schema.Object("saucer", (0.0, 10.0, 48.0, 32.0)))
    text = schema.triplet_text("cup", "on", "saucer")
    v1 = schema.Sample(
        id="fuzz-v1", source="synthetic", split="train", image=_jpeg(photo, (width, height)),
        width=width, height=height, action="drinking", caption="A cup on a saucer.",
        objects=objects, relations=(schema.Relation(0, "on", 1, text,
                                                    _jpeg(photo, (width, height))),),
        mask_kind="box")
    tw, th = schema.train_image_size(width, height, view)
    v2 = dataclasses.replace(
        v1, id="fuzz-v2", image=None, view_size=view, train_image=_jpeg(photo, (tw, th)),
        objects=tuple(dataclasses.replace(o, view=_jpeg(photo, (view, view))) for o in objects),
        relations=(schema.Relation(0, "on", 1, text, None, _jpeg(photo, (view, view))),))
    return {"v1": schema.encode(v1), "v2": schema.encode(v2)}


def _seeds_torch_file() -> dict[str, bytes]:
    import torch
    state = {"w": torch.arange(4.0), "b": torch.zeros(2, 3, dtype=torch.float16)[:, 1],
             "n": torch.tensor([1, 2], dtype=torch.int64)}
    out = io.BytesIO()
    torch.save(state, out)
    with zipfile.ZipFile(io.BytesIO(out.getvalue())) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    return {"torch-save": out.getvalue(), "data-pkl": pkl}


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    """A safetensors file from its description: u64 little-endian header size, the JSON header
    (padded with spaces to a multiple of 8), the tensors' bytes."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


def _seeds_safetensors() -> dict[str, bytes]:
    import numpy as np
    from safetensors.numpy import save
    real = save({"w": np.arange(4, dtype=np.float32), "b": np.zeros((2, 2), np.float16)},
                metadata={"format": "pt"})
    bf16 = safetensors_bytes({"__metadata__": {"format": "pt"},
                              "w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
                              "n": {"dtype": "I32", "shape": [2], "data_offsets": [8, 16]}},
                             bytes(range(16)))
    return {"numpy": bytes(real), "bf16": bf16}


JSON_TOKENS = ('"', "{", "}", "[", "]", ":", ",", "true", "null", "-1e9", '"\\u00e9"', "NaN",
               "Infinity")
TARGETS = {t.name: t for t in (
    Target("vlm_reply", ("data_prep.vlm", "data_prep.vlm_reply", "data_prep.loose_json"),
           _make_vlm_reply, _seeds_vlm_reply,
           JSON_TOKENS + ('"action"', '"objects"', '"relations"', '"dense caption"', "```json",
                          "'", "(", ")", "True", "None", "...", "//", "/*", "<", ">", "|",
                          "\u201c", "\u201d")),
    Target("loose_json", ("data_prep.loose_json",), _make_loose_json, _seeds_loose_json,
           JSON_TOKENS + ("'", "(", ")", "True", "None", "...", "//", "/*", "*/", "\u2026",
                          "\u2018", "\u201e")),
    Target("psg", ("data_prep.scene_graphs", "data_prep.source_items"), _make_psg, _seeds_psg,
           JSON_TOKENS + ('"data"', '"segments_info"', '"relations"', '"category_id"',
                          '"annotations"', '"bbox"', '"file_name"', '"pan_seg_file_name"')),
    Target("coco_captions", ("data_prep.scene_graphs.psg", "data_prep.source_items"),
           _make_coco_captions, _seeds_coco_captions,
           JSON_TOKENS + ('"images"', '"annotations"', '"image_id"', '"caption"')),
    Target("vg", ("data_prep.scene_graphs", "data_prep.source_items"), _make_vg, _seeds_vg,
           JSON_TOKENS + ('"object_id"', '"names"', '"subject"', '"object"', '"predicate"',
                          '"url"', '"x"', '"w"')),
    Target("record", ("sclaro_jax.data.schema", "sclaro_jax.data.decode",
                      "sclaro_jax.data.pipeline", "sclaro_jax.data.augment",
                      "sclaro_jax.data.collate"), _make_record, _seeds_record),
    Target("torch_file", ("sclaro_jax.models.torch_files",), _make_torch_file,
           _seeds_torch_file),
    Target("safetensors", ("sclaro_jax.models.torch_files", "sclaro_jax.models.hf_weights"),
           _make_safetensors, _seeds_safetensors,
           ('"dtype"', '"shape"', '"data_offsets"', '"BF16"', '"F32"', '"I64"', "[0, 8]",
            '"__metadata__"')),
    Target("selftest", (), _make_selftest,
           lambda: {k.lower(): k.encode() for k in ("SEGV", "HANG", "RAISE", "REFUSE")}),
)}


ALL = tuple(n for n in TARGETS if n != "selftest")


# ------------------------------------------------------------------------- one input

_LOADED: dict[str, tuple] = {}


def scratch_folder(name: str) -> Path:
    """A new folder for target `name` to write its inputs into (in memory where it can)."""
    return Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-", dir="/dev/shm" if os.access(
        "/dev/shm", os.W_OK) else None))


def runner(name: str, scratch: str | None = None):
    """(run, refusals) of target `name`, made once per process, writing its inputs into
    `scratch` (default: a folder made here and removed at a normal exit)."""
    if name not in _LOADED:
        if scratch is None:
            import atexit
            scratch = scratch_folder(name)
            atexit.register(shutil.rmtree, scratch, True)
        _LOADED[name] = TARGETS[name].make(Path(scratch))
    return _LOADED[name]


def signature(error: BaseException) -> str:
    """'Type at file:line': the innermost frame of this checkout's code (not this file)."""
    frames = traceback.extract_tb(error.__traceback__)
    here = [f for f in frames if f.filename.startswith(str(ROOT))
            and not f.filename.endswith("bench/fuzz.py")]
    frame = (here or frames or [None])[-1]
    where = "?" if frame is None else f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}"
    return f"{type(error).__name__} at {where}"


def crash_of(name: str, data: bytes) -> tuple[str, BaseException] | None:
    """(signature, exception) when target `name` crashes on `data` in this process, None when
    it reads the input or refuses it with one of its refusal types."""
    run, refusals = runner(name)
    try:
        run(data)
    except refusals:
        return None
    except Exception as error:  # RecursionError and MemoryError are Exceptions
        return signature(error), error
    return None


def limit_memory(mib: int) -> None:
    """Allow this process `mib` MiB of address space more than it holds now (Linux), so that
    an input asking for more raises MemoryError where it allocates."""
    import resource
    status = Path("/proc/self/status")
    vm = re.search(r"VmSize:\s+(\d+) kB", status.read_text()) if status.exists() else None
    if vm:
        limit = int(vm.group(1)) * 1024 + mib * 2 ** 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


# ------------------------------------------------------------------------- hypothesis pass

def mutants(name: str):
    """A hypothesis strategy of inputs for target `name`: a seed with up to 8 byte edits
    (replace, insert, delete, or insert one of the target's tokens), or a short random input."""
    from hypothesis import strategies as st
    seeds = [data for _, data in sorted(TARGETS[name].seeds().items())]
    tokens = [t.encode() for t in TARGETS[name].tokens] or [b"\0"]
    edit = st.tuples(st.sampled_from("ridt"), st.integers(0, 1 << 20), st.integers(0, 255))

    def apply(seed: bytes, edits) -> bytes:
        out = bytearray(seed)
        for op, at, value in edits:
            at %= len(out) + 1
            if op == "i":
                out.insert(at, value)
            elif op == "t":
                out[at:at] = tokens[value % len(tokens)]
            elif out and op == "r":
                out[at % len(out)] = value
            elif out and op == "d":
                del out[at % len(out)]
        return bytes(out)
    return st.one_of(st.builds(apply, st.sampled_from(seeds), st.lists(edit, max_size=8)),
                     st.binary(max_size=64))


def hypothesis_pass(name: str, examples: int) -> list[tuple[str, bytes]]:
    """(signature, input) of each crash of target `name` in a derandomized hypothesis pass of
    `examples` inputs (`mutants`), in this process."""
    from hypothesis import HealthCheck, Phase, given, settings
    found: list[tuple[str, bytes]] = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(mutants(name))
    def check(data: bytes):
        crash = crash_of(name, data)
        if crash is not None:
            found.append((crash[0], data))
    check()
    return found


# ------------------------------------------------------------------------- child process

def child(args) -> None:
    """One target under libFuzzer: Python crashes recorded in --stats and saved, fuzzing on."""
    import atheris
    with atheris.instrument_imports(include=list(TARGETS[args.child].modules)):
        runner(args.child, args.scratch)
    limit_memory(args.rss_mb)  # a huge allocation: a MemoryError here, not a restart
    for hook in ("RegEx", "str"):
        atheris.enabled_hooks.add(hook)
    crashes_dir = Path(args.crashes)
    stats = {"executions": 0, "crashes": {}}
    last = [time.monotonic()]

    def write_stats():
        tmp = f"{args.stats}.tmp"
        Path(tmp).write_text(json.dumps(stats))
        os.replace(tmp, args.stats)
        last[0] = time.monotonic()

    def one_input(data: bytes):
        stats["executions"] += 1
        found = crash_of(args.child, data)
        if found is not None:
            sig, error = found
            entry = stats["crashes"].setdefault(sig, {"count": 0, "inputs": []})
            entry["count"] += 1
            digest = hashlib.sha1(data).hexdigest()
            if len(entry["inputs"]) < 100 and digest not in entry["inputs"]:
                entry["inputs"].append(digest)
            if entry["count"] == 1:
                path = crashes_dir / (f"exception-{hashlib.sha1(sig.encode()).hexdigest()[:8]}"
                                      f"-{digest}")
                path.write_bytes(data)
                entry.update(file=str(path), error=f"{type(error).__name__}: "
                                                   f"{str(error)[:300]}")
                print(f"CRASH {sig}: {entry['error']} (input {path})", file=sys.stderr,
                      flush=True)
            write_stats()
        elif time.monotonic() - last[0] > 0.5:
            write_stats()

    write_stats()
    atheris.Setup([sys.argv[0], *args.libfuzzer], one_input)
    atheris.Fuzz()


# ------------------------------------------------------------------------- parent

def write_seeds(name: str, folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    seeds = TARGETS[name].seeds()
    for key, data in seeds.items():
        path = folder / f"seed-{key}"
        if not path.exists():
            path.write_bytes(data)
    return len(seeds)


def replay_signature(name: str, path: Path, args) -> str:
    """The Python frame a fatal input dies in, replayed in a fresh process with faulthandler
    (and an address-space limit of --rss-mb more than the target's own, so that an input that
    blew the memory limit raises MemoryError where it allocates)."""
    scratch = scratch_folder(name)
    try:
        proc = subprocess.run([sys.executable, __file__, "--target", name,
                               "--timeout", str(args.timeout), "--rss-mb", str(args.rss_mb),
                               "--scratch", str(scratch), "--replay", str(path)],
                              capture_output=True, text=True, timeout=args.timeout + 120)
    except subprocess.TimeoutExpired:
        return "hang (replay did not end)"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    frames = re.findall(r'File "([^"]+)", line (\d+)', proc.stderr)
    ours = [f for f in frames if f[0].startswith(str(ROOT)) and "bench/fuzz.py" not in f[0]]
    kind = next((k for k in ("Segmentation fault", "Aborted", "Bus error", "Timeout",
                             "Floating point exception") if k in proc.stderr), None)
    if kind is None:
        crash = re.search(r"CRASH (\S+ at \S+?):? ", proc.stdout)
        return crash.group(1) if crash else f"exit {proc.returncode} on replay"
    where = f" at {os.path.relpath(ours[0][0], ROOT)}:{ours[0][1]}" if ours else ""
    return f"{kind}{where}"


def _dict_escape(token: str) -> str:
    """A libFuzzer dictionary entry's body: printable ASCII as is, other bytes as \\xNN."""
    return "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\x{b:02x}"
                   for b in token.encode())


def _artifacts(folder: Path) -> set[Path]:
    return {p for p in folder.iterdir() if p.name.split("-")[0] in ("crash", "timeout", "oom")}


def _forget_in_corpus(corpus: Path, data: bytes) -> None:
    """A fatal input found in the corpus (a seed, say) would end every restart: moved out."""
    for path in corpus.iterdir():
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            path.unlink()


def fuzz_target(name: str, args) -> dict:
    corpus, crashes = Path(args.corpus) / name, Path(args.crashes) / name
    seeds = write_seeds(name, corpus)
    crashes.mkdir(parents=True, exist_ok=True)
    tokens = TARGETS[name].tokens
    flags = [f"-timeout={args.timeout}", f"-rss_limit_mb={args.rss_mb}",
             f"-artifact_prefix={crashes}/", "-print_final_stats=1",
             f"-report_slow_units={args.timeout + 1}"]
    if tokens:
        dict_file = crashes / "tokens.dict"
        dict_file.write_text("".join(f'"{_dict_escape(t)}"\n' for t in tokens))
        flags.append(f"-dict={dict_file}")
    if args.seed:
        flags.append(f"-seed={args.seed}")
    if args.runs:
        flags.append(f"-runs={args.runs}")
    result = {"target": name, "seeds": seeds, "executions": 0, "seconds": 0.0,
              "signatures": {}, "restarts": 0}
    inputs: set[str] = set()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    log = open(Path(args.crashes) / f"{name}.log", "w")
    while (left := deadline - time.monotonic()) >= 1 and result["restarts"] <= args.restarts:
        stats = crashes / ".stats.json"
        before = _artifacts(crashes)
        offset = log.tell()
        scratch = scratch_folder(name)  # removed here: libFuzzer ends the child without atexit
        cmd = [sys.executable, __file__, "--child", name, "--stats", str(stats), "--crashes",
               str(crashes), "--rss-mb", str(args.rss_mb), "--scratch", str(scratch), "--",
               *flags, f"-max_total_time={max(1, int(left))}", str(corpus)]
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=left + 120 + args.timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "killed"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log.flush()
        got = json.loads(stats.read_text()) if stats.exists() else {"executions": 0,
                                                                    "crashes": {}}
        stats.unlink(missing_ok=True)
        with open(log.name, errors="replace") as f:  # libFuzzer's count, when it printed one
            f.seek(offset)
            final = re.findall(r"stat::number_of_executed_units: *(\d+)", f.read())
        got["executions"] = max([got["executions"], *map(int, final)])
        result["executions"] += got["executions"]
        for sig, entry in got["crashes"].items():
            seen = result["signatures"].setdefault(sig, {"count": 0, **entry})
            seen["count"] += entry["count"]
            inputs.update(entry["inputs"])
        fatal = sorted(_artifacts(crashes) - before)
        for path in fatal:
            sig = f"{path.name.split('-')[0]}: " + replay_signature(name, path, args)
            seen = result["signatures"].setdefault(sig, {"count": 0, "file": str(path)})
            seen["count"] += 1
            inputs.add(path.name.split("-")[1])
            _forget_in_corpus(corpus, path.read_bytes())
        if not fatal:
            if code != 0 and got["executions"] == 0:
                log.close()
                raise SystemExit(f"error: target {name}: the fuzzing process ended with "
                                 f"{code} before any input; see {log.name}")
            break
        result["restarts"] += 1
    log.close()
    result["seconds"] = round(time.monotonic() - start, 1)
    result["inputs"] = len(inputs)
    return result


def report(result: dict) -> None:
    rate = result["executions"] / max(result["seconds"], 1e-9)
    print(f"{result['target']}: {result['executions']:,} executions in {result['seconds']:.1f} s"
          f" ({rate:,.0f}/s), {result['inputs']} crashing inputs, "
          f"{len(result['signatures'])} distinct crashes", flush=True)
    for sig, entry in result["signatures"].items():
        print(f"  {sig} x{entry['count']}: {entry.get('error', '')} {entry.get('file', '')}",
              flush=True)


def replay(args) -> int:
    """Each --replay file through the target once: ok, refused, or CRASH with its traceback."""
    import faulthandler
    faulthandler.enable()  # a fatal signal prints the Python stack it came in
    runner(args.target, args.scratch)  # imports first: the limits are the input's
    limit_memory(args.rss_mb)
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    crashed = 0
    for path in args.replay:
        found = crash_of(args.target, Path(path).read_bytes())
        if found is None:
            print(f"{path}: ok (read or refused)")
            continue
        crashed += 1
        sig, error = found
        print(f"CRASH {sig}: {type(error).__name__}: {str(error)[:300]} ({path})")
        traceback.print_exception(error, file=sys.stderr)
    faulthandler.cancel_dump_traceback_later()
    return 1 if crashed else 0


def quick(args) -> int:
    """--hypothesis N: each target's crashes in a hypothesis pass, their inputs saved."""
    crashed = 0
    for name in ALL if args.target == "all" else [args.target]:
        start = time.monotonic()
        found = hypothesis_pass(name, args.hypothesis)
        print(f"{name}: {args.hypothesis} hypothesis inputs in {time.monotonic() - start:.1f} s,"
              f" {len(found)} crashes", flush=True)
        folder = Path(args.crashes) / name
        for sig, data in found:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"hypothesis-{hashlib.sha1(data).hexdigest()}"
            path.write_bytes(data)
            print(f"  {sig} ({path})", flush=True)
        crashed += bool(found)
    return 1 if crashed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/fuzz.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=["all", *TARGETS], default="all",
                        help="the parser to fuzz (default: all, one after another)")
    parser.add_argument("--minutes", type=float, default=1.0, help="per target (default 1)")
    parser.add_argument("--corpus", default="/tmp/sclaro-fuzz/corpus",
                        help="seeds and found inputs, a folder per target")
    parser.add_argument("--crashes", default="/tmp/sclaro-fuzz/crashes",
                        help="crashing inputs and logs, a folder per target")
    parser.add_argument("--timeout", type=int, default=10,
                        help="seconds one input may take before it counts as a hang")
    parser.add_argument("--rss-mb", type=int, default=2048, help="memory limit (MiB)")
    parser.add_argument("--restarts", type=int, default=20,
                        help="restarts after fatal crashes, per target, at most")
    parser.add_argument("--seed", type=int, default=0, help="libFuzzer's seed (0: random)")
    parser.add_argument("--runs", type=int, default=0,
                        help="stop a fuzzing process after this many inputs (0: no limit)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--replay", nargs="+", metavar="FILE",
                        help="run these inputs once through --target and say what happened")
    parser.add_argument("--hypothesis", type=int, metavar="N",
                        help="instead of atheris: a derandomized hypothesis pass of N inputs "
                             "per target, in this process (no restart after a fatal crash)")
    parser.add_argument("--scratch", help="the folder the file targets write each input into "
                                          "(default: a new one, removed at exit)")
    parser.add_argument("--child", choices=list(TARGETS), help=argparse.SUPPRESS)
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    parser.add_argument("libfuzzer", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.replay:
        if args.target == "all":
            parser.error("--replay needs --target NAME")
        return replay(args)
    if args.hypothesis:
        return quick(args)
    if args.minutes <= 0 or args.timeout < 1 or args.rss_mb < 256:
        parser.error("--minutes must be > 0, --timeout >= 1 and --rss-mb >= 256")
    try:
        import atheris  # noqa: F401
    except ImportError:
        parser.exit(2, "error: fuzzing needs atheris (pip install atheris); --replay does "
                       "not\n")
    results = []
    for name in ALL if args.target == "all" else [args.target]:
        results.append(fuzz_target(name, args))
        report(results[-1])
    print("\n| target | executions | exec/s | crashes (distinct) |\n|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['target']} | {r['executions']:,} | "
              f"{r['executions'] / max(r['seconds'], 1e-9):,.0f} | {r['inputs']} "
              f"({len(r['signatures'])}) |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any(r["signatures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
