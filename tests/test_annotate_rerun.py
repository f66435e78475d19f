"""`python -m data_prep annotate` reruns after the user changed something: caches keyed by the
content of the replies and of the model weights (not their paths), "N images from cache", a
missing reply counted as an exclusion, an aborted first try that does not lock the work folder,
a replies file keyed by the wrong ids refused with the id format."""

import collections
import json
import logging
import os
import shutil

import pytest
from PIL import Image

from data_prep.testing import SCENES, photograph, scripted_reply
from sclaro_jax.data import schema

NAMES = ("astronaut", "coffee", "chelsea", "rocket")  # 2 chunks of 2 (sorted ids)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from data_prep import detect, segment
    root = tmp_path_factory.mktemp("photos")
    replies = {}
    for name in NAMES:
        img = Image.fromarray(photograph(name))
        img.thumbnail((160, 160))
        img.save(root / f"{name}.jpg", quality=90)
        action, objects, relations = SCENES[name]
        replies[f"folder/{name}.jpg"] = scripted_reply(action, objects, relations, f"a {name}")
    models = tmp_path_factory.mktemp("models")
    detect.save_tiny_model(str(models / "gdino"))
    segment.save_tiny_sam(str(models / "sam.pth"))
    (models / "replies.json").write_text(json.dumps(replies))
    return dict(root=str(root), detector=str(models / "gdino"), sam=str(models / "sam.pth"),
                replies=str(models / "replies.json"), reply_texts=replies)


def _args(setup, out, work, replies=None, sam=None, batch_size=2):
    return ["annotate", "--root", setup["root"], "--out", str(out), "--work", str(work),
            "--vlm-replies", str(replies or setup["replies"]), "--detector", setup["detector"],
            "--sam", str(sam or setup["sam"]), "--sam-type", "tiny", "--device", "cpu",
            "--box-threshold", "0.05", "--text-threshold", "0.05", "--batch-size",
            str(batch_size), "--image-size", "32", "--no-progress"]


Result = collections.namedtuple("Result", "returncode stdout stderr log")


@pytest.fixture
def run(capsys, caplog):
    """The command line in this process (no interpreter and torch start per run): exit status,
    stdout, stderr and the warnings it logged (printed to stderr outside pytest)."""
    from data_prep.__main__ import main

    def call(args, ok=True):
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            code = main(args)
        out, err = capsys.readouterr()
        if ok:
            assert code == 0, err[-3000:]
        return Result(code, out, err, "\n".join(r.getMessage() for r in caplog.records))
    return call


def _records(out) -> dict:
    from array_record.python.array_record_module import ArrayRecordReader
    recs = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".array_record"):
            reader = ArrayRecordReader(os.path.join(out, name))
            for rec in reader.read_all():
                sample = schema.decode(rec)
                recs[sample.id] = sample
            reader.close()
    return recs


