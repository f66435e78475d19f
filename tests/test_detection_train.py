"""Detection end to end: the detection task (`sclaro_jax.detection.task`, what
`launch/train.py --config configs/detection.py` runs) on a ScenarioCLIP workdir's encoders (global
encoder -> RPN, object encoder -> RoI heads) trained on the demo photographs' boxes and evaluated
on the same images (an overfit check: AP50 >= 0.9), `python -m sclaro_jax.eval.detect` evaluating
the run again, the rerun that resumes, exact resume after a stop, the CLI's errors, and the
backbone against the CLIP tower it wraps."""

import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sclaro_jax.config import load_config
from sclaro_jax.detection import backbones, data, train
from sclaro_jax.detection.model import Detector, ViTBackbone
from sclaro_jax.eval import detect as cli
from sclaro_jax.models import clip
from sclaro_jax.run import task as tasks
from sclaro_jax.run.folder import ConfigDriftError

TASK = tasks.get("detection")


def demo_config(data_dir, backbone=""):
    config = load_config("detection:demo")
    config.data.dir, config.backbone.workdir = str(data_dir), str(backbone)
    return config


OVERFIT = r"""
import json, sys
sys.path.insert(0, "tests")
from test_detection_train import TASK, demo_config
config = demo_config(sys.argv[1], sys.argv[2])
fitted = TASK.fit(config, sys.argv[3], progress=False)
assert fitted.step == fitted.steps, (fitted.step, fitted.steps)
print("RESULTS " + json.dumps(TASK.evaluate(config, sys.argv[3], progress=False).results))
"""


