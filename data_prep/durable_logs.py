"""Crash-safe append-only logs for resumable runs (`data_prep.annotate`'s caches): every append
is flushed and fsynced before it returns, and on opening a torn or corrupt tail (an interrupted
write) is cut off, so a killed run loses at most the entry in flight.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from typing import Iterator, Sequence

log = logging.getLogger(__name__)


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


_FRAME = struct.Struct("<II")  # payload length, crc32


class RecordLog:
    """Append-only framed binary records (length, CRC32, payload), fsynced per append. Only an
    index (offset, length) is held in memory; payloads are read back from disk one at a time,
    so the log can outgrow memory. On opening, a torn or corrupt tail is cut off."""

    def __init__(self, path: str):
        self.path = path
        self.index: list[tuple[int, int]] = []
        if os.path.exists(path):
            size = os.path.getsize(path)
            pos = 0
            with open(path, "rb") as f:
                while pos + _FRAME.size <= size:
                    f.seek(pos)
                    n, crc = _FRAME.unpack(f.read(_FRAME.size))
                    payload = f.read(n)
                    if len(payload) < n or zlib.crc32(payload) != crc:
                        break
                    self.index.append((pos + _FRAME.size, n))
                    pos += _FRAME.size + n
            _cut_torn_tail(path, pos, size)
        self._f = open(path, "ab")

    def append_many(self, payloads: Sequence[bytes]) -> None:
        if not payloads:
            return
        pos = self._f.tell()
        _append_durably(self._f, b"".join(_FRAME.pack(len(p), zlib.crc32(p)) + p
                                          for p in payloads))
        for p in payloads:
            self.index.append((pos + _FRAME.size, len(p)))
            pos += _FRAME.size + len(p)

    def read(self, entry: tuple[int, int]) -> bytes:
        offset, n = entry
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(n)

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            for offset, n in self.index:
                f.seek(offset)
                yield f.read(n)

    @property
    def records(self) -> list[bytes]:
        """All payloads in memory (small logs, tests)."""
        return list(self)

    def close(self) -> None:
        self._f.close()
