"""Crash-safe append-only logs for resumable runs (`data_prep.annotate`'s caches): every append
is flushed and fsynced before it returns, and on opening a torn or corrupt tail (an interrupted
write) is cut off, so a killed run loses at most the entry in flight. `write_replacing` is the
whole-file counterpart (the curation files, the annotation run key, hash memo and block markers,
the ROCS stage caches).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

log = logging.getLogger(__name__)


def write_replacing(path, write, *, text: bool = False, fsync: bool = False,
                    unique: bool = False) -> Path:
    """Write `path` through `write(file)` under a temporary name beside it, then rename it over
    `path` (`os.replace`): an interrupted write never leaves a torn file. The one place of that
    idiom in data_prep.

    text: the file is UTF-8 text (else binary). fsync: flushed to disk before the rename, so the
    new file also survives a power cut. unique: a temporary name of its own
    (`NAME.tmp-XXXXXXXX`, for writers that may race on one path), else `NAME.tmp`."""
    path = Path(path)
    tmp = path.with_name(path.name + (f".tmp-{uuid.uuid4().hex[:8]}" if unique else ".tmp"))
    with open(tmp, "w" if text else "wb", encoding="utf-8" if text else None) as f:
        write(f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _cut_torn_tail(path: str, good: int, size: int) -> None:
    if good < size:
        log.warning("%s: cutting off a torn tail of %d bytes (an interrupted write)", path,
                    size - good)
        with open(path, "r+b") as f:
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
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            good = 0
            for line in data.splitlines(keepends=True):
                if not line.endswith(b"\n"):
                    break
                try:
                    self.entries.append(json.loads(line))
                except json.JSONDecodeError:
                    break
                good += len(line)
            _cut_torn_tail(path, good, len(data))
        self._f = open(path, "ab")

    def append(self, entry: dict) -> None:
        _append_durably(self._f, (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8"))
        self.entries.append(entry)

    def close(self) -> None:
        self._f.close()


