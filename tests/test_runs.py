"""Runs that survive what users do to them: SIGINT / SIGTERM while a checkpoint is written in the
background, copied workdirs and moved datasets, changed configs, damaged shards, bad flags."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import launch_all

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16  # the program of tests/test_trainer.py's runs (same steps and EMA warm-up): one
# compilation for both files in the suite's shared cache
OVERRIDES = [f"--config.train.steps={STEPS}", "--config.checkpoint_every=8",
             "--config.log_every=2", "--config.train.ema_warmup_steps=6",
             "--config.progress_bar=False"]


def _cmd(workdir, data, cache, *extra):
    return [sys.executable, "launch/train.py", "--config", "configs/scenarioclip.py:demo",
            "--workdir", str(workdir), f"--config.data.dir={data}",
            f"--config.compilation_cache={cache}", *OVERRIDES, *extra]


def _run(cmd, timeout=900):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _state(workdir, step=STEPS):
    import orbax.checkpoint as ocp
    return ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step),
                                                         "state"))


def _flat(tree):
    import jax
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _metrics(workdir):
    return [json.loads(line) for line in open(Path(workdir) / "metrics.jsonl")]


def _event_steps(workdir):
    """(tag, step) of every scalar in the run's TensorBoard event files."""
    from sclaro_jax.run.folder import _event_records
    from tensorboardX.proto import event_pb2

    out = []
    folder = Path(workdir) / "tensorboard"
    for name in sorted(os.listdir(folder)):
        data = (folder / name).read_bytes()
        for start, end in _event_records(data):
            event = event_pb2.Event()
            event.ParseFromString(data[start + 12:end - 4])
            out += [(v.tag, event.step) for v in event.summary.value]
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")  # one compilation for every run below


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, demo_dir, cache):
    """The reference run; while it compiles (or loads) its step, a second run on its workdir (a
    requeued job) is refused at once, naming the first, which goes on undisturbed."""
    import socket

    workdir = tmp_path_factory.mktemp("run_full")
    proc = subprocess.Popen(_cmd(workdir, demo_dir, cache), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "compiling the train step for " in line:
            break
    # the first is paused there (SIGSTOP; its lock held) while the second starts, so the
    # second meets it running whether its step is compiled or loaded from the cache
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        # refused at once: a second run that waited for the lock would wait on a stopped
        # process and fail here by its timeout
        second = _run(_cmd(workdir, demo_dir, cache), timeout=120)
        assert proc.poll() is None  # refused while the first runs, not after it
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=900)
    err = "".join(seen) + err
    assert proc.returncode == 0, err[-3000:]
    line = _error(second)
    assert line.startswith(f"error: {workdir} is in use by another run: pid {proc.pid} on host "
                           f"{socket.gethostname()}"), line
    assert "another --workdir" in line, line
    assert not second.stdout.strip()
    assert "next:" in out.lower() and "sclaro_jax.train.export" in out
    assert [r["step"] for r in _metrics(workdir)] == list(range(2, STEPS + 1, 2))  # each once
    return workdir


def _interrupt(sig, workdir, data, cache):
    """Start a run, send `sig` as soon as the step-8 checkpoint is being written in the
    background, and return (the step it stopped at, its stdout, its stderr)."""
    # A process started in the background of a non-interactive shell inherits SIGINT ignored;
    # a caught signal is reset to the default at exec, so the child gets SIGINT's default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(_cmd(workdir, data, cache), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "checkpoint at step 8 started (written in the background)" in line:
            os.kill(proc.pid, sig)
            break
    out, err = proc.communicate(timeout=600)
    err = "".join(seen) + err
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "cannot schedule new futures" not in err, err[-3000:]
    line = [x for x in out.splitlines() if x.startswith("stopped at step")]
    assert line, out
    stopped = int(line[0].split()[3])
    assert f"stopped at step {stopped} of {STEPS}; rerun the same command to continue" in out
    # the step running when the signal came (or step 8 itself, when the signal is handled
    # before the next step starts)
    assert 8 <= stopped < STEPS
    names = sorted(os.listdir(Path(workdir) / "checkpoints"))
    assert str(stopped) in names and "8" in names, names  # the one in flight and the final
    assert not [n for n in names if "tmp" in n], names
    assert [r["step"] for r in _metrics(workdir)] == list(range(2, stopped + 1, 2))
    return stopped, out, err