@pytest.fixture(scope="module")
def overfit(scenario_workdir, demo_dir, tmp_path_factory):
    """The detection task's fit and evaluation of the demo boxes (what the launcher runs), in a
    child compiled with LLVM's passes (`long_run_xla_env`): its steps are most of the file's
    computing (conftest.py)."""
    import subprocess
    import sys

    from conftest import ROOT, long_run_xla_env
    out = tmp_path_factory.mktemp("detect") / "run"
    result = subprocess.run([sys.executable, "-c", OVERFIT, str(demo_dir), str(scenario_workdir),
                             str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env=long_run_xla_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("RESULTS ")][-1]
    return demo_config(demo_dir, scenario_workdir), out, json.loads(line[len("RESULTS "):])


@pytest.mark.slow
def test_the_task_overfits_the_demo_boxes(overfit):
    _, out, results = overfit
    m = results["metrics"]
    assert m["AP50"] >= 0.9, m
    assert 0 < m["AP"] <= m["AP50"]
    assert results["model"].startswith("ScenarioCLIP (global -> RPN, object -> RoI")
    assert results["split"] == "train" and results["images"] == 10
    assert results["steps"] == train.total_steps(load_config("detection:demo"), 10)
    table = (out / "results.md").read_text().splitlines()
    assert table[0] == "| Model | AP | AP50 | AP75 | APr | APc | APf |"
    assert f"| {100 * m['AP50']:.1f} |" in table[2]
    written = json.loads((out / "results.json").read_text())["metrics"]
    assert written.keys() == m.keys()
    np.testing.assert_array_equal(list(written.values()), list(m.values()))  # NaN where m has
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == results["steps"]
    assert {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg",
            "examples_per_sec"} <= set(logged[-1])
    assert logged[-1]["loss"] < logged[0]["loss"]


@pytest.mark.slow
def test_eval_detect_evaluates_the_run_again_and_a_rerun_resumes(overfit, caplog, capsys):
    config, out, results = overfit
    (out / "results.json").unlink()
    assert cli.main(["--workdir", str(out)]) == 0  # its recipe: the run's config.json
    printed = capsys.readouterr().out
    assert printed.lstrip().startswith("| Model | AP |")  # the launcher's --eval-only output
    assert f"results: {out / 'results.md'}" in printed
    again = json.loads((out / "results.json").read_text())
    assert again["metrics"]["AP50"] == pytest.approx(results["metrics"]["AP50"], abs=1e-6)
    with caplog.at_level("INFO"):
        fitted = TASK.fit(config, str(out), progress=False)
    assert "nothing to train" in caplog.text and fitted.step == fitted.steps


@pytest.mark.slow
def test_a_longer_recipe_continues_only_when_allowed(overfit):
    """The run's length is part of its recipe: another `epochs` for the run is refused in a
    message that names --allow-config-change, and trains on when allowed."""
    config, out, results = overfit
    longer = config.copy_and_resolve_references()
    longer.epochs = 101
    with pytest.raises(ConfigDriftError) as refused:
        TASK.fit(longer, str(out), progress=False)
    assert "trained with another config" in str(refused.value)
    assert "epochs: 100 in the run, 101 now" in str(refused.value)
    assert "--allow-config-change" in str(refused.value)
    fitted = TASK.fit(longer, str(out), progress=False, allow_config_change=True)
    assert fitted.step == fitted.steps > results["steps"]
    assert json.loads((out / "config.json").read_text())["epochs"] == 101


def _tiny_run(tiny_hf, demo_dir, out, stop_at=None):
    folder, _ = tiny_hf
    config = load_config("detection:demo")
    config.epochs, config.batch_size, config.log_every = 1, 2, 1
    config.detector.update(image_size=64, rpn_pre_nms_top_n_train=64,
                           rpn_post_nms_top_n_train=32, box_batch_size_per_image=16)
    examples, classes = data.load_examples(demo_dir, "train")
    examples = [data.resize_for_detection(ex, 64) for ex in examples]
    towers = clip.from_hf(folder)
    model = Detector(train.detector_config(config, len(classes)), towers.vision_model,
                     towers.config.vision.patch_size)
    return train.train(config, str(out), model, examples, len(classes), progress=False,
                       stop_at=stop_at)


@pytest.mark.slow
def test_stop_and_resume_equals_an_uninterrupted_run(tiny_hf, demo_dir, tmp_path):
    """The stopped and the resumed run take the uninterrupted run's step (`kept_step`: one
    compilation in the process) and end at its parameters."""
    from sclaro_jax.run.ahead import clear_kept_steps

    clear_kept_steps()
    _, whole, info = _tiny_run(tiny_hf, demo_dir, tmp_path / "whole")
    assert info == {"steps": 5, "start": 0, "compiles": 1}
    _, part, info = _tiny_run(tiny_hf, demo_dir, tmp_path / "split", stop_at=2)
    assert int(part["step"]) == 2 and info == {"steps": 5, "start": 0, "compiles": 0}
    _, part, info = _tiny_run(tiny_hf, demo_dir, tmp_path / "split")
    assert info == {"steps": 5, "start": 2, "compiles": 0} and int(part["step"]) == 5
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(part["params"]),
                 jax.device_get(whole["params"]))
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_backbone_equals_the_clip_tower_at_its_own_size(tiny_hf):
    from flax import nnx

    towers = clip.from_hf(tiny_hf[0])
    cfg = towers.config.vision
    forward = nnx.jit(lambda module, x: module(x))  # one program per call, not op by op
    pixels = jax.random.normal(jax.random.key(0), (2, cfg.image_size, cfg.image_size, 3))
    hidden, _ = forward(towers.vision_model, pixels)
    grid = cfg.image_size // cfg.patch_size
    got = forward(ViTBackbone(towers.vision_model, cfg.patch_size), pixels)
    np.testing.assert_allclose(got, np.asarray(hidden[:, 1:]).reshape(2, grid, grid, -1),
                               atol=1e-5)
    big = forward(ViTBackbone(towers.vision_model, cfg.patch_size),
                  jnp.zeros((1, 2 * cfg.image_size, 2 * cfg.image_size, 3)))
    assert big.shape == (1, 2 * grid, 2 * grid, cfg.hidden_size)


