"""XLA compile options for sclaro_jax's own jitted functions, per backend.

On CPU, jaxlib 0.10's XLA sends float32 matmuls to YNNPACK fusions by default; XLA's own
(Eigen) dot path runs the ViT-B/32 forward faster (measured in bench/README.md).
Options apply per compilation, so they change nothing else in the process; on other backends
there are none.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp

_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.lru_cache(maxsize=None)
def _accepted(backend: str) -> tuple[tuple[str, str], ...]:
    if backend != "cpu":
        return ()
    try:
        jax.jit(lambda x: x @ x, compiler_options=_CPU_OPTIONS).lower(jnp.ones((2, 2))).compile()
    except Exception as err:  # an XLA that no longer knows the option: its defaults are correct
        logging.warning("XLA does not accept %s (%s); compiling with its defaults",
                        _CPU_OPTIONS, err)
        return ()
    return tuple(_CPU_OPTIONS.items())


def compiler_options(backend: str | None = None) -> dict[str, str]:
    """The options for `backend` (the default backend if None)."""
    return dict(_accepted(backend or jax.default_backend()))


def jit(fun: Callable, **kwargs: Any) -> Callable:
    """`jax.jit` with `compiler_options()` for the default backend."""
    return jax.jit(fun, compiler_options=compiler_options(), **kwargs)
