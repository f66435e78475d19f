"""Calibration of a MINER ANN index's search settings at build time (`sclaro_jax.miner.index`).

Why: the recall an ANN shortlist gives depends on the gallery (how its images cluster, how far a
query lies from its image's views), so fixed search settings give one gallery 0.97 and another
0.47 of the exact order. A build therefore measures, on calibration queries, the recall@10 that
each search setting gives against the EXACT MINER + CSLS order, and stores the cheapest setting
that reaches the recall asked (`--recall`, default 0.95) in meta.json ("calibration"); a search
uses it unless given flags (`searching.search_settings`).

The calibration queries: `--calibration-queries FILE`, or by default `bank_rows` of the query
bank: every row, or 1,000 rows evenly spaced in a larger bank. They stay in the bank:
r_i is over the whole bank, as documented, so that an index built from `eval.rocs`'s cache (the
split's own queries as the bank, transductive CSLS) still gives exactly the MINER row, and
inductive r_i is the user's bank, not a part of it. The bias this could leave (a bank row's
r_i terms include its own scores) measured small, and the noise of few queries large (the
anisotropic gallery of the tests, 1,000 new queries not in the bank): calibrated on 100 bank rows
with a 1.645-standard-error margin, 0.968 on them but 0.948 on the new queries (the cheapest
setting that passes on a few queries is one whose recall they overstate); on all 1,000 bank rows
with `Z` = 2.326, 0.957 and 0.961 on them, 0.955 and 0.960 on the new queries (max / mean
pooling). So every bank row up to 1,000 calibrates. The tests calibrate on bank rows and check
the recall on other queries, never in the bank
(tests/test_miner_calibration.py). Pass `--calibration-queries` for queries from elsewhere.

Exact order: the store step's streamed pass (`stream.search` over each chunk with the bank) also
returns each calibration query's top 10 of 2 S - r_i within the chunk (r_q is a constant per
query, and a chunk's r_i is exact: it needs only the bank); `save_exact` merges the chunks'
tops into calibration.npz (the queries and their exact top 10 rows of the shard). No second
pass over the gallery.

Measure: the exact re-rank of a candidate set keeps the exact order, so recall@10 of a setting
is the share of each query's exact top 10 that its candidates hold. Per lists-probed value of
each index, one FAISS search at the largest shortlist gives every smaller shortlist's
candidates as prefixes (the global index's top s; the crop index's first s distinct images of
its top s * P vectors), so the whole grid (`SHORTLISTS` x powers of two up to each index's
lists) costs a few searches of the calibration queries, and no re-rank. With crops the global
index's shortlist is a setting of its own (`shortlist_global`, from `SHORTLISTS`; None: the
crop index's): at 1M images a global index probed in 4 lists added 200 candidates a query to
the re-rank for little recall.

Choose: the cheapest setting (`cost`: bytes a query reads: the coarse centres, the codes of the
lists probed, the float16 views of the candidates) whose recall's lower bound, the mean less
`Z` standard errors over the calibration queries, reaches the recall asked (so a recall
measured on few queries is not luck). Asking more never picks cheaper: the settings that reach a
higher recall are a subset of those that reach a lower one. If none does (the largest shortlist
measured, 1024, is not enough), the exhaustive setting: every image of the shard shortlisted,
every list probed (exact), said so in meta.json and by `search`. Shards calibrate on their own
rows; a search over shards takes the largest of each setting and reports the smallest recall.
Nothing is refitted at search time.
"""

from __future__ import annotations

import numpy as np

from sclaro_jax.files import write_replacing
from sclaro_jax.miner.index.files import _read_json, _write_json, open_index
from sclaro_jax.miner.index.settings import _is_ivf, _nlist_of, faiss
from sclaro_jax.miner.index.vectors import per_image, query_vectors

K = 10  # recall@K against the exact order
Z = 2.326  # one-sided 99% lower bound of the mean recall over the calibration queries
SHORTLISTS = (10, 16, 25, 32, 50, 64, 100, 128, 200, 256, 400, 512, 1024)