@pytest.mark.parametrize("argv, message", [
    (["--workdir", "/nonexistent/run"], "--workdir /nonexistent/run does not exist"),
    (["--config", "detection:demo", "--config.epochz=3"],
     "unknown config key 'epochz' (in --config.epochz=3); did you mean epochs? (see python -m "
     "sclaro_jax.eval.detect --help)"),
    (["--config", "detection:demo", "--config.epochs=x"],
     "--config.epochs=x: config.epochs takes int values (the recipe's is"),
    (["--config", "detection:demo", "--config.epochs"], "expected KEY=VALUE"),
    (["--config", "nosuch"], "config file not found: nosuch"),
    (["--config", "detection:demo", "--config.input_resize=crop"], "unknown resize mode 'crop'"),
    (["--config", "scenarioclip:demo"], "is a scenarioclip run, not a detector's"),
    (["--config", "detection:demo"], "holds no trained detector"),
])
def test_eval_detect_errors_are_one_line(argv, message, demo_dir, tmp_path, capsys):
    argv = ["--workdir", str(tmp_path), f"--config.data.dir={demo_dir}", *argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.slow
def test_vitdet_input_end_to_end(tiny_hf, demo_dir, tmp_path):
    """input_resize=longest_side end to end (a few steps): trains on padded inputs, evaluates
    in the loaded images' pixels, and records the setting."""
    out = tmp_path / "run"
    config = demo_config(demo_dir, tiny_hf[0])
    # the train step of _tiny_run and the launcher's first run, and the launcher's eval batch
    # (the demo's eval_batch_size): the same programs, compiled once for the file
    config.update(epochs=1, batch_size=2, input_resize="longest_side")
    config.detector.update(image_size=64, rpn_pre_nms_top_n_train=64,
                           rpn_post_nms_top_n_train=32, box_batch_size_per_image=16)
    TASK.fit(config, str(out), progress=False)
    results = TASK.evaluate(config, str(out)).results
    assert results["config"]["input_resize"] == "longest_side" and results["steps"] == 5
    assert all(0 <= v <= 1 for k, v in results["metrics"].items() if v == v)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(x["copy_paste_rate"] == 0.0 for x in lines)  # the demo recipe pastes nothing


def test_help_names_the_run_and_the_recipe(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--workdir" in out and "--config" in out and "--config.KEY=VALUE" in out


SMALL_DETECTOR = dict(image_size=64, rpn_pre_nms_top_n_train=64, rpn_post_nms_top_n_train=32,
                      box_batch_size_per_image=16)


def _one_sharded_step(strategy, num_classes, params=None):
    """(metrics, initial parameters) of one detection train step under the trainer's sharding
    `strategy` ("none": one device; "fsdp": the batch split as in dp, and the weights too) on a
    fixed random batch: the demo recipe at 64 px with the launcher test's sizes and a 10-step
    schedule (the single-device step is the launcher's resumed run's program, compiled once) on
    the tiny preset's tower, drawn here or given (`params`, the single-device run's)."""
    from flax import nnx

    from sclaro_jax.run import sharding

    config = load_config("detection:demo")
    config.detector.update(**SMALL_DETECTOR)
    cfg = train.detector_config(config, num_classes)

    def make():
        return Detector(cfg, clip.create("tiny").vision_model, 8)

    if params is None:
        model = make()
    else:  # the given weights in the detector's structure (built abstractly: none drawn)
        model = nnx.eval_shape(make)
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
        nnx.update(model, state)
    initial = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 40, (2, 4, 2)).astype(np.float32)
    boxes, labels, valid = (np.zeros((2, cfg.max_boxes, 4), np.float32),
                            np.zeros((2, cfg.max_boxes), np.int32),
                            np.zeros((2, cfg.max_boxes), bool))
    boxes[:, :4] = np.concatenate([xy, xy + rng.uniform(8, 24, (2, 4, 2))], -1)
    labels[:, :4] = rng.integers(0, num_classes, (2, 4))
    valid[:, :4] = [[True, True, True, False], [True, True, False, False]]
    batch = {"image": rng.integers(0, 256, (2, 64, 64, 3), dtype=np.uint8), "boxes": boxes,
             "labels": labels, "valid": valid}
    graphdef, state, tx = train.init_state(model, config, 10)
    mesh = sharding.make_mesh(strategy)
    step, state = sharding.jit_step(train.make_train_step(graphdef, tx, 0), state, mesh, strategy)
    _, metrics = step(state, sharding.put_batch(batch, mesh))
    return {k: float(v) for k, v in metrics.items()}, initial


SHARDED = r'''
import os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # the suite's flags too
                           + " --xla_force_host_platform_device_count=2")
import json
import pickle
import sys
import jax
jax.config.update("jax_default_matmul_precision", "highest")
assert len(jax.devices()) == 2
sys.path.insert(0, "tests")
from test_detection_train import _one_sharded_step

with open(PARAMS, "rb") as f:
    initial = pickle.load(f)
metrics, _ = _one_sharded_step("fsdp", CLASSES, initial)
print("fsdp", json.dumps(metrics))
print("OK")
'''


@pytest.mark.slow
def test_fsdp_losses_match_one_device(demo_dir, tmp_path):
    """The detection step under the trainer's fsdp sharding on 2 host devices (a child process)
    gives the single-device losses (computed here, from the same weights and batch; samplers
    draw per image from one key, so the draws agree too)."""
    import pickle

    from conftest import run_script

    classes = len(data.load_examples(demo_dir, "train")[1])
    want, initial = _one_sharded_step("none", classes)
    (tmp_path / "initial.pkl").write_bytes(pickle.dumps(initial))
    script = SHARDED.replace("PARAMS", repr(str(tmp_path / "initial.pkl")))
    printed = run_script(script.replace("CLASSES", str(classes)))
    got = json.loads(next(x for x in printed.splitlines() if x.startswith("fsdp "))[5:])
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-5 * max(1.0, abs(v)), (k, got[k], v)


def test_make_batch_pastes_rare_classes_inside_the_image(demo_dir):
    config = load_config("detection:demo")
    config.copy_paste_prob = 1.0
    examples, classes = data.load_examples(demo_dir, "train")
    examples = [data.resize_for_detection(ex, 64) for ex in examples]
    cfg = train.detector_config(config, len(classes))
    counts = data.class_instance_counts(examples, len(classes))
    rare = data.rare_classes(counts, 2)  # the classes seen once
    assert rare.any() and not rare.all()
    batch = train.make_batch(examples, np.arange(4), cfg, config, rare, step=3)
    assert batch["image"].shape == (4, 64, 64, 3) and batch["image"].dtype == np.uint8
    assert batch["boxes"].shape == (4, cfg.max_boxes, 4) and batch["valid"].dtype == bool
    boxes = batch["boxes"][batch["valid"]]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 64).all()
    assert (boxes[:, 2:] > boxes[:, :2]).all()
    added = [Counter(batch["labels"][i][batch["valid"][i]].tolist())
             - Counter(examples[i].labels.tolist()) for i in range(4)]
    assert sum(sum(a.values()) for a in added) > 0
    assert all(rare[c] for a in added for c in a)  # only rare classes were pasted
    again = train.make_batch(examples, np.arange(4), cfg, config, rare, step=3)
    np.testing.assert_array_equal(again["image"], batch["image"])  # drawn from (seed, step)


