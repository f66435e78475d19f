"""Many processes and elastic restore, with the demo config through launch/train.py:

- two processes on this machine (`jax.distributed` on localhost, gloo collectives, 2 host devices
  each) train the same losses as one process with 4 devices (1e-6), and after one of them is
  SIGKILLed the two resume from the last checkpoint to the same losses;
- a checkpoint written with fsdp over 4 devices resumes on 1 device and with dp over 2, and the
  losses of the following steps are the uninterrupted run's (1e-6).

The one-process runs share one XLA compilation cache; a multi-process run keeps none (JAX
writes cache entries from process 0 only, so on a rerun process 0 would load its step while
process 1 compiles, and its first collective would time out). Losses agree to 1e-6 relative
(float32 summation order over 4 devices in 1 or 2 processes). Four devices in all, not more:
the suite runs a file's processes on one core, where each step runs every device in turn.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CHEAP_COMPILE

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 2, 1  # killed after step 1's checkpoint; step 2 compared after each resume
TIMEOUT = 900
TOL = 1e-6  # relative
# Every run here compiles its train step (seven compiles, no two the same program); its children
# start from a clean environment, with the suite's cheap-compile flags (conftest.py) restated.


def _close(a, b):
    return abs(a - b) <= TOL * max(1.0, abs(b))


def _cmd(workdir, data, cache, *extra):
    return [sys.executable, "launch/train.py", "--config", "configs/scenarioclip.py:demo",
            "--workdir", str(workdir), f"--config.data.dir={data}",
            f"--config.train.steps={STEPS}", f"--config.checkpoint_every={EVERY}",
            "--config.log_every=1", "--config.data.batch_size=8",
            "--config.checkpoint_async=False", "--config.progress_bar=False",
            f"--config.compilation_cache={cache}", "--no-eval", *extra]  # losses are compared


def _env(devices, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([*CHEAP_COMPILE, *(
        [f"--xla_force_host_platform_device_count={devices}"] if devices > 1 else [])]), **extra)
    return env


def _losses(workdir):
    """step -> loss from metrics.jsonl (a step logged twice: its last row)."""
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl", encoding="utf-8")]
    return {r["step"]: r["loss"] for r in rows}


def _run(cmd, env):
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(cmd, stderr_dir, tag):
    """Start processes 0 and 1 of a two-process run (2 host devices each); process 0's stderr
    is a pipe (read it), process 1's goes to a file."""
    port = _free_port()
    procs = []
    for index in (0, 1):
        env = _env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(index))
        err = subprocess.PIPE if index == 0 else open(stderr_dir / f"{tag}-1.err", "w")
        procs.append(subprocess.Popen(cmd + ["--config.distributed=True"], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=err, text=True))
    return procs


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_dir, cache):
    """One process, 4 host devices, fsdp, uninterrupted: checkpoints at steps 1 and 2."""
    workdir = tmp_path_factory.mktemp("one_process_fsdp4")
    _run(_cmd(workdir, demo_dir, cache, "--config.sharding=fsdp"), _env(4))
    losses = _losses(workdir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return workdir, losses


@pytest.mark.slow
def test_two_processes_train_and_resume_like_one_process(reference, demo_dir, cache, tmp_path):
    _, want = reference
    workdir = tmp_path / "run"
    cmd = _cmd(workdir, demo_dir, cache, "--config.sharding=fsdp")
    procs = _two_processes(cmd, tmp_path, "first")
    for line in procs[0].stderr:  # synchronous checkpoints: "written" means complete
        if f"checkpoint at step {EVERY} written" in line:
            os.kill(procs[1].pid, signal.SIGKILL)  # one host dies ...
            break
    procs[1].wait(timeout=TIMEOUT)
    assert procs[1].returncode == -signal.SIGKILL, "process 1 ended before it could be killed"
    procs[0].kill()  # ... and the job goes down with it (its scheduler restarts both)
    procs[0].communicate(timeout=TIMEOUT)
    assert sorted(os.listdir(workdir / "checkpoints")) == [str(EVERY)]
    assert sorted(os.listdir(workdir / "checkpoints" / str(EVERY) / "data")) == [
        "commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"]
    steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)), steps  # process 0 alone writes metrics

    procs = _two_processes(cmd, tmp_path, "rerun")
    _, err0 = procs[0].communicate(timeout=TIMEOUT)
    procs[1].wait(timeout=TIMEOUT)
    assert procs[0].returncode == 0, err0[-3000:]
    assert procs[1].returncode == 0, (tmp_path / "rerun-1.err").read_text()[-3000:]
    assert f"resumed from {workdir} at step {EVERY}" in err0
    got = _losses(workdir)
    print("two processes: max |loss - one process|", max(abs(got[s] - want[s]) for s in want))
    assert sorted(got) == sorted(want)
    for step in want:
        assert _close(got[step], want[step]), (step, got[step], want[step])


@pytest.mark.slow
@pytest.mark.parametrize("devices, strategy", [(1, "none"), (2, "dp")])
def test_fsdp_checkpoint_resumes_on_another_layout(reference, demo_dir, cache, tmp_path,
                                                   devices, strategy):
    source, want = reference
    workdir = tmp_path / "run"
    shutil.copytree(source / "checkpoints" / str(EVERY), workdir / "checkpoints" / str(EVERY))
    result = _run(_cmd(workdir, demo_dir, cache, f"--config.sharding={strategy}"),
                  _env(devices))
    assert f"resumed from {workdir} at step {EVERY}" in result.stderr
    got = _losses(workdir)
    print(strategy, devices, "max |loss - uninterrupted|",
          max(abs(got[s] - want[s]) for s in got))
    assert sorted(got) == list(range(EVERY + 1, STEPS + 1))
    for step in got:
        assert _close(got[step], want[step]), (step, got[step], want[step])
