"""`annotate --source webdataset` and `--source hf`: images read in place from .tar shards
(img2dataset's webdataset layout, written with webdataset's TarWriter) and from a `datasets`
folder (save_to_disk) give the records of the same images in a plain folder, byte for byte once
id/source/split (which name the source) are set equal, and `--source-option name=cc3m` over the
tars gives exactly the records of the `cc3m` adapter over img2dataset's files layout; a
SIGKILLed webdataset run resumes to the same bytes; `--engine ray` with its default stage
settings (`--stage-cpus auto`) runs on 2 CPUs. Tiny random GroundingDINO and SAM, scripted VLM
replies, real photographs."""

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest
from PIL import Image

from conftest import init_ray
from data_prep.sources import SourceError, iter_source, read_image
from data_prep.testing import SCENES, photograph, scripted_reply
from sclaro_jax.data import schema
from test_annotate import _records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHOTOS = {k: v for k, v in SCENES.items() if k != "immunohistochemistry"}
BATCH = 2


def _keys():
    """(shard, key, photograph name, mirrored) for 4 images in two shards of 2."""
    out = []
    for i, (name, mirrored) in enumerate([("astronaut", False), ("coffee", False),
                                          ("chelsea", False), ("chelsea", True)]):
        out.append((f"{i // 2:05d}", f"{i:09d}", name, mirrored))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_torch_thread):
    import datasets
    import webdataset as wds

    from data_prep import detect, segment
    base = tmp_path_factory.mktemp("streaming")
    jpegs, replies, rows = {}, {}, []
    for shard, key, name, mirrored in _keys():
        img = Image.fromarray(photograph(name))
        img.thumbnail((128, 128))
        if mirrored:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        data = buf.getvalue()
        jpegs[(shard, key)] = data
        caption = f"a photograph of {name} {key}"
        meta = {"caption": caption, "key": key, "url": f"http://example.com/{key}.jpg",
                "status": "success", "width": img.width, "height": img.height}
        # img2dataset's files layout (the cc3m adapter) and a plain folder of the same files
        for root in ("files", "folder"):
            os.makedirs(base / root / shard, exist_ok=True)
            (base / root / shard / f"{key}.jpg").write_bytes(data)
        (base / "files" / shard / f"{key}.txt").write_text(caption)
        (base / "files" / shard / f"{key}.json").write_text(json.dumps(meta))
        rows.append({"image": {"bytes": data, "path": None}, "key": f"{shard}/{key}",
                     "caption": caption})
        action, objects, relations = PHOTOS[name]
        reply = scripted_reply(action, objects, relations, f"a {name}")
        for image_id in (f"folder/{shard}/{key}.jpg", f"cc3m/{shard}/{key}",
                         f"webdataset/{shard}/{key}", f"hf/{shard}/{key}"):
            replies[image_id] = reply
    os.makedirs(base / "tars")
    for shard in sorted({s for s, *_ in _keys()}):  # img2dataset's webdataset layout
        with wds.TarWriter(str(base / "tars" / f"{shard}.tar")) as sink:
            for s, key, *_ in _keys():
                if s == shard:
                    caption = (base / "files" / s / f"{key}.txt").read_text()
                    sink.write({"__key__": key, "jpg": jpegs[(s, key)], "txt": caption,
                                "json": (base / "files" / s / f"{key}.json").read_bytes()})
    features = datasets.Features({"image": datasets.Image(), "key": datasets.Value("string"),
                                  "caption": datasets.Value("string")})
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(base / "hf"))
    models = tmp_path_factory.mktemp("models")
    detect.save_tiny_model(str(models / "gdino"))
    segment.save_tiny_sam(str(models / "sam.pth"))
    (models / "replies.json").write_text(json.dumps(replies))
    return dict(base=base, jpegs=jpegs, tars=str(base / "tars" / "{00000..00001}.tar"),
                detector=str(models / "gdino"), sam=str(models / "sam.pth"),
                replies=str(models / "replies.json"))


