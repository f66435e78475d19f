"""The hostile-input corpus (SECURITY.md): files and folders crafted as an attacker, or a careless
colleague, would make them, each run through the real command. Every case ends in one of two
ways: exit 2 with one `error:` line and no traceback, or a counted skip; no payload runs (a
payload only ever writes a marker file); the user's files in a sentinel folder outside every path
a command was given are byte-identical before and after (hashed).

Each crafted file is built here from the published format it imitates (a torch zip, a PSG json,
a FAISS header, a JPEG header), never from this project's own writers alone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "PAYLOAD-RAN"  # the file a payload writes where it can; no test may find one


# ------------------------------------------------------------------------------------------------
# The harness every case uses
# ------------------------------------------------------------------------------------------------

def cli(*argv: str, cwd=None, env: dict | None = None, timeout: float = 300,
        stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """`python ARGV...` with the interpreter running the tests and this checkout first on the
    path (so a command that starts from another folder still runs the code under test)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
    environ.update(env or {})
    return subprocess.run([sys.executable, *argv], cwd=cwd or ROOT, env=environ, text=True,
                          capture_output=True, timeout=timeout, stdin=stdin)


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, exactly one `error:` line (the last one) holding each of `words`, no traceback;
    returns the line."""
    err = proc.stderr
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err[-3000:]
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


def assert_no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-3000:]


def payload_code(marker: Path) -> str:
    """Python that writes `marker`: the whole of every payload in this corpus."""
    return f"open({str(marker)!r}, 'w').write('ran')\n"


def tree_hashes(folder: Path) -> dict[str, str]:
    """{relative path: sha256 of its bytes, or '-> target' of a link, or '/' of a folder}."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "/"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class Sentinel:
    """A user's folder outside every path a command is given: a few files of their own, hashed
    when made; `check()` asserts nothing in it was written, moved or deleted, and that no
    payload's marker appeared in it or at `marker`."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True)
        (folder / "thesis.tex").write_text("\\section{Results}\n" * 50)
        (folder / "notes").mkdir()
        (folder / "notes" / "todo.txt").write_text("back up the results\n")
        (folder / "weights.bin").write_bytes(os.urandom(4096))
        self.marker = folder.parent / MARKER
        self.hashes = tree_hashes(folder)

    def check(self) -> None:
        assert not self.marker.exists(), "a payload ran"
        assert tree_hashes(self.folder) == self.hashes, "the user's folder changed"


@pytest.fixture
def sentinel(tmp_path) -> Sentinel:
    """A `Sentinel` beside the test's own folders, checked after the test."""
    s = Sentinel(tmp_path / "users_files")
    yield s
    s.check()


def test_the_sentinel_sees_a_write_a_deletion_and_a_marker(tmp_path):
    """The harness can fail: each kind of change to the user's folder is seen."""
    for change in (lambda s: (s.folder / "thesis.tex").write_text("gone"),
                   lambda s: (s.folder / "notes" / "todo.txt").unlink(),
                   lambda s: (s.folder / "new.txt").write_text("x"),
                   lambda s: s.marker.write_text("ran")):
        s = Sentinel(tmp_path / os.urandom(4).hex() / "users_files")
        change(s)
        with pytest.raises(AssertionError):
            s.check()


def test_assert_refused_rejects_a_traceback_and_a_second_error_line():
    def done(rc, err):
        return subprocess.CompletedProcess([], rc, "", err)

    assert assert_refused(done(2, "warning: x\nerror: bad --nprobe\n"), "--nprobe")
    for rc, err in ((1, "error: x\n"), (2, "Traceback (most recent call last):\nerror: x\n"),
                    (2, "error: x\nerror: y\n"), (2, "error: x\nmore\n"), (0, "")):
        with pytest.raises(AssertionError):
            assert_refused(done(rc, err))


# ------------------------------------------------------------------------------------------------
# Why 1-2: nothing deleted that the command did not make; writes never follow links
# ------------------------------------------------------------------------------------------------

# (end of writes and deletions)


# ------------------------------------------------------------------------------------------------
# Why 4: no code from data files (pickles, repository code, configs' folders)
# ------------------------------------------------------------------------------------------------

# (end of code from data)


