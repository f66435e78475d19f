"""Files written whole or not at all: `write_replacing`, the one place of the write-to-a-
temporary-name-then-rename idiom (the library's run folders, caches and checkpoints' side files,
and data_prep's work files, which imports it from here)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable, IO


def write_replacing(path, write: Callable[[IO], object], *, text: bool = False,
                    fsync: bool = False, unique: bool = False) -> Path:
    """Write `path` through `write(file)` under a temporary name beside it, then rename it over
    `path` (`os.replace`): an interrupted write never leaves a torn file, and a reader sees the
    old file or the new one.

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