@pytest.mark.parametrize("prob", [0.0, 0.3, 1.0])
def test_copy_paste_rate_is_the_config_value(demo_dir, prob):
    """Over 800 draws the fraction of images that received pasted instances matches
    copy_paste_prob (binomial test); the other images are the examples unchanged."""
    from scipy import stats

    config = load_config("detection:demo")
    config.copy_paste_prob = prob
    examples, classes = data.load_examples(demo_dir, "train")
    examples = [data.resize_for_detection(ex, 32) for ex in examples]
    cfg = train.detector_config(config, len(classes))
    rare = data.rare_classes(data.class_instance_counts(examples, len(classes)), 2)
    donors = data.rare_donors(examples, rare)
    assert 0 < len(donors) < len(examples)
    pasted = 0
    for step in range(100):
        indices = np.random.default_rng(step).integers(0, len(examples), 8)
        batch = train.make_batch(examples, indices, cfg, config, rare, step, donors)
        pasted += int(batch["pasted"].sum())
        for k in np.flatnonzero(~batch["pasted"]):
            ex = examples[indices[k]]
            np.testing.assert_array_equal(batch["image"][k], ex.image)
            assert batch["labels"][k][batch["valid"][k]].tolist() == ex.labels.tolist()
    if prob in (0.0, 1.0):
        assert pasted == 800 * prob
    else:
        assert stats.binomtest(pasted, 800, prob).pvalue > 1e-3, pasted / 800


