"""MINER search over a large gallery in fixed-size chunks, never forming the [Q, G] matrix.

Scores (docs/design.md, section 4), all embeddings L2-normalised; the fusion and the CSLS
combination are `kernels.fuse` and `kernels.csls_combine`, the column means `kernels.topk_mean`:

    S = (1 - alpha) * T G^T + alpha * pool_r(T C_r^T)      pool = max (default) or mean
    S = T G^T                                               when there are no crops
    CSLS = 2 S - r_q - r_i                                  rescore="csls"
    r_q[q] = mean of query q's k highest S over the gallery (k = min(k, G))
    r_i[j] = mean of image j's k highest S over the queries (transductive), or over the fused
             scores of a separate query bank (inductive, `bank=`); k = min(k, number of rows)

One pass over the gallery. Per chunk of `chunk` images (the last one padded with zero rows and
masked to -inf, so every chunk has the same shape and one compiled function serves all of them)
a jitted step computes the chunk's fused scores [Q, C] in float32, the chunk's r_i (exact: a
column needs only the queries, or the bank), merges the chunk into a running per-query top-k of
S (for r_q) and a running per-query top-`top` of 2 S - r_i with global gallery indices. r_q is
constant per query, so it is subtracted at the end without changing the order.

Ties: the order is a stable descending sort by score, i.e. equal scores rank by lower gallery
index first (`jax.lax.top_k` keeps the lower position first, and positions follow gallery order).

Ground truth (`gt=`): `gt_rank[q]` = number of gallery items ranked ahead of q's ground-truth
image = #{j : s_j > s_gt} + #{j < gt : s_j == s_gt}, counted per chunk, so recall@k =
mean(gt_rank < k) exactly, also for ranks beyond `top`. This needs the ground truth's rescored
score before the scan: a short pre-pass runs the same compiled step on chunks made of the
ground-truth rows only (its column statistics are exact, a column needs only the queries).
`gt_score` returns the value seen during the scan. The same compiled step computes both, but
if XLA rounded a column differently at another position in the chunk, items within one float32
ulp of the ground truth could be miscounted (the tests compare gt_rank exactly, skipping
near-ties closer than 1e-6).

Memory rule (float32 bytes, Q queries, Qb bank rows, C = chunk, D = dim, R crops):
    gallery chunk, host + device:   2 x C * (1 + R) * D * itemsize   (one computing, one loaded)
    upcast for the matmul:          C * D * 4 (per view, transient)
    scores and masks:               about 5 * Q * C * 4  (+ 2 * Qb * C * 4 with a bank,
                                    + 2 * Q * C * 4 with crops: running pool + one crop)
    column top-k (r_i):             C * 16 k * 4 candidates + Q / 16 * C * 4 block maxima
                                    (`kernels.topk_mean`, blocked when 16 k < Q)
    results:                        G * 4 (r_i) + Q * (k + 2 top) * 4
Queries are kept whole (the transductive r_i of a column needs every query's score); pick
`chunk` so that 5 * Q * C * 4 fits, e.g. Q = 1,000 and C = 65,536 is about 1.3 GB.
"""

from __future__ import annotations

import functools
from typing import Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from sclaro_jax.miner.kernels import csls_combine, fuse, topk_mean

HIGHEST = jax.lax.Precision.HIGHEST
NEG = -jnp.inf

# Incremented each time `_step` is traced (i.e. compiled for a new shape / configuration).
TRACE_COUNT = {"step": 0}


class SearchResult(NamedTuple):
    """`scores` [Q, top] f32 (rescored: 2S - r_q - r_i, or S), `indices` [Q, top] int64 global
    gallery rows, `r_q` [Q] and `r_i` [G] (None without CSLS), `gt_rank` [Q] int64 items ranked
    ahead of the ground truth and `gt_score` [Q] its rescored score (None without `gt`)."""

    scores: np.ndarray
    indices: np.ndarray
    r_q: Optional[np.ndarray]
    r_i: Optional[np.ndarray]
    gt_rank: Optional[np.ndarray] = None
    gt_score: Optional[np.ndarray] = None


class Config(NamedTuple):
    """Static settings of the compiled step (hashable)."""

    alpha: float
    pool: str
    k_q: int
    k_i: int
    top: int
    csls: bool


