"""The vectors each index of a MINER ANN index holds (`sclaro_jax.miner.index`): the global
vectors [g, -r_i / 2], the fused crop vectors, and the crop vectors that choose a fused vector's
IVF list; all zero-padded to the factory's dimension."""

from __future__ import annotations

import numpy as np


def _pad(x: np.ndarray, d: int) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    if x.shape[1] == d:
        return x
    out = np.zeros((x.shape[0], d), np.float32)
    out[:, :x.shape[1]] = x
    return out


def global_vectors(views: np.ndarray, r_i: np.ndarray, d: int) -> np.ndarray:
    """[g, -r_i / 2, 0...] per image, float32 [n, d]."""
    g = views[:, 0].astype(np.float32)
    return _pad(np.concatenate([g, -0.5 * r_i.astype(np.float32)[:, None]], axis=1), d)


def query_vectors(t: np.ndarray, d: int) -> np.ndarray:
    """[t, 1, 0...] per query, float32 [Q, d]: with `global_vectors` or `crop_vectors`, the
    inner product is S - r_i / 2."""
    t = np.asarray(t, np.float32)
    return _pad(np.concatenate([t, np.ones((len(t), 1), np.float32)], axis=1), d)


def crop_vectors(views: np.ndarray, r_i: np.ndarray, d: int, alpha: float, pool: str
                 ) -> np.ndarray:
    """The fused crop vectors, float32 [n * P, d] (P = R for pool max, 1 for mean), image i's
    at rows i * P ... i * P + P - 1:

        max:  x_ir = [(1 - alpha) g_i + alpha c_ir, -r_i / 2]      r = 0 .. R - 1
        mean: x_i  = [(1 - alpha) g_i + alpha mean_r c_ir, -r_i / 2]

    so that with the query [t, 1], max_r t.x_ir (or t.x_i) = S_i - r_i / 2 = (2 S_i - r_i) / 2:
    an exact inner product search over these vectors, keeping each image's best, gives the
    MINER + CSLS order; the ANN only approximates the inner products."""
    g = views[:, :1].astype(np.float32)
    c = views[:, 1:].astype(np.float32)
    if pool == "mean":
        c = c.mean(axis=1, keepdims=True)
    x = (1 - alpha) * g + alpha * c
    ri = np.broadcast_to(-0.5 * r_i.astype(np.float32)[:, None, None], x.shape[:2] + (1,))
    x = np.concatenate([x, ri], axis=2)
    return _pad(x.reshape(-1, x.shape[2]), d)


def per_image(n_crops: int, pool: str) -> int:
    """Crop-index vectors per image (`crop_vectors`)."""
    return n_crops if pool == "max" else 1


def route_vectors(views: np.ndarray, d: int, pool: str) -> np.ndarray:
    """The vectors that choose each crop-index vector's IVF list, float32 [n * P, d] in
    `crop_vectors`' order: the crop itself, [c_ir, 0...] (max), or [mean_r c_ir, 0...] (mean).
    The fused vector mixes the image's global view into every crop, so lists made from fused
    vectors group images, not what their crops show, and a query about one crop (far from any
    fused vector: cos ~0.3 for a caption) probes the wrong lists. Lists made from the crops
    group what the crops show; the fused vector is still what each list stores and scores.
    (Measured in bench/README.md, "MINER ANN index on CPU".)"""
    c = views[:, 1:].astype(np.float32)
    if pool == "mean":
        c = c.mean(axis=1, keepdims=True)
    return _pad(c.reshape(-1, c.shape[2]), d)
