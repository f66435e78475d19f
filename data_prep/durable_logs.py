"""Crash-safe append-only logs for resumable runs (`data_prep.annotate`'s caches): every append
is flushed and fsynced before it returns, and on opening a torn or corrupt tail (an interrupted
write) is cut off, so a killed run loses at most the entry in flight. `write_replacing`
(`sclaro_jax.files`, imported here for data_prep) is the whole-file counterpart (the curation
files, the annotation run key, hash memo and block markers, the ROCS stage caches).
"""

from __future__ import annotations

import json
import logging
import os

from sclaro_jax import bounds
from sclaro_jax.files import open_new, write_replacing  # noqa: F401  (data_prep's name for it)

log = logging.getLogger(__name__)

def _cut_torn_tail(f, path: str, good: int, size: int) -> None:
    if good < size:
        log.warning("%s: cutting off a torn tail of %d bytes (an interrupted write)", path,
                    size - good)
        f.truncate(good)


def _append_durably(f, blob: bytes) -> None:
    f.write(blob)
    f.flush()
    os.fsync(f.fileno())


class JsonLog:
    """Append-only JSON lines (small: the stage caches), fsynced per line, held in memory. On
    opening, a torn last line (an interrupted write) is cut off."""

    def __init__(self, path: str):
        self.path = path
        self.entries: list[dict] = []
        self._f = open_new(path, append=True)  # never through a link, nor a hard link
        with open(path, "rb") as f:
            data = f.read()
        good = 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                self.entries.append(bounds.parse_json(line, path))
            except ValueError:  # not JSON (torn), or nested too deep: not ours
                break
            good += len(line)
        _cut_torn_tail(self._f, path, good, len(data))

    def append(self, entry: dict) -> None:
        _append_durably(self._f, (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8"))
        self.entries.append(entry)

    def close(self) -> None:
        self._f.close()


