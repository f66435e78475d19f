"""A run whose newest checkpoint is damaged (a truncated data file, an empty step folder) or that
has no checkpoints/ at all: every reader of runs (export, eval.rocs, eval.suite) names it in at
most 3 stderr lines, exit 2, no traceback, and says which step to pass; `--step` with a complete
one works; a trainer's resume falls back to the newest complete one with a warning."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2  # checkpoints at 1 and 2; the program of tests/test_install.py's two-step demo run
# (same steps, the demo's EMA warm-up): one compilation in the suite's shared cache


def _train(shared_launcher, workdir, data, cache):
    return shared_launcher.run(
        [sys.executable, "launch/train.py", "--config", "configs/scenarioclip.py:demo",
         "--workdir", str(workdir), f"--config.data.dir={data}",
         f"--config.compilation_cache={cache}", f"--config.train.steps={STEPS}",
         "--config.checkpoint_every=1", "--config.progress_bar=False"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_dir, shared_launcher):
    """{kind: workdir}: one tiny demo run and copies of it damaged three ways."""
    base = tmp_path_factory.mktemp("damaged")
    good = base / "good"
    done = _train(shared_launcher, good, demo_dir, base / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(good / "checkpoints")) == ["1", "2"]
    out = {"good": good}
    for kind in ("truncated", "empty", "none"):
        out[kind] = base / kind
        shutil.copytree(good, out[kind])
    data = out["truncated"] / "checkpoints" / "2" / "state"
    biggest = max((p for p in data.rglob("*") if p.is_file() and p.parent.name == "d"
                   and "ocdbt.process" in str(p)), key=lambda p: p.stat().st_size)
    size = biggest.stat().st_size
    os.truncate(biggest, size // 3)
    out["truncated_file"] = biggest.name
    empty = out["empty"] / "checkpoints" / "2"
    shutil.rmtree(empty)
    empty.mkdir()
    shutil.rmtree(out["none"] / "checkpoints")
    out["base"], out["data"], out["cache"] = base, demo_dir, base / "cache"
    return out


def _refused(proc, *named):
    """Exit 2 and at most 3 stderr lines, the last the error: no traceback, no asyncio noise."""
    err = proc.stderr
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 3 and lines[-1].startswith("error: "), err[-3000:]
    for text in named:
        assert text in lines[-1], lines[-1]
    return lines[-1]


def _cmd(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_check_names_the_step_the_file_and_the_step_instead(runs):
    from sclaro_jax.checkpoint import DamagedRunError, check_run

    assert check_run(str(runs["good"])) == 2
    assert check_run(str(runs["truncated"]), 1) == 1
    with pytest.raises(DamagedRunError, match=rf"checkpoints/2 is damaged \(state/ocdbt\."
                       rf"process_0/d/{runs['truncated_file']}: truncated, \d+ of at least "
                       r"\d+ bytes\); the newest complete checkpoint is step 1: pass --step 1"):
        check_run(str(runs["truncated"]))
    with pytest.raises(DamagedRunError, match=r"2 is damaged \(an empty folder\).*--step 1"):
        check_run(str(runs["empty"]))
    with pytest.raises(DamagedRunError, match="no checkpoint in"):
        check_run(str(runs["none"]))
    with pytest.raises(DamagedRunError, match=r"no checkpoint of step 3 .*\[1, 2\]"):
        check_run(str(runs["good"]), 3)


@pytest.mark.slow
def test_export_refuses_a_damaged_run_and_takes_step(runs, tmp_path):
    args = ("--level", "object", "--out")
    _refused(_cmd("sclaro_jax.train.export", "--workdir", runs["truncated"], *args,
                  tmp_path / "t"), "checkpoints/2 is damaged", runs["truncated_file"],
             "truncated", "pass --step 1")
    _refused(_cmd("sclaro_jax.train.export", "--workdir", runs["empty"], *args, tmp_path / "e"),
             "checkpoints/2 is damaged (an empty folder)", "pass --step 1")
    _refused(_cmd("sclaro_jax.train.export", "--workdir", runs["none"], *args, tmp_path / "n"),
             "no checkpoint in", "checkpoints")

    from sclaro_jax.train import export
    assert export.main(["--workdir", str(runs["truncated"]), *args, str(tmp_path / "ok"),
                        "--step", "1"]) == 0
    assert (tmp_path / "ok" / "config.json").is_file()


@pytest.mark.slow
def test_evaluators_refuse_a_damaged_run(runs, tmp_path):
    from sclaro_jax.eval.retrieval import synthetic

    split = synthetic.make_planted_split(tmp_path / "planted", num_images=3)
    _refused(_cmd("sclaro_jax.eval.rocs", "--model", runs["truncated"], "--level", "object",
                  "--split", split, "--out", tmp_path / "r", "--no-progress"),
             "checkpoints/2 is damaged", "truncated", "pass --step 1")
    # a workdir without checkpoints/ is named as a run, not as a Hugging Face folder
    line = _refused(_cmd("sclaro_jax.eval.rocs", "--model", runs["none"], "--level", "object",
                         "--split", split, "--out", tmp_path / "r2", "--no-progress"),
                    "no checkpoint in")
    assert "model_type" not in line
    _refused(_cmd("sclaro_jax.eval.suite", "--workdir", runs["empty"], "--out", tmp_path / "s",
                  "--no-progress"), "checkpoints/2 is damaged (an empty folder)",
             "pass --step 1")


@pytest.mark.slow
def test_resume_falls_back_to_the_newest_complete_checkpoint(runs, shared_launcher):
    workdir = runs["truncated"]
    done = _train(shared_launcher, workdir, runs["data"], runs["cache"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("the checkpoint of step 2 is damaged" in done.stderr
            and "resuming from step 1, the newest complete one" in done.stderr), done.stderr
    assert "resumed from" in done.stderr and "at step 1" in done.stderr
    names = sorted(os.listdir(workdir / "checkpoints"))
    assert names == ["1", "2", "2.damaged"], names
    from sclaro_jax.checkpoint import check_run
    assert check_run(str(workdir)) == 2


@pytest.mark.slow
def test_the_launchers_eval_only_takes_the_step_its_refusal_names(runs):
    """`launch/train.py --eval-only` on a run whose newest checkpoint is damaged is refused,
    naming the step to pass; `--eval-only --step` with it evaluates that checkpoint; `--step`
    alone (training) is a usage error. One launcher process runs the three (conftest)."""
    import json

    from conftest import launch_all

    workdir = runs["empty"]
    base = ["--config", "configs/scenarioclip.py:demo", "--workdir", workdir,
            f"--config.data.dir={runs['data']}", "--config.progress_bar=False"]
    refused, stepped, alone = launch_all([base + ["--eval-only"],
                                          base + ["--eval-only", "--step", "1"],
                                          base + ["--step", "1"]])
    _refused(refused, "checkpoints/2 is damaged (an empty folder)", "pass --step 1")
    assert stepped.returncode == 0, stepped.stderr[-3000:]
    assert json.loads((workdir / "results.json").read_text())["step"] == 1
    assert f"results: {workdir / 'results.md'}" in stepped.stdout
    line = _refused(alone, "--step 1 picks the checkpoint that --eval-only evaluates")
    assert line.endswith("(see python launch/train.py --help)"), line
