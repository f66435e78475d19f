"""`python -m data_prep annotate --engine ray`: the Ray Data pipeline writes the records and the
summary of `--engine local` byte for byte (13 real photographs, tiny random GroundingDINO and
SAM, scripted VLM replies); an exception in a stage, a killed stage actor and a SIGKILLed driver
each end with the clean run's records; a rerun resumes the other engine's blocks; bad input is
counted, not fatal; missing models stop before any work."""

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from conftest import init_ray
from data_prep.testing import SCENES, photograph, scripted_reply
from test_annotate import _main, _records

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # every test here starts Ray (or reads a run that did)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHOTOS = {k: v for k, v in SCENES.items() if k != "immunohistochemistry"}
TIMING = ("stage_seconds_this_run",)  # the only summary fields that may differ


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_torch_thread):
    from skimage import data as skdata

    from data_prep import detect, segment
    root = tmp_path_factory.mktemp("photos")
    replies = {}
    for name, (action, objects, relations) in PHOTOS.items():
        img = Image.fromarray(photograph(name))
        img.thumbnail((224, 224))
        for suffix, view in (("", img), ("_mirrored", img.transpose(Image.FLIP_LEFT_RIGHT))):
            view.save(root / f"{name}{suffix}.jpg", quality=90)
            replies[f"folder/{name}{suffix}.jpg"] = scripted_reply(action, objects, relations,
                                                                   f"a {name}{suffix}")
    small = Image.fromarray(skdata.astronaut()[::4, ::4])
    small.save(root / "refusal.png")  # a reply that does not parse
    replies["folder/refusal.png"] = "I'm sorry, I cannot describe this image."
    small.save(root / "empty_objects.png")
    replies["folder/empty_objects.png"] = scripted_reply("sitting", [], [], "x")
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")  # unreadable
    replies["folder/broken.jpg"] = scripted_reply("x", ["y"], [("y", "on", "y")], "z")
    models = tmp_path_factory.mktemp("models")
    detect.save_tiny_model(str(models / "gdino"))
    segment.save_tiny_sam(str(models / "sam.pth"))
    (models / "replies.json").write_text(json.dumps(replies))
    return dict(root=str(root), detector=str(models / "gdino"), sam=str(models / "sam.pth"),
                replies=str(models / "replies.json"), images=len(replies))


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance for the module (`conftest.init_ray`: 2 CPUs, other drivers can
    join); its address for the CLI runs."""
    init_ray()
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _config(setup, base, engine="local", **kw):
    from data_prep.annotate import AnnotateConfig
    return AnnotateConfig(
        source="folder", root=setup["root"], out=str(base / "out"), work=str(base / "work"),
        vlm_replies=setup["replies"], detector=setup["detector"], sam=setup["sam"],
        sam_type="tiny", device="cpu", box_threshold=0.05, text_threshold=0.05, batch_size=3,
        records_per_shard=2, progress=False, engine=engine, stage_cpus=0.5, **kw)


def _cli(setup, base, *extra):
    return [sys.executable, "-m", "data_prep", "annotate", "--root", setup["root"], "--out",
            str(base / "out"), "--work", str(base / "work"), "--vlm-replies", setup["replies"],
            "--detector", setup["detector"], "--sam", setup["sam"], "--sam-type", "tiny",
            "--device", "cpu", "--box-threshold", "0.05", "--text-threshold", "0.05",
            "--batch-size", "3", "--records-per-shard", "2", "--no-progress", *extra]


def _same_summary(a: dict, b: dict) -> None:
    strip = lambda s: {k: v for k, v in s.items() if k not in TIMING}  # noqa: E731
    assert strip(a) == strip(b)


def _markers(work) -> dict:
    folder = work / "blocks"
    return {int(n[:-5]): json.loads((folder / n).read_text())
            for n in sorted(os.listdir(folder)) if n.endswith(".json")}


@pytest.fixture(scope="module")
def local_run(setup, one_torch_thread, tmp_path_factory):
    import torch

    from data_prep.annotate import annotate
    base = tmp_path_factory.mktemp("local")
    torch.set_num_threads(one_torch_thread)  # torch's default here, one in the stage actors
    try:
        summary = annotate(_config(setup, base))
    finally:
        torch.set_num_threads(1)
    return dict(base=base, summary=summary, records=_records(base / "out"))


@pytest.fixture(scope="module")
def ray_run(setup, cluster, tmp_path_factory):
    from data_prep.annotate import annotate
    base = tmp_path_factory.mktemp("ray")
    summary = annotate(_config(setup, base, engine="ray"))
    return dict(base=base, summary=summary, records=_records(base / "out"))


def test_ray_writes_the_records_and_summary_of_the_local_engine(setup, local_run, ray_run):
    s = ray_run["summary"]
    assert s["images"] == setup["images"] == 13
    _same_summary(s, local_run["summary"])
    assert ray_run["records"] == local_run["records"]  # same ids, byte-identical payloads
    assert len(ray_run["records"]) == s["kept"] >= 6
    # bad input is counted and the run goes on
    assert s["failed"] == {"unreadable_image": 1}
    assert s["excluded"]["vlm_no_json"] == 1 and s["excluded"]["no_objects"] == 1
    for name in ("manifest.json", "actions.txt", "objects.txt", "relations.txt"):
        if name == "manifest.json":
            a, b = (json.loads((r["base"] / "out" / name).read_text())
                    for r in (ray_run, local_run))
            a.pop("created"), b.pop("created")
            assert a == b
        else:
            assert (ray_run["base"] / "out" / name).read_bytes() == \
                (local_run["base"] / "out" / name).read_bytes()
    markers = _markers(ray_run["base"] / "work")
    assert sorted(markers) == list(range(5))  # 13 images in blocks of 3
    assert {m["engine"] for m in markers.values()} == {"ray"}
    local = _markers(local_run["base"] / "work")
    for k, m in markers.items():
        assert m["sha256"] == local[k]["sha256"] and m["status"] == local[k]["status"]
    # a rerun with other settings is refused, as with the local engine, before Ray is used
    from data_prep.annotate import annotate
    with pytest.raises(ValueError, match=r"holds caches of a run with other settings \(nms_iou "
                                         r"differ\)"):
        annotate(dataclasses.replace(_config(setup, ray_run["base"], engine="ray"),
                                     nms_iou=0.5))


@pytest.fixture(scope="module")
def resumed_with_faults(setup, cluster, one_torch_thread, tmp_path_factory):
    """A local run that stops in block 2 (blocks 0 and 1 done), then the Ray engine on its work
    folder with an exception in the detector (block 2) and a killed SAM actor (block 3)."""
    import itertools

    from data_prep.annotate import Models, annotate, load_models
    base = tmp_path_factory.mktemp("resumed")
    cfg = _config(setup, base)
    models = load_models(cfg)
    calls = itertools.count()

    def detector(images, objects):  # the local run stops in block 2, blocks 0 and 1 done
        if next(calls) == 2:
            raise RuntimeError("CUDA out of memory")
        return models.detector(images, objects)

    with pytest.raises(RuntimeError, match="out of memory"):
        annotate(cfg, Models(models.vlm, detector, models.segmenter))
    local = _markers(base / "work")
    faults = (("detect", 2, "raise"), ("segment", 3, "kill"))
    summary = annotate(_config(setup, base, engine="ray", faults=faults))
    return dict(base=base, summary=summary, faults=faults, local=local)


def test_faults_end_with_the_clean_records(resumed_with_faults, local_run):
    """An exception in the detector (block 2) and a killed SAM actor (block 3), in one run."""
    run = resumed_with_faults
    base = run["base"]
    for stage, block, kind in run["faults"]:
        assert (base / "work" / "faults" / f"{stage}-{block}-{kind}").exists()  # it fired
    records = _records(base / "out")
    assert records == local_run["records"]
    ids = []
    for name in os.listdir(base / "out"):  # no id twice across the dataset's shards
        if name.endswith(".array_record"):
            from array_record.python.array_record_module import ArrayRecordReader

            from sclaro_jax.data import schema
            reader = ArrayRecordReader(str(base / "out" / name))
            ids += [schema.decode(r).id for r in reader.read_all()]
            reader.close()
    assert len(ids) == len(set(ids)) == len(records)
    assert not [n for n in os.listdir(base / "work" / "blocks") if ".tmp-" in n]
    # the retried blocks' images counted once: the clean local run's counts of blocks 2-4
    clean = _markers(local_run["base"] / "work")
    want = collections.Counter()
    for k in (2, 3, 4):
        want.update(clean[k]["stage_images"])
    assert run["summary"]["stage_images_this_run"] == dict(want)


def test_a_failing_stage_stops_the_run_naming_stage_and_block(setup, cluster, tmp_path):
    from data_prep.annotate import annotate
    with pytest.raises(Exception, match=r"stage detector, block 0: RuntimeError: injected fault "
                                        r"in stage detect, block 0 \(tried 1 times\)"):
        annotate(_config(setup, tmp_path, engine="ray", retries=0,
                         faults=(("detect", 0, "raise"),), limit=3))
    assert not (tmp_path / "out" / "manifest.json").exists()  # nothing before every block


def test_a_killed_driver_resumes_and_the_other_engine_takes_over(setup, cluster, local_run,
                                                                  tmp_path):
    cmd = _cli(setup, tmp_path, "--engine", "ray", "--ray-address", cluster,
               "--stage-cpus", "0.5")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    blocks = tmp_path / "work" / "blocks"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if blocks.exists() and any(n.endswith(".json") for n in os.listdir(blocks)):
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert blocks.exists(), "no block finished in 300 s: the driver was killed before any"
    done = _markers(tmp_path / "work")
    assert 1 <= len(done) < 5 and not (tmp_path / "out" / "manifest.json").exists()
    # the same command completes the run with the clean records (in this process, a driver of
    # the same cluster: the kill above is the one that matters)
    code, _, stderr = _main(cmd)
    assert code == 0, stderr[-3000:]
    assert _records(tmp_path / "out") == local_run["records"]
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert summary["images_from_cache"] >= 3 * len(done) - 2  # the finished blocks, skipped
    for k, m in done.items():  # blocks finished before the kill were not redone
        assert _markers(tmp_path / "work")[k]["run"] == m["run"]
    # a rerun with the local engine finds every block finished (and says so)
    code, stdout, stderr = _main(_cli(setup, tmp_path, "--overwrite"))
    assert code == 0, stderr[-3000:]
    assert "13 images from cache, 0 annotated this run" in stdout, stdout


def test_local_blocks_are_resumed_by_the_ray_engine(resumed_with_faults, local_run):
    """The Ray engine takes the blocks the local engine finished from the cache (the run of
    `resumed_with_faults`, whose faults are in the blocks Ray ran)."""
    run = resumed_with_faults
    summary = run["summary"]
    assert sorted(run["local"]) == [0, 1]
    assert summary["images_from_cache"] == 6
    markers = _markers(run["base"] / "work")
    engines = {k: m["engine"] for k, m in markers.items()}
    assert engines == {0: "local", 1: "local", 2: "ray", 3: "ray", 4: "ray"}
    for k in (0, 1):  # not redone
        assert markers[k]["run"] == run["local"][k]["run"]
    assert _records(run["base"] / "out") == local_run["records"]
    _same_summary({**summary, "images_from_cache": 0, "stage_images_this_run": {}},
                  {**local_run["summary"], "images_from_cache": 0,
                   "stage_images_this_run": {}})


def test_a_damaged_block_shard_is_redone(setup, local_run, tmp_path, caplog):
    import shutil

    from data_prep.annotate import annotate
    shutil.copytree(local_run["base"] / "work", tmp_path / "work")
    shard = tmp_path / "work" / "blocks" / "000002.array_record"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    summary = annotate(_config(setup, tmp_path))
    assert "000002.array_record does not match the checksum in its marker; redone" in caplog.text
    assert summary["images_from_cache"] == 10
    assert _records(tmp_path / "out") == local_run["records"]


def test_cli_errors_name_the_flag(setup, tmp_path, capsys, monkeypatch):
    from data_prep.__main__ import main
    base = ["annotate", "--root", setup["root"], "--out", str(tmp_path / "out"),
            "--vlm-replies", setup["replies"], "--detector", setup["detector"], "--sam",
            setup["sam"], "--sam-type", "tiny", "--engine", "ray"]
    assert main(base[:-4] + ["--sam", str(tmp_path / "no.pth"), "--engine", "ray"]) == 2
    err = capsys.readouterr().err
    assert f"error: --sam {tmp_path / 'no.pth'}: no such file or folder; pass --sam" in err
    assert main(base + ["--stage-concurrency", "detector=0"]) == 2
    assert "--stage-concurrency 'detector=0': expected STAGE=N with N >= 1" in \
        capsys.readouterr().err
    assert main(base + ["--stage-concurrency", "gpu=2"]) == 2
    assert "unknown stage 'gpu'; stages: vlm, detector, sam" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "error: --engine ray needs Ray Data, which is not installed" in err
    assert 'pip install -e ".[cluster]" from the sclaro-jax checkout' in err
    assert not (tmp_path / "out.work").exists()


def test_actors_that_do_not_fit_the_cluster_are_refused(setup, cluster, tmp_path):
    from data_prep.annotate import annotate
    with pytest.raises(ValueError, match=r"the stage actors need 4.25 CPUs \(vlm 1, detector 2, "
                                         r"sam 1 actors x --stage-cpus 1, plus 0.25 for "
                                         r"writing\) but the Ray cluster has 2: lower "
                                         r"--stage-cpus or --stage-concurrency"):
        annotate(dataclasses.replace(_config(setup, tmp_path, engine="ray", limit=3),
                                     stage_cpus=1.0, stage_concurrency=(("detect", 2),)))


def test_concurrency_flags():
    from data_prep.annotate.ray_engine import parse_concurrency
    assert parse_concurrency(["2", "sam=1"]) == {"vlm": 2, "detect": 2, "segment": 1}
    assert parse_concurrency(["detector=3"]) == {"detect": 3}


def test_the_vlm_actor_of_a_replies_file_runs_without_torch(setup, monkeypatch):
    """The VLM stage reading `--vlm-replies` runs no model: its actor's setup imports no torch
    (and so needs no torch threads or device); the model stages' setup does."""
    from data_prep.annotate.ray_engine import _worker_setup
    cfg = _config(setup, Path(setup["root"]), engine="ray")
    monkeypatch.setitem(sys.modules, "torch", None)  # an import of torch raises
    assert _worker_setup(cfg, "vlm") == "cpu"
    with pytest.raises(ImportError):
        _worker_setup(cfg, "detect")
