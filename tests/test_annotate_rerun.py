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
def setup(tmp_path_factory, one_torch_thread):
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


def _args(setup, out, work, replies=None, sam=None, batch_size=2, limit=0):
    return ["annotate", "--root", setup["root"], "--out", str(out), "--work", str(work),
            "--vlm-replies", str(replies or setup["replies"]), "--detector", setup["detector"],
            "--sam", str(sam or setup["sam"]), "--sam-type", "tiny", "--device", "cpu",
            "--box-threshold", "0.05", "--text-threshold", "0.05", "--batch-size",
            str(batch_size), "--limit", str(limit), "--image-size", "32", "--no-progress"]


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
    """id -> decoded sample of every record in the shards of `out`."""
    from test_annotate import _records as encoded
    return {k: schema.decode(rec) for k, rec in encoded(out).items()}


def _lines(work, name) -> list[dict]:
    return [json.loads(line) for line in (work / name).read_text().splitlines()]


def _cache_files(work) -> dict:
    """The stage caches and the finished blocks' shards and markers, by name."""
    files = {n: (work / n).read_bytes() for n in ("vlm.jsonl", "detect.jsonl")}
    files.update({n: (work / "blocks" / n).read_bytes()
                  for n in sorted(os.listdir(work / "blocks"))})
    return files


def _markers(work) -> list[dict]:
    return [json.loads((work / "blocks" / n).read_text())
            for n in sorted(os.listdir(work / "blocks")) if n.endswith(".json")]


def _fresh(run, setup, tmp_path, replies_text=None, sam=None):
    """A first run over chunk 0 (astronaut, chelsea) with its own copy of the replies file."""
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps(replies_text or setup["reply_texts"]))
    work = tmp_path / "work"
    proc = run(_args(setup, tmp_path / "out0", work, replies=replies, sam=sam, limit=2))
    return replies, work, proc


def test_unchanged_rerun_takes_every_image_from_cache(run, setup, tmp_path):
    replies, work, proc = _fresh(run, setup, tmp_path)
    assert "0 images from cache, 2 annotated this run" in proc.stdout, proc.stdout
    before = _cache_files(work)
    proc = run(_args(setup, tmp_path / "out", work, replies=replies, limit=2))
    assert ("2 images: 2 kept, 0 excluded, 0 failed; 2 images from cache, 0 annotated this "
            "run") in proc.stdout, proc.stdout
    assert "recomputing" not in proc.log
    assert _cache_files(work) == before  # no model ran
    summary = json.loads((work / "summary.json").read_text())
    assert summary["images_from_cache"] == 2 and summary["stage_images_this_run"] == {}
    assert _records(tmp_path / "out") == _records(tmp_path / "out0")


@pytest.mark.slow
def test_an_edited_reply_redoes_its_chunk(run, setup, tmp_path):
    replies, work, _ = _fresh(run, setup, tmp_path)
    texts = dict(setup["reply_texts"])
    _, objects, relations = SCENES["chelsea"]
    texts["folder/chelsea.jpg"] = scripted_reply("sleeping", objects, relations, "a cat")
    replies.write_text(json.dumps(texts))  # fixed in place, the first run's path
    proc = run(_args(setup, tmp_path / "out", work, replies=replies, limit=2))
    assert (f"recomputing stages 1-3 of 1 chunk (2 images): their replies in {replies} "
            f"changed since they were cached") in proc.log, proc.log
    assert "0 images from cache, 2 annotated this run" in proc.stdout, proc.stdout
    assert [e["chunk"] for e in _lines(work, "vlm.jsonl")] == [0, 0]
    old, new = _records(tmp_path / "out0"), _records(tmp_path / "out")
    assert old["folder/chelsea.jpg"].action == "resting"
    assert new["folder/chelsea.jpg"].action == "sleeping"
    assert new["folder/chelsea.jpg"].caption == "The image shows a cat."
    assert new["folder/astronaut.jpg"] == old["folder/astronaut.jpg"]
    moved = tmp_path / "moved.json"  # the same content at another path: still the cache
    shutil.copy(replies, moved)
    proc = run(_args(setup, tmp_path / "out1", work, replies=moved, limit=2))
    assert "2 images from cache" in proc.stdout and "recomputing" not in proc.log


