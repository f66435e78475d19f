"""The gallery embedding cache (`eval.rocs`'s `--cache-dir`, read by `python -m
sclaro_jax.miner.index build --cache`): this module owns its files, writer and reader.

A cache folder `CACHE_DIR/<key>/` holds one split's embeddings:
    meta.json                       version, encoder, split, source, images, queries, crops,
                                    crop_rule (what made them; `check` refuses another crop rule)
    gallery-PPPPP-of-NNNNN.npy      float16 [n, 1 + R, D] per part of images: the global view
                                    first, then the crops; each written whole, then renamed, so
                                    an interrupted embedding resumes from the last finished part
    queries.npy                     float32 [Q, D] the split's query embeddings
The key (`eval.retrieval.gallery.cache_key`) hashes the encoder, the split and the crop settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from sclaro_jax import bounds
from sclaro_jax.files import write_replacing
from sclaro_jax.miner.index.settings import IndexFileError

CACHE_VERSION = 2  # 2: the crop rule (`CropSpec.shape`, aspect-keeping by default) recorded


class CacheMismatchError(ValueError):
    """A cache folder holds embeddings made with other settings than the ones asked for."""


def part_path(folder: Path, part: int, parts: int) -> Path:
    """The file of gallery part `part` of `parts`."""
    return Path(folder) / f"gallery-{part:05d}-of-{parts:05d}.npy"


def queries_path(folder: Path) -> Path:
    return Path(folder) / "queries.npy"


def check(folder: Path, meta: dict) -> None:
    """Refuse a cache folder whose embeddings were made with another crop rule (a folder
    copied or renamed by hand, or written by an older version without the rule)."""
    path = folder / "meta.json"
    if not path.exists():
        if any(folder.glob("gallery-*.npy")):
            raise CacheMismatchError(f"{folder} holds gallery embeddings without a meta.json "
                                     f"saying how they were made; delete the folder")
        return
    try:
        old = bounds.read_json(path)
    except ValueError as err:
        raise CacheMismatchError(f"{path} is not JSON ({err}); delete {folder}") from None
    for field in ("crops", "crop_rule"):
        if old.get(field) != meta[field]:
            raise CacheMismatchError(
                f"{path}: the cached embeddings were made with {field} {old.get(field)!r}, "
                f"not {meta[field]!r}; delete {folder} or use another --cache-dir")


def open_folder(folder, meta: dict) -> Path:
    """Make (or take) the cache folder, check it against `meta` (`check`), write meta.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    check(folder, {"version": CACHE_VERSION, **meta})
    write_replacing(folder / "meta.json",
                    lambda f: json.dump({"version": CACHE_VERSION, **meta}, f, indent=1),
                    text=True)
    return folder


def save(path: Path, array: np.ndarray) -> None:
    """A part or the queries, written whole and then renamed."""
    write_replacing(path, lambda f: np.save(f, array))


def find(folder) -> Path:
    """The key folder of `folder`: itself (it has meta.json), or the one key folder under a
    cache folder `OUT/cache` that holds one split's."""
    folder = Path(folder)
    keys = sorted(p.parent for p in folder.glob("*/meta.json"))
    if not (folder / "meta.json").exists() and len(keys) == 1:
        return keys[0]
    if not (folder / "meta.json").exists() and keys:
        raise ValueError(f"{folder} holds the caches of {len(keys)} splits; name one: "
                         + ", ".join(str(k) for k in keys))
    return folder


def read(folder) -> tuple[dict, list, tuple, Optional[Path]]:
    """(meta.json, [(start, stop, path)] of the gallery parts, the shape of the last part,
    queries.npy or None) of a finished cache (`find`); an unfinished or damaged one is refused
    naming what is wrong."""
    folder = find(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(2, "No such file or directory (not an eval.rocs embedding "
                                   "cache folder)", str(meta_path))
    try:
        meta = bounds.read_json(meta_path)
    except bounds.BoundsError:
        raise
    except ValueError as e:
        raise ValueError(f"{meta_path} is not JSON ({e})") from None
    files = sorted(folder.glob("gallery-*-of-*.npy"))
    total = int(files[0].name.split("-of-")[1][:5]) if files else 0
    if not files or len(files) != total:
        raise IndexFileError(f"{folder}: {len(files)} of {total or '?'} gallery parts; run "
                             f"eval.rocs to finish the cache")
    parts, start, shape = [], 0, None
    for path in files:
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise IndexFileError(f"{path}: unreadable ({e})") from None
        parts.append((start, start + arr.shape[0], path))
        start += arr.shape[0]
        shape = arr.shape
    if start != meta.get("images", start):
        raise IndexFileError(f"{folder}: {start} gallery rows, meta.json says "
                             f"{meta['images']}")
    queries = queries_path(folder)
    return meta, parts, shape, queries if queries.is_file() else None