def _lines(work, name) -> list[dict]:
    return [json.loads(line) for line in (work / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def first(setup, tmp_path_factory):
    from data_prep.__main__ import main
    base = tmp_path_factory.mktemp("first")
    assert main(_args(setup, base / "out", base / "work")) == 0
    summary = json.loads((base / "work" / "summary.json").read_text())
    assert summary["images_from_cache"] == 0
    return dict(work=base / "work", records=_records(base / "out"), summary=summary)


def _copy_work(first, tmp_path):
    shutil.copytree(first["work"], tmp_path / "work")
    return tmp_path / "work"


def _cache_files(work) -> dict:
    return {n: (work / n).read_bytes() for n in ("vlm.jsonl", "detect.jsonl", "status.jsonl")}


def test_unchanged_rerun_takes_every_image_from_cache(run, setup, first, tmp_path):
    work = _copy_work(first, tmp_path)
    before = _cache_files(work)
    proc = run(_args(setup, tmp_path / "out", work))
    kept = first["summary"]["kept"]
    assert (f"4 images: {kept} kept, {4 - kept} excluded, 0 failed; 4 images from cache, 0 "
            f"annotated this run") in proc.stdout, proc.stdout
    assert "recomputing" not in proc.log
    assert _cache_files(work) == before  # no model ran
    summary = json.loads((work / "summary.json").read_text())
    assert summary["images_from_cache"] == 4 and summary["stage_images_this_run"] == {}
    assert _records(tmp_path / "out") == first["records"]


def test_an_edited_reply_redoes_its_chunk(run, setup, first, tmp_path):
    work = _copy_work(first, tmp_path)
    replies = tmp_path / "replies.json"
    shutil.copy(setup["replies"], replies)
    # the same content at another path: still the cache
    proc = run(_args(setup, tmp_path / "out", work, replies=replies))
    assert "4 images from cache" in proc.stdout and "recomputing" not in proc.log
    texts = dict(setup["reply_texts"])
    _, objects, relations = SCENES["coffee"]
    texts["folder/coffee.jpg"] = scripted_reply("sipping", objects, relations, "a coffee")
    replies.write_text(json.dumps(texts))  # fixed in place, same path
    proc = run(_args(setup, tmp_path / "out2", work, replies=replies))
    assert (f"recomputing stages 1-3 of 1 chunk (2 images): their replies in {replies} "
            f"changed since they were cached") in proc.log, proc.log
    assert "2 images from cache, 2 annotated this run" in proc.stdout, proc.stdout
    chunks = [e["chunk"] for e in _lines(work, "vlm.jsonl")]
    assert sorted(chunks) == [0, 1, 1]  # coffee is in chunk 1 (astronaut, chelsea | coffee, rocket)
    recs = _records(tmp_path / "out2")
    assert recs["folder/coffee.jpg"].action == "sipping"
    assert first["records"]["folder/coffee.jpg"].action == "drinking"
    assert set(recs) == set(first["records"])
    for image_id in set(recs) - {"folder/coffee.jpg"}:
        assert recs[image_id] == first["records"][image_id]


def test_changed_sam_weights_redo_stage_3_only(run, setup, first, tmp_path):
    from data_prep import segment
    work = _copy_work(first, tmp_path)
    sam = tmp_path / "sam.pth"
    shutil.copy(setup["sam"], sam)  # moved checkpoint, same bytes: still the cache
    proc = run(_args(setup, tmp_path / "out", work, sam=sam))
    assert "4 images from cache" in proc.stdout and "recomputing" not in proc.log
    before = _cache_files(work)
    segment.save_tiny_sam(str(sam), seed=1)  # other weights, same path
    proc = run(_args(setup, tmp_path / "out2", work, sam=sam))
    assert (f"recomputing stage 3 of 2 chunks (4 images): the SAM weights {sam} changed since "
            f"they were cached") in proc.log, proc.log
    assert "0 images from cache, 4 annotated this run" in proc.stdout
    after = _cache_files(work)
    assert after["vlm.jsonl"] == before["vlm.jsonl"]  # stages 1 and 2 cached
    assert after["detect.jsonl"] == before["detect.jsonl"]
    assert len(_lines(work, "status.jsonl")) == 4
    summary = json.loads((work / "summary.json").read_text())
    assert summary["stage_images_this_run"] == {"segment": summary["stage_images_this_run"].get(
        "segment", 0)} and summary["stage_images_this_run"]["segment"] > 0


def test_a_missing_reply_is_an_exclusion(run, setup, first, tmp_path):
    texts = dict(setup["reply_texts"])
    del texts["folder/chelsea.jpg"]
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps(texts))
    proc = run(_args(setup, tmp_path / "out", tmp_path / "work", replies=replies))
    assert (f"image folder/chelsea.jpg: no reply in --vlm-replies {replies}; excluded "
            f"(vlm_no_reply)") in proc.log, proc.log
    assert "vlm_no_reply 1" in proc.stdout, proc.stdout
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert summary["excluded"] == {"vlm_no_reply": 1, **first["summary"]["excluded"]}
    assert "folder/chelsea.jpg" not in _records(tmp_path / "out")
    # the reply supplied later: its chunk is redone and the image annotated
    replies.write_text(json.dumps(setup["reply_texts"]))
    proc = run(_args(setup, tmp_path / "out2", tmp_path / "work", replies=replies))
    assert "recomputing stages 1-3 of 1 chunk (2 images): their replies" in proc.log
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert summary["excluded"] == first["summary"]["excluded"]
    assert "folder/chelsea.jpg" in _records(tmp_path / "out2")


def test_an_aborted_first_try_does_not_lock_the_work_folder(run, setup, tmp_path):
    from data_prep.annotate import AnnotateConfig, Models, annotate

    def out_of_memory(images):
        raise RuntimeError("CUDA out of memory")

    work = tmp_path / "work"
    cfg = AnnotateConfig(source="folder", root=setup["root"], out=str(tmp_path / "out"),
                         work=str(work), vlm_replies=setup["replies"],
                         detector=setup["detector"], sam=setup["sam"], sam_type="tiny",
                         batch_size=4, box_threshold=0.05, text_threshold=0.05,
                         progress=False)
    with pytest.raises(RuntimeError, match="out of memory"):
        annotate(cfg, Models(vlm=out_of_memory, detector=None, segmenter=None))
    assert (work / "run.json").exists()
    proc = run(_args(setup, tmp_path / "out", work, batch_size=2))  # the corrected command
    assert (f"{work}: an earlier run with other settings (batch_size) finished no chunk; "
            f"starting over with these settings") in proc.log, proc.log
    assert "4 images: " in proc.stdout
    # once a chunk is finished, other settings are refused as before
    proc = run(_args(setup, tmp_path / "out3", work, batch_size=4), ok=False)
    assert proc.returncode == 1
    assert "holds caches of a run with other settings (batch_size differ)" in proc.stderr


def test_replies_keyed_by_other_ids_are_refused_with_the_id_format(run, setup, tmp_path):
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps({k.split("/", 1)[1]: v
                                   for k, v in setup["reply_texts"].items()}))
    proc = run(_args(setup, tmp_path / "out", tmp_path / "work", replies=replies), ok=False)
    assert proc.returncode == 1
    assert (f"error: --vlm-replies {replies}: none of its 4 image ids is an image of the folder "
            f"source in {setup['root']} (it has 'astronaut.jpg', the source has "
            f"'folder/astronaut.jpg'); key each reply by its image id, 'folder/<path under "
            f"--root, extension included>'") in proc.stderr, proc.stderr


