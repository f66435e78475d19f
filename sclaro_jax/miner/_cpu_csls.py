"""Two-sided CSLS on the CPU at the memory bound: numba kernels behind `kernels.csls`.

    CSLS_qi = 2 S_qi - r_q - r_i
    r_q = mean of the min(k, G) largest S_q.   (a row's best images)
    r_i = mean of the min(k, Q) largest S_.i   (a column's best queries; or a query bank's)

Two passes over the matrix, where XLA's blocked top-k makes one per axis plus the combination:

1. `_topk_means` reads S once and keeps, at the same time, every row's and every column's k
   largest scores. The columns are cut into one stripe per thread; a thread walks its stripe
   row by row, so it reads memory in order and its column state (a threshold per column, the
   k best per column) stays in cache. Blocks of `BLOCK` scores are compared with the row's and
   the columns' thresholds (the smallest of the k kept) in one test; in a block holding a
   score above a threshold, a bit mask of those scores (`_beats`) gives the ones to look at,
   and that is rare: a score enters a list of k when it beats the k-th best seen so far. The
   first BLOCK x k rows, where it is not rare, go into the columns' lists by branch-free
   compare-exchanges instead (SIMD code). Each stripe keeps its own k best per row; the
   stripes' lists are merged at the end (`_merged_means`).
2. `_combine` writes 2 S - r_q - r_i, into a fresh buffer or over S itself.

Sums are accumulated in float64 and divided once. The values are exact top-k means (ties do
not matter: a mean of the k largest values is the same whichever tied element is taken). NaN
scores are not supported (a NaN never enters a list).

numba compiles the kernels on first use and caches them next to this file (or in numba's
per-user cache where that folder is read-only): about 20 s once per machine (and per numba
version), then a fraction of a second to load. `prepare` does it up front and says which
happened, so a command can announce the wait and time it.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# Scores compared with the thresholds in one test (measured fastest of 32-128, see
# bench/README.md, "CSLS against the authors' kernels").
BLOCK = 64
assert BLOCK <= 64  # a block's hits are one uint64 bit mask (`_beats`)


@intrinsic
def _trailing_zeros(typingctx, x):
    """The index of the lowest set bit of a uint64 (LLVM's cttz: one instruction)."""
    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))
    return types.uint64(types.uint64), codegen


@njit(inline="always", boundscheck=False, nogil=True)
def _beats(block, row_low, block_low):
    """Bit j set where block[j] beats the row's threshold or its column's."""
    bits = np.uint64(0)
    for j in range(BLOCK):
        bits |= np.uint64((block[j] > row_low) | (block[j] > block_low[j])) << np.uint64(j)
    return bits


@njit(inline="always", boundscheck=False, nogil=True)
def _replace_smallest(best, value):
    """`best` is sorted ascending and `value` > best[0]: drop best[0], put `value` in its sorted
    place (a new entry usually ranks low: few moves), return the new smallest."""
    k = best.shape[0]
    i = 0
    while i + 1 < k and best[i + 1] < value:
        best[i] = best[i + 1]
        i += 1
    best[i] = value
    return best[0]


@njit(inline="never", cache=True, boundscheck=False, nogil=True, fastmath={"nsz"})
def _insert_columns(levels, row, carry):
    """Insert `row` into every column's k best at once: `levels [k, width]`, each column sorted
    descending down the levels, one compare-exchange per level (max stays, min moves down).
    Branch-free, so LLVM turns it into SIMD code: cheaper than testing thresholds while most
    scores still enter a list (the first rows)."""
    carry[:] = row
    for i in range(levels.shape[0]):
        level = levels[i]
        for j in range(carry.shape[0]):
            a = level[j]
            b = carry[j]
            level[j] = max(a, b)
            carry[j] = min(a, b)


