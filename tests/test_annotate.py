"""`python -m data_prep annotate` end to end: real photographs, a tiny random GroundingDINO
(transformers), a tiny random SAM (segment-anything modules), scripted VLM replies; exclusion
rules; SIGKILL part-way and rerun gives the same records."""

import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from data_prep import views
from data_prep.testing import SCENES, photograph, scripted_reply
from sclaro_jax.data import schema

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PHOTOS = {k: v for k, v in SCENES.items() if k != "immunohistochemistry"}
NO_ACTION = next(iter(PHOTOS))  # its reply names no action


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_torch_thread):
    from skimage import data as skdata

    from data_prep import detect, segment
    root = tmp_path_factory.mktemp("photos")
    replies = {}
    for name, (action, objects, relations) in PHOTOS.items():
        img = Image.fromarray(photograph(name))
        img.thumbnail((256, 256))
        img.save(root / f"{name}.jpg", quality=90)
        action = "" if name == NO_ACTION else action  # kept, with action "" (appendix)
        replies[f"folder/{name}.jpg"] = scripted_reply(action, objects, relations, f"a {name}")
    # exclusion rules: no objects, no relations, an unusable reply, an unreadable file
    for name, reply in (("empty_objects", scripted_reply("sitting", [], [], "x")),
                        ("empty_relations", scripted_reply("standing", ["man"], [], "y")),
                        ("refusal", "I'm sorry, I cannot describe this image.")):
        Image.fromarray(skdata.astronaut()[::4, ::4]).save(root / f"{name}.png")
        replies[f"folder/{name}.png"] = reply
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    replies["folder/broken.jpg"] = scripted_reply("x", ["y"], [("y", "on", "y")], "z")
    models = tmp_path_factory.mktemp("models")
    detector = str(models / "gdino")
    detect.save_tiny_model(detector)
    sam = str(models / "sam_tiny.pth")
    segment.save_tiny_sam(sam)
    replies_file = models / "replies.json"
    replies_file.write_text(json.dumps(replies))
    return dict(root=str(root), detector=detector, sam=sam, replies=str(replies_file))


def _cli(setup, out, work, *extra):
    return [sys.executable, "-m", "data_prep", "annotate", "--root", setup["root"], "--out",
            str(out), "--work", str(work), "--vlm-replies", setup["replies"], "--detector",
            setup["detector"], "--sam", setup["sam"], "--sam-type", "tiny", "--device", "cpu",
            "--box-threshold", "0.05", "--text-threshold", "0.05", "--batch-size", "2",
            "--records-per-shard", "2", "--no-progress", *extra]


def _main(cmd) -> tuple[int, str, str]:
    """A `_cli` command line run in this process (`data_prep.__main__.main`, no interpreter and
    torch start): (exit status, stdout, stderr)."""
    from data_prep.__main__ import main
    assert cmd[:3] == [sys.executable, "-m", "data_prep"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(cmd[3:])
    return code, out.getvalue(), err.getvalue()


def _records(out) -> dict:
    from array_record.python.array_record_module import ArrayRecordReader
    recs = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".array_record"):
            reader = ArrayRecordReader(os.path.join(out, name))
            for rec in reader.read_all():
                recs[schema.decode(rec).id] = rec
            reader.close()
    return recs


@pytest.fixture(scope="module")
def full_run(setup, tmp_path_factory):
    base = tmp_path_factory.mktemp("full")
    code, stdout, stderr = _main(_cli(setup, base / "out", base / "work"))
    assert code == 0, stderr[-3000:]
    summary = json.loads((base / "work" / "summary.json").read_text())
    return dict(out=base / "out", work=base / "work", summary=summary, stdout=stdout)


@pytest.mark.slow
def test_records_come_out_and_exclusions_are_counted(full_run):
    s = full_run["summary"]
    assert s["images"] == 9
    assert s["excluded"].get("no_objects") == 1
    assert s["excluded"].get("no_relations") == 1
    assert sum(v for k, v in s["excluded"].items() if k.startswith("vlm_")) == 1
    assert s["failed"] == {"unreadable_image": 1}
    assert s["kept"] >= 3 and s["kept"] + sum(s["excluded"].values()) + 1 == 9
    assert s["vlm_parse_recoveries"].get("code_fence") == 7
    recs = _records(full_run["out"])
    assert len(recs) == s["kept"] == s["records"]
    assert any(k.startswith(f"folder/{NO_ACTION}.") for k in recs)  # no action, still kept
    manifest = json.loads((full_run["out"] / "manifest.json").read_text())
    assert sum(v["no_action"] for v in manifest["splits"].values()) == 1
    actions = (full_run["out"] / "actions.txt").read_text().splitlines()
    assert "" not in actions and PHOTOS[NO_ACTION][0] not in actions
    assert "kept" in full_run["stdout"] and "excluded" in full_run["stdout"]
    # schema version 2 at the default 224 px, without originals; the work folder keeps them
    assert (manifest["schema_version"], manifest["view_size"], manifest["originals"]) == (
        2, 224, False)
    logged = _logged_samples(full_run["work"])
    for image_id, rec in recs.items():
        written = schema.decode(rec)
        sample = dataclasses.replace(logged[image_id], split=written.split)
        assert written == views.with_views(sample, 224)
        name = image_id.split("/", 1)[1].rsplit(".", 1)[0]
        action, objects, relations = PHOTOS[name]
        assert sample.action == ("" if name == NO_ACTION else action)
        assert sample.mask_kind == "sam"
        assert {o.name for o in sample.objects} <= set(objects)
        allowed = {(a, b, c) for a, b, c in relations}
        for rel in sample.relations:
            triple = (sample.objects[rel.subject].name, rel.predicate,
                      sample.objects[rel.object].name)
            assert triple in allowed
            assert rel.subject != rel.object
            region = np.asarray(Image.open(__import__("io").BytesIO(rel.region)))
            assert region.shape == (sample.height, sample.width, 3)
        schema.validate(sample)
        schema.validate(schema.decode(rec))