def _config(setup, out, source, root, options=(), **kw):
    from data_prep.annotate import AnnotateConfig
    return AnnotateConfig(
        source=source, root=root, source_options=tuple(options), out=str(out / "out"),
        work=str(out / "work"), vlm_replies=setup["replies"], detector=setup["detector"],
        sam=setup["sam"], sam_type="tiny", device="cpu", box_threshold=0.05,
        text_threshold=0.05, batch_size=BATCH, records_per_shard=2, progress=False, **kw)


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    """The local engine over the folder, the cc3m files layout, the tars named cc3m and the
    datasets folder (the models loaded once)."""
    from data_prep.annotate import annotate, load_models
    base = setup["base"]
    sources = {"folder": ("folder", str(base / "folder"), ()),
               "cc3m": ("cc3m", str(base / "files"), ()),
               "wds_cc3m": ("webdataset", setup["tars"], (("name", "cc3m"),)),
               "hf": ("hf", str(base / "hf"), ())}
    models = None
    out = {}
    for label, (source, root, options) in sources.items():
        where = tmp_path_factory.mktemp(label)
        cfg = _config(setup, where, source, root, options)
        models = models or load_models(cfg)
        summary = annotate(cfg, models=models)
        out[label] = dict(summary=summary, records=_records(where / "out"), base=where)
    out["models"] = models
    return out


def _as_folder(records: dict, prefix: str) -> dict:
    """Records re-encoded with the folder source's id, source and split (the fields that name
    where an image came from), keyed by the folder id."""
    out = {}
    for image_id, rec in records.items():
        assert image_id.startswith(prefix + "/")
        folder_id = "folder/" + image_id[len(prefix) + 1:] + ".jpg"
        out[folder_id] = (image_id, schema.decode(rec))
    return out


def _assert_same_as_folder(folder: dict, records: dict, prefix: str) -> None:
    moved = _as_folder(records, prefix)
    assert sorted(moved) == sorted(folder) and len(folder) >= 2
    for folder_id, rec in folder.items():
        image_id, sample = moved[folder_id]
        want = schema.decode(rec)
        assert (sample.id, sample.source) == (image_id, prefix)
        same = dataclasses.replace(sample, id=want.id, source=want.source, split=want.split)
        assert schema.encode(same) == rec, folder_id
        assert schema.encode(want) == rec  # the folder record re-encodes to itself


def test_listing_reads_headers_only_and_keeps_captions(setup):
    items = list(iter_source("webdataset", setup["tars"]))
    assert [i.id for i in items] == [f"webdataset/{s}/{k}" for s, k, *_ in _keys()]
    for item, (shard, key, name, _) in zip(items, _keys()):
        assert item.path == str(setup["base"] / "tars" / f"{shard}.tar")
        assert item.member == f"{key}.jpg" and item.caption == f"a photograph of {name} {key}"
        with open(item.path, "rb") as f:  # the recorded byte range is the member's data
            f.seek(item.offset)
            assert f.read(item.size) == setup["jpegs"][(shard, key)]
        data, image = read_image(item)
        assert data == setup["jpegs"][(shard, key)]
        assert image.size == Image.open(io.BytesIO(data)).size
    # a folder of tars and a single tar list the same members
    folder = list(iter_source("webdataset", str(setup["base"] / "tars")))
    assert folder == items
    one = list(iter_source("webdataset", str(setup["base"] / "tars" / "00001.tar")))
    assert one == items[2:]
    # name=cc3m: the ids, source and captions of the cc3m adapter over the files layout
    named = list(iter_source("webdataset", setup["tars"], name="cc3m"))
    files = list(iter_source("cc3m", str(setup["base"] / "files")))
    assert [(i.id, i.source, i.caption) for i in named] == [
        (i.id, i.source, i.caption) for i in files]
    assert [read_image(i)[0] for i in named] == [read_image(i)[0] for i in files]


