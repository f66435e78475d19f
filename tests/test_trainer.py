"""The demo training run end to end: loss falls, scales move, a SIGKILLed run resumes exactly."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import own_cache_env

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
OVERRIDES = [f"--config.train.steps={STEPS}", "--config.checkpoint_every=8",
             "--config.log_every=4", "--config.train.ema_warmup_steps=6"]


def _train_cmd(workdir, data):
    return [sys.executable, "launch/train.py", "--config", "configs/scenarioclip.py:demo",
            "--workdir", str(workdir), f"--config.data.dir={data}", *OVERRIDES]


def _final_params(workdir):
    import orbax.checkpoint as ocp
    path = os.path.join(workdir, "checkpoints", str(STEPS), "state")
    return ocp.PyTreeCheckpointer().restore(path)


def _flat(tree):
    import jax
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield jax.tree_util.keystr(path), np.asarray(leaf)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, demo_dir, shared_launcher):
    workdir = tmp_path_factory.mktemp("run_full")
    # in the worker's shared launcher (conftest): the runs below that take its recipe's step
    # (the version-1 records, the old-layout resume) find it traced and compiled there
    result = shared_launcher.run(_train_cmd(workdir, demo_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    (workdir / "stderr.txt").write_text(result.stderr)
    return workdir


@pytest.mark.slow
def test_demo_run_learns_and_logs_the_api_fields(uninterrupted):
    log = (uninterrupted / "stderr.txt").read_text()
    # the step compiled before the first batch, then the first loss and the time to it
    compiled = log.index("compiled the train step for 1 batch shape(s) in ")
    assert compiled < log.index("step 1 done: loss ") < log.index(" s after the process started")
    assert "compiling it now" not in log and "(first step only)" not in log
    rows = [json.loads(line) for line in open(uninterrupted / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(4, STEPS + 1, 4))
    for field in ("step", "loss", "loss_ca", "loss_kd", "lr", "kd_temperature",
                  "examples_per_sec", "data_wait_fraction", "crops_objects", "crops_relations",
                  "padding_objects", "padding_relations", "packed_size"):
        assert all(np.isfinite(r[field]) for r in rows), field
    # the packed layout (the default): every crop trained, its slots the one planned size of
    # the demo (4 images x its largest counts, 7 objects and 6 relations)
    assert all(r["dropped_objects"] == r["dropped_relations"] == 0 for r in rows)
    assert {r["packed_size"] for r in rows} == {4 * 7 + 4 * 6}
    for r in rows:
        assert r["padding_objects"] == pytest.approx(1 - r["crops_objects"] / 28)
        assert r["padding_relations"] == pytest.approx(1 - r["crops_relations"] / 24)
    assert all(0 <= r["data_wait_fraction"] <= 1 for r in rows)
    assert np.mean([r["loss"] for r in rows[-2:]]) < np.mean([r["loss"] for r in rows[:2]])
    assert rows[-1]["kd_temperature"] != rows[0]["kd_temperature"]
    for level in ("global", "object", "relation"):
        assert rows[-1][f"logit_scale_{level}"] != rows[0][f"logit_scale_{level}"]
    assert sorted(os.listdir(uninterrupted / "checkpoints")) == ["16", "8"]
    state = _final_params(uninterrupted)
    assert int(state["step"]) == STEPS


@pytest.mark.slow
def test_the_end_of_run_evaluation_equals_the_checkpoints(uninterrupted, tmp_path):
    """The launcher evaluates the student it trained as it is in memory
    (`train.task.fitted_student`); the same evaluators on the newest checkpoint read back give
    the same results.json. A fit that ended elsewhere, or trained with another attention than
    a checkpoint is evaluated with, is read back instead."""
    import shutil

    import jax
    from flax import nnx

    from sclaro_jax.checkpoint import load_checkpoint, run_config
    from sclaro_jax.run.task import Fitted
    from sclaro_jax.train import core
    from sclaro_jax.train.task import TASK, fitted_student

    want = json.loads((uninterrupted / "results.json").read_text())
    assert want["step"] == STEPS
    copy = tmp_path / "run"  # evaluate writes results.json: not into the shared run
    shutil.copytree(uninterrupted, copy, ignore=shutil.ignore_patterns("jax_cache"))
    config = run_config(str(copy))
    read_back = TASK.evaluate(config, str(copy), progress=False).results
    assert json.loads(json.dumps(read_back, default=str)) == want

    model, step = load_checkpoint(str(copy), config=config)
    graph, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    teacher = jax.tree.map(lambda x: x + 1.0, params)  # not what is evaluated
    state = core.TrainState(step=STEPS, params=params, teacher=teacher, opt_state=None)
    fitted = Fitted(state, STEPS, STEPS, graph)
    student = fitted_student(config, fitted, STEPS)
    assert student is not None
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(student, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                      err_msg=str(path))
    in_memory = TASK.evaluate(config, str(copy), progress=False, fitted=fitted).results
    assert json.loads(json.dumps(in_memory, default=str)) == want
    assert fitted_student(config, fitted, STEPS - 8) is None  # not the newest checkpoint
    assert fitted_student(config, Fitted(state, STEPS, STEPS), STEPS) is None  # no graph
    config.perf.attention = "xla"  # trained with another attention than evaluation's
    assert fitted_student(config, fitted, STEPS) is None


@pytest.mark.slow
def test_version_1_records_give_the_same_loss_curve(uninterrupted, tmp_path,
                                                    shared_launcher):
    """The same 16-step demo run from version-1 records (views made from the originals on the
    host every step) and from version-2 records (stored views, the global view cropped from
    the downscaled train_image): the losses stay within 2% at every logged step."""
    from data_prep.demo import build_demo

    v1 = tmp_path / "v1"
    build_demo(str(v1), image_size=None, progress=False)
    workdir = tmp_path / "run"
    result = shared_launcher.run(  # the same batch shapes as the uninterrupted run's step
        _train_cmd(workdir, v1) + [f"--config.compilation_cache={uninterrupted / 'jax_cache'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    want = [json.loads(line) for line in open(uninterrupted / "metrics.jsonl")]
    got = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    ratios = [g["loss"] / w["loss"] for g, w in zip(got, want)]
    assert max(abs(r - 1) for r in ratios) <= 0.02, ratios
    assert ratios != [1.0] * len(ratios)  # the records differ, so the pixels do


@pytest.mark.slow
def test_the_caps_layout_trains_the_same_losses_as_the_packed_default(uninterrupted, demo_dir,
                                                                     tmp_path, shared_launcher):
    """The same 16-step demo run with the per-image caps layout (8 objects, 6 relations: the
    demo's counts fit, nothing dropped) logs the packed run's losses to 1e-5."""
    result = shared_launcher.run(  # its losses are what is compared: no end-of-run evaluation
        _train_cmd(tmp_path, demo_dir) + ["--config.data.layout=caps", "--no-eval"])
    assert result.returncode == 0, result.stderr[-3000:]
    want = [json.loads(line) for line in open(uninterrupted / "metrics.jsonl")]
    got = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert all("packed_size" not in r and r["dropped_objects"] == 0 for r in got)
    for g, w in zip(got, want):
        assert g["crops_objects"] == w["crops_objects"], g["step"]  # the same crops
        assert g["padding_objects"] > w["padding_objects"]  # in more slots
        for key in ("loss", "loss_ca", "loss_kd", "loss_object", "loss_relation"):
            assert g[key] == pytest.approx(w[key], rel=1e-5), (g["step"], key)


@pytest.mark.slow
def test_sigkill_then_rerun_gives_the_uninterrupted_parameters(uninterrupted, demo_dir,
                                                               tmp_path):
    cmd = _train_cmd(tmp_path, demo_dir) + ["--no-eval"]  # its parameters are what is compared
    # Synchronous checkpoints and no progress bar, so the log line below means the step-8
    # checkpoint is complete; the run is killed the moment it says so.
    kill_cmd = cmd + ["--config.checkpoint_async=False", "--config.progress_bar=False"]
    env = own_cache_env()  # the workdir's own cache (the default) is what this test reads
    proc = subprocess.Popen(kill_cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:  # blocks on the pipe until the trainer reports the checkpoint
        if "checkpoint at step 8 written" in line:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    done = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
    assert done and max(done) < STEPS  # killed mid-way
    cached = sorted(os.listdir(tmp_path / "jax_cache"))  # config.compilation_cache="workdir"
    assert any(name.startswith("jit_step-") for name in cached), cached
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from" in rerun.stderr
    # the rerun took its step from the cache (nothing new written), and the parameters below
    # equal those of the uninterrupted run, which compiled its own
    assert [n for n in sorted(os.listdir(tmp_path / "jax_cache")) if n.startswith("jit_step-")
            ] == [n for n in cached if n.startswith("jit_step-")]
    want = dict(_flat(_final_params(uninterrupted)))  # student, teacher, optimiser, step
    got = dict(_flat(_final_params(tmp_path)))
    assert want.keys() == got.keys() and len(want) > 500
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_restore_gives_the_state_and_the_next_batch_where_the_checkpoint_left_off(demo_dir,
                                                                                   tmp_path):
    """`resume.restore` (what a resumed run calls), in process and without training: a
    checkpoint of a state and of the input iterator after 3 batches restores to that state and
    to the 4th batch, not one batch earlier or later (the fast tier's guard on resume; the
    launcher's kill-and-rerun tests above are slow)."""
    import grain.python as grain
    import orbax.checkpoint as ocp
    from conftest import demo_config

    from sclaro_jax.checkpoint import build_model
    from sclaro_jax.data.pipeline import make_loader
    from sclaro_jax.train import core, resume, trainer

    config = demo_config(demo_dir, steps=STEPS)
    tcfg = trainer.train_config(config, STEPS)
    _, state, _ = core.init_state(build_model(config), tcfg)

    def loader():
        return iter(make_loader(demo_dir, "train", config.data.batch_size, seed=config.seed,
                                config=trainer.pipeline_config(config)))

    it = loader()
    first = [next(it) for _ in range(3)]
    saved = state.replace(step=state.step + 3)
    manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"),
                                    options=ocp.CheckpointManagerOptions(create=True))
    manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(saved),
                                            data=grain.PyGrainCheckpointSave(it)))
    manager.wait_until_finished()
    want = [next(it) for _ in range(2)]
    fresh = loader()
    assert int(resume.restore(manager, 3, state, fresh, tcfg).step) == int(saved.step)
    got = [next(fresh) for _ in range(2)]
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for key in w:
            np.testing.assert_array_equal(np.asarray(g[key]), np.asarray(w[key]), err_msg=key)
    assert any(not np.array_equal(np.asarray(first[-1][k]), np.asarray(got[0][k]))
               for k in got[0])  # the batches differ, so an off-by-one would show
    manager.close()