def bank_rows(rows: int) -> np.ndarray:
    """The bank rows that are calibration queries by default (module docstring)."""
    count = min(rows, 1000)
    return np.unique(np.linspace(0, rows - 1, count).round().astype(np.int64))


def save_chunk(path, res, first: int) -> None:
    """One chunk's exact top of 2 S - r_i per calibration query (`stream.search`'s result:
    scores 2 S - r_q - r_i over the chunk, so r_q is added back), rows shifted by `first`."""
    values = res.scores + res.r_q[:, None]
    rows = np.where(res.indices >= 0, res.indices + first, -1)
    write_replacing(path, lambda f: np.savez(f, values=values.astype(np.float32), rows=rows),
                    fsync=True)


def save_exact(path, queries: np.ndarray, parts) -> None:
    """calibration.npz: the queries and their exact top K rows of the shard (the chunks' tops
    merged; equal values: the lower row first, `stream`'s tie rule)."""
    chunks = [np.load(p) for p in parts]
    values = np.concatenate([c["values"] for c in chunks], axis=1)
    rows = np.concatenate([c["rows"] for c in chunks], axis=1)
    order = np.lexsort((rows, -values), axis=1)[:, :K]
    exact = np.take_along_axis(rows, order, axis=1)
    write_replacing(path, lambda f: np.savez(f, queries=queries, exact=exact), fsync=True)


def _probes(index, factory: str) -> list:
    """Lists-probed values measured for one index: powers of two up to its lists (None: not IVF,
    nothing to set)."""
    if index is None or not _is_ivf(factory):
        return [None]
    nlist = _nlist_of(factory)
    return sorted({min(2 ** i, nlist) for i in range(nlist.bit_length() + 1)})


def _search(index, q: np.ndarray, nprobe, k: int) -> np.ndarray:
    if nprobe is not None:
        faiss().ParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    return index.search(query_vectors(q, index.d), k)[1]