def _logged_samples(work) -> dict:
    """The records stage 3 left in the work folder's block shards (version 1, originals; split
    not yet assigned), by id."""
    from array_record.python.array_record_module import ArrayRecordReader
    samples = {}
    for name in sorted(os.listdir(work / "blocks")):
        if name.endswith(".array_record"):
            reader = ArrayRecordReader(str(work / "blocks" / name))
            if reader.num_records():
                samples.update((s.id, s) for s in map(schema.decode, reader.read_all()))
            reader.close()
    return samples


@pytest.mark.slow
def test_rerun_with_another_image_size_only_rewrites_the_shards(setup, full_run, tmp_path):
    out = tmp_path / "out64"
    vlm_lines = (full_run["work"] / "vlm.jsonl").read_text()
    code, _, stderr = _main(_cli(setup, out, full_run["work"], "--image-size", "64",
                                 "--keep-originals"))
    assert code == 0, stderr[-3000:]
    assert (full_run["work"] / "vlm.jsonl").read_text() == vlm_lines  # every stage cached
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["schema_version"], manifest["view_size"], manifest["originals"]) == (
        2, 64, True)
    logged = _logged_samples(full_run["work"])
    recs = _records(out)
    assert sorted(recs) == sorted(_records(full_run["out"]))
    for image_id, rec in recs.items():
        written = schema.decode(rec)
        assert written == views.with_views(
            dataclasses.replace(logged[image_id], split=written.split), 64, keep_originals=True)


@pytest.mark.slow
def test_resume_after_sigkill_gives_the_same_records(setup, full_run, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = _cli(setup, out, work)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    def finished():
        blocks = work / "blocks"
        return sum(n.endswith(".json") for n in os.listdir(blocks)) if blocks.exists() else 0

    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if finished() >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = finished()
    assert 2 <= done_before < 5 and not (out / "manifest.json").exists()  # 5 chunks of 2
    # the same command completes it (in this process: the kill above is the one that matters)
    code, _, stderr = _main(cmd)
    assert code == 0, stderr[-3000:]
    vlm_chunks = [json.loads(line)["chunk"] for line in (work / "vlm.jsonl").read_text()
                  .splitlines()]
    assert sorted(vlm_chunks) == list(range(5))  # every chunk through stage 1 exactly once
    assert _records(out) == _records(full_run["out"])


@pytest.mark.slow
def test_speed_switches_write_the_same_records(setup, full_run, tmp_path):
    """--detector-text-once and --sam-sdpa: the records of the default run, byte for byte
    (tests/test_annotate_switches.py checks each switch on its own)."""
    code, _, stderr = _main(_cli(setup, tmp_path / "out", tmp_path / "work",
                                 "--detector-text-once", "--sam-sdpa"))
    assert code == 0, stderr[-3000:]
    expected = _records(full_run["out"])
    assert _records(tmp_path / "out") == expected and len(expected) >= 3


@pytest.mark.slow
def test_a_rerun_with_other_settings_is_refused(setup, full_run):
    cmd = _cli(setup, full_run["out"], full_run["work"], "--nms-iou", "0.5")
    code, _, stderr = _main(cmd)
    assert code == 2
    assert "other settings" in stderr and "nms_iou" in stderr


def test_cli_names_what_is_missing(tmp_path, capsys):
    from data_prep.__main__ import main
    Image.new("RGB", (40, 30)).save(tmp_path / "a.jpg")
    base = ["annotate", "--root", str(tmp_path), "--out", str(tmp_path / "out")]
    assert main(base) == 2
    assert "missing --vlm, --detector, --sam" in capsys.readouterr().err
    (tmp_path / "d").mkdir()
    (tmp_path / "s.pth").write_bytes(b"")
    (tmp_path / "r.json").write_text("{}")
    models = ["--vlm-replies", str(tmp_path / "r.json"), "--detector", str(tmp_path / "d"),
              "--sam", str(tmp_path / "s.pth")]
    assert main(base + models + ["--source-option", "bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    # a path that is not there stops before any work, naming the flag
    for i, flag in ((1, "--vlm-replies"), (3, "--detector"), (5, "--sam")):
        wrong = list(models)
        wrong[i] = str(tmp_path / "none")
        assert main(base + wrong) == 2
        assert (f"error: {flag} {tmp_path / 'none'}: no such file or folder; pass {flag} with "
                f"the path of") in capsys.readouterr().err
    assert not (tmp_path / "out.work").exists() and not (tmp_path / "out").exists()


def test_torn_tails_are_cut_off(tmp_path):
    from data_prep.durable_logs import JsonLog
    j = JsonLog(str(tmp_path / "a.jsonl"))
    j.append({"chunk": 0})
    j.close()
    with open(tmp_path / "a.jsonl", "ab") as f:
        f.write(b'{"chunk": 1, "ids"')  # killed mid-line
    j = JsonLog(str(tmp_path / "a.jsonl"))
    assert j.entries == [{"chunk": 0}]
    j.append({"chunk": 1})
    j.close()
    assert JsonLog(str(tmp_path / "a.jsonl")).entries == [{"chunk": 0}, {"chunk": 1}]
