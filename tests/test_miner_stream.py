"""`sclaro_jax.miner.stream` / `.sharded` against a full-matrix float64 numpy reference.

The reference forms the whole [Q, G] fused matrix from the same float16-rounded gallery values,
takes the k-nearest means with np.partition and orders by a stable descending argsort (ties to
the lower gallery index). Scores, r_q and r_i must agree within 1e-5 and top indices / gt ranks
exactly, except where two reference scores are closer than 1e-6 (float32 rounding may then swap
them); such near-ties are skipped, counted, and required to be rare.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from sclaro_jax.miner import recall_from_ranks, stream

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = Path(__file__).resolve().parents[1]
TIE = 1e-6
TOL = 1e-5


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_data(seed: int = 0, q: int = 53, g: int = 1000, d: int = 24, r: int = 5, qb: int = 61):
    """Random unit queries (f32), gallery and crops (f16), a bank (f32) and ground truth."""
    rng = np.random.default_rng(seed)
    return dict(
        queries=_unit(rng.normal(size=(q, d))).astype(np.float32),
        gallery=_unit(rng.normal(size=(g, d))).astype(np.float16),
        crops=_unit(rng.normal(size=(g, r, d))).astype(np.float16),
        bank=_unit(rng.normal(size=(qb, d))).astype(np.float32),
        gt=rng.integers(0, g, size=q),
    )


def _topk_mean(x: np.ndarray, k: int, axis: int) -> np.ndarray:
    k = min(k, x.shape[axis])
    return -np.partition(-x, k - 1, axis=axis).take(range(k), axis=axis).mean(axis=axis)


def reference(queries, gallery, crops=None, *, alpha=0.4, pool="max", k=10, rescore="csls",
              bank=None, top=10, gt=None):
    """Full-matrix float64 MINER scores: (scores [Q, top], indices, r_q, r_i, full matrix, ranks)."""
    g = gallery.astype(np.float64)

    def fused(t):
        t = t.astype(np.float64)
        s = t @ g.T
        if crops is None:
            return s
        per = np.einsum("qd,grd->qgr", t, crops.astype(np.float64))
        pooled = per.max(-1) if pool == "max" else per.mean(-1)
        return (1 - alpha) * s + alpha * pooled

    s = fused(queries)
    r_q = r_i = None
    full = s
    if rescore == "csls":
        r_q = _topk_mean(s, k, axis=1)
        r_i = _topk_mean(s if bank is None else fused(bank), k, axis=0)
        full = 2 * s - r_q[:, None] - r_i[None, :]
    order = np.argsort(-full, axis=1, kind="stable")
    ranks = None
    if gt is not None:
        pos = np.empty_like(order)
        np.put_along_axis(pos, order, np.arange(order.shape[1])[None, :], axis=1)
        ranks = pos[np.arange(len(gt)), gt]
    top = min(top, g.shape[0])
    return (np.take_along_axis(full, order[:, :top], 1), order[:, :top], r_q, r_i, full, ranks)


def check(res, ref, gt=None) -> None:
    """Assert the streamed result equals the reference (with the near-tie guard)."""
    scores, order, r_q, r_i, full, ranks = ref
    np.testing.assert_allclose(res.scores, scores, atol=TOL, rtol=0)
    if r_q is not None:
        np.testing.assert_allclose(res.r_q, r_q, atol=TOL, rtol=0)
        np.testing.assert_allclose(res.r_i, r_i, atol=TOL, rtol=0)
    else:
        assert res.r_q is None and res.r_i is None
    # Near-ties: any two of the first top+1 reference scores closer than TIE.
    srt = -np.sort(-full, axis=1)[:, :order.shape[1] + 1]
    tied = (np.diff(srt, axis=1) > -TIE).any(axis=1)
    assert tied.mean() < 0.1, f"{tied.sum()} near-tied queries"
    np.testing.assert_array_equal(res.indices[~tied], order[~tied])
    if gt is not None:
        mine = full[np.arange(len(gt)), gt]
        near = (np.abs(full - mine[:, None]) < TIE).sum(axis=1) > 1
        assert near.mean() < 0.1
        np.testing.assert_array_equal(res.gt_rank[~near], ranks[~near])
        np.testing.assert_allclose(res.gt_score, mine, atol=TOL, rtol=0)


CASES = {
    # name: (use crops, pool, rescore, use bank, chunk)
    "global-csls-chunk97": (False, "max", "csls", False, 97),
    "crops-max-chunk128": (True, "max", "csls", False, 128),
    "crops-mean-chunk250": (True, "mean", "csls", False, 250),
    "crops-max-bank-chunk333": (True, "max", "csls", True, 333),
    "global-bank-chunk-over-G": (False, "max", "csls", True, 4096),
    "crops-plain-topk": (True, "max", "none", False, 301),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stream_matches_reference(name):
    use_crops, pool, rescore, use_bank, chunk = CASES[name]
    d = make_data(seed=len(name))
    crops = d["crops"] if use_crops else None
    bank = d["bank"] if use_bank else None
    res = stream.search(d["queries"], d["gallery"], crops, pool=pool, rescore=rescore, bank=bank,
                        chunk=chunk, gt=d["gt"], top=10)
    ref = reference(d["queries"], d["gallery"], crops, pool=pool, rescore=rescore, bank=bank,
                    gt=d["gt"])
    check(res, ref, d["gt"])
    # recall@k follows exactly from the ranks.
    assert recall_from_ranks(res.gt_rank, (1, 5, 10, 50)) == {
        k: 100.0 * np.mean(ref[5] < k) for k in (1, 5, 10, 50)}


def test_memmap_gallery_and_top_beyond_chunk(tmp_path):
    """An np.memmap gallery (read with file reads) gives the in-memory result; top > chunk."""
    d = make_data(seed=3, g=777)
    path = tmp_path / "gallery.f16"
    mm = np.memmap(path, dtype=np.float16, mode="w+", shape=d["gallery"].shape)
    mm[:] = d["gallery"]
    mm.flush()
    del mm
    mm = np.memmap(path, dtype=np.float16, mode="r", shape=d["gallery"].shape)
    res = stream.search(d["queries"], mm, None, chunk=40, top=64, gt=d["gt"])
    check(res, reference(d["queries"], d["gallery"], None, top=64, gt=d["gt"]), d["gt"])


def test_one_compile_for_all_chunks():
    """The chunk step compiles once per shape/configuration, not per chunk or per call."""
    d = make_data(seed=5, g=1234)
    kw = dict(chunk=100, alpha=0.31)
    before = (stream.step_cache_size(), stream.TRACE_COUNT["step"])
    stream.search(d["queries"], d["gallery"], d["crops"], bank=d["bank"], gt=d["gt"], **kw)
    after_first = (stream.step_cache_size(), stream.TRACE_COUNT["step"])
    assert after_first[0] - before[0] == 1 and after_first[1] - before[1] == 1
    other = make_data(seed=6, g=999)
    stream.search(other["queries"], other["gallery"], other["crops"], bank=other["bank"],
                  gt=other["gt"], **kw)  # 13 and 10 chunks, plus the ground-truth pre-pass
    assert (stream.step_cache_size(), stream.TRACE_COUNT["step"]) == after_first


SHARDED = r'''
import os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # the suite's flags too
                           + " --xla_force_host_platform_device_count=8")
import sys
sys.path.insert(0, "tests")
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
from test_miner_stream import make_data, reference, check
from sclaro_jax.miner import sharded

assert len(jax.devices()) == 8
mesh = sharded.gallery_mesh()
d = make_data(seed=11, g=1003)          # 8 devices x 3 chunks x 42 rows = 1008 rows, 5 padding
for crops, bank, pool in ((None, None, "max"), (d["crops"], d["bank"], "max"),
                          (d["crops"], None, "mean")):
    res = sharded.search(d["queries"], d["gallery"], crops, mesh=mesh, bank=bank, pool=pool,
                         chunk=42, gt=d["gt"])
    check(res, reference(d["queries"], d["gallery"], crops, bank=bank, pool=pool, gt=d["gt"]),
          d["gt"])
res = sharded.search(d["queries"], d["gallery"], None, mesh=mesh, rescore="none", chunk=42)
check(res, reference(d["queries"], d["gallery"], None, rescore="none"))
one = sharded.search(d["queries"], d["gallery"], d["crops"], mesh=sharded.gallery_mesh(
    jax.devices()[:1]), chunk=100, gt=d["gt"])
check(one, reference(d["queries"], d["gallery"], d["crops"], gt=d["gt"]), d["gt"])
print("OK")
'''


@pytest.mark.slow
def test_sharded_on_eight_host_devices():
    result = subprocess.run([sys.executable, "-c", SHARDED], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "OK" in result.stdout
