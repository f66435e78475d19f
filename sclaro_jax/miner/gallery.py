"""The gallery an ANN index is built from (`sclaro_jax.miner.index`): arrays in memory or
memory-mapped .npy files, or the parts of an `eval.rocs` embedding cache, read in row ranges."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np

from sclaro_jax import bounds
from sclaro_jax.miner.index_files import IndexFileError


@dataclasses.dataclass
class Gallery:
    """Gallery views to read in row ranges: `images` [G, D] and `crops` [G, R, D] (numpy or
    np.memmap), or the parts of an `eval.rocs` embedding cache (`from_cache`)."""

    n: int
    dim: int
    n_crops: int
    images: Optional[np.ndarray] = None
    crops: Optional[np.ndarray] = None
    parts: Optional[list] = None  # [(start, stop, path)] of [n, 1 + R, D] cache parts
    encoder: Optional[str] = None
    crop_rule: Optional[str] = None
    crop_spec: Optional[dict] = None
    queries: Optional[Path] = None  # a cache's queries.npy (the default bank)

    def views(self, a: int, b: int) -> np.ndarray:
        """Rows a:b as float16 [b - a, 1 + R, D], global view first."""
        from sclaro_jax.miner.stream import read_rows

        if self.parts is not None:
            out = []
            for lo, hi, path in self.parts:
                if hi > a and lo < b:
                    arr = np.load(path, mmap_mode="r")
                    out.append(np.asarray(arr[max(a, lo) - lo:min(b, hi) - lo]))
            return np.concatenate(out).astype(np.float16)
        g = read_rows(self.images, a, b).astype(np.float16)[:, None]
        if self.crops is None:
            return g
        return np.concatenate([g, read_rows(self.crops, a, b).astype(np.float16)], axis=1)

    @classmethod
    def from_arrays(cls, images, crops=None, **info) -> "Gallery":
        images = np.asarray(images) if not isinstance(images, np.ndarray) else images
        if images.ndim != 2:
            raise ValueError(f"images must be [G, D], not shape {images.shape}")
        if crops is not None and (crops.ndim != 3 or crops.shape[0] != images.shape[0]
                                  or crops.shape[2] != images.shape[1]):
            raise ValueError(f"crops must be [{images.shape[0]}, R, {images.shape[1]}], not "
                             f"shape {crops.shape}")
        return cls(n=images.shape[0], dim=images.shape[1],
                   n_crops=0 if crops is None else crops.shape[1], images=images, crops=crops,
                   **info)

    @classmethod
    def from_npy(cls, images: str, crops: Optional[str] = None, **info) -> "Gallery":
        return cls.from_arrays(_load(images), None if crops is None else _load(crops), **info)

    @classmethod
    def from_cache(cls, folder) -> "Gallery":
        """An `eval.rocs` embedding cache folder (`OUT/cache/<key>`: meta.json, gallery parts
        `gallery-PPPPP-of-NNNNN.npy` [n, 1 + R, D] float16, queries.npy), or the cache folder
        `OUT/cache` itself when it holds one split's."""
        folder = Path(folder)
        keys = sorted(p.parent for p in folder.glob("*/meta.json"))
        if not (folder / "meta.json").exists() and len(keys) == 1:
            folder = keys[0]
        elif not (folder / "meta.json").exists() and keys:
            raise ValueError(f"{folder} holds the caches of {len(keys)} splits; name one: "
                             + ", ".join(str(k) for k in keys))
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
        queries = folder / "queries.npy"
        return cls(n=start, dim=shape[2], n_crops=shape[1] - 1, parts=parts,
                   encoder=meta.get("encoder"), crop_rule=meta.get("crop_rule"),
                   crop_spec=meta.get("crops"), queries=queries if queries.is_file() else None)


def _load(path: str) -> np.ndarray:
    """A .npy file as a read-only memory map (a missing one is an OSError naming it)."""
    if not Path(path).is_file():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    try:
        return np.load(path, mmap_mode="r")
    except ValueError as e:
        raise ValueError(f"{path}: not a .npy array ({e})") from None