def _same_run(workdir, uninterrupted):
    want, got = _flat(_state(uninterrupted)), _flat(_state(workdir))
    assert want.keys() == got.keys() and len(want) > 500
    for k in want:  # student, teacher, optimiser state, step: bit for bit
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    rows, ref = _metrics(workdir), _metrics(uninterrupted)
    assert [r["step"] for r in rows] == [r["step"] for r in ref]  # each step once
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]
    steps = [s for tag, s in _event_steps(workdir) if tag == "loss"]
    assert steps == list(range(2, STEPS + 1, 2)), steps


@pytest.mark.slow
def test_sigint_during_a_background_checkpoint_then_a_copied_workdir_and_moved_data(
        uninterrupted, demo_dir, cache, tmp_path, shared_launcher):
    first, moved = tmp_path / "first", tmp_path / "elsewhere" / "data"
    stopped, _, err = _interrupt(signal.SIGINT, first, demo_dir, cache)
    assert "SIGINT received: stopping after the current step" in err
    # the workdir is copied and the dataset moved: the copy resumes on the moved data
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    shutil.copytree(demo_dir, moved)
    rerun = shared_launcher.run(_cmd(copy, moved, cache))  # (the rerun's process is not the
    # subject: the worker's shared launcher, conftest.py)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {copy} at step {stopped}" in rerun.stderr
    assert "config change at step %d: data.dir" % stopped in rerun.stderr
    _same_run(copy, uninterrupted)