@pytest.mark.slow
def test_old_list_layout_checkpoint_resumes_to_the_same_parameters(uninterrupted, demo_dir,
                                                                   tmp_path, shared_launcher):
    """A checkpoint written before the optimiser state was keyed by names (Adam's moments over
    a list of the trainable leaves) is converted on restore: resuming the uninterrupted run's
    step 8 from that layout ends at its step-16 parameters."""
    import jax
    import grain.python as grain
    import orbax.checkpoint as ocp
    from conftest import demo_config

    from sclaro_jax.checkpoint import build_model
    from sclaro_jax.data.pipeline import make_loader
    from sclaro_jax.train import core, resume, trainer

    config = demo_config(demo_dir, steps=STEPS)
    config.train.ema_warmup_steps = 6
    tcfg = trainer.train_config(config, STEPS)
    _, state, _ = core.init_state(build_model(config), tcfg)
    it = iter(make_loader(demo_dir, "train", config.data.batch_size, seed=config.seed,
                          config=trainer.pipeline_config(config)))
    source = ocp.CheckpointManager(str(uninterrupted / "checkpoints"))
    state = source.restore(8, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(state), data=grain.PyGrainCheckpointRestore(it)))["state"]
    old = jax.tree.unflatten(jax.tree.structure(resume.positional_opt_state(state, tcfg)),
                             jax.tree.leaves(state.opt_state))
    assert isinstance(old[1].inner_states["decay"].inner_state[0].mu, list)
    manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"),
                                    options=ocp.CheckpointManagerOptions(create=True))
    manager.save(8, args=ocp.args.Composite(  # as the trainer saved before the change
        state=ocp.args.StandardSave(state.replace(opt_state=old)),
        data=grain.PyGrainCheckpointSave(it)))
    manager.wait_until_finished()
    assert resume.is_positional(str(tmp_path / "checkpoints" / "8"))
    cmd = _train_cmd(tmp_path, demo_dir) + [  # its parameters are compared: no evaluation
        f"--config.compilation_cache={uninterrupted / 'jax_cache'}", "--no-eval"]
    rerun = shared_launcher.run(cmd)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from" in rerun.stderr
    want = dict(_flat(_final_params(uninterrupted)))
    got = dict(_flat(_final_params(tmp_path)))
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_data_wait_fraction_and_its_one_warning(caplog):
    """The fraction is the interval's waiting time over its wall time; past 10% it warns once
    (not on the first interval, which holds the workers' start-up), naming worker_count."""
    import logging

    from sclaro_jax.train.trainer import DataWait

    wait = DataWait(workers=3)
    with caplog.at_level(logging.WARNING, logger="sclaro_jax.train.trainer"):
        wait.add(0.5)
        assert wait.fraction(1.0, step=4) == 0.5  # first interval: no warning
        assert not caplog.records
        wait.add(0.02)
        wait.add(0.03)
        assert wait.fraction(1.0, step=8) == pytest.approx(0.05)
        assert not caplog.records
        wait.add(0.25)
        assert wait.fraction(1.0, step=12) == pytest.approx(0.25)
        wait.add(0.9)
        assert wait.fraction(1.0, step=16) == pytest.approx(0.9)
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "data_wait_fraction 0.25" in msg and "step 12" in msg
    assert "Give it more worker processes: config.data.workers is 3" in msg
    caplog.clear()
    quiet = DataWait(workers=0)  # the demo configs' own setting: not blamed as a mistake
    with caplog.at_level(logging.WARNING, logger="sclaro_jax.train.trainer"):
        quiet.fraction(1.0, step=4)
        quiet.add(0.5)
        quiet.fraction(1.0, step=8)
    msg = caplog.records[0].getMessage()
    assert "config.data.workers is 0, the demo configs' choice" in msg
    assert "--config.data.workers=N" in msg and "Give it more" not in msg


