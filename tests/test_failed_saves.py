"""A checkpoint that cannot be written stops the run at once (`sclaro_jax.run.checkpoints`), in
process on a tiny state: refused before writing when it does not fit the disk, and within two
steps of a save that fails in the background. The same on a real full disk, end to end:
tests/test_runs.py::test_a_full_disk_stops_the_run_at_the_failed_checkpoint_and_the_rerun_continues.
"""

import errno
import os
import threading
import time
from collections import namedtuple

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from sclaro_jax.run import checkpoints as ckpt
from sclaro_jax.run.loop import LoopSpec, run_steps


def _save_args(state):
    return ocp.args.Composite(state=ocp.args.StandardSave(state))


def _state():
    return {"w": jnp.arange(4096, dtype=jnp.float32), "b": jnp.ones((16,), jnp.float32)}


def _run(workdir, steps, checkpoint_every, *, written=None):
    """run_steps over a step that adds one to every array; returns the steps it took and the
    Checkpoints. `written` (a threading.Event set when a background write has ended): a step
    taken while a checkpoint is written ends only after the write has, as orbax itself reports
    it (`is_saving_in_progress` false; up to 60 s). The event alone is set inside orbax's
    writer, before orbax records the outcome: on a loaded machine, 10 more steps once ran
    before orbax's thread got to it, and the test failed for the scheduler, not the loop."""
    taken = []

    def step_fn(state, batch):
        taken.append(batch)
        if written is not None and checkpoints.pending is not None:
            assert written.wait(60), "the background write did not end"
            deadline = time.monotonic() + 60
            while checkpoints.manager.is_saving_in_progress():
                assert time.monotonic() < deadline, "orbax did not record the write's end"
                time.sleep(0.001)
        return {k: v + 1 for k, v in state.items()}, {"loss": jnp.float32(1.0)}

    checkpoints = ckpt.Checkpoints.open(str(workdir), _save_args, keep=3)
    spec = LoopSpec(workdir=str(workdir), start=checkpoints.start, steps=steps, log_every=1000,
                    checkpoint_every=checkpoint_every, examples_per_step=1, progress=False)
    try:
        run_steps(step_fn, _state(), lambda i: i + 1, checkpoints, spec, chief=True)
    finally:
        checkpoints.close()
    return taken, checkpoints


@pytest.mark.slow
def test_a_save_that_fails_in_the_background_stops_the_run_within_two_steps(
        tmp_path, monkeypatch):
    """The step-10 checkpoint's data is written, then orbax's writer fails (as a full disk
    does): the loop notices after a step, not at the next save (step 20)."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    write = async_checkpointer._background_wait_for_commit_futures
    written = threading.Event()

    def failing(directory, commit_futures, on_commit_callback, **kwargs):
        def fail():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        try:
            return write(directory, commit_futures, fail, **kwargs)
        finally:
            written.set()

    monkeypatch.setattr(async_checkpointer, "_background_wait_for_commit_futures", failing)
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        # steps slower than the failed write: "within two steps" is the loop's
        _run(tmp_path, steps=20, checkpoint_every=10, written=written)
    message = str(e.value)
    assert message.startswith(f"the checkpoint of step 10 could not be written to "
                              f"{tmp_path / 'checkpoints'} (No space left on device); "
                              "training stopped at step "), message
    stopped = int(message.split("training stopped at step ")[1].split(".")[0])
    assert 10 <= stopped <= 12, message
    assert "The unfinished one is removed when the run starts again" in message
    assert "The newest complete checkpoint is none" in message


Usage = namedtuple("Usage", "total used free")


def _free(monkeypatch, free):
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: Usage(10**12, 0, free))
    # (shutil's own function: monkeypatch puts it back after the test)


def test_a_checkpoint_that_does_not_fit_is_refused_before_it_is_written(tmp_path, monkeypatch):
    """First checkpoint: the state's size in memory is what it needs; later ones the newest
    complete checkpoint's size on disk. A refused one leaves nothing behind and stops the run
    at its step."""
    nbytes = ckpt.state_bytes(_state())
    assert nbytes == 4096 * 4 + 16 * 4
    _free(monkeypatch, nbytes - 1)
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        _run(tmp_path, steps=6, checkpoint_every=3)
    message = str(e.value)
    assert message.startswith(f"the checkpoint of step 3 could not be written to "
                              f"{tmp_path / 'checkpoints'} (No space left on device); "
                              "training stopped at step 3. A checkpoint takes about 16.1 KiB and "
                              "16.1 KiB are free there; nothing of step 3 was written. The newest "
                              "complete checkpoint is none (the run starts over)."), message
    assert os.listdir(tmp_path / "checkpoints") == []

    _free(monkeypatch, 10**12)
    taken, checkpoints = _run(tmp_path, steps=3, checkpoint_every=3)
    assert taken == [1, 2, 3] and checkpoints.complete == 3
    size = ckpt.bytes_on_disk(str(tmp_path / "checkpoints" / "3"))
    assert size > 0  # (zstd: less than the 16 KiB in memory, this arange compresses)
    reopened = ckpt.Checkpoints.open(str(tmp_path), _save_args, keep=3)
    assert reopened.space_needed(_state()) == size
    reopened.close()

    _free(monkeypatch, size - 1)  # the newest complete checkpoint would not fit beside
    with pytest.raises(ckpt.CheckpointWriteError, match="training stopped at step 6. A "
                       "checkpoint takes about .* nothing of step 6 was written. The newest "
                       "complete checkpoint is step 3. Free the space"):
        _run(tmp_path, steps=9, checkpoint_every=3)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]

    _free(monkeypatch, size)  # it fits
    taken, checkpoints = _run(tmp_path, steps=6, checkpoint_every=3)
    assert taken == [4, 5, 6] and sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]


def test_no_disk_to_ask_leaves_the_save_to_the_write(tmp_path, monkeypatch):
    def no_disk(path):
        raise OSError(errno.ENOSYS, "no statvfs here")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", no_disk)
    taken, checkpoints = _run(tmp_path, steps=2, checkpoint_every=2)
    assert taken == [1, 2] and checkpoints.complete == 2