# ------------------------------------------------------------------------------------------------
# Why 3, 6, 7 (files): bounds before bytes (torch files, FAISS, image headers, JSON, labels,
# control characters)
# ------------------------------------------------------------------------------------------------

# (end of bounds)


# ------------------------------------------------------------------------------------------------
# Why 5, 8: paths from data stay inside their root; services on loopback only
# ------------------------------------------------------------------------------------------------

def _jpeg_with(marker: bytes, size=(64, 48)) -> bytes:
    """A real photograph (skimage's astronaut) as a baseline JPEG, with `marker` planted in a
    COM segment (FF FE, 2-byte length, then the bytes) right after SOI: any copy of the file's
    bytes carries the marker, and any JPEG reader still decodes it."""
    import io

    import skimage.data
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(skimage.data.astronaut()).resize(size).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    assert data[:2] == b"\xff\xd8"
    return data[:2] + b"\xff\xfe" + (len(marker) + 2).to_bytes(2, "big") + marker + data[2:]


def _plant(sentinel: Sentinel, name: str, data: bytes) -> Path:
    """A private file of the user's, `name` in their folder (hashed with the rest)."""
    path = sentinel.folder / name
    path.write_bytes(data)
    sentinel.hashes = tree_hashes(sentinel.folder)
    return path


def _private_photo(sentinel: Sentinel, name: str = "private.jpg") -> tuple[Path, bytes]:
    """(path, marker): a photograph in the user's folder whose bytes hold a unique marker."""
    marker = b"PRIVATE-" + os.urandom(8).hex().encode()
    return _plant(sentinel, name, _jpeg_with(marker)), marker


def _assert_nowhere(marker: bytes, *folders: Path) -> None:
    """No file under `folders` holds `marker`, nor any record of a dataset among them (the
    records read back through the dataset reader, whatever the shards' compression)."""
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                assert marker not in path.read_bytes(), f"{path} holds the outside file's bytes"
        for manifest in folder.rglob("manifest.json"):
            from sclaro_jax.data import schema
            from sclaro_jax.data.dataset import open_dataset
            ds = open_dataset(str(manifest.parent))
            for split in schema.SPLITS:
                if split in ds.manifest["splits"]:
                    for _, record in ds.records(split):
                        assert marker not in record, f"a record of {manifest.parent} holds it"


