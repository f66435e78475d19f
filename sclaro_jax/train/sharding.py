"""Moved to `sclaro_jax.run.sharding` (shared by every trainer); this name stays for older
imports."""

from sclaro_jax.run.sharding import *  # noqa: F401,F403
from sclaro_jax.run.sharding import AXIS, ENV, STRATEGIES, _leaf_spec  # noqa: F401
