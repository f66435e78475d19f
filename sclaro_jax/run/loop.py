"""One training loop under every trainer: `run_steps`.

A trainer builds its jitted step, its train state and a function that gives the batch of a step,
opens its checkpoints (`Checkpoints.open`: an unfinished checkpoint left by a killed run is
reported and removed, the newest complete one is the step to resume from) and hands them to
`run_steps`, which owns what every run needs alike:
- SIGINT / SIGTERM (`folder.GracefulStop`) stop the run after the current step with a checkpoint
  (with many processes, all stop after the same step);
- the non-finite guard: a NaN / inf loss stops the run (`NonFiniteLossError`) before anything
  of that step is saved;
- `metrics.jsonl` (one line per logged step: the step's metrics, `step`, `examples_per_sec` and
  the trainer's own fields) and TensorBoard scalars, written by process 0; the progress bar;
- checkpoints every `checkpoint_every` steps, at the end and on a stop, and the wait for a
  checkpoint still being written in the background whatever happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from sclaro_jax.run.ahead import CompiledSteps, seconds_since_start
from sclaro_jax.run.folder import (GracefulStop, RunError, config_changes, import_tensorboardx,
                                   length_changes, refuse_drift, unfinished_checkpoints)

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    pass


class CheckpointWriteError(RunError):
    """A checkpoint that could not be written (a full disk, a lost mount): the run stops."""


def _cause(error: BaseException) -> str:
    """The operating system's reason in an orbax / TensorStore write error ('No space left on
    device'), else the error's first line."""
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


def _quiet_unraisable(previous):
    """A `sys.unraisablehook` that drops 'Event loop is closed' (TensorStore's callbacks into an
    orbax write that already failed, hundreds of them) and passes on the rest."""
    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and \
                "Event loop is closed" in str(unraisable.exc_value):
            return
        previous(unraisable)
    hook.previous = previous
    return hook


@dataclasses.dataclass
class LoopSpec:
    """How a run's steps go: steps `start`..`steps` (the run's total), a metrics line every
    `log_every` steps and at the end, a checkpoint every `checkpoint_every` steps, at the end and
    on a stop. `examples_per_step`: the global batch (for examples_per_sec). `stop_at`: stop
    after that step with a checkpoint, as a signal would. `hint`: what to do about a non-finite
    loss (the error message's end)."""
    workdir: str
    start: int
    steps: int
    log_every: int
    checkpoint_every: int
    examples_per_step: int
    progress: bool = True
    desc: str = "train"
    stop_at: int | None = None
    hint: str = "lower the learning rate or check the data."


@dataclasses.dataclass
class Hooks:
    """A trainer's additions to the loop, each optional:
    `started()`: after the first step has run (the run's config is the one in use);
    `log_fields(wall, step)`: extra fields of a metrics line, `wall` the seconds since the last;
    `after_step(step, state)`: after every step and its checkpoint (e.g. periodic evaluation)."""
    started: Callable[[], None] | None = None
    log_fields: Callable[[float, int], dict] | None = None
    after_step: Callable[[int, Any], None] | None = None


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
        self._closed = False
        _NOISE.open += 1
        self._hook = sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)

    @classmethod
    def open(cls, workdir: str, save_args: Callable, *, keep: int, background: bool = True,
             chief: bool = True) -> "Checkpoints":
        """WORKDIR/checkpoints; checkpoints orbax never finished writing are removed (by
        process 0) with a warning, and `start` is the newest complete one (0: none)."""
        folder = os.path.abspath(os.path.join(workdir, "checkpoints"))
        torn = unfinished_checkpoints(folder, remove=chief)
        manager = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=background))
        self = cls(manager, save_args, background)
        if torn:
            log.warning("found an unfinished checkpoint (%s, interrupted while it was written); "
                        "%s", ", ".join(torn), f"resuming from step {self.start}, the newest "
                        "complete one" if self.start else "no complete checkpoint: starting "
                        "from step 0")
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

    def _failure(self, step: int, error: BaseException | None) -> CheckpointWriteError:
        cause = _cause(error) if error is not None else "it is missing after the write"
        self.failed = CheckpointWriteError(
            f"the checkpoint of step {step} could not be written to {self.folder} ({cause}); "
            f"training stopped at step {max(self.now, step)}. The newest complete checkpoint is "
            f"{f'step {self.complete}' if self.complete else 'none (the run starts over)'}; "
            "the unfinished one is removed when the run starts again. Free the space (or fix "
            "the cause), then rerun the same command.")
        self.saved.discard(step)
        return self.failed

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


class Result(NamedTuple):
    state: Any
    done: int  # the last step taken
    stopped: str | None  # what stopped the run early (a signal's name, "stop_at"), or None


def stop_here(stop: GracefulStop, checkpoints: Checkpoints, done: int, multi: bool) -> bool:
    """Before each step (`done` steps taken): whether the run stops here, a signal having come;
    CheckpointWriteError if a checkpoint written in the background failed. With many processes
    (`multi`), one gather answers both for all of them, so all stop, or fail, after the same
    step (saving a checkpoint is collective)."""
    asked, failed = stop.requested is not None, not checkpoints.poll(done)
    if multi:
        from jax.experimental import multihost_utils
        flags = np.asarray(multihost_utils.process_allgather(
            np.array([asked, failed], np.int32))).reshape(-1, 2).max(axis=0)
        if flags[0] and not asked:
            stop.requested = "a signal to another process"
        asked, failed = bool(flags[0]), bool(flags[1])
    if failed:
        raise checkpoints.failed or CheckpointWriteError(
            f"a checkpoint of another process failed by step {done}; training stopped (see "
            "that process's error)")
    return asked


