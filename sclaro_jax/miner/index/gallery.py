"""The gallery an ANN index is built from (`sclaro_jax.miner.index`): arrays in memory or
memory-mapped .npy files, or the parts of an `eval.rocs` embedding cache, read in row ranges."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np

from sclaro_jax.miner.index import cache


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
        """An `eval.rocs` embedding cache folder (`OUT/cache/<key>`, `cache`'s files), or the
        cache folder `OUT/cache` itself when it holds one split's."""
        meta, parts, shape, queries = cache.read(folder)
        return cls(n=parts[-1][1], dim=shape[2], n_crops=shape[1] - 1, parts=parts,
                   encoder=meta.get("encoder"), crop_rule=meta.get("crop_rule"),
                   crop_spec=meta.get("crops"), queries=queries)


def _load(path: str) -> np.ndarray:
    """A .npy file as a read-only memory map (a missing one is an OSError naming it)."""
    if not Path(path).is_file():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    try:
        return np.load(path, mmap_mode="r")
    except ValueError as e:
        raise ValueError(f"{path}: not a .npy array ({e})") from None
