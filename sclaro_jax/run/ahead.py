"""The start of a run: its train step compiled for every batch shape before the first step,
and the time since the process started (the loop logs it with the first loss).

`jax.jit` compiles on the first call at each new shape, so a run whose batches come in several
shapes (the packed crop layout's sizes) would stop to compile in the middle of training, one
executable after another. `CompiledSteps` lowers and compiles them all up front, several at a
time where the host has the cores (XLA releases the GIL while it compiles), and then hands each
batch to the executable of its shapes. With the persistent compilation cache on
(`run.cache.use_compilation_cache`) a rerun loads them from disk instead.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
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


class CompiledSteps:
    """`(state, batch) -> (state, metrics)` through executables compiled ahead of time for the
    batch shapes in `specs` (one per packed size; one with caps). A batch of any other shape
    goes to the jitted step, which compiles it then (with a warning: it should not happen)."""

    def __init__(self, jitted: Callable, state, specs: Sequence[Specs], threads: int = 0):
        self.jitted = jitted
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=getattr(x, "sharding", None)),
                              state)
        batches = [{name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in s.items()}
                   for s in specs]
        threads = threads or default_threads(len(batches))
        log.info("compiling the train step for %d batch shape(s), %d at a time ...",
                 len(batches), threads)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, threads)) as pool:
            compiled = list(pool.map(lambda b: jitted.lower(shapes, b).compile(), batches))
        self.seconds = time.perf_counter() - t0
        log.info("compiled the train step for %d batch shape(s) in %.1f s", len(batches),
                 self.seconds)
        self.threads = threads
        self.executables = {signature(b): c for b, c in zip(batches, compiled)}
        self.late: set[tuple] = set()

    def __call__(self, state, batch):
        key = signature(batch)
        executable = self.executables.get(key)
        if executable is not None:
            return executable(state, batch)
        if key not in self.late:
            self.late.add(key)
            log.warning("a batch of shapes none of the %d compiled ahead: compiling it now (%s)",
                        len(self.executables), dict(key))
        return self.jitted(state, batch)