def test_hf_rows_keep_raw_bytes_ids_and_captions(setup, tmp_path):
    import datasets
    items = list(iter_source("hf", str(setup["base"] / "hf")))
    assert [i.id for i in items] == [f"hf/{s}/{k}" for s, k, *_ in _keys()]
    for item, (shard, key, name, _) in zip(items, _keys()):
        assert read_image(item)[0] == setup["jpegs"][(shard, key)]
        assert item.caption == f"a photograph of {name} {key}" and item.column == "image"
    # a DatasetDict: split= picks the split; no id column: zero-padded row numbers; an image
    # stored by path
    ds = datasets.load_from_disk(str(setup["base"] / "hf")).remove_columns(["key"])
    path = str(setup["base"] / "folder" / "00000" / "000000000.jpg")
    by_path = datasets.Dataset.from_dict(
        {"picture": [path], "text": ["by path"]},
        features=datasets.Features({"picture": datasets.Image(),
                                    "text": datasets.Value("string")}))
    datasets.DatasetDict({"train": ds, "val": by_path}).save_to_disk(str(tmp_path / "dd"))
    train = list(iter_source("hf", str(tmp_path / "dd"), name="mine"))
    assert [i.id for i in train] == [f"mine/{r}" for r in range(4)]
    assert train[2].split == "train" and train[2].caption == items[2].caption
    assert read_image(train[2])[0] == read_image(items[2])[0]
    (val,) = iter_source("hf", str(tmp_path / "dd"), split="val")
    assert (val.id, val.caption, val.column) == ("hf/0", "by path", "picture")
    assert read_image(val)[0] == setup["jpegs"][("00000", "000000000")]
    with pytest.raises(SourceError, match=r"has no split 'test'; its splits: train, val"):
        iter_source("hf", str(tmp_path / "dd"), split="test")
    with pytest.raises(SourceError, match=r"has no column 'nope' \(caption_column\)"):
        iter_source("hf", str(tmp_path / "dd"), caption_column="nope")