def _panoptic_png(path: Path, size, segments) -> None:
    """A COCO panoptic PNG: each pixel's segment id as R + 256 G + 256^2 B; `segments` are
    (id, (x0, y0, x1, y1)) boxes painted in order (0 = void)."""
    import numpy as np
    from PIL import Image

    ids = np.zeros(size[::-1], np.int64)
    for sid, (x0, y0, x1, y1) in segments:
        ids[y0:y1, x0:x1] = sid
    rgb = np.stack([ids % 256, ids // 256 % 256, ids // 65536], -1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(path)


PSG_SEGMENTS = [(11, (4, 4, 30, 40)), (12, (34, 4, 60, 40))]  # person, cat; 64 x 48 photos


def _psg_root(root: Path, hostile: dict) -> Path:
    """An OpenPSG root as released (psg.json, coco/ images and panoptic PNGs, COCO captions)
    with one good image (id 1) and one whose entry is `hostile` over a good entry (id 2)."""
    import json

    coco = root / "coco"
    entries = []
    for image_id in (1, 2):
        name = f"{image_id:012d}"
        (coco / "train2017").mkdir(parents=True, exist_ok=True)
        (coco / "train2017" / f"{name}.jpg").write_bytes(_jpeg_with(b"inside"))
        _panoptic_png(coco / "panoptic_train2017" / f"{name}.png", (64, 48), PSG_SEGMENTS)
        entries.append({
            "file_name": f"train2017/{name}.jpg", "image_id": image_id, "height": 48,
            "width": 64, "pan_seg_file_name": f"panoptic_train2017/{name}.png",
            "segments_info": [{"id": sid, "category_id": c, "iscrowd": 0, "isthing": 1,
                               "area": 1} for (sid, _), c in zip(PSG_SEGMENTS, (0, 1))],
            "annotations": [{"bbox": list(box), "bbox_mode": 0, "category_id": c}
                            for (_, box), c in zip(PSG_SEGMENTS, (0, 1))],
            "relations": [[0, 1, 0]]})
    entries[1].update(hostile)
    (root / "psg.json").write_text(json.dumps({
        "data": entries, "thing_classes": ["person", "cat"], "stuff_classes": [],
        "predicate_classes": ["beside"], "test_image_ids": []}))
    (coco / "annotations").mkdir()
    (coco / "annotations" / "captions_train2017.json").write_text(json.dumps({
        "images": [{"id": i, "file_name": f"{i:012d}.jpg"} for i in (1, 2)],
        "annotations": [{"id": i, "image_id": i, "caption": "A person beside a cat."}
                        for i in (1, 2)]}))
    return root


@pytest.mark.parametrize("how", ["absolute", "climbing", "link", "panoptic"])
def test_psg_paths_that_leave_the_root_are_skipped_unread(tmp_path, sentinel, how):
    """A PSG entry naming a photograph (or panoptic PNG) of the user's outside --root: by an
    absolute file_name, by ../ out of coco/, by a link inside the root that points out, or by
    a pan_seg_file_name climbing out. The import skips it as outside_root and never reads it."""
    photo, marker = _private_photo(sentinel)
    png = sentinel.folder / "private.png"  # a real panoptic PNG of the photograph's size
    _panoptic_png(png, (64, 48), PSG_SEGMENTS)
    sentinel.hashes = tree_hashes(sentinel.folder)
    coco = tmp_path / "psg" / "coco"
    hostile = {"absolute": {"file_name": str(photo)},
               "climbing": {"file_name": os.path.relpath(photo, coco)},
               "link": {},
               "panoptic": {"pan_seg_file_name": os.path.relpath(png, coco)}}[how]
    root = _psg_root(tmp_path / "psg", hostile)
    if how == "link":
        target = coco / "train2017" / "000000000002.jpg"
        target.unlink()
        target.symlink_to(photo)
    out = tmp_path / "out"
    proc = cli("-m", "data_prep", "import", "--source", "psg", "--root", str(root), "--out",
               str(out), "--no-actions", "--keep-originals", "--workers", "1", "--no-progress")
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped: outside_root 1" in proc.stdout, proc.stdout
    import json
    summary = json.loads((out / "manifest.json").read_text())["import"]
    assert summary["kept"] == 1 and summary["skipped"] == {"outside_root": 1}, summary
    _assert_nowhere(marker, out)


def test_visual_genome_paths_that_leave_the_root_are_skipped_unread(tmp_path, sentinel):
    """Visual Genome entries whose image id (VG_100K/<id>.jpg) or url (its last two parts)
    climbs out of --root, to the user's photograph and to one beside the root."""
    import json

    photo, marker = _private_photo(sentinel)
    beside = tmp_path / "private.jpg"  # <root>/../private.jpg
    beside.write_bytes(photo.read_bytes())
    root = tmp_path / "vg"
    (root / "VG_100K").mkdir(parents=True)
    (root / "VG_100K" / "1.jpg").write_bytes(_jpeg_with(b"inside"))
    climbing = os.path.relpath(photo.with_suffix(""), root / "VG_100K")  # ../../users_files/..
    images = [{"image_id": 1, "url": "https://cs.stanford.edu/rak248/VG_100K/1.jpg",
               "width": 64, "height": 48},
              {"image_id": climbing, "url": None, "width": 64, "height": 48},
              {"image_id": 3, "url": "https://cs.stanford.edu/rak248/../private.jpg",
               "width": 64, "height": 48}]
    keys = [1, climbing, 3]
    objects = [{"object_id": 1, "x": 4, "y": 4, "w": 26, "h": 36, "names": ["man"]},
               {"object_id": 2, "x": 34, "y": 4, "w": 26, "h": 36, "names": ["cat"]}]
    for name, doc in (
            ("image_data", images),
            ("objects", [{"image_id": k, "objects": objects} for k in keys]),
            ("relationships", [{"image_id": k, "relationships": [
                {"predicate": "beside", "subject": {"object_id": 1},
                 "object": {"object_id": 2}}]} for k in keys]),
            ("region_descriptions", [{"id": k, "regions": [{"phrase": "a man beside a cat"}]}
                                     for k in keys])):
        (root / f"{name}.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    proc = cli("-m", "data_prep", "import", "--source", "vg", "--root", str(root), "--out",
               str(out), "--no-actions", "--keep-originals", "--workers", "1", "--no-progress")
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "manifest.json").read_text())["import"]
    assert summary["kept"] == 1 and summary["skipped"] == {"outside_root": 2}, summary
    _assert_nowhere(marker, out)