@pytest.mark.slow
def test_changed_sam_weights_redo_stage_3_only(run, setup, tmp_path):
    from data_prep import segment
    sam = tmp_path / "sam.pth"
    shutil.copy(setup["sam"], sam)
    replies, work, _ = _fresh(run, setup, tmp_path, sam=sam)
    before = _cache_files(work)
    segment.save_tiny_sam(str(sam), seed=1)  # other weights at the first run's path
    proc = run(_args(setup, tmp_path / "out", work, replies=replies, sam=sam, limit=2))
    assert (f"recomputing stage 3 of 1 chunk (2 images): the SAM weights {sam} changed since "
            f"they were cached") in proc.log, proc.log
    assert "0 images from cache, 2 annotated this run" in proc.stdout
    after = _cache_files(work)
    assert after["vlm.jsonl"] == before["vlm.jsonl"]  # stages 1 and 2 cached
    assert after["detect.jsonl"] == before["detect.jsonl"]
    [marker] = _markers(work)
    assert marker["stage_images"] == {"segment": 2}
    summary = json.loads((work / "summary.json").read_text())
    assert set(summary["stage_images_this_run"]) == {"segment"}
    moved = tmp_path / "moved.pth"  # the same bytes at another path: still the cache
    shutil.copy(sam, moved)
    proc = run(_args(setup, tmp_path / "out1", work, replies=replies, sam=moved, limit=2))
    assert "2 images from cache" in proc.stdout and "recomputing" not in proc.log


@pytest.mark.slow
def test_a_missing_reply_is_an_exclusion(run, setup, tmp_path):
    texts = dict(setup["reply_texts"])
    del texts["folder/chelsea.jpg"]
    replies, work, proc = _fresh(run, setup, tmp_path, replies_text=texts)
    assert (f"image folder/chelsea.jpg: no reply in --vlm-replies {replies}; excluded "
            f"(vlm_no_reply)") in proc.log, proc.log
    assert "2 images: 1 kept, 1 excluded, 0 failed" in proc.stdout, proc.stdout
    assert "  excluded: vlm_no_reply 1" in proc.stdout, proc.stdout
    summary = json.loads((work / "summary.json").read_text())
    assert summary["excluded"] == {"vlm_no_reply": 1}
    assert list(_records(tmp_path / "out0")) == ["folder/astronaut.jpg"]
    # the reply supplied later: its chunk is redone and the image annotated
    replies.write_text(json.dumps(setup["reply_texts"]))
    proc = run(_args(setup, tmp_path / "out", work, replies=replies, limit=2))
    assert "recomputing stages 1-3 of 1 chunk (2 images): their replies" in proc.log
    summary = json.loads((work / "summary.json").read_text())
    assert summary["excluded"] == {} and summary["kept"] == 2


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
    proc = run(_args(setup, tmp_path / "out", work, batch_size=2, limit=2))  # corrected
    assert (f"{work}: an earlier run with other settings (batch_size, limit) finished no "
            f"chunk; starting over with these settings") in proc.log, proc.log
    assert "2 images: " in proc.stdout
    # once a chunk is finished, other settings are refused as before
    proc = run(_args(setup, tmp_path / "out3", work, batch_size=4, limit=2), ok=False)
    assert proc.returncode == 2
    assert "holds caches of a run with other settings (batch_size differ)" in proc.stderr


def test_replies_keyed_by_other_ids_are_refused_with_the_id_format(run, setup, tmp_path):
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps({k.split("/", 1)[1]: v
                                   for k, v in setup["reply_texts"].items()}))
    proc = run(_args(setup, tmp_path / "out", tmp_path / "work", replies=replies), ok=False)
    assert proc.returncode == 2
    assert (f"error: --vlm-replies {replies}: none of its 4 image ids is an image of the folder "
            f"source in {setup['root']} (it has 'astronaut.jpg', the source has "
            f"'folder/astronaut.jpg'); key each reply by its image id, 'folder/<path under "
            f"--root, extension included>'") in proc.stderr, proc.stderr


def test_weight_digests_follow_content_not_stat(tmp_path, monkeypatch):
    from data_prep.annotate import keys as annotate_keys
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