@njit(inline="always", boundscheck=False, nogil=True)
def _levels_to_lists(levels, col_best, low):
    """`levels [k, width]` (descending) -> `col_best [width, k]` (ascending), `low` their
    smallest."""
    k = levels.shape[0]
    for j in range(levels.shape[1]):
        for i in range(k):
            col_best[j, i] = levels[k - 1 - i, j]
        low[j] = col_best[j, 0]


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _topk_means(s, k_rows, k_cols, rows, cols, stripes):
    """float32 `s [Q, G]` (C-contiguous) -> (r_q [Q] or [0], r_i [G] or [0]), one read of `s`.

    `rows` / `cols`: which of the two means to compute; `stripes`: column stripes, one per
    thread."""
    n_rows, n_cols = s.shape
    neg = np.float32(-np.inf)
    pos = np.float32(np.inf)
    row_best = np.full((stripes, n_rows if rows else 1, max(k_rows, 1)), neg, np.float32)
    col_best = np.full((n_cols if cols else 1, max(k_cols, 1)), neg, np.float32)
    col_low = np.full(n_cols, neg if cols else pos, np.float32)
    for t in prange(stripes):
        c0 = t * n_cols // stripes
        c1 = (t + 1) * n_cols // stripes
        width = c1 - c0
        full = width - width % BLOCK
        low = col_low[c0:c1]
        lanes = np.empty(BLOCK, np.float32)
        lane_best = np.empty(max(k_rows, 1), np.float32)
        prime = rows and full > 0 and k_rows <= BLOCK
        # The first rows go into the columns' lists by `_insert_columns` (no thresholds yet:
        # nearly every block would hold scores to look at), for BLOCK x k rows: after r rows
        # a block of BLOCK scores beats a column's threshold with odds of about BLOCK k / r.
        cold = min(n_rows, BLOCK * k_cols) if cols and k_cols <= BLOCK else 0
        levels = np.full((k_cols if cold else 1, width if cold else 1), neg, np.float32)
        carry = np.empty(width if cold else 1, np.float32)
        if cold:
            low[:] = pos
        for r in range(n_rows):
            row = s[r, c0:c1]
            best = row_best[t, r if rows else 0]
            floor = neg if rows else pos
            if prime:
                # The k-th largest of the lane maxima (max over the blocks of each position)
                # is a lower bound of the stripe's k-th largest score: scores below it never
                # enter the row's list, which saves most insertions.
                lanes[:] = row[0:BLOCK]
                for c in range(BLOCK, full, BLOCK):
                    for j in range(BLOCK):
                        lanes[j] = max(lanes[j], row[c + j])
                lane_best[:] = neg
                lane_low = neg
                for j in range(BLOCK):
                    if lanes[j] > lane_low:
                        lane_low = _replace_smallest(lane_best, lanes[j])
                floor = np.nextafter(lane_low, neg)  # `v > floor` keeps scores equal to it
            row_low = floor
            for c in range(0, full, BLOCK):
                block = row[c:c + BLOCK]
                block_low = low[c:c + BLOCK]
                hit = False
                for j in range(BLOCK):
                    hit |= (block[j] > row_low) | (block[j] > block_low[j])
                if hit:  # only the scores that beat a threshold, by their bits
                    bits = _beats(block, row_low, block_low)
                    while bits:
                        j = _trailing_zeros(bits)
                        bits &= bits - np.uint64(1)
                        v = block[j]
                        if v > row_low:
                            row_low = max(_replace_smallest(best, v), floor)
                        if v > block_low[j]:
                            block_low[j] = _replace_smallest(col_best[c0 + c + j], v)
            for j in range(full, width):
                v = row[j]
                if v > row_low:
                    row_low = max(_replace_smallest(best, v), floor)
                if v > low[j]:
                    low[j] = _replace_smallest(col_best[c0 + j], v)
            if r < cold:  # the columns' part of this row (their thresholds are +inf so far)
                _insert_columns(levels, row, carry)
                if r == cold - 1:  # from the next row on, thresholds and sorted lists of k
                    _levels_to_lists(levels, col_best[c0:c1], low)
    r_q = _merged_means(row_best, k_rows, stripes) if rows else np.zeros(0, np.float32)
    r_i = np.zeros(n_cols if cols else 0, np.float32)
    if cols:
        for c in prange(n_cols):
            total = 0.0
            for i in range(k_cols):
                total += col_best[c, i]
            r_i[c] = total / k_cols
    return r_q, r_i


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _merged_means(row_best, k, chunks_per_thread=4):
    """`row_best [stripes, rows, k]` (each stripe's k best of a row, ascending) -> each row's
    mean of its k best over all stripes: a merge from the lists' tops, no sort, no allocation
    per row."""
    stripes, n_rows = row_best.shape[0], row_best.shape[1]
    r_q = np.zeros(n_rows, np.float32)
    chunks = stripes * chunks_per_thread
    for t in prange(chunks):
        top = np.empty(stripes, np.int64)
        for r in range(t * n_rows // chunks, (t + 1) * n_rows // chunks):
            top[:] = k - 1
            total = 0.0
            for _ in range(k):  # a list runs out only at the last pick, so top stays >= 0
                pick = 0
                for u in range(1, stripes):
                    if row_best[u, r, top[u]] > row_best[pick, r, top[pick]]:
                        pick = u
                total += row_best[pick, r, top[pick]]
                top[pick] -= 1
            r_q[r] = total / k
    return r_q


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _combine(s, r_q, r_i, out):
    """out = 2 s - r_q[:, None] - r_i[None, :] (float32, the order of `kernels.csls_combine`);
    `out` may be `s`."""
    n_rows, n_cols = s.shape
    two = np.float32(2)
    for r in prange(n_rows):
        src = s[r]
        dst = out[r]
        a = r_q[r]
        for c in range(n_cols):
            dst[c] = two * src[c] - a - r_i[c]


def _stripes(n_cols: int) -> int:
    """One column stripe per numba thread, each at least 4 blocks wide."""
    return max(1, min(numba.get_num_threads(), n_cols // (4 * BLOCK)))


def topk_means(x: np.ndarray, k: int, rows: bool = True, cols: bool = True
               ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(r_q, r_i) of a float32 2-D array in one read: mean of each row's min(k, G) largest
    entries and of each column's min(k, Q) largest (None where not asked for). A C- or
    Fortran-contiguous array is read where it lies; anything else is copied once."""
    if not x.flags.c_contiguous:
        if x.flags.f_contiguous:  # a transposed view: its rows are the columns of x.T
            r_i, r_q = topk_means(x.T, k, rows=cols, cols=rows)
            return r_q, r_i
        x = np.ascontiguousarray(x)
    n_rows, n_cols = x.shape
    r_q, r_i = _topk_means(x, min(k, n_cols), min(k, n_rows), rows, cols, _stripes(n_cols))
    return (r_q if rows else None), (r_i if cols else None)


def combine(s: np.ndarray, r_q: np.ndarray, r_i: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`out[...] = 2 s - r_q[:, None] - r_i` (out may be s); C- or Fortran-contiguous `s` and
    `out` of the same order."""
    if s.flags.c_contiguous and out.flags.c_contiguous:
        _combine(s, r_q, r_i, out)
    elif s.flags.f_contiguous and out.flags.f_contiguous:
        _combine(s.T, r_i, r_q, out.T)
    else:
        raise ValueError("combine needs s and out both C- or both Fortran-contiguous")
    return out


def prepare() -> tuple[float, bool, str | None]:
    """Have the kernels ready for what `kernels.csls` passes them (a read-only view of a CPU
    jax array's float32 buffer, C order; numba compiles a variant per array type): loaded from
    numba's on-disk cache, or compiled (and cached) where there is none. Returns (seconds,
    whether any kernel was compiled, the cache folder)."""
    start = time.perf_counter()
    s = np.zeros((4, 8), np.float32)
    s.setflags(write=False)
    r_q, r_i = topk_means(s, 2)
    combine(s, r_q, r_i, np.empty(s.shape, np.float32))
    kernels = (_topk_means, _merged_means, _combine)
    compiled = any(sum(f.stats.cache_misses.values()) for f in kernels)
    return time.perf_counter() - start, compiled, _topk_means.stats.cache_path


def aligned_empty(shape: tuple[int, ...], alignment: int = 64) -> np.ndarray:
    """An uninitialised float32 C-contiguous array whose data starts on an `alignment`-byte
    boundary: `jax.device_put` aliases such an array on the CPU instead of copying it."""
    size = int(np.prod(shape)) * 4
    raw = np.empty(size + alignment, np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + size].view(np.float32).reshape(shape)


def host_matrix(x, what: str) -> np.ndarray:
    """`x` as a float32 2-D numpy array: a view where it already is one (a numpy array, or a
    CPU jax array's buffer), one copy where the caller's dtype or strides force it."""
    if isinstance(x, jax.Array):
        # a view that lives as long as the numpy array (np.asarray would keep one on `x`
        # itself, and XLA cannot donate a buffer that something else still references)
        a = np.from_dlpack(x) if x.dtype in (jnp.float32, jnp.float16, jnp.float64) else \
            np.asarray(x)
    else:
        a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"{what} must be a [rows, columns] matrix, got shape {a.shape}")
    if a.dtype != np.float32:
        a = a.astype(np.float32)
    if not (a.flags.c_contiguous or a.flags.f_contiguous):
        a = np.ascontiguousarray(a)
    return a