def test_broken_shards_are_named(setup, tmp_path):
    tar = setup["base"] / "tars" / "00000.tar"
    data = tar.read_bytes()
    with pytest.raises(SourceError, match=r"1 of the 3 tars of .*\{00000..00002\}.tar are "
                                          r"missing, e.g. .*00002.tar"):
        iter_source("webdataset", str(setup["base"] / "tars" / "{00000..00002}.tar"))
    first = next(iter_source("webdataset", str(tar)))
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[:first.offset + first.size // 2])
    with pytest.raises(SourceError, match=r"cut.tar is truncated: member 000000000.jpg needs "
                                          r"bytes up to \d+, the file has \d+"):
        iter_source("webdataset", str(cut))
    cut.write_bytes(data)  # listed whole, cut afterwards: read_image names the member
    item = next(iter_source("webdataset", str(cut)))
    cut.write_bytes(data[:item.offset + 10])
    with pytest.raises(SourceError, match=r"webdataset/cut/000000000: cannot read image "
                                          r".*cut.tar member 000000000.jpg: .*truncated"):
        read_image(item)
    lone = tmp_path / "lone.tar"  # a caption without an image
    with tarfile.open(lone, "w") as t:
        info = tarfile.TarInfo("000000007.txt")
        info.size = 3
        t.addfile(info, io.BytesIO(b"cat"))
    with pytest.raises(SourceError, match=r"lone.tar: key '000000007' has no image \(members "
                                          r"000000007.txt\)"):
        iter_source("webdataset", str(lone))
    mixed = tmp_path / "mixed.tar"  # skip_missing=true skips such a key
    with tarfile.open(mixed, "w") as t:
        for name, data in (("000000007.txt", b"cat"), ("000000008.jpg", setup["jpegs"][
                ("00000", "000000000")])):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    (item,) = iter_source("webdataset", str(mixed), skip_missing=True)
    assert item.id == "webdataset/mixed/000000008" and item.caption is None


@pytest.mark.slow
def test_sources_give_the_folder_records(runs):
    folder = runs["folder"]["records"]
    summaries = {k: {f: v for f, v in r["summary"].items() if f != "stage_seconds_this_run"}
                 for k, r in runs.items() if k != "models"}
    assert len(summaries) == 4 and summaries["folder"]["kept"] >= 3
    assert len({json.dumps(s, sort_keys=True) for s in summaries.values()}) == 1
    _assert_same_as_folder(folder, runs["hf"]["records"], "hf")
    _assert_same_as_folder(folder, runs["cc3m"]["records"], "cc3m")
    # the tars named cc3m: exactly the cc3m adapter's records, ids, source and split included
    assert runs["wds_cc3m"]["records"] == runs["cc3m"]["records"]


def _cli(setup, base, *extra):
    return [sys.executable, "-m", "data_prep", "annotate", "--source", "webdataset", "--root",
            setup["tars"], "--source-option", "name=cc3m", "--out", str(base / "out"),
            "--work", str(base / "work"), "--vlm-replies", setup["replies"], "--detector",
            setup["detector"], "--sam", setup["sam"], "--sam-type", "tiny", "--device", "cpu",
            "--box-threshold", "0.05", "--text-threshold", "0.05", "--batch-size", str(BATCH),
            "--records-per-shard", "2", "--no-progress", *extra]


@pytest.mark.slow
def test_webdataset_resumes_after_sigkill(setup, runs, tmp_path):
    cmd = _cli(setup, tmp_path)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    blocks = tmp_path / "work" / "blocks"

    def finished():
        return sum(n.endswith(".json") for n in os.listdir(blocks)) if blocks.exists() else 0

    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and finished() < 1:
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert finished() == 1 and not (tmp_path / "out" / "manifest.json").exists()
    # the rerun: the command's settings, in this process (the CLI's parsing checked above)
    from data_prep.annotate import annotate
    summary = annotate(_config(setup, tmp_path, "webdataset", setup["tars"],
                               (("name", "cc3m"),)), models=runs["models"])
    vlm_chunks = sorted(json.loads(line)["chunk"] for line in
                        (tmp_path / "work" / "vlm.jsonl").read_text().splitlines())
    assert vlm_chunks == [0, 1]  # every block through stage 1 exactly once
    assert summary["images_from_cache"] == BATCH
    assert _records(tmp_path / "out") == runs["wds_cc3m"]["records"]


# --------------------------------------------------------------------------- Ray defaults


def test_auto_stage_cpus():
    from data_prep.annotate.ray_engine import auto_stage_cpus
    assert auto_stage_cpus(2, 3) == 0.58  # (2 - 0.25) / 3, rounded down
    assert auto_stage_cpus(64, 3) == 1.0
    assert auto_stage_cpus(1, 3) == 0.25
    assert auto_stage_cpus(1, 4) is None
    from data_prep.__main__ import build_parser
    parser = build_parser()
    base = ["annotate", "--root", "r", "--out", "o"]
    assert parser.parse_args(base).stage_cpus == "auto"
    assert parser.parse_args(base + ["--stage-cpus", "0.5"]).stage_cpus == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--stage-cpus", "lots"])


@pytest.mark.slow
def test_ray_with_default_stage_settings_runs_on_two_cpus(setup, runs, tmp_path):
    """The webdataset source through the Ray engine (tar members travel as row fields), with
    the default --stage-cpus auto on a 2-CPU Ray: the folder's records."""
    ray = pytest.importorskip("ray")
    from data_prep.annotate import annotate
    from data_prep.annotate.pipeline import AnnotateConfig
    assert AnnotateConfig(source="folder", root="r", out="o").stage_cpus == "auto"
    init_ray()
    try:
        cfg = _config(setup, tmp_path, "webdataset", setup["tars"], engine="ray",
                      limit=2)  # the first shard: one block
        with pytest.raises(ValueError, match=r"--stage-cpus auto: the Ray cluster's 2 CPUs "
                                             r"cannot hold 12 stage actors \(vlm 4, detector "
                                             r"4, sam 4\) of at least 0.25 CPUs each"):
            annotate(dataclasses.replace(cfg, stage_concurrency=(("vlm", 4), ("detect", 4),
                                                                 ("segment", 4))))
        summary = annotate(cfg)
    finally:
        ray.shutdown()
    folder = {k: v for k, v in runs["folder"]["records"].items()
              if k.startswith("folder/00000/")}
    assert summary["images"] == 2 and summary["kept"] == len(folder)
    _assert_same_as_folder(folder, _records(tmp_path / "out"), "webdataset")