def tensorboard(workdir: str):
    try:
        writer = import_tensorboardx().SummaryWriter
    except ImportError:  # optional: metrics.jsonl is always written
        return None
    return writer(os.path.join(workdir, "tensorboard"))


class _AboveTheBar(logging.Filter):
    """While a progress bar is shown, clears it before each log line, so the line starts on a
    line of its own (the bar is drawn again below it at the next step), as `tqdm.write` does.
    Sits on the handlers of the root and absl loggers."""

    def __init__(self, bar):
        super().__init__()
        self.bar = bar
        self.handlers = [h for name in ("", "absl") for h in logging.getLogger(name).handlers]
        for handler in self.handlers:
            handler.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self.bar.clear()
        return True

    def remove(self) -> None:
        for handler in self.handlers:
            handler.removeFilter(self)


class _Log:
    """metrics.jsonl, TensorBoard and the progress bar of one `run_steps` call."""

    def __init__(self, spec: LoopSpec, hooks: Hooks, chief: bool):
        self.spec, self.hooks, self.chief = spec, hooks, chief
        self.file = open(os.path.join(spec.workdir, "metrics.jsonl"), "a",
                         encoding="utf-8") if chief else None
        self.writer = tensorboard(spec.workdir) if chief else None
        self.bar = None
        self._above = None
        self.t_last, self.n_last = time.perf_counter(), 0

    def first_step(self, done: int) -> None:
        if self.hooks.started is not None:
            self.hooks.started()
        # the rate (and the time left) starts after the compilation
        self.bar = tqdm(total=self.spec.steps, initial=done, desc=self.spec.desc, unit="step",
                        disable=not (self.spec.progress and self.chief))
        if not self.bar.disable:
            self._above = _AboveTheBar(self.bar)
        self.t_last, self.n_last = time.perf_counter(), 0

    def write(self, metrics: dict, done: int) -> None:
        now = time.perf_counter()
        if not self.chief:
            self.t_last, self.n_last = now, 0
            return
        metrics.update(step=done, examples_per_sec=(
            self.n_last / (now - self.t_last) if self.n_last else 0.0))
        if self.hooks.log_fields is not None:
            metrics.update(self.hooks.log_fields(now - self.t_last, done))
        self.t_last, self.n_last = now, 0
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, done)
        self.bar.set_postfix(loss=f"{metrics['loss']:.3f}",
                             ex_s=f"{metrics['examples_per_sec']:.1f}")

    def close(self) -> None:
        if self._above is not None:
            self._above.remove()
            self._above = None
        for thing in (self.bar, self.file, self.writer):
            if thing is not None:
                thing.close()


def _finite(metrics, done: int, checkpoints: Checkpoints, hint: str) -> dict:
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not np.isfinite(metrics["loss"]):
        raise NonFiniteLossError(
            f"loss became {metrics['loss']} at step {done}; stopping. The last good checkpoint "
            f"(step {max(checkpoints.saved)}) in {checkpoints.folder} is intact; {hint}")
    return metrics


def _after_step(state, metrics, done: int, spec: LoopSpec, checkpoints: Checkpoints,
                logs: _Log, hooks: Hooks) -> None:
    log_now = done % spec.log_every == 0 or done == spec.steps
    save_now = done % spec.checkpoint_every == 0 or done == spec.steps
    if log_now or save_now:  # never checkpoint a state whose loss is not finite
        metrics = _finite(metrics, done, checkpoints, spec.hint)
    if done == spec.start + 1:  # the run has started: its config is the one in use
        jax.block_until_ready(state)
        log.info("step %d done: loss %.4f, %.1f s after the process started", done,
                 float(jax.device_get(metrics["loss"])), seconds_since_start())
        logs.first_step(done)
    if log_now:
        logs.write(metrics, done)
    if done > spec.start + 1:
        logs.bar.update(1)
    if save_now:
        checkpoints.save(done, state)
    if hooks.after_step is not None:
        hooks.after_step(done, state)


def run_steps(step_fn, state, batch_of: Callable[[int], dict], checkpoints: Checkpoints,
              spec: LoopSpec, hooks: Hooks | None = None, *, chief: bool | None = None) -> Result:
    """Take steps `spec.start`..`spec.steps` of `step_fn(state, batch) -> (state, metrics)`
    (`metrics` holds at least "loss") with `batch_of(i)` the batch of step i (0-based); see the
    module's docstring. Returns the state after the last step taken."""
    hooks = hooks or Hooks()
    chief = jax.process_index() == 0 if chief is None else chief
    logs = _Log(spec, hooks, chief)
    stop = GracefulStop()
    multi = jax.process_count() > 1  # then the processes agree on when to stop
    done = spec.start
    try:
        try:
            with stop:
                if not isinstance(step_fn, CompiledSteps):
                    log.info("compiling the train step (first step only) ...")
                for step in range(spec.start, spec.steps):
                    if stop_here(stop, checkpoints, done, multi):
                        break
                    if spec.stop_at is not None and step >= spec.stop_at:
                        stop.requested = stop.requested or "stop_at"
                        break
                    state, metrics = step_fn(state, batch_of(step))
                    logs.n_last += spec.examples_per_step
                    done = step + 1
                    _after_step(state, metrics, done, spec, checkpoints, logs, hooks)
                if done not in checkpoints.saved:  # stopped early: a checkpoint of the last step
                    checkpoints.save(done, state)
        finally:
            logs.close()
    except KeyboardInterrupt:  # a second Ctrl-C: leave at once (a write in flight is left
        raise                  # unfinished; the next start removes it)
    except BaseException:
        with contextlib.suppress(CheckpointWriteError):  # the error in flight says more
            checkpoints.close()
        raise
    checkpoints.close()
    # (a stop is announced when it is asked for; the caller says where the run stands)
    return Result(state, done, stop.requested)