def _hf_folder(folder: Path, rows: list[dict]) -> Path:
    """A Hugging Face `datasets` folder as save_to_disk writes it (an Arrow IPC stream,
    dataset_info.json, state.json) whose Image column holds `rows`' {"bytes", "path"} structs
    as given: datasets itself embeds a local file's bytes when it saves, a folder made
    elsewhere need not."""
    import datasets
    import pyarrow as pa

    features = datasets.Features({"image": datasets.Image(), "key": datasets.Value("string")})
    datasets.Dataset.from_dict({"image": [{"bytes": b"", "path": None}] * len(rows),
                                "key": [r["key"] for r in rows]},
                               features=features).save_to_disk(str(folder))
    (arrow,) = folder.glob("data-*.arrow")
    with pa.ipc.open_stream(pa.OSFile(str(arrow))) as reader:
        table = reader.read_all()
    field = table.schema.field("image")
    table = table.set_column(table.schema.get_field_index("image"), field, pa.array(
        [r["image"] for r in rows], type=field.type))
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return folder


def test_hf_dataset_row_naming_an_absolute_path_is_skipped_unread(tmp_path, sentinel):
    """`annotate --source hf` over a datasets folder whose second row is {bytes: None, path:
    /the/user's/photo.jpg}: the row fails as outside_root, nothing of the photo is read into
    the records or the work folder; the other row is annotated as usual."""
    import json

    from data_prep import detect, segment
    from data_prep.testing import scripted_reply

    photo, marker = _private_photo(sentinel)
    data = _hf_folder(tmp_path / "hf", [
        {"key": "good", "image": {"bytes": _jpeg_with(b"inside"), "path": None}},
        {"key": "evil", "image": {"bytes": None, "path": str(photo)}}])
    models = tmp_path / "models"
    detect.save_tiny_model(str(models / "gdino"))
    segment.save_tiny_sam(str(models / "sam.pth"))
    reply = scripted_reply("standing", ["person", "cat"], [("person", "beside", "cat")],
                           "a person beside a cat")
    (models / "replies.json").write_text(json.dumps({"hf/good": reply, "hf/evil": reply}))
    out, work = tmp_path / "out", tmp_path / "work"
    proc = cli("-m", "data_prep", "annotate", "--source", "hf", "--root", str(data), "--out",
               str(out), "--work", str(work), "--vlm-replies", str(models / "replies.json"),
               "--detector", str(models / "gdino"), "--sam", str(models / "sam.pth"),
               "--sam-type", "tiny", "--device", "cpu", "--box-threshold", "0.05",
               "--text-threshold", "0.05", "--keep-originals", "--no-progress")
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["images"] == 2 and summary["failed"] == {"outside_root": 1}, summary
    assert "outside_root 1" in proc.stdout, proc.stdout
    _assert_nowhere(marker, out, work)