def test_unknown_train_keys_are_refused_with_the_known_ones(demo_dir, tmp_path):
    from conftest import demo_config

    from sclaro_jax.train import trainer
    config = demo_config(demo_dir)
    assert trainer.train_config(config, 5).frozen_text_layers == 1  # the demo's override
    config.train.lamda_kd = 0.0  # a typo
    with pytest.raises(ValueError, match=r"unknown keys \['lamda_kd'\]; known: .*'lambda_kd'"):
        trainer.train(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
def test_export_cli_from_the_demo_run(uninterrupted, tmp_path, monkeypatch):
    # the export CLI on the workdir the demo run left: its latest checkpoint, read by PyTorch
    # (transformers' AutoModel with the export's model code; its module copy goes to tmp_path)
    import transformers.dynamic_module_utils as dynamic
    from test_export_clients import _auto_model, _torch_embeddings

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))

    from sclaro_jax.checkpoint import load_checkpoint
    out = tmp_path / "exported"
    result = subprocess.run([sys.executable, "-m", "sclaro_jax.train.export", "--workdir",
                             str(uninterrupted), "--level", "global", "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"wrote the global level of step {STEPS}" in result.stdout
    model, step = load_checkpoint(str(uninterrupted))
    assert step == STEPS
    pixels = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
    ids = np.array([[49406, 320, 49407, 0], [49406, 7, 8, 49407]], np.int32)
    img, txt = _torch_embeddings(_auto_model(out), pixels, ids)
    np.testing.assert_allclose(img, np.asarray(model.pair("global").encode_image(pixels)),
                               atol=1e-5)
    np.testing.assert_allclose(txt, np.asarray(model.pair("global").encode_text(ids)),
                               atol=1e-5)


@pytest.mark.parametrize("config, kind", [("configs/pyramidclip.py:demo", "PyramidCLIP"),
                                          ("configs/scenarioclip_nokd.py:demo", "ScenarioCLIP")])
@pytest.mark.slow
def test_baseline_configs_train(tmp_path, demo_dir, config, kind, shared_launcher):
    # the ScenarioCLIP w/o KD run also evaluates itself periodically (config.evals)
    evaluate = ["--config.evals.zero_shot.every=2", "--config.evals.zero_shot.split=test"] \
        if kind == "ScenarioCLIP" \
        else []
    result = shared_launcher.run(
        [sys.executable, "launch/train.py", "--config", config, "--workdir", str(tmp_path),
         f"--config.data.dir={demo_dir}", "--config.train.steps=2", "--config.log_every=1",
         *evaluate])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    # the launcher ends in results: config.evals on the final checkpoint, and their table
    final = json.loads((tmp_path / "results.json").read_text())
    assert final["step"] == 2 and set(final["evaluators"]) == {"zero_shot"}
    split = final["evaluators"]["zero_shot"]["split"]
    assert split == ("test" if evaluate else "val")
    assert f"zero_shot ({split}):" in result.stdout and "| action.strict.all |" in result.stdout
    assert f"results: {tmp_path / 'results.md'}" in result.stdout
    if evaluate:
        evals = [json.loads(line) for line in open(tmp_path / "eval.jsonl")]
        assert [e["step"] for e in evals] == [2] and evals[0]["split"] == "test"
        assert evals[0]["evaluator"] == "zero_shot"
        zero_shot = evals[0]["results"]
        assert set(zero_shot) >= {"action", "object", "relation"}, zero_shot.keys()
    else:
        assert not (tmp_path / "eval.jsonl").exists()
    assert all(r["loss_kd"] == 0.0 and r["loss"] == r["loss_ca"] for r in rows)
    from sclaro_jax.checkpoint import load_checkpoint
    model, _ = load_checkpoint(str(tmp_path))
    assert type(model).__name__ == kind
    if kind == "PyramidCLIP":  # one pair serves every level
        assert model.pair("global") is model.pair("object") is model.pair("relation")


def test_compilation_cache_choice(tmp_path):
    import jax
    from jax.experimental.compilation_cache import compilation_cache
    from ml_collections import ConfigDict

    from sclaro_jax.run.cache import use_compilation_cache
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert use_compilation_cache(ConfigDict({"compilation_cache": ""}), str(tmp_path)) is None
        assert jax.config.jax_compilation_cache_dir is None
        got = use_compilation_cache(ConfigDict({"compilation_cache": "workdir"}), str(tmp_path))
        assert got == str(tmp_path / "jax_cache") == jax.config.jax_compilation_cache_dir
        assert (tmp_path / "jax_cache").is_dir()
        # a folder already set for JAX (here the one above) is left as it is
        other = ConfigDict({"compilation_cache": str(tmp_path / "shared")})
        assert use_compilation_cache(other, str(tmp_path)) == got
        jax.config.update("jax_compilation_cache_dir", None)
        assert use_compilation_cache(other, str(tmp_path)) == str(tmp_path / "shared")
        assert use_compilation_cache(ConfigDict({}), str(tmp_path / "w")) == str(tmp_path / "shared")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


def test_the_run_cache_stores_even_the_shortest_compilation(tmp_path, monkeypatch):
    """JAX's default stores only compilations of 1 s or more, which left out the model's
    initialisers (a warm demo start compiled 66 of them again); the run's cache stores every
    one, unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache
    from ml_collections import ConfigDict

    from sclaro_jax.run.cache import use_compilation_cache
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # JAX's default
        path = use_compilation_cache(ConfigDict({"compilation_cache": "workdir"}),
                                     str(tmp_path))
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        jax.jit(lambda x: x * 3.25 + 1.5)(jnp.ones(7)).block_until_ready()  # about 10 ms
        assert os.listdir(path), "the small program was not stored"
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1.0")
        use_compilation_cache(ConfigDict({"compilation_cache": "workdir"}), str(tmp_path / "b"))
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0  # the user's
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        compilation_cache.reset_cache()


def test_in_training_evals_log_their_numbers():
    """The log line of a periodic evaluation carries its numbers (nested results flattened)."""
    from sclaro_jax.train.trainer import _numbers

    results = {"object": {"strict": {"top1": 12.5, "top5": 40.0}}, "n": 7, "ok": True,
               "names": ["a"]}
    assert _numbers(results) == "object.strict.top1 12.5, object.strict.top5 40, n 7"
    many = {f"k{i}": float(i) for i in range(15)}
    assert _numbers(many, most=3) == "k0 0, k1 1, k2 2, ... (12 more in eval.jsonl)"


def _built_step(config, steps=4):
    """`trainer.build`'s jitted step for `config` (abstract state: nothing initialised)."""
    from sclaro_jax.train import trainer
    dataset = trainer.open_training_data(config)
    return trainer.build(config, dataset, trainer.train_config(config, steps), abstract=True)[2]


def test_a_run_takes_the_step_an_earlier_run_of_its_recipe_built(demo_dir):
    """`trainer.build` hands a run the jitted step of an earlier run in the process whose graph,
    recipe, switches, layout and state shapes are its own (JAX keeps what that step traced and
    compiled), and builds a new one when any of them differs; the newest KEEP_STEPS are kept."""
    from conftest import demo_config

    from sclaro_jax.run import ahead

    ahead.clear_kept_steps()
    first = _built_step(demo_config(demo_dir))
    assert _built_step(demo_config(demo_dir)) is first
    for key, value in (("train.lr", 1e-3), ("train.frozen_vision_layers", 2),
                       ("perf.fused_qkv", True), ("model.embed_dim", 32),
                       ("model.kind", "pyramidclip")):
        config = demo_config(demo_dir)
        section, name = key.split(".")
        config[section][name] = value
        assert _built_step(config) is not first, key
    assert _built_step(demo_config(demo_dir), steps=5) is not first  # its schedule's length
    assert len(ahead._KEPT) == ahead.KEEP_STEPS
    assert _built_step(demo_config(demo_dir)) is not first  # let go: the oldest of 7
    ahead.clear_kept_steps()
    assert not ahead._KEPT


@pytest.mark.slow
def test_a_second_run_of_a_recipe_in_one_process_neither_traces_nor_compiles_its_step(
        demo_dir, tmp_path):
    """Two runs of one recipe in this process (as a notebook trains again): the second takes the
    first's step without tracing, lowering or compiling it, and ends at the same parameters."""
    from jax import monitoring
    from conftest import demo_config

    from sclaro_jax.run import ahead
    from sclaro_jax.train import trainer

    config = demo_config(demo_dir, steps=2)
    # a cheap compile: one CLIP pair (PyramidCLIP's), its towers' blocks frozen
    config.model.kind = "pyramidclip"
    config.train.frozen_vision_layers = config.train.frozen_text_layers = 2
    config.progress_bar = False
    events = []

    def listen(event, seconds, fun_name="", **_):
        events.append((event, fun_name))

    ahead.clear_kept_steps()
    monitoring.register_event_duration_secs_listener(listen)
    try:
        states = []
        for run in ("first", "second"):
            events.clear()
            states.append(trainer.train(config, str(tmp_path / run)))
            step_events = [e for e, name in events if name in ("step", "jit_step")]
            if run == "first":
                assert "/jax/core/compile/jaxpr_trace_duration" in step_events, events
    finally:
        monitoring.unregister_event_duration_listener(listen)
        ahead.clear_kept_steps()
    assert step_events == [], step_events  # the second run's
    first, second = (dict(_flat(s)) for s in states)
    assert first.keys() == second.keys() and len(first) > 100
    for k in first:
        np.testing.assert_array_equal(second[k], first[k], err_msg=k)
