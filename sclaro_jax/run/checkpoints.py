"""A run's checkpoints: `Checkpoints`, the orbax CheckpointManager every trainer saves through.

- An unfinished checkpoint left by a killed run is reported and removed when the run opens,
  a damaged one (`run.complete`) reported and moved aside to `<step>.damaged`; the newest
  complete one is the step to resume from.
- A checkpoint that cannot be written stops the run with one `CheckpointWriteError`:
  - refused before anything of it is written when the checkpoint folder's disk has less free
    space than it takes (`space_needed`: the newest complete checkpoint's size on disk, or for
    the first one the state's size in memory), so a full disk stops the run at the step of the
    save;
  - otherwise, a write that fails in the background (a lost mount, a disk filled by someone
    else meanwhile) is noticed by `poll`, after every step: the run stops at the first step
    after orbax's writer has given up (which takes as long as the write did, up to the
    failure).
- orbax's routine warnings, and while a run's checkpoints are open its error reports with their
  tracebacks, are kept out of the log: the run's one error says it once.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import sys
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from sclaro_jax.run.complete import quiet_hook, set_aside_damaged
from sclaro_jax.run.folder import (RunError, config_changes, length_changes, refuse_drift,
                                   unfinished_checkpoints)

log = logging.getLogger(__name__)


class CheckpointWriteError(RunError):
    """A checkpoint that could not be written (a full disk, a lost mount): the run stops."""


def _cause(error: BaseException) -> str:
    """The operating system's reason in an orbax / TensorStore write error ('No space left on
    device'), else the error's first line."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error)
    code = re.search(r"os_error_code='?(\d+)", text)
    if code:
        return os.strerror(int(code.group(1)))
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return first if len(first) <= 300 else first[:300] + " ..."


class _OrbaxNoise(logging.Filter):
    """On the absl logger that orbax writes to: drops orbax's routine warnings (a resumed
    checkpoint without optional metadata; "consider checkpointing less frequently" after a
    background save) and, while a run's `Checkpoints` are open, its error reports with their
    tracebacks (and asyncio's reports of its failed tasks): a failed write reaches the run as
    one `CheckpointWriteError` instead."""

    ROUTINE = ("Metadata file does not exist", "consider checkpointing less frequently")

    def __init__(self):
        super().__init__()
        self.open = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":  # the failed write's tasks, collected as the process ends
            return not (self.open and "exception was never retrieved" in str(record.msg))
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        if record.levelno >= logging.ERROR:
            return not self.open
        message = str(record.msg)
        return not any(text in message for text in self.ROUTINE)


_NOISE = _OrbaxNoise()
logging.getLogger("absl").addFilter(_NOISE)
logging.getLogger("asyncio").addFilter(_NOISE)


def bytes_on_disk(folder: str) -> int:
    """The size of the files under `folder` (0 when it is missing)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


def state_bytes(state) -> int:
    """The size in memory of a state's arrays (the global size of sharded ones)."""
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state)))


def size_text(n: int) -> str:
    """'58.6 MiB', '16.1 KiB', '12 bytes'."""
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} bytes"