class State(NamedTuple):
    """Running per-query state carried from chunk to chunk."""

    topq: jax.Array     # [Q, k_q] f32: highest S so far (for r_q)
    cand_s: jax.Array   # [Q, top] f32: highest 2S - r_i (or S) so far
    cand_i: jax.Array   # [Q, top] int32: their global gallery indices
    ahead: jax.Array    # [Q] int32: items ranked ahead of the ground truth so far
    gt_seen: jax.Array  # [Q] f32: the ground truth's rescored score when its chunk was seen


def init_state(n_queries: int, cfg: Config) -> State:
    """The state before the first chunk."""
    return State(topq=jnp.full((n_queries, cfg.k_q), NEG, jnp.float32),
                 cand_s=jnp.full((n_queries, cfg.top), NEG, jnp.float32),
                 cand_i=jnp.full((n_queries, cfg.top), -1, jnp.int32),
                 ahead=jnp.zeros((n_queries,), jnp.int32),
                 gt_seen=jnp.full((n_queries,), NEG, jnp.float32))


def top_of(scores: jax.Array, indices: jax.Array, top: int) -> tuple[jax.Array, jax.Array]:
    """The `top` highest of each row of scores [Q, n] and their indices [Q, n], ties to the
    lower position (so to the lower gallery index when the positions follow gallery order)."""
    vals, pos = jax.lax.top_k(scores, top)
    return vals, jnp.take_along_axis(indices, pos, axis=1)


def merge_top(run_s: jax.Array, run_i: jax.Array, new_s: jax.Array, new_i: jax.Array,
              top: int) -> tuple[jax.Array, jax.Array]:
    """Top-`top` of the running list [Q, top] and new candidates [Q, n] (indices all above the
    running ones', or running first in gallery order), ties to the lower index."""
    return top_of(jnp.concatenate([run_s, new_s], axis=1),
                  jnp.concatenate([run_i, new_i], axis=1), top)


def step_body(state: State, queries: jax.Array, glob: jax.Array, crops: Optional[jax.Array],
              bank: Optional[jax.Array], start: jax.Array, n_valid: jax.Array,
              gt_idx: jax.Array, gt_val: jax.Array, cfg: Config) -> tuple[State, jax.Array]:
    """One gallery chunk: returns the updated state and the chunk's r_i [C] (zeros without CSLS).

    `start` is the chunk's first global row, `n_valid` its real rows (the rest is padding).
    `gt_idx` [Q] global ground-truth rows (-1: none), `gt_val` [Q] their rescored scores
    (2S - r_i, or S), used to count items ranked ahead of them.
    """
    c = glob.shape[0]
    s = fuse(queries, glob, crops, cfg.alpha, cfg.pool, precision=HIGHEST)
    col = jnp.arange(c, dtype=jnp.int32)
    valid = (col < n_valid)[None, :]
    gidx = start + col
    s_masked = jnp.where(valid, s, NEG)
    topq = jax.lax.top_k(jnp.concatenate([state.topq, s_masked], axis=1), cfg.k_q)[0]
    if cfg.csls:
        src = s if bank is None else fuse(bank, glob, crops, cfg.alpha, cfg.pool,
                                          precision=HIGHEST)
        r_i = topk_mean(src, cfg.k_i, axis=0)
        resc = jnp.where(valid, csls_combine(s, None, r_i), NEG)  # r_q: in `finish`
    else:
        r_i = jnp.zeros((c,), jnp.float32)
        resc = s_masked
    new_s, new_pos = jax.lax.top_k(resc, min(cfg.top, c))
    cand_s, cand_i = merge_top(state.cand_s, state.cand_i, new_s, gidx[new_pos], cfg.top)
    g = gt_idx[:, None]
    v = gt_val[:, None]
    is_gt = gidx[None, :] == g
    ahead = ((resc > v) | ((resc == v) & (gidx[None, :] < g))) & ~is_gt
    seen = jnp.max(jnp.where(is_gt & valid, resc, NEG), axis=1)
    new = State(topq=topq, cand_s=cand_s, cand_i=cand_i,
                ahead=state.ahead + ahead.sum(axis=1, dtype=jnp.int32),
                gt_seen=jnp.maximum(state.gt_seen, seen))
    return new, r_i


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=(0,))
def _step(state: State, queries: jax.Array, glob: jax.Array, crops: Optional[jax.Array],
          bank: Optional[jax.Array], start: jax.Array, n_valid: jax.Array, gt_idx: jax.Array,
          gt_val: jax.Array, cfg: Config) -> tuple[State, jax.Array]:
    TRACE_COUNT["step"] += 1
    return step_body(state, queries, glob, crops, bank, start, n_valid, gt_idx, gt_val, cfg)