@pytest.mark.slow
def test_sigterm_then_refusals_then_the_rerun_continues(uninterrupted, demo_dir, cache,
                                                        tmp_path, shared_launcher):
    workdir = tmp_path / "run"
    stopped, _, err = _interrupt(signal.SIGTERM, workdir, demo_dir, cache)
    assert "SIGTERM received" in err
    config_before = (workdir / "config.json").read_text()
    metrics_before = (workdir / "metrics.jsonl").read_text()

    # three refusals, run in turn in one launcher process (conftest.launch_all)
    other = tmp_path / "other_data"  # another dataset (same files, another manifest)
    shutil.copytree(demo_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["note"] = "a different dataset"
    (other / "manifest.json").write_text(json.dumps(manifest))
    drift, longer, mismatch = launch_all([
        _cmd(workdir, demo_dir, cache, "--config.train.lr=0.001")[2:],
        _cmd(workdir, demo_dir, cache, f"--config.train.steps={2 * STEPS}")[2:],
        _cmd(workdir, other, cache)[2:]])

    # another learning rate: refused, listing the difference; nothing in the run is touched
    assert drift.returncode == 2
    assert "Traceback" not in drift.stderr
    error = drift.stderr.strip().splitlines()
    assert error[0].startswith("error: ") and f"holds a run at step {stopped}" in error[0]
    assert "train.lr: 0.0005 in the run, 0.001 now" in drift.stderr
    assert "--allow-config-change" in drift.stderr

    # a longer run: its schedule would be re-stretched, so it is a change like the one above
    assert longer.returncode == 2 and "Traceback" not in longer.stderr
    assert f"train.steps: {STEPS} in the run, {2 * STEPS} now" in longer.stderr
    assert f"re-stretches the schedule from step {stopped} on" in longer.stderr

    # another dataset: refused, naming both
    assert mismatch.returncode == 2 and "Traceback" not in mismatch.stderr
    last = mismatch.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "was trained on another dataset" in last, last
    assert f"at {demo_dir} when the run started" in last and str(other) in last
    assert (workdir / "config.json").read_text() == config_before
    assert (workdir / "metrics.jsonl").read_text() == metrics_before

    # a checkpoint that never finished (the process died while writing it) is reported
    torn = workdir / "checkpoints" / f"{stopped + 2}.orbax-checkpoint-tmp-1764560000"
    torn.mkdir()
    rerun = shared_launcher.run(_cmd(workdir, demo_dir, cache, "--config.progress_bar=True"))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # the log of a resumed run with its progress bar: no orbax warnings, and every log line
    # on a line of its own (none glued behind the bar's text)
    for noise in ("Metadata file does not exist", "consider checkpointing less frequently"):
        assert noise not in rerun.stderr, rerun.stderr[-3000:]
    assert "|" in rerun.stderr and f"{STEPS}/{STEPS}" in rerun.stderr  # the bar was drawn
    pieces = [p.strip() for p in re.split(r"[\r\n]", rerun.stderr)]
    records = [p for p in pieces if re.search(r"[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ ", p)]
    assert records and all(re.match(r"[IWE]\d{4} ", p) for p in records), [
        p for p in records if not re.match(r"[IWE]\d{4} ", p)]
    assert (f"found an unfinished checkpoint ({torn.name}, interrupted while it was written); "
            f"resuming from step {stopped}, the newest complete one") in rerun.stderr
    assert "done:" in rerun.stdout
    _same_run(workdir, uninterrupted)


@pytest.fixture
def small_filesystem(tmp_path):
    """A tmpfs folder (mounted here: needs root) and a function that resizes it."""
    folder = tmp_path / "small"
    folder.mkdir()

    def mount(size_mb, *options):
        return subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join((*options,
                               f"size={size_mb}m")), "tmpfs", str(folder)], capture_output=True)

    if mount(8).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield folder, lambda size_mb: mount(size_mb, "remount")
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_the_failed_checkpoint_and_the_rerun_continues(
        uninterrupted, demo_dir, cache, small_filesystem, shared_launcher):
    """The step-16 checkpoint (the run's last) does not fit beside step 8's: the run stops at
    step 16, before writing it (a save that fails in the background instead:
    tests/test_failed_saves.py)."""
    folder, resize = small_filesystem
    size = sum(f.stat().st_size for f in (Path(uninterrupted) / "checkpoints" / str(STEPS))
               .rglob("*") if f.is_file()) / 2**20
    assert size > 1
    # room for the step-8 checkpoint and the logs, not for step 16's beside it
    assert resize(int(1.6 * size) + 2).returncode == 0
    workdir = folder / "run"
    full = _run(_cmd(workdir, demo_dir, cache))
    assert full.returncode == 2, full.stderr[-3000:]
    lines = full.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: the checkpoint of step 16 could not be written to "
                                f"{workdir / 'checkpoints'} (No space left on device); "
                                "training stopped at step 16. A checkpoint takes about "), lines[-1]
    assert "nothing of step 16 was written" in lines[-1]
    assert "The newest complete checkpoint is step 8" in lines[-1]
    assert sum(x.startswith("error:") for x in lines) == 1
    assert sum(x.startswith(("Traceback", "  File ")) for x in lines) <= 5, full.stderr[-5000:]
    assert "Event loop is closed" not in full.stderr
    assert os.listdir(workdir / "checkpoints") == ["8"]
    assert [r["step"] for r in _metrics(workdir)] == list(range(2, 17, 2))  # none past the save
    assert "done:" not in full.stdout and "stopped at step" not in full.stdout

    assert resize(int(4 * size) + 8).returncode == 0  # the cause removed
    rerun = shared_launcher.run(_cmd(workdir, demo_dir, cache))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "found an unfinished checkpoint" not in rerun.stderr
    assert f"resumed from {workdir} at step 8" in rerun.stderr
    assert "Metadata file does not exist" not in rerun.stderr  # orbax's routine warning
    _same_run(workdir, uninterrupted)