def test_webdataset_members_are_listed_by_header_and_never_extracted(tmp_path, sentinel):
    """A webdataset shard whose keys climb out (`../`), are absolute, or are a link member
    pointing at the user's file: the listing reads headers only, a link member is no image,
    and nothing is written outside (or inside) the folder of the tar."""
    import io
    import tarfile

    from data_prep.sources import iter_source, read_image

    photo, marker = _private_photo(sentinel)
    shard = tmp_path / "shards" / "00000.tar"
    shard.parent.mkdir()
    good = _jpeg_with(b"inside")
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in (("000000001.jpg", good), ("../../users_files/000000002.jpg", good),
                           ("/tmp/000000003.jpg", good)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("000000004.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, str(photo)
        tar.addfile(link)
    before = tree_hashes(tmp_path)
    items = list(iter_source("webdataset", str(shard)))
    # members are read in place by their byte range: the link member is not an image
    assert "webdataset/00000/000000004" not in [it.id for it in items]
    for item in items:
        assert read_image(item)[0] == good
    assert tree_hashes(tmp_path) == before  # nothing extracted anywhere


def test_rocs_evaluation_leaves_out_a_caption_file_image_outside_its_folder(tmp_path,
                                                                            sentinel):
    """`python -m sclaro_jax.eval.rocs --split caps=captions.json --image-root IMAGES` where the
    COCO captions file names the user's photograph by an absolute path: the image is left out
    of the gallery unread (counted as outside_root in results.json and said on stderr)."""
    import json

    photo, _ = _private_photo(sentinel)
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        (images / f"{i}.jpg").write_bytes(_jpeg_with(f"inside {i}".encode(), (48 + 8 * i, 40)))
    doc = {"images": [{"id": i, "file_name": f"{i}.jpg"} for i in range(3)]
                     + [{"id": 3, "file_name": str(photo)}],
           "annotations": [{"image_id": i, "caption": f"a photograph number {i}"}
                           for i in range(4)]}
    (tmp_path / "captions.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    proc = cli("-m", "sclaro_jax.eval.rocs", "--model", "planted-colours", "--split",
               f"caps={tmp_path / 'captions.json'}", "--image-root", str(images), "--out",
               str(out), "--rescore", "none", "--k", "1", "--no-progress")
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    split = json.loads((out / "results.json").read_text())["splits"]["caps"]
    assert split["images"] == 3 and split["queries"] == 3, split
    assert split["skipped"] == {"outside_root": 1}, split
    assert "caps: 1 images left out of the gallery unread (outside_root" in proc.stderr


def test_a_dataset_manifest_naming_a_shard_outside_its_folder_is_refused(tmp_path, sentinel):
    """A dataset folder whose manifest.json lists, as one of its shards, an ArrayRecord file of
    the user's outside the folder (`../../users_files/private.array_record`): `reshard` refuses
    the dataset in one line naming the file, reads none of its records and writes nothing."""
    import json

    from data_prep.demo import build_demo

    data = tmp_path / "shared" / "data"
    build_demo(str(data), image_size=32, progress=False)
    manifest = json.loads((data / "manifest.json").read_text())
    entry = manifest["splits"]["train"]["shards"][0]
    private = _plant(sentinel, "private.array_record", (data / entry["file"]).read_bytes())
    (data / entry["file"]).unlink()
    entry["file"] = os.path.relpath(private, data)
    (data / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    proc = cli("-m", "data_prep", "reshard", "--in", str(data), "--out", str(out),
               "--image-size", "32", "--workers", "1", "--no-progress")
    assert_refused(proc, "private.array_record", "outside")
    assert not out.exists()


@pytest.fixture(scope="module")
def local_ray():
    """The Ray `annotate --engine ray` starts on this machine (no --ray-address), through the
    project's own `start_ray`, with 2 CPUs; shut down at the end of the module."""
    ray = pytest.importorskip("ray")
    from data_prep.annotate.ray_start import start_ray

    start_ray(num_cpus=2)
    yield ray
    ray.shutdown()


def _listening(pids) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every listening TCP socket of the processes."""
    import psutil

    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out += [(pid, proc.name(), c.laddr.ip, c.laddr.port)
                    for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return out


def test_the_ray_annotate_starts_listens_on_loopback_only(local_ray):
    """Every listening TCP socket of the Ray processes (this driver, GCS server, raylet and
    its object manager, workers, agents) is bound to 127.0.0.1, never to every interface."""
    import ipaddress

    import psutil

    @local_ray.remote
    def worker_pid():
        return os.getpid()

    workers = set(local_ray.get([worker_pid.remote() for _ in range(2)]))
    me = psutil.Process()
    pids = {me.pid, *workers, *(p.pid for p in me.children(recursive=True))}
    sockets = _listening(pids)
    # the test sees Ray's servers: the GCS server and the raylet listen, so it can fail
    assert {"gcs_server", "raylet"} <= {name for _, name, *_ in sockets}, sockets
    exposed = [s for s in sockets if not ipaddress.ip_address(
        s[2].removeprefix("::ffff:")).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"


# (end of paths and services)


# ------------------------------------------------------------------------------------------------
# Why 7 (commands): the index commands' numbers and interrupts, missing extras
# ------------------------------------------------------------------------------------------------

# (end of index commands)
