"""Moved to `sclaro_jax.run.folder` (the run folder under every trainer); this name stays for
older imports."""

from sclaro_jax.run.folder import *  # noqa: F401,F403
from sclaro_jax.run.folder import (  # noqa: F401
    LEGACY_SOURCE, SAFE_KEYS, TMP_SUFFIX, _event_records, _keep_lines, _safe, _truncate_events)