@pytest.mark.slow
def test_backbones_of_each_kind_of_workdir(tiny_hf, scenario_workdir, tmp_path, demo_dir):
    rpn, roi, patch, name = backbones.backbones(str(tiny_hf[0]), "global", "object", False)
    assert roi is None and patch == 8 and name.startswith("CLIP (")
    rpn, roi, patch, name = backbones.backbones(str(scenario_workdir), "global", "object", False)
    assert roi is not None and roi is not rpn and "global -> RPN, object -> RoI" in name
    rpn, roi, _, name = backbones.backbones(str(scenario_workdir), "object", "object", True)
    assert roi is None and name.startswith("ScenarioCLIP (object")
    from conftest import _checkpointed_workdir

    _checkpointed_workdir(tmp_path / "pyr", demo_dir, kind="pyramidclip")
    rpn, roi, _, name = backbones.backbones(str(tmp_path / "pyr"), "global", "object", False)
    assert roi is None and name.startswith("PyramidCLIP (global")


@pytest.mark.slow
@pytest.mark.parametrize("patch", [8, 14, 32])
def test_pyramid_strides_for_each_patch_size(patch):
    """Strides 4-64 for the RPN and 4-32 for the RoI heads whatever the patch size: powers of 2
    by deconvolution / pooling, 14 through a resize of the token map to the stride-16 grid."""
    import dataclasses

    from flax import nnx

    from sclaro_jax.detection.model import DetectorConfig

    base = clip.config_from_preset("tiny")
    vision = dataclasses.replace(base.vision, patch_size=patch, image_size=2 * patch)
    size = 448 if patch == 14 else 128
    cfg = DetectorConfig(num_classes=3, image_size=size, pyramid_dim=8, fpn_dim=8,
                         representation_size=16)
    # shapes only: the detector built abstractly (no weights drawn) and traced by eval_shape
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Detector(
        cfg, clip.CLIPModel(base.replace(vision=vision), rngs=nnx.Rngs(0)).vision_model, patch)))
    rpn, roi = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s).features(x), state,
                              jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32))
    assert [f.shape[1] for f in rpn] == [size // s for s in (4, 8, 16, 32, 64)]
    assert [f.shape for f in roi] == [f.shape for f in rpn[:-1]]
    assert all(f.dtype == jnp.float32 for f in rpn)


LAUNCH_SMALL = ["--config.batch_size=2", "--config.log_every=1", "--config.checkpoint_every=2",
                "--config.detector.image_size=64", "--config.detector.rpn_pre_nms_top_n_train=64",
                "--config.detector.rpn_post_nms_top_n_train=32",
                "--config.detector.box_batch_size_per_image=16", "--config.progress_bar=false"]


@pytest.mark.slow
def test_launcher_trains_evaluates_and_resumes_the_detector(demo_dir, tmp_path, shared_launcher):
    """`launch/train.py --config configs/detection.py:demo` trains the detector (a tiny random
    encoder) with ScenarioCLIP's flags and overrides and ends with the AP table and
    WORKDIR/results.json; a rerun with another recipe or length is refused with one error line
    unless --allow-config-change (then it resumes)."""
    import sys

    from conftest import launch_all

    workdir = tmp_path / "det"

    def args(*extra):
        return ["--config", "configs/detection.py:demo", "--workdir", str(workdir),
                f"--config.data.dir={demo_dir}", *LAUNCH_SMALL, *extra]

    def launch(*extra):
        # in the worker's shared launcher (conftest: the runs, not their process, are the
        # case), at the matmul precision of this process (conftest): the launcher's train and
        # eval programs are then those _tiny_run, test_vitdet_input_end_to_end and the fsdp
        # test's reference compiled (the run's compilation cache), as every shape and setting
        # here is theirs
        return shared_launcher.run([sys.executable, "launch/train.py", *args(*extra)],
                                   jax_config={"jax_default_matmul_precision": "highest"})

    first = launch("--config.epochs=1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "done: 5 steps" in first.stdout
    results = json.loads((workdir / "results.json").read_text())
    assert results["steps"] == 5 and set(results["metrics"]) >= {"AP", "AP50", "AP75"}
    assert "| Model | AP | AP50 | AP75 | APr | APc | APf |" in first.stdout
    assert f"results: {workdir / 'results.md'}" in first.stdout
    assert sorted(int(x.name) for x in (workdir / "checkpoints").iterdir()) == [4, 5]
    # the orbax layout of the checkpoints written before the run layer: one item, "default"
    assert {x.name for x in (workdir / "checkpoints" / "5").iterdir() if x.is_dir()} == {"default"}
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert json.loads((workdir / "config.json").read_text())["trainer"] == "detection"
    # three refusals, run in turn in one launcher process (conftest.launch_all)
    refused, bad_key, longer = launch_all([
        args("--config.epochs=2", "--config.head_lr=0.5"),
        args("--config.detector.imagesize=3"),
        args("--config.epochs=2")])  # another length re-stretches the schedule: refused
    assert refused.returncode == 2
    assert "error: " in refused.stderr and "trained with another config" in refused.stderr
    assert "head_lr" in refused.stderr and "Traceback" not in refused.stderr
    assert bad_key.returncode == 2 and "imagesize" in bad_key.stderr.strip().splitlines()[-1]
    assert longer.returncode == 2 and "epochs: 1 in the run, 2 now" in longer.stderr
    resumed = launch("--config.epochs=2", "--allow-config-change", "--no-eval")  # if allowed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "done: 10 steps" in resumed.stdout and "resumed" in resumed.stderr
    assert "results:" not in resumed.stdout  # --no-eval
    assert ("the run's length changes at step 5 (epochs 1 -> 2, allowed): its learning-rate "
            "schedule is re-stretched") in resumed.stderr
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert {"loss", "loss_objectness", "copy_paste_rate", "examples_per_sec"} <= set(rows[-1])


def test_without_pycocotools_the_task_stops_before_any_work(demo_dir, tmp_path, monkeypatch,
                                                           capsys):
    """COCO AP needs pycocotools (the `eval` extra): a machine without it hears so at once,
    not after the training it would evaluate (the task's check comes first)."""
    import sys
    import time

    for name in ("pycocotools", "pycocotools.coco", "pycocotools.cocoeval"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    out = tmp_path / "det"
    t0 = time.monotonic()
    with pytest.raises(ImportError) as refused:
        TASK.check(demo_config(demo_dir))  # the launcher's first call, before any writing
    took = time.monotonic() - t0
    said = str(refused.value)  # one line naming the extra and the pip command
    assert said.startswith("COCO AP needs the pycocotools package (") and "\n" not in said
    assert said.endswith('install the `eval` extra, pip install -e ".[eval]" from the '
                         'sclaro-jax checkout')
    assert not out.exists() and took < 10, took  # nothing prepared, trained or compiled
    assert cli.main(["--workdir", str(tmp_path), "--config", "detection:demo"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {refused.value}"]