def test_allowed_config_change_keeps_both_configs(tmp_path):
    from ml_collections import ConfigDict

    from sclaro_jax.run import folder

    old = ConfigDict({"train": {"lr": 5e-4, "steps": 10}, "log_every": 5, "data": {"dir": "a"}})
    folder.write_config(str(tmp_path), old, step=0, unsafe={})
    new = ConfigDict({"train": {"lr": 1e-3, "steps": 20}, "log_every": 1, "data": {"dir": "b"}})
    unsafe, safe = folder.config_changes(str(tmp_path), new)
    assert unsafe == {"train.lr": (5e-4, 1e-3), "train.steps": (10, 20)}  # steps: the schedule
    assert safe == {"data.dir": ("a", "b"), "log_every": (5, 1)}
    newer = ConfigDict(new.to_dict())
    newer.train.decay_logit_scales = True  # a key added to the code since the run started
    assert folder.config_changes(str(tmp_path), newer) == (unsafe, {
        **safe, "train.decay_logit_scales": ("(absent)", True)})
    folder.write_config(str(tmp_path), new, step=8, unsafe=unsafe)
    assert json.loads((tmp_path / "config.until-step-8.json").read_text())["train"]["lr"] == 5e-4
    assert json.loads((tmp_path / "config.json").read_text())["train"]["lr"] == 1e-3
    change = json.loads((tmp_path / "config_changes.jsonl").read_text())
    assert change == {"step": 8, "changes": {"train.lr": {"before": 5e-4, "after": 1e-3},
                                             "train.steps": {"before": 10, "after": 20}}}


def test_logs_are_cut_back_to_the_resumed_step(tmp_path):
    from tensorboardX import SummaryWriter

    from sclaro_jax.run import folder

    writer = SummaryWriter(str(tmp_path / "tensorboard"))
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (2, 4, 6, 8):
            f.write(json.dumps({"step": step, "loss": float(step)}) + "\n")
            writer.add_scalar("loss", float(step), step)
        f.write('{"step": 10, "lo')  # torn by a kill
    writer.close()
    assert folder.truncate_logs(str(tmp_path), 4) == 2 + 1 + 2
    assert [r["step"] for r in _metrics(tmp_path)] == [2, 4]
    assert _event_steps(tmp_path) == [("loss", 2), ("loss", 4)]
    assert folder.truncate_logs(str(tmp_path), 4) == 0  # nothing left to cut


