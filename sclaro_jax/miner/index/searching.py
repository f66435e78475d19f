"""Searching a MINER ANN index (`sclaro_jax.miner.index`): FAISS candidates from the global and
crop indexes of every shard, then the exact MINER score of the union (a numba kernel reading the
views in place on a CPU backend, jax on the gathered views otherwise) and its CSLS order."""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sclaro_jax.miner.index.files import Shard, open_shards, prefetch
from sclaro_jax.miner.index.settings import (DEFAULT_NPROBE, DEFAULT_NPROBE_GLOBAL,
                                             DEFAULT_SHORTLIST, SEARCH_SETTINGS,
                                             IndexMismatchError, _is_ivf, check_ranges, faiss)
from sclaro_jax.miner.index.vectors import per_image, query_vectors

DEFAULTS = {"shortlist": DEFAULT_SHORTLIST, "shortlist_global": None, "nprobe": DEFAULT_NPROBE,
            "nprobe_global": DEFAULT_NPROBE_GLOBAL}


def search_settings(shards: Sequence[Shard], **given) -> tuple[dict, str]:
    """({shortlist, shortlist_global, nprobe, nprobe_global} a search uses, one line saying
    where they come from): each one given (not None) wins; else the calibrated one
    (`calibration`; over shards the largest); else, for an index built before calibration, the
    defaults. shortlist_global None: the global index takes `shortlist` too (so does a
    `shortlist` given without a `shortlist_global`)."""
    cals = [s.meta.get("calibration") for s in shards]
    given = {k: v for k, v in given.items() if v is not None}
    if all(cals):
        out = {k: max((c[k] for c in cals if c[k] is not None), default=DEFAULTS[k])
               for k in SEARCH_SETTINGS if k != "shortlist_global"}
        # a shard without a global shortlist of its own (or calibrated before there was one)
        # shortlists `shortlist` there
        own = max(c.get("shortlist_global") or c["shortlist"] for c in cals)
        out["shortlist_global"] = None if own == out["shortlist"] else own
        c = min(cals, key=lambda c: c["recall_lower"])
        line = (f"calibrated at build time: recall@{c['k']} {c['recall']:.3f} of the exact "
                f"MINER + CSLS order on {c['queries']} calibration queries (asked "
                f"{c['asked']:g})")
        if any(c["exhaustive"] for c in cals):
            line += "; exhaustive: no cheaper setting measured reached it"
    else:
        out, line = dict(DEFAULTS), ("uncalibrated index (built before calibration): the "
                                     "default search settings")
    if "shortlist" in given and "shortlist_global" not in given:
        out["shortlist_global"] = None  # a shortlist given is every index's, as before
    out.update(given)
    line += "; " + ", ".join(f"{k} {out[k]}" + (" (given)" if k in given else "")
                             for k in SEARCH_SETTINGS if out[k] is not None)
    return out, line


def _rank(s: np.ndarray, ids: np.ndarray, r_i: np.ndarray, *, k: int, top: int):
    """MINER + CSLS order of each query's candidates from their fused scores, in float32.

    s [B, W] fused scores (-inf where there is no candidate); ids [B, W] gallery rows, ascending
    among the valid ones, -1 past them; r_i [B, W]. r_q = mean of the min(k, valid) highest S;
    CSLS = 2 S - r_q - r_i (`kernels.csls_combine`); the top `top` by a stable descending order
    (ties: the lower position, so the lower gallery row). Invalid: -inf, -1. Returns (scores,
    ids, r_q).
    """
    valid = ids >= 0
    kk = min(k, s.shape[1])
    best = -np.sort(-s, axis=1)[:, :kk]
    count = np.minimum(valid.sum(axis=1), kk)
    finite = np.arange(kk)[None, :] < count[:, None]
    r_q = (np.where(finite, best, np.float32(0)).sum(axis=1, dtype=np.float32)
           / np.maximum(count, 1).astype(np.float32))
    resc = np.where(valid, 2 * s - r_q[:, None] - r_i, np.float32(-np.inf))
    order = np.argsort(-resc, axis=1, kind="stable")[:, :top]
    vals = np.take_along_axis(resc, order, axis=1)
    idx = np.where(np.isfinite(vals), np.take_along_axis(ids, order, axis=1), -1)
    return vals, idx, r_q


@functools.partial(jax.jit, static_argnames=("alpha", "pool"))
def _fused(t, views, *, alpha: float, pool: str):
    """S [B, W] by `kernels.fuse` of t [B, D] f32 and each query's gathered candidates' views
    [B, W, V, D] (global, then crops)."""
    from sclaro_jax.miner.kernels import fuse

    def one(tq, v):
        crops = v[:, 1:] if v.shape[1] > 1 else None
        return fuse(tq[None], v[:, 0], crops, alpha, pool, precision=jax.lax.Precision.HIGHEST)[0]
    return jax.vmap(one)(t, views)


# The fused scores on a CPU backend: read in place from the candidates' memory-mapped views by
# the numba kernel of `miner._cpu_fuse` (no gather, no copy to the device); False (or another
# backend) gathers the views and scores them in jax (`_fused`), e.g. to compare the two. Either
# way `_rank` orders them.
CPU_RERANK = True