def step_cache_size() -> int:
    """Number of compiled variants of the chunk step (one per shape / configuration)."""
    return _step._cache_size()


def read_rows(arr: np.ndarray, a: int, b: int) -> np.ndarray:
    """Rows a:b of a numpy array or np.memmap, as a fresh in-memory array.

    A C-contiguous np.memmap is read with a plain file read, so its pages never become part of
    this process's resident set (slicing the map would leave the whole file counted in RSS).
    """
    if (isinstance(arr, np.memmap) and getattr(arr, "filename", None)
            and arr.flags.c_contiguous):
        row = int(np.prod(arr.shape[1:], dtype=np.int64))
        out = np.fromfile(arr.filename, dtype=arr.dtype, count=(b - a) * row,
                          offset=arr.offset + a * row * arr.dtype.itemsize)
        return out.reshape((b - a,) + arr.shape[1:])
    return np.array(arr[a:b])


def padded_rows(arr: np.ndarray, a: int, b: int, size: int) -> np.ndarray:
    """Rows a:b of arr, padded with zero rows to `size` rows."""
    rows = read_rows(arr, a, min(b, arr.shape[0]))
    if rows.shape[0] == size:
        return rows
    out = np.zeros((size,) + arr.shape[1:], arr.dtype)
    out[:rows.shape[0]] = rows
    return out


def make_config(n_queries: int, n_gallery: int, n_bank: Optional[int], *, alpha: float,
                pool: str, k: int, rescore: str, top: int) -> Config:
    """Validate the options; k and top are clipped to the sizes available."""
    if rescore not in ("csls", "none"):
        raise ValueError(f"rescore must be 'csls' or 'none', not {rescore!r}")
    if pool not in ("max", "mean"):
        raise ValueError(f"pool must be 'max' or 'mean', not {pool!r}")
    rows = n_queries if n_bank is None else n_bank
    return Config(alpha=float(alpha), pool=pool, k_q=min(k, n_gallery), k_i=min(k, rows),
                  top=min(top, n_gallery), csls=rescore == "csls")


def _chunks(gallery: np.ndarray, crops: Optional[np.ndarray], chunk: int
            ) -> Iterator[tuple[jax.Array, Optional[jax.Array], int, int]]:
    """(glob, crops, start, n_valid) per chunk, already placed on the device."""
    n = gallery.shape[0]
    for a in range(0, n, chunk):
        g = jax.device_put(padded_rows(gallery, a, a + chunk, chunk))
        c = None if crops is None else jax.device_put(padded_rows(crops, a, a + chunk, chunk))
        yield g, c, a, min(chunk, n - a)


def gt_values(queries: jax.Array, gallery: np.ndarray, crops: Optional[np.ndarray],
               bank: Optional[jax.Array], gt: np.ndarray, chunk: int, cfg: Config,
               step=None) -> np.ndarray:
    """[Q] rescored score (2S - r_i, or S) of each query's ground truth, by the chunk step run on
    chunks made of the ground-truth rows only."""
    step = step or functools.partial(_step, cfg=cfg)
    q = queries.shape[0]
    if gt.shape != (q,) or gt.min() < 0 or gt.max() >= gallery.shape[0]:
        raise ValueError(f"gt must be [{q}] rows of the gallery (0..{gallery.shape[0] - 1})")
    rows, where = np.unique(gt, return_inverse=True)
    out = np.full((q,), -np.inf, np.float32)
    for a in range(0, len(rows), chunk):
        sel = rows[a:a + chunk]
        g = np.zeros((chunk,) + gallery.shape[1:], gallery.dtype)
        g[:len(sel)] = gallery[sel]
        c = None
        if crops is not None:
            c = np.zeros((chunk,) + crops.shape[1:], crops.dtype)
            c[:len(sel)] = crops[sel]
        mine = (where >= a) & (where < a + len(sel))
        pos = np.where(mine, where - a, -1).astype(np.int32)
        never = np.full((q,), np.inf, np.float32)
        state, _ = step(init_state(q, cfg), queries, jnp.asarray(g),
                        None if c is None else jnp.asarray(c), bank, jnp.int32(0),
                        jnp.int32(len(sel)), jnp.asarray(pos), jnp.asarray(never))
        seen = np.asarray(state.gt_seen)
        out[mine] = seen[mine]
    return out