def test_weight_digests_follow_content_not_stat(tmp_path, monkeypatch):
    from data_prep import annotate_keys
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "weights.bin").write_bytes(b"\x00" * 100)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x").write_text("download metadata")
    memo = annotate_keys.HashMemo(str(tmp_path / "hashes.json"))
    digest = memo.weights(str(folder))
    import hashlib
    expect = "".join(sorted(f"{rel}\t{hashlib.sha256(data).hexdigest()}\n" for rel, data in (
        ("config.json", b"{}"), (os.path.join("sub", "weights.bin"), b"\x00" * 100))))
    assert digest == hashlib.sha256(expect.encode()).hexdigest()
    memo.save()
    calls = []
    real = annotate_keys.sha256_file
    monkeypatch.setattr(annotate_keys, "sha256_file", lambda p: calls.append(p) or real(p))
    memo = annotate_keys.HashMemo(str(tmp_path / "hashes.json"))
    assert memo.weights(str(folder)) == digest and calls == []  # memo: no file read
    (folder / ".cache" / "x").write_text("changed")  # hidden: not part of the weights
    assert memo.weights(str(folder)) == digest
    st = os.stat(folder / "sub" / "weights.bin")
    (folder / "sub" / "weights.bin").write_bytes(b"\x01" + b"\x00" * 99)
    os.utime(folder / "sub" / "weights.bin", ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime
    assert memo.weights(str(folder)) != digest  # ctime changed: hashed again
    assert calls == [str(folder / "sub" / "weights.bin")]
