"""MINER's fused score (`kernels.fuse`) of an index's candidates on the CPU, read straight from the
memory-mapped float16 views: the exact re-rank of `miner.index` search without a gather.

For each query b and candidate w the kernel reads the candidate's row of views.npy (the global
view, then its crops: `[1 + R, D]` float16) where it lies, converts each float16 to float32 as
it is loaded (LLVM's `fpext half`, an F16C instruction where the CPU has it: every one of the
65,536 half values converts exactly) and computes

    S = (1 - alpha) t.g + alpha pool_r t.c_r,   pool: max, or the sum over crops / R
    S = t.g                                      without crops

in float32, as `kernels.fuse` does; only the order of each dot product's sum differs from XLA's
(a few float32 ulps). Queries run in parallel (numba threads); nothing of the views is copied:
a query's candidates cost the bytes of their rows, read once. Also `first_distinct`, the
images of a crop index's candidates in order (one pass, a hash set per row), and `first_hits`,
where in that order each of a query's exact top images comes (the index's calibration). numba
compiles them on first use and caches them next to this file (as `_cpu_csls`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic


@intrinsic
def _half(typingctx, bits):
    """float32 of the float16 whose bits are `bits` (uint16): exact for every value."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@njit(boundscheck=False, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def _dot(row, t):
    acc = np.float32(0.0)
    for j in range(t.shape[0]):
        acc += _half(row[j]) * t[j]
    return acc


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _fused_rows(views, t, rows, a_global, a_crops, use_max, out):
    """views uint16 [n, V, D] (float16 bits), t float32 [B, D], rows int64 [B, W] (-1: not in
    these views, left as it is), out float32 [B, W]: the fused score of each row."""
    n_views = views.shape[1]
    for b in prange(rows.shape[0]):
        q = t[b]
        for w in range(rows.shape[1]):
            r = rows[b, w]
            if r < 0:
                continue
            g = _dot(views[r, 0], q)
            if n_views == 1:
                out[b, w] = g
                continue
            pooled = _dot(views[r, 1], q)
            for c in range(2, n_views):
                s = _dot(views[r, c], q)
                pooled = max(pooled, s) if use_max else pooled + s
            if not use_max:
                pooled = pooled / np.float32(n_views - 1)
            out[b, w] = a_global * g + a_crops * pooled


def fused_rows(views: np.ndarray, t: np.ndarray, rows: np.ndarray, alpha: float, pool: str,
               out: np.ndarray) -> None:
    """Write into `out [B, W]` (float32) the fused score (module docstring) of query `t[b]`
    (float32 [B, D]) and row `rows[b, w]` of `views` (float16 [n, 1 + R, D], e.g. an index's
    memory-mapped views.npy); entries whose row is -1 are left as they are."""
    if pool not in ("max", "mean"):
        raise ValueError(f"pool must be 'max' or 'mean', got {pool!r}")
    if views.dtype != np.float16 or views.ndim != 3 or views.shape[2] != t.shape[1]:
        raise ValueError(f"views must be float16 [n, V, {t.shape[1]}], got {views.dtype} "
                         f"{views.shape}")
    bits = np.asarray(views).view(np.uint16)  # no copy: the memory map's own pages
    # as jnp computes (1 - alpha) * s + alpha * pooled with a Python float alpha: float32 factors
    _fused_rows(bits, np.ascontiguousarray(t, np.float32), np.ascontiguousarray(rows, np.int64),
                np.float32(1 - alpha), np.float32(alpha), pool == "max", out)


@njit(cache=True, boundscheck=False, nogil=True)
def _id_table(width):
    """(an empty open-addressing table for `width` ids, its bits): at most half full."""
    bits = 1
    while (1 << bits) < 2 * width:
        bits += 1
    return np.full(1 << bits, -1, np.int64), bits


@njit(cache=True, boundscheck=False, nogil=True)
def _is_new(table, bits, v):
    """Whether id v (>= 0) was not in `table` yet; it is afterwards."""
    mask = np.uint64((1 << bits) - 1)
    h = (np.uint64(v) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits)
    while table[h] != -1 and table[h] != v:
        h = (h + np.uint64(1)) & mask
    if table[h] == v:
        return False
    table[h] = v
    return True


@njit(cache=True, boundscheck=False, nogil=True)
def _distinct(ids, m, want, big):
    """One pass over each row of ids: (its first m distinct non-negative ids in row order,
    padded with -1; for each id of want[b], its rank among them and its first position, big
    where the row lacks it). first_distinct passes no want, first_hits m 0 (no ids kept, the
    whole row read)."""
    rows, width = ids.shape
    out = np.full((rows, m), -1, np.int64)
    rank = np.full(want.shape, big, np.int64)
    pos = np.full(want.shape, big, np.int64)
    table, bits = _id_table(width)  # the ids seen in this row
    for b in range(rows):
        table[:] = -1
        n = 0
        for j in range(width):
            v = ids[b, j]
            if v < 0 or not _is_new(table, bits, v):
                continue
            for k in range(want.shape[1]):
                if want[b, k] == v:
                    rank[b, k] = n
                    pos[b, k] = j
            if n < m:
                out[b, n] = v
            n += 1
            if n == m:
                break
    return out, rank, pos


def first_distinct(ids: np.ndarray, m: int) -> np.ndarray:
    """Per row of `ids` (int64 [B, K]), the first `m` distinct non-negative ids in row order,
    padded with -1 ([B, m] int64): the images of a crop index's candidate vectors, in the
    order of their best vector."""
    ids = np.ascontiguousarray(ids, np.int64)
    return _distinct(ids, int(m), np.zeros((len(ids), 0), np.int64), np.int64(0))[0]


def first_hits(ids: np.ndarray, want: np.ndarray, big: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `ids` (int64 [B, W], -1: none) and each of its wanted ids `want[b]` (int64
    [B, K]): (the wanted id's rank among the row's distinct non-negative ids in row order,
    its first position in the row), `big` where the row lacks it (or it is negative). One
    pass, a hash set per row: `first_distinct`'s order, for the index's calibration."""
    ids = np.ascontiguousarray(ids, np.int64)
    return _distinct(ids, 0, np.ascontiguousarray(want, np.int64), np.int64(big))[1:]