def prepare(queries: np.ndarray, gallery: np.ndarray, crops: Optional[np.ndarray],
            bank: Optional[np.ndarray], gt: Optional[np.ndarray], chunk: int, **options
            ) -> tuple[Config, jax.Array, Optional[jax.Array], jax.Array, jax.Array]:
    """What a search needs before its scan: the Config (`make_config(..., **options)`), the
    queries and the bank as float32 device arrays, and the ground-truth rows [Q] with their
    rescored scores (`gt_values`, chunks of `chunk` rows); -1 and +inf without `gt`."""
    cfg = make_config(queries.shape[0], gallery.shape[0], None if bank is None else bank.shape[0],
                      **options)
    q = jnp.asarray(queries, jnp.float32)
    b = None if bank is None else jnp.asarray(bank, jnp.float32)
    if gt is None:
        gt_idx = np.full((q.shape[0],), -1, np.int32)
        gt_val = np.full((q.shape[0],), np.inf, np.float32)
    else:
        gt_idx = np.asarray(gt, np.int32)
        gt_val = gt_values(q, gallery, crops, b, gt_idx, chunk, cfg)
    return cfg, q, b, jnp.asarray(gt_idx), jnp.asarray(gt_val)


def search(queries: np.ndarray, gallery: np.ndarray, crops: Optional[np.ndarray] = None, *,
           alpha: float = 0.4, pool: str = "max", k: int = 10, rescore: str = "csls",
           bank: Optional[np.ndarray] = None, top: int = 10, chunk: int = 65536,
           gt: Optional[np.ndarray] = None) -> SearchResult:
    """Top-`top` gallery images per query under fused + two-sided CSLS scores, streamed.

    queries [Q, D] f32; gallery [G, D] (float16 numpy array or np.memmap); crops [G, R, D]
    optional; bank [Qb, D] optional (inductive r_i); gt [Q] optional ground-truth rows (returns
    `gt_rank`, so recall@k = 100 * mean(gt_rank < k)). See the module docstring for the formulas
    and the memory rule. The next chunk is read and sent to the device while the current one
    computes (JAX dispatch is asynchronous); at most two chunks are alive at a time. A gallery
    smaller than `chunk` is one chunk of its own size (no padding rows to score).
    """
    chunk = max(1, min(chunk, gallery.shape[0]))
    cfg, q, b, gt_idx, gt_val = prepare(queries, gallery, crops, bank, gt, chunk, alpha=alpha,
                                        pool=pool, k=k, rescore=rescore, top=top)
    state = init_state(q.shape[0], cfg)
    r_i_parts = []
    chunks = _chunks(gallery, crops, chunk)
    nxt = next(chunks)
    while nxt is not None:
        g, c, a, n_valid = nxt
        state, r_i = _step(state, q, g, c, b, jnp.int32(a), jnp.int32(n_valid), gt_idx, gt_val,
                           cfg=cfg)
        nxt = next(chunks, None)          # host read + transfer overlaps the step above
        jax.block_until_ready(state)      # bound memory: one chunk computing, one loaded
        r_i_parts.append(np.asarray(r_i)[:n_valid])
    return finish(state, np.concatenate(r_i_parts), cfg, gt is not None)


def finish(state: State, r_i: np.ndarray, cfg: Config, with_gt: bool) -> SearchResult:
    """Host-side result: subtract r_q from the candidates' scores (CSLS)."""
    cand_s = np.asarray(state.cand_s)
    gt_score = np.asarray(state.gt_seen) if with_gt else None
    if cfg.csls:
        r_q = np.asarray(state.topq).mean(axis=1)
        cand_s = cand_s - r_q[:, None]
        if with_gt:
            gt_score = gt_score - r_q
    return SearchResult(scores=cand_s.astype(np.float32),
                        indices=np.asarray(state.cand_i).astype(np.int64),
                        r_q=r_q if cfg.csls else None,
                        r_i=r_i.astype(np.float32) if cfg.csls else None,
                        gt_rank=np.asarray(state.ahead).astype(np.int64) if with_gt else None,
                        gt_score=gt_score)