def _fused_cpu(shards: Sequence[Shard], t: np.ndarray, ids: np.ndarray, *, alpha: float,
               pool: str) -> tuple[np.ndarray, np.ndarray]:
    """(S [B, W] float32 by `_cpu_fuse.fused_rows`, read straight from each shard's
    memory-mapped views; r_i [B, W]) of gallery rows ids (-1: -inf and 0)."""
    from sclaro_jax.miner._cpu_fuse import fused_rows

    s = np.full(ids.shape, -np.inf, np.float32)
    r_i = np.zeros(ids.shape, np.float32)
    for shard in shards:
        inside = (ids >= shard.offset) & (ids < shard.offset + shard.n)
        rows = np.where(inside, ids - shard.offset, -1)
        prefetch(shard.views, rows[inside])
        fused_rows(shard.views, t, rows, alpha, pool, s)
        r_i[inside] = shard.r_i[rows[inside]]
    return s, r_i


def candidates(shards: Sequence[Shard], t: np.ndarray, shortlist: int, nprobe: int,
               nprobe_global: Optional[int] = None,
               shortlist_global: Optional[int] = None) -> np.ndarray:
    """[B, W] gallery rows per query: the union over shards of the top `shortlist_global`
    images of the global index and the first `shortlist` distinct images of the top
    `shortlist * P` fused crop vectors (P per image), ascending, padded with -1 (W =
    (shortlist_global + shortlist) * shards, less where a shard is smaller). nprobe /
    nprobe_global: IVF lists visited in the crop / global index (None: nprobe in both);
    shortlist_global None: shortlist."""
    f = faiss()
    found = []
    for s in shards:
        params = f.ParameterSpace()
        for index, fac, probes in ((s.glob, s.meta["factory_global"], nprobe_global or nprobe),
                                   (s.crops, s.meta["factory_crops"], nprobe)):
            if index is not None and _is_ivf(fac):
                params.set_index_parameter(index, "nprobe", probes)
        _, ig = s.glob.search(query_vectors(t, s.glob.d), min(shortlist_global or shortlist,
                                                              s.n))
        found.append(np.where(ig >= 0, ig + s.offset, -1))
        if s.crops is not None:
            per = per_image(s.meta["n_crops"], s.meta["pool"])
            _, ic = s.crops.search(query_vectors(t, s.crops.d),
                                   min(shortlist * per, s.crops.ntotal))
            found.append(_first_distinct(np.where(ic >= 0, ic // per + s.offset, -1),
                                         min(shortlist, s.n)))
    ids = np.concatenate(found, axis=1)
    big = np.iinfo(np.int64).max
    ids = np.sort(np.where(ids < 0, big, ids), axis=1)
    dup = np.zeros_like(ids, bool)
    dup[:, 1:] = ids[:, 1:] == ids[:, :-1]
    ids = np.sort(np.where(dup, big, ids), axis=1)
    return np.where(ids == big, -1, ids)


FAISS_BLOCK_IDS = 1 << 23  # candidate ids FAISS returns per call, at most (64 MB of int64)


def faiss_block(shards: Sequence[Shard], shortlist: int, batch: int,
                shortlist_global: Optional[int] = None) -> int:
    """Queries per FAISS call in `search`: a multiple of the re-rank `batch`, as many as keep
    the ids FAISS returns under `FAISS_BLOCK_IDS`. FAISS's IVF scans answer a block of queries
    at once faster than the same queries in re-rank batches (each list's codes are read for
    the block's queries together): 2,000 global-only queries over 300,000 images, IVF2048 fast
    scan, 128 lists probed, 200 each, on one core, took 0.33 s in one call and 0.63 s in calls
    of 64."""
    width = sum(min(shortlist_global or shortlist, s.n)
                + (min(shortlist, s.n) * per_image(s.meta["n_crops"], s.meta["pool"])
                   if s.crops is not None else 0) for s in shards)
    return batch * max(1, FAISS_BLOCK_IDS // max(1, width * batch))


def _first_distinct(ids: np.ndarray, m: int) -> np.ndarray:
    """Per row, the first m distinct non-negative ids in row order, padded with -1 (a numba
    kernel: `_cpu_fuse.first_distinct`)."""
    from sclaro_jax.miner._cpu_fuse import first_distinct
    return first_distinct(ids, m)


def _gather(shards: Sequence[Shard], ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 views [B, W, V, D] and r_i [B, W] of gallery rows ids (-1: zeros, or with one
    shard row 0's views, which the re-rank masks)."""
    first = shards[0]
    v = first.views.shape[1:]
    if len(shards) == 1:  # one read, no zero fill: rows of -1 read row 0, masked by the re-rank
        rows = np.where(ids >= 0, ids - first.offset, 0).reshape(-1)
        prefetch(first.views, rows)
        return (first.views[rows].reshape(ids.shape + v),
                np.where(ids >= 0, first.r_i[rows].reshape(ids.shape), 0).astype(np.float32))
    out = np.zeros(ids.shape + v, np.float16)
    r_i = np.zeros(ids.shape, np.float32)
    flat = ids.reshape(-1)
    ov, orr = out.reshape((-1,) + v), r_i.reshape(-1)
    for s in shards:
        sel = np.nonzero((flat >= s.offset) & (flat < s.offset + s.n))[0]
        if len(sel):
            rows = flat[sel] - s.offset
            order = np.argsort(rows, kind="stable")
            prefetch(s.views, rows)
            ov[sel[order]] = s.views[rows[order]]
            orr[sel] = s.r_i[rows]
    return out, r_i


def search(queries: np.ndarray, shards, *, top: int = 10, shortlist: Optional[int] = None,
           nprobe: Optional[int] = None, nprobe_global: Optional[int] = None,
           batch: int = 64, progress: bool = False, shortlist_global: Optional[int] = None):
    """Top `top` gallery images per query under the exact MINER + CSLS score on the ANN
    shortlist (module docstring). queries [Q, D] L2-normalised; shards: from `open_shards` (or
    folders). Returns `stream.SearchResult` (scores [Q, top] 2S - r_q - r_i, indices [Q, top]
    global gallery rows, -1 past the candidates; r_q [Q] over the shortlist; r_i [G] the
    bank's). shortlist, shortlist_global, nprobe, nprobe_global: None takes the index's
    calibrated settings (`search_settings`). Each number outside its `settings.RANGES` is a
    ValueError naming it."""
    from tqdm.auto import tqdm

    from sclaro_jax.miner.stream import SearchResult

    check_ranges(top=top, shortlist=shortlist, shortlist_global=shortlist_global, nprobe=nprobe,
                 nprobe_global=nprobe_global, batch=batch)
    if not shards or isinstance(shards, (str, os.PathLike)) or not isinstance(shards[0], Shard):
        shards = open_shards(shards)
    chosen, _ = search_settings(shards, shortlist=shortlist, shortlist_global=shortlist_global,
                                nprobe=nprobe, nprobe_global=nprobe_global)
    shortlist, shortlist_global, nprobe, nprobe_global = (chosen[k] for k in SEARCH_SETTINGS)
    meta = shards[0].meta
    queries = np.ascontiguousarray(queries, np.float32)
    if queries.ndim != 2 or queries.shape[1] != meta["dim"]:
        raise IndexMismatchError(f"{shards[0].path / 'meta.json'}: the index was built with "
                                 f"dim {meta['dim']}, not {queries.shape[-1]} (queries of "
                                 f"shape {queries.shape})")
    total = meta["total"]
    top = min(top, total)
    scores = np.empty((len(queries), top), np.float32)
    indices = np.empty((len(queries), top), np.int64)
    r_q = np.empty((len(queries),), np.float32)
    block = faiss_block(shards, shortlist, batch, shortlist_global)
    cpu = CPU_RERANK and jax.default_backend() == "cpu"
    found = (0, np.zeros((0, 0), np.int64))  # (first query, candidates of its FAISS block)
    for a in tqdm(range(0, len(queries), batch), desc="search", unit="batch",
                  disable=not progress):
        t = queries[a:a + batch]
        if a >= found[0] + len(found[1]):  # FAISS answers a block of queries in one call
            found = (a, candidates(shards, queries[a:a + block], shortlist, nprobe,
                                   nprobe_global, shortlist_global))
        ids = found[1][a - found[0]:a - found[0] + batch]
        b = len(t)
        if not cpu and b < batch and len(queries) > batch:  # one compiled shape for `_fused`
            t = np.concatenate([t, np.zeros((batch - b, t.shape[1]), np.float32)])
            ids = np.concatenate([ids, np.full((batch - b, ids.shape[1]), -1)])
        fusion = dict(alpha=meta["alpha"], pool=meta["pool"])
        if cpu:
            s, r_i = _fused_cpu(shards, t, ids, **fusion)
        else:
            views, r_i = _gather(shards, ids)
            s = np.where(ids >= 0, np.asarray(_fused(jnp.asarray(t), jnp.asarray(views),
                                                     **fusion)), np.float32(-np.inf))
        vals, idx, rq = _rank(s, ids, r_i, k=meta["k"], top=min(top, ids.shape[1]))
        vals, idx = np.asarray(vals)[:b], np.asarray(idx)[:b]
        pad = top - vals.shape[1]
        scores[a:a + b] = np.pad(vals, ((0, 0), (0, pad)), constant_values=-np.inf)
        indices[a:a + b] = np.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
        r_q[a:a + b] = np.asarray(rq)[:b]
    return SearchResult(scores=scores, indices=indices, r_q=r_q,
                        r_i=np.concatenate([s.r_i for s in shards]))


def gt_ranks(indices: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """Position of each query's ground truth in its result list, or the list's length when it
    is not there (so recall@k = mean(rank < k) for k up to the list's length)."""
    hit = indices == np.asarray(gt)[:, None]
    return np.where(hit.any(axis=1), hit.argmax(axis=1), indices.shape[1]).astype(np.int64)


# --------------------------------------------------------------------------------------------