def _error(result):
    """The one `error:` line of a refused command (and no traceback)."""
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_user_errors_are_one_line(demo_dir, cache, tmp_path):
    """Each refused command line as a user types it; those refused before training are run in
    turn in one launcher process (conftest.launch_all), the damaged shard that only training
    reads in a process of its own."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "truncated"
    shutil.copytree(demo_dir, broken)
    truncated = broken / "train-00000-of-00003.array_record"
    data = truncated.read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    flipped = tmp_path / "flipped"
    shutil.copytree(demo_dir, flipped)
    shard = flipped / "train-00001-of-00003.array_record"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF  # same size, same index: only the hash tells
    shard.write_bytes(bytes(data))

    def train(*args, workdir=tmp_path / "w"):
        return ["--config", "configs/scenarioclip.py:demo", "--workdir", workdir, *args]

    cases = {
        "unknown key": train("--config.train.lrr=0.1"),
        "bad value": train("--config.train.lr=fast"),
        "big batch": train(f"--config.data.dir={demo_dir}", "--config.data.batch_size=64"),
        "missing data": train(f"--config.data.dir={tmp_path / 'nowhere'}"),
        "empty data": train(f"--config.data.dir={empty}"),
        "blocked workdir": train(f"--config.data.dir={demo_dir}", workdir=blocker / "run"),
        "truncated": train(f"--config.data.dir={broken}"),
        "flipped": train(f"--config.data.dir={flipped}", "--verify-data",
                         "--config.train.steps=1"),
        "missing init": train(f"--config.data.dir={demo_dir}",
                              "--config.model.init=/nonexistent/clip", workdir=tmp_path / "init"),
        "lr -0.001": train("--config.train.lr=-0.001", workdir=tmp_path / "neg"),
        "lr 0": train("--config.train.lr=0", workdir=tmp_path / "neg"),
        "verbose": train("--config.train.lrr=0.1", "--verbose"),
    }
    got = dict(zip(cases, launch_all(list(cases.values()))))

    line = _error(got["unknown key"])
    assert "unknown config key 'train.lrr'" in line and "did you mean train.lr" in line
    assert ("--config.train.lr=fast: config.train.lr takes float values (the recipe's is "
            "0.0005), not 'fast'") in _error(got["bad value"])

    big = _error(got["big batch"])
    assert "batch size 64 exceeds the 10 training records" in big
    assert "--config.data.batch_size" in big
    assert not (tmp_path / "w" / "config.json").exists()  # a failed attempt writes no config

    missing = _error(got["missing data"])
    assert missing.startswith(f"error: config.data.dir = '{tmp_path / 'nowhere'}': no such "
                              "file or folder (a dataset folder written by `python -m "
                              "data_prep`"), missing
    assert "manifest.json not found" in _error(got["empty data"])

    assert f"cannot write to the workdir {blocker / 'run'}" in _error(got["blocked workdir"])

    line = _error(got["truncated"])
    assert str(truncated) in line and "truncated" in line, line

    line = _error(got["flipped"])
    assert str(shard) in line and "sha256 does not match" in line, line

    flipped_quietly = _run(_cmd(tmp_path / "w2", flipped, cache), timeout=600)
    line = _error(flipped_quietly)  # without --verify-data: the read fails, naming the shard
    assert f"of shard {shard}: Corrupted Riegeli/records file" in line, line
    assert "The shard is damaged; --verify-data checks every shard's sha256" in line, line
    assert flipped_quietly.stderr.strip().splitlines()[-1] == line

    # a start that fails after making its folders leaves none of them empty
    line = _error(got["missing init"])
    assert "/nonexistent/clip has no config.json" in line, line
    assert sorted(os.listdir(tmp_path / "init")) == [".run.lock"]

    for lr in ("-0.001", "0"):
        line = _error(got[f"lr {lr}"])
        assert line == f"error: config.train.lr = {float(lr)}: must be > 0", line
    assert not (tmp_path / "neg" / "demo_data").exists()  # refused before any work

    verbose = got["verbose"]
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr


def test_help_lists_the_configs_and_their_variants():
    result = _run([sys.executable, "launch/train.py", "--help"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")}
    for spec in ("scenarioclip:demo", "scenarioclip:psg", "pyramidclip", "scenarioclip_nokd:demo",
                 "detection:demo"):
        assert spec in listed, result.stdout  # the recipes by name, each variant on its line
    assert "configs/NAME.py[:VARIANT]" in result.stdout  # and by file
    # the flags as every command spells them: hyphens, `--[no-]` for a switch
    for flag in ("--[no-]allow-config-change", "--[no-]verify-data", "--[no-]progress",
                 "--[no-]eval", "--workdir"):
        assert f"\n  {flag}" in result.stdout, result.stdout
    assert "_" not in "".join(line.partition(":")[0] for line in
                              result.stdout.split("Flags:\n", 1)[1].splitlines())


def test_an_allowed_new_length_says_what_happens_to_the_learning_rate(demo_dir, caplog):
    """The warning of an allowed length change gives the learning rate at the resumed step on
    both schedules (warm-up 10%, then cosine to 0, as numpy computes it here)."""
    import logging
    import math

    from conftest import demo_config
    from sclaro_jax.train import trainer

    config = demo_config(demo_dir, steps=40)
    tcfg = trainer.train_config(config, 40)

    def lr(total, t):
        warmup = max(1, int(0.1 * total))
        peak = config.train.lr
        if t < warmup:
            return peak * (1e-3 + (1 - 1e-3) * t / warmup)
        return peak * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))

    with caplog.at_level(logging.WARNING, logger="sclaro_jax"):
        trainer._log_schedule_change(config, {"train.steps": (16, 40)}, tcfg, 12, 10)
    assert (f"learning rate at step 12: {lr(16, 12):.4g} on the run's schedule of 16 steps, "
            f"{lr(40, 12):.4g} on the new one of 40 steps (warm-up 4 steps") in caplog.text
