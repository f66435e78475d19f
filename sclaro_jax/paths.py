"""Paths named by data files stay inside the folder they are relative to: `inside_root`, the one
check every reader makes before it opens an image, a panoptic PNG or a dataset row's file that a
json, a caption file, a dataset's rows or a folder listing names.

A path is used only when it resolves, every symbolic link followed, to a place inside its
root's own resolved path (the root itself may be a link, e.g. `coco -> /datasets/coco`). An
absolute path, one that climbs out with `..`, a link inside the root that points out of it, a
NUL byte, a `~` or drive-like (`C:\\`, `\\\\server`) path give None: the readers skip that
image and count it with the reason `OUTSIDE_ROOT`, without opening it (tarfile's `data` filter,
PEP 706, refuses the same members for extraction)."""

from __future__ import annotations

import os
import re
from pathlib import Path

OUTSIDE_ROOT = "outside_root"  # the skip reason every reader counts
_FOREIGN = re.compile(r"^(~|\\|[A-Za-z]:[\\/])")  # home-relative, UNC or drive-rooted


def inside_root(root, relative) -> Path | None:
    """`root/relative` resolved (links followed), or None when `relative` is not a relative
    path that stays inside `root`. `relative` is taken as the data gave it: anything but a
    non-empty string (or path) is None too."""
    if isinstance(relative, os.PathLike):
        relative = os.fspath(relative)
    if not isinstance(relative, str) or not relative or "\0" in relative:
        return None
    if os.path.isabs(relative) or _FOREIGN.match(relative):
        return None
    base = os.path.realpath(root)
    try:
        full = os.path.realpath(os.path.join(base, relative))
    except (OSError, ValueError):  # a link loop on some systems, an unencodable name
        return None
    if os.path.commonpath([base, full]) != base:
        return None
    return Path(full)
