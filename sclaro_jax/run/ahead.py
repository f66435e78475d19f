"""The start of a run: its train step compiled for every batch shape before the first step,
and the time since the process started (the loop logs it with the first loss).

`jax.jit` compiles on the first call at each new shape, so a run whose batches come in several
shapes (the packed crop layout's sizes) would stop to compile in the middle of training, one
executable after another. `CompiledSteps` lowers and compiles them all up front, several at a
time where the host has the cores (XLA releases the GIL while it compiles), and then hands each
batch to the executable of its shapes. With the persistent compilation cache on
(`run.cache.use_compilation_cache`) a rerun loads them from disk instead; a second run in the
same process takes the jitted step an earlier run built for the same program (`kept_step`),
which JAX has traced and compiled already.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

log = logging.getLogger(__name__)

_IMPORTED = time.monotonic()


def seconds_since_start() -> float:
    """Wall seconds since this process started (on Linux from /proc; elsewhere since this
    module was imported)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


Specs = Mapping[str, tuple[tuple, np.dtype]]  # field -> (global shape, dtype)


def default_threads(executables: int) -> int:
    """Compilations at once when the config says 0 (auto): one per four cores, since each XLA
    compilation runs several threads itself, and never more than there are executables."""
    return max(1, min(executables, (os.cpu_count() or 1) // 4))


def signature(batch: Mapping) -> tuple:
    """The (name, shape) of every field: the executable a batch runs in."""
    return tuple(sorted((name, tuple(np.shape(value))) for name, value in batch.items()))


# The jitted train steps of this process's runs by what they were built from, newest last.
_KEPT: "collections.OrderedDict[tuple, Callable]" = collections.OrderedDict()
KEEP_STEPS = 4


def state_shapes(state) -> tuple:
    """The state's tree structure and its leaves' shapes and dtypes (hashable: a part of a
    `kept_step` key, since the step's shardings follow from them)."""
    return (jax.tree.structure(state),
            tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(state)))


def kept_step(jitted: Callable, key: tuple) -> Callable:
    """The jitted step an earlier run of this process built from `key`, else `jitted`, kept for
    the runs after it (the newest `KEEP_STEPS`). `key` holds everything the step is built from
    (a trainer's: its graph, recipe, switches, mesh, strategy and `state_shapes`; each part
    hashable and compared by value). JAX keeps what it traced, lowered and compiled for a jitted
    function, so a second run of a recipe in one process (a notebook that trains again, a run
    resumed after a stop) starts without tracing or compiling its step; a run that differs in
    any part of the key builds its own. `clear_kept_steps()` lets them go."""
    kept = _KEPT.get(key)
    if kept is not None:
        _KEPT.move_to_end(key)
        return kept
    _KEPT[key] = jitted
    while len(_KEPT) > KEEP_STEPS:
        _KEPT.popitem(last=False)
    return jitted


def clear_kept_steps() -> None:
    """Let go of the jitted steps earlier runs of this process kept (and so of their compiled
    programs, once nothing else holds them)."""
    _KEPT.clear()


class CompiledSteps:
    """`(state, batch) -> (state, metrics)` through executables compiled ahead of time for the
    batch shapes in `specs` (one per packed size; one with caps). A batch of any other shape
    goes to the jitted step, which compiles it then (with a warning: it should not happen).

    `state` may be abstract (shapes and shardings only). With `background=True` the
    compilations run in daemon threads while the caller goes on (restoring a checkpoint,
    starting the input workers); the first call, or `executables`, waits for them."""

    def __init__(self, jitted: Callable, state, specs: Sequence[Specs], threads: int = 0, *,
                 background: bool = False):
        self.jitted = jitted
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=getattr(x, "sharding", None)),
                              state)
        self._batches = [{name: jax.ShapeDtypeStruct(shape, dtype)
                          for name, (shape, dtype) in s.items()} for s in specs]
        self.threads = threads or default_threads(len(self._batches))
        log.info("compiling the train step for %d batch shape(s), %d at a time ...",
                 len(self._batches), self.threads)
        self._t0 = time.perf_counter()
        self._compiled: list = [None] * len(self._batches)
        self._errors: list = []
        self._ended: list = []
        gate = threading.Semaphore(max(1, self.threads))

        def compile_one(i):
            with gate:
                try:
                    self._compiled[i] = jitted.lower(shapes, self._batches[i]).compile()
                except BaseException as err:  # noqa: BLE001 (raised where the caller waits)
                    self._errors.append(err)
                self._ended.append(time.perf_counter())

        # daemon threads; a caller that fails while they run calls `settle` before raising (an
        # interpreter that exits while XLA compiles in a thread aborts: "terminate called")
        self._workers = [threading.Thread(target=compile_one, args=(i,), daemon=True)
                         for i in range(len(self._batches))]
        for worker in self._workers:
            worker.start()
        self._executables: dict | None = None
        self.late: set[tuple] = set()
        if not background:
            self.wait()

    def wait(self) -> dict:
        """{batch signature: executable}, once every compilation has finished."""
        if self._executables is None:
            for worker in self._workers:
                worker.join()
            if self._errors:
                raise self._errors[0]
            self.seconds = max(self._ended, default=self._t0) - self._t0  # compiling alone
            log.info("compiled the train step for %d batch shape(s) in %.1f s",
                     len(self._batches), self.seconds)
            self._executables = {signature(b): c for b, c in zip(self._batches, self._compiled)}
        return self._executables

    def settle(self) -> None:
        """Wait for the compilations to end, raising nothing (the caller's error says more)."""
        for worker in self._workers:
            worker.join()

    @property
    def executables(self) -> dict:
        return self.wait()

    def __call__(self, state, batch):
        key = signature(batch)
        executable = self.wait().get(key)
        if executable is not None:
            return executable(state, batch)
        if key not in self.late:
            self.late.add(key)
            log.warning("a batch of shapes none of the %d compiled ahead: compiling it now (%s)",
                        len(self._executables), dict(key))
        return self.jitted(state, batch)
