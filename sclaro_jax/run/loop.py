"""One training loop under every trainer: `run_steps`.

A trainer builds its jitted step, its train state and a function that gives the batch of a step,
opens its checkpoints (`run.checkpoints.Checkpoints.open`: an unfinished checkpoint left by a
killed run is reported and removed, the newest complete one is the step to resume from) and hands
them to `run_steps`, which owns what every run needs alike:
- SIGINT / SIGTERM (`folder.GracefulStop`) stop the run after the current step with a checkpoint
  (with many processes, all stop after the same step);
- the non-finite guard: a NaN / inf loss stops the run (`NonFiniteLossError`) before anything
  of that step is saved;
- `metrics.jsonl` (one line per logged step: the step's metrics, `step`, `examples_per_sec` and
  the trainer's own fields) and TensorBoard scalars, written by process 0; the progress bar;
- checkpoints every `checkpoint_every` steps, at the end and on a stop, and the wait for a
  checkpoint still being written in the background whatever happens; a checkpoint that cannot
  be written (`CheckpointWriteError`) stops the run: one that does not fit the disk at the step
  of its save, one that fails in the background at the first step after orbax gives up (its
  state is asked before every step).
- Python's full garbage collections skip what the run built before its loop and its first step
  (`sclaro_jax.heap.FrozenHeap`), until the loop ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from sclaro_jax.cli import ctrl_c
from sclaro_jax.files import open_new
from sclaro_jax.heap import FrozenHeap
from sclaro_jax.run.ahead import CompiledSteps, seconds_since_start
from sclaro_jax.run.checkpoints import Checkpoints, CheckpointWriteError
from sclaro_jax.run.folder import GracefulStop, import_tensorboardx

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    pass


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
        self.file = open_new(os.path.join(spec.workdir, "metrics.jsonl"), append=True,
                             text=True) if chief else None
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
            with stop, FrozenHeap() as heap:
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
                    if done == spec.start + 1:
                        heap.settled()
                if done not in checkpoints.saved:  # stopped early: a checkpoint of the last step
                    checkpoints.save(done, state)
                # the last write ends with the handlers still set: a SIGTERM now is a request
                checkpoints.close()
        finally:
            logs.close()
    except BaseException as e:
        # a second Ctrl-C (either form, `cli.ctrl_c`): leave at once (a write in flight is left
        # unfinished; the next start removes it); else the writes end first
        if not ctrl_c(e):
            with contextlib.suppress(CheckpointWriteError):  # the error in flight says more
                checkpoints.close()
        raise
    # (a stop is announced when it is asked for; the caller says where the run stands)
    return Result(state, done, stop.requested)