class Checkpoints:
    """A run's orbax CheckpointManager and what is saved of a state (`save_args(state)`: the
    orbax args, which fix the checkpoint's item names)."""

    def __init__(self, manager: ocp.CheckpointManager, save_args: Callable, background: bool):
        self.manager = manager
        self.save_args = save_args
        self.background = background
        self.start = manager.latest_step() or 0
        self.saved = {self.start}
        self.complete = self.start  # the newest checkpoint known to be complete
        self.pending: int | None = None  # the step of a checkpoint written in the background
        self.failed: CheckpointWriteError | None = None
        self.now = self.start  # the step the run has reached (for messages)
        self._size = (-1, 0)  # (a complete checkpoint's step, its bytes on disk)
        self._closed = False
        _NOISE.open += 1
        self._hook = sys.unraisablehook = quiet_hook(sys.unraisablehook)

    @classmethod
    def open(cls, workdir: str, save_args: Callable, *, keep: int, background: bool = True,
             chief: bool = True) -> "Checkpoints":
        """WORKDIR/checkpoints; checkpoints orbax never finished writing are removed (by
        process 0) with a warning, damaged ones above the newest complete one (an empty
        folder, a truncated file: `complete.problem`) are moved aside to `<step>.damaged` with
        a warning naming the step and what is wrong, and `start` is the newest complete one
        (0: none)."""
        folder = os.path.abspath(os.path.join(workdir, "checkpoints"))
        torn = unfinished_checkpoints(folder, remove=chief)
        damaged = set_aside_damaged(folder, move=chief)
        manager = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=background))
        self = cls(manager, save_args, background)
        if torn:
            log.warning("found an unfinished checkpoint (%s, interrupted while it was written); "
                        "%s", ", ".join(torn), f"resuming from step {self.start}, the newest "
                        "complete one" if self.start else "no complete checkpoint: starting "
                        "from step 0")
        for step, bad, target in damaged:
            log.warning("the checkpoint of step %d is damaged (%s): moved to %s; %s", step, bad,
                        target, f"resuming from step {self.start}, the newest complete one"
                        if self.start else "no complete checkpoint: starting from step 0")
        return self

    @property
    def folder(self) -> str:
        return str(self.manager.directory)

    def config_drift(self, config, workdir: str, allow: bool) -> dict:
        """A resumed run's config against WORKDIR/config.json: the unsafe changes (more than
        `folder.SAFE_KEYS`) are refused (`folder.ConfigDriftError`) unless `allow`; every
        change is logged. Returns the unsafe ones ({} for a fresh run)."""
        if not self.start:
            return {}
        unsafe, safe = config_changes(workdir, config)
        if unsafe and not allow:
            self.close()
            refuse_drift(workdir, self.start, unsafe)
        for k, (before, now) in {**safe, **unsafe}.items():
            log.info("config change at step %d: %s %r -> %r", self.start, k, before, now)
        for k, (before, now) in length_changes(unsafe).items():
            log.warning("the run's length changes at step %d (%s %r -> %r, allowed): its "
                        "learning-rate schedule is re-stretched over the new length from this "
                        "step on", self.start, k, before, now)
        return unsafe

    def _failure(self, step: int, error: BaseException | None, *,
                 short: tuple[int, int] | None = None) -> CheckpointWriteError:
        """The run's error for the checkpoint of `step`: written and failed (`error`, None: it
        is missing after the write), or refused before writing (`short`: the bytes it takes
        and the bytes free)."""
        if short is not None:
            cause = os.strerror(errno.ENOSPC)
            need, free = (size_text(n) for n in short)
            detail = (f" A checkpoint takes about {need} and {free} are free there; nothing of "
                      f"step {step} was written.")
        else:
            cause = _cause(error) if error is not None else "it is missing after the write"
            detail = " The unfinished one is removed when the run starts again."
        self.failed = CheckpointWriteError(
            f"the checkpoint of step {step} could not be written to {self.folder} ({cause}); "
            f"training stopped at step {max(self.now, step)}.{detail} The newest complete "
            f"checkpoint is "
            f"{f'step {self.complete}' if self.complete else 'none (the run starts over)'}. "
            "Free the space (or fix the cause), then rerun the same command.")
        self.saved.discard(step)
        return self.failed

    def space_needed(self, state) -> int:
        """The bytes a checkpoint of `state` takes on disk, about: the newest complete
        checkpoint's (orbax's zstd saves ~5% on float training state), the first one the
        state's size in memory."""
        if self._size[0] != self.complete:
            path = os.path.join(self.folder, str(self.complete))
            self._size = (self.complete, bytes_on_disk(path) if self.complete else 0)
        return self._size[1] or state_bytes(state)

    def _short(self, state) -> tuple[int, int] | None:
        """(bytes needed, bytes free) when the next checkpoint does not fit the free space of
        the checkpoint folder's disk, else None; with many processes, all agree (any one
        short: all are)."""
        try:
            free = shutil.disk_usage(self.folder).free
        except OSError:  # no local disk to ask: the write says
            free = None
        need = self.space_needed(state) if free is not None else 0
        short = (need, free) if free is not None and free < need else None
        if jax.process_count() > 1:  # saving is collective: all save, or all stop
            from jax.experimental import multihost_utils
            rows = np.asarray(multihost_utils.process_allgather(np.array(
                [need, free or 0, short is not None], np.int64))).reshape(-1, 3)
            if short is None and rows[:, 2].any():
                short = tuple(int(x) for x in rows[rows[:, 2].argmax(), :2])
        return short

    def _settle(self) -> None:
        """Whether the checkpoint in flight (if it has finished) was written; raises
        CheckpointWriteError when it was not."""
        step, self.pending = self.pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 (named in the error)
            raise self._failure(step, e) from e
        if not os.path.isdir(os.path.join(self.folder, str(step))):
            raise self._failure(step, None)
        self.complete = step

    def poll(self, step: int) -> bool:
        """False once a checkpoint written in the background has failed (checked after each
        step, `step` the one just taken: the run stops at once, with `failed` the error)."""
        self.now = step
        if self.failed is not None:
            return False
        if self.pending is not None and not self.manager.is_saving_in_progress():
            try:
                self._settle()
            except CheckpointWriteError:
                return False
        return True

    def save(self, step: int, state) -> None:
        self.now = step
        if self.pending is not None:
            self._settle()  # orbax waits for it anyway; a failure is named here
        short = self._short(state)
        if short is not None:  # refused before anything of it is written
            raise self._failure(step, None, short=short)
        try:
            self.manager.save(step, args=self.save_args(state), force=True)
        except Exception as e:  # noqa: BLE001 (named in the error)
            raise self._failure(step, e) from e
        self.saved.add(step)
        if self.background:
            self.pending = step
        else:
            self.complete = step
        log.info("checkpoint at step %d %s", step,
                 "started (written in the background)" if self.background else "written")

    def close(self) -> None:
        """Wait for a checkpoint in flight (CheckpointWriteError if it fails) and close."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.pending is not None and self.failed is None:
                self._settle()  # a checkpoint in flight completes, whatever happened
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 (a failed write, already reported)
                if self.failed is None:
                    raise
            finally:
                # after a failed write, orbax's threads may still report it while the process
                # ends: the filters stay (the run's error has said it once)
                if self.failed is None:
                    _NOISE.open -= 1
                    if sys.unraisablehook is self._hook:
                        sys.unraisablehook = self._hook.previous


