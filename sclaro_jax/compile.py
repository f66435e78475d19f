"""XLA compile options for sclaro_jax's own jitted functions, per backend.

On CPU, jaxlib 0.10's XLA sends float32 matmuls to YNNPACK fusions by default; XLA's own
(Eigen) dot path runs the ViT-B/32 forward faster (measured in bench/README.md).
Options apply per compilation, so they change nothing else in the process; on other backends
there are none. A caller may add its own (`jit(..., options=)`, e.g. the train step's
`config.perf.xla_options`), merged over these once XLA has accepted them (`checked_options`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping

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


def option_backend(name: str) -> str | None:
    """The backend an XLA option is for, by its prefix ("cpu" for xla_cpu_*, "gpu" for
    xla_gpu_*), or None (every backend)."""
    return next((b for b in ("cpu", "gpu") if name.startswith(f"xla_{b}_")), None)


@functools.lru_cache(maxsize=None)
def _checked(options: tuple[tuple[str, Any], ...], backend: str) -> tuple[tuple[str, Any], ...]:
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(jnp.ones(2)).compile()
    except Exception as err:  # jaxlib's XlaRuntimeError: INVALID_ARGUMENT, naming the option
        raise ValueError(f"XLA does not accept the compile options {dict(options)}: "
                         f"{str(err).splitlines()[0]}") from None
    skipped = [name for name, _ in options if option_backend(name) not in (None, backend)]
    if skipped:
        logging.warning("XLA options for another backend than this process's (%s), left out: %s",
                     backend, ", ".join(skipped))
    return tuple((name, value) for name, value in options if name not in skipped)


def checked_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` for the default backend: each checked by XLA, which knows every backend's
    options (an unknown name, or a value it cannot parse, is a ValueError quoting XLA), and
    those of another backend left out, with a log line. (jaxlib 0.10's XLA:CPU accepts the
    xla_gpu_* options and compiles the same module with them.) Booleans are Python bools: XLA
    reads True / False, not "true" / "false"."""
    if not options:
        return {}
    return dict(_checked(tuple(sorted(options.items())), jax.default_backend()))


def jit(fun: Callable, *, options: Mapping[str, Any] | None = None, **kwargs: Any) -> Callable:
    """`jax.jit` with `compiler_options()` for the default backend, and `options`
    (`checked_options`) over them."""
    return jax.jit(fun, compiler_options={**compiler_options(), **checked_options(options or {})},
                   **kwargs)