def _global_ranks(ids: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """[Qc, K] position of each exact row in the global index's list (a large number: absent)."""
    hit = ids[:, :, None] == exact[:, None, :]
    return np.where(hit.any(1), hit.argmax(1), np.iinfo(np.int32).max)


def _crop_ranks(ids: np.ndarray, exact: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([Qc, K] distinct-image rank, [Qc, K] vector position) of each exact row's first vector
    in the crop index's list of images (`searching._first_distinct`'s order; a numba kernel:
    `_cpu_fuse.first_hits`)."""
    from sclaro_jax.miner._cpu_fuse import first_hits
    return first_hits(ids, exact, np.iinfo(np.int32).max)


def cost(shard, shortlist: int, nprobe, nprobe_global, shortlist_global=None) -> float:
    """Bytes one query reads: each index's coarse centres and the codes of the lists it probes
    (all codes where it is not IVF), and the float16 views of its candidates (`shortlist` from
    each index, or `shortlist_global` from the global one)."""
    total = 0.0
    for index, fac, probes in ((shard.glob, shard.meta["factory_global"], nprobe_global),
                               (shard.crops, shard.meta["factory_crops"], nprobe)):
        if index is None:
            continue
        code = getattr(index, "code_size", 4 * index.d)
        if _is_ivf(fac):
            nlist = _nlist_of(fac)
            total += nlist * index.d * 4 + min(probes, nlist) / nlist * index.ntotal * code
        else:
            total += index.ntotal * code
    views = 1 + shard.meta["n_crops"]
    rows = min(shortlist_global or shortlist, shard.n)
    if shard.crops is not None:
        rows += min(shortlist, shard.n)
    return total + rows * views * shard.meta["dim"] * 2


def measure(shard, queries: np.ndarray, exact: np.ndarray) -> list[dict]:
    """Every setting of the grid with its cost and its recall@K (mean and lower bound) on the
    calibration queries (module docstring)."""
    n, valid = shard.n, exact >= 0
    shortlists = sorted({s for s in SHORTLISTS if s < n} | {min(n, SHORTLISTS[-1])})
    top = shortlists[-1]
    glob = {p: _global_ranks(_search(shard.glob, queries, p, top), exact)
            for p in _probes(shard.glob, shard.meta["factory_global"])}
    crops, per = {None: None}, per_image(shard.meta["n_crops"], shard.meta["pool"])
    if shard.crops is not None:
        k = min(top * per, shard.crops.ntotal)
        crops = {p: _crop_ranks(np.where((i := _search(shard.crops, queries, p, k)) >= 0,
                                         i // per, -1), exact)
                 for p in _probes(shard.crops, shard.meta["factory_crops"])}
    # with crops, the global index's shortlist is a setting of its own (None: the same)
    table, counts = [], np.maximum(valid.sum(1), 1)
    for s in shortlists:
        sgs = [None] + ([x for x in shortlists if x != s] if shard.crops is not None else [])
        limits = np.array([sg or s for sg in sgs])[:, None, None]
        for pc, c in crops.items():
            hit_c = None if c is None else (c[0] < s) & (c[1] < s * per)
            for pg, g in glob.items():
                hit = g[None] < limits  # [global shortlists, Qc, K]
                if hit_c is not None:
                    hit |= hit_c[None]
                each = np.ascontiguousarray((hit & valid[None]).sum(2) / counts)
                means, stds = each.mean(1), each.std(1)
                for sg, mean, std in zip(sgs, means, stds):
                    table.append({"shortlist": s, "shortlist_global": sg, "nprobe": pc,
                                  "nprobe_global": pg, "cost": cost(shard, s, pc, pg, sg),
                                  "recall": float(mean),
                                  "lower": float(mean) - Z * float(std) / np.sqrt(each.shape[1])})
    return table


def choose(table: list[dict], recall: float) -> dict | None:
    """The cheapest entry whose lower bound reaches `recall` (ties: the smaller shortlist, the
    smaller global shortlist, then fewer lists), or None."""
    ok = [t for t in table if t["lower"] >= recall - 1e-12]
    if not ok:
        return None
    return min(ok, key=lambda t: (t["cost"], t["shortlist"],
                                  t.get("shortlist_global") or t["shortlist"],
                                  t["nprobe_global"] or 0, t["nprobe"] or 0))


def calibrate(shard, recall: float) -> dict:
    """meta.json's "calibration" of an opened shard whose folder holds calibration.npz."""
    data = np.load(shard.path / "calibration.npz")
    queries, exact = data["queries"], data["exact"]
    best = choose(measure(shard, queries, exact), recall)
    exhaustive = best is None
    if best is None:  # nothing measured reaches it: every image shortlisted, every list probed
        full = [None if p[0] is None else p[-1] for p in
                (_probes(shard.crops, shard.meta["factory_crops"]),
                 _probes(shard.glob, shard.meta["factory_global"]))]
        best = {"shortlist": shard.n, "shortlist_global": None, "nprobe": full[0],
                "nprobe_global": full[1],
                "cost": cost(shard, shard.n, full[0], full[1]), "recall": 1.0, "lower": 1.0}
    return {"asked": float(recall), "k": K, "queries": int(len(queries)),
            "shortlist": int(best["shortlist"]),
            "shortlist_global": (None if best.get("shortlist_global") is None
                                 else int(best["shortlist_global"])),
            "nprobe": best["nprobe"],
            "nprobe_global": best["nprobe_global"], "recall": round(float(best["recall"]), 4),
            "recall_lower": round(float(best["lower"]), 4), "exhaustive": bool(exhaustive),
            "cost_bytes": int(best["cost"])}


def recalibrate(path, recall: float) -> dict | None:
    """Calibrate a finished index again for another recall (its calibration.npz kept), writing
    meta.json; None (said on stderr) for an index built before calibration."""
    import sys

    shard = open_index(path)
    if not (shard.path / "calibration.npz").is_file():
        print(f"index {path}: built before calibration (no calibration.npz); build it again "
              f"in a new folder to calibrate it", file=sys.stderr)
        return None
    meta = _read_json(shard.path / "meta.json")
    meta["calibration"] = calibrate(shard, recall)
    _write_json(shard.path / "meta.json", meta)
    return meta["calibration"]
