"""JAX's persistent compilation cache for a run (`config.compilation_cache`)."""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

XLA_CACHES = "xla_gpu_per_fusion_autotune_cache_dir"


def use_compilation_cache(config, workdir: str) -> str | None:
    """Turn on JAX's persistent compilation cache as `config.compilation_cache` says
    ("workdir" -> WORKDIR/jax_cache, a folder, or "" for off) unless a cache folder is already
    set for JAX. Returns the folder in use (None: no cache). A cache hit gives the same
    executable, so results do not change; only the compile time goes.

    Every compilation is stored, however short (`jax_persistent_cache_min_compile_time_secs`
    0 unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise): JAX's default, 1 s,
    left out the model's initialisers, dozens of small programs of 0.02-0.1 s each that a warm
    start compiled again every time (the demo on one core: 4.7 s of a 12 s start)."""
    current = jax.config.jax_compilation_cache_dir
    choice = config.get("compilation_cache", "workdir")
    if jax.process_count() > 1 and not current:
        # JAX writes cache entries from process 0 only: on a rerun process 0 would load its
        # step while the others compile, and its first collective would time out.
        log.info("XLA compilation cache: off (%d processes)", jax.process_count())
        return None
    if current or not choice:
        return current or None
    path = os.path.abspath(os.path.join(workdir, "jax_cache") if choice == "workdir"
                           else os.path.expanduser(choice))
    os.makedirs(path, exist_ok=True)
    from jax.experimental.compilation_cache import compilation_cache
    if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:
        # XLA's GEMM / fusion autotuning results go into the cache folder too, so a warm start
        # does not autotune again on a GPU (stated, not left to the JAX version's default)
        jax.config.update("jax_persistent_cache_enable_xla_caches", XLA_CACHES)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.set_cache_dir(path)
    compilation_cache.reset_cache()  # a process that compiled before picks the folder up
    log.info("XLA compilation cache: %s", path)
    return path
