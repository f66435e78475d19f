"""Paired timing for the benchmarks in this folder."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np


def paired_timings(fns: Sequence[Callable[[], object]], rounds: int, pause: float = 0.25
                   ) -> np.ndarray:
    """Seconds of each function in each round, `[rounds, len(fns)]`.

    Every function is called twice first (compile / warm up). Within a round each is called once,
    the order flipping every round, so drift in machine load hits all alike; the pause before
    each call lets the previous framework's spinning worker threads go idle.
    """
    for fn in fns:
        fn(), fn()
    times = np.zeros((rounds, len(fns)))
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            time.sleep(pause)
            t0 = time.perf_counter()
            fns[i]()
            times[r, i] = time.perf_counter() - t0
    return times
