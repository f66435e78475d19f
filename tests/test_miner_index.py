"""`sclaro_jax.miner.index`: the ANN index for MINER galleries against `stream.search` (the exact
streamed MINER + CSLS with the same query bank), its shards, its resume after a kill, its
refusals, its command and `eval.rocs --index`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("faiss")

from sclaro_jax.eval import rocs  # noqa: E402
from sclaro_jax.eval.retrieval import synthetic  # noqa: E402
from sclaro_jax.miner import index, stream  # noqa: E402
from sclaro_jax.miner.index import building, files as index_files  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
G, R, D = 2000, 3, 16


def _unit(rng, *shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    """A gallery with structure (images near 40 centres, crops near their image), queries
    planted near crops, and a separate query bank."""
    rng = np.random.default_rng(0)
    centres = _unit(rng, 40, D)
    images = _unit(rng, G, D) * 0.5 + centres[rng.integers(0, 40, G)]
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    crops = images[:, None] + 0.6 * _unit(rng, G, R, D)
    crops /= np.linalg.norm(crops, axis=-1, keepdims=True)
    gt = rng.integers(0, G, 60)
    queries = crops[gt, rng.integers(0, R, 60)] + 0.3 * _unit(rng, 60, D)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    bank = _unit(rng, 300, D)
    return dict(images=images.astype(np.float16), crops=crops.astype(np.float16),
                queries=queries.astype(np.float32), bank=bank, gt=gt)


@pytest.fixture(scope="module")
def flat(data, tmp_path_factory):
    """Flat indexes (exact inner products) with and without crops."""
    out = {}
    for name, crops in (("crops", data["crops"]), ("global", None)):
        path = tmp_path_factory.mktemp(f"flat_{name}")
        index.build(index.Gallery.from_arrays(data["images"], crops, encoder="enc-a",
                                              crop_rule="rule-a"),
                    data["bank"], path, factory="Flat", chunk=512, progress=False)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def exact(data):
    return {name: stream.search(data["queries"], data["images"], crops, bank=data["bank"],
                                top=10, k=10)
            for name, crops in (("crops", data["crops"]), ("global", None))}


def _same(res, ref):
    np.testing.assert_array_equal(res.indices, ref.indices)
    np.testing.assert_allclose(res.scores, ref.scores, atol=1e-5)
    np.testing.assert_allclose(res.r_q, ref.r_q, atol=1e-5)
    np.testing.assert_allclose(res.r_i, ref.r_i, atol=1e-5)


@pytest.mark.parametrize("name", ["crops", "global"])
def test_flat_index_with_the_whole_gallery_shortlisted_is_stream_search(data, flat, exact,
                                                                        name):
    res = index.search(data["queries"], [flat[name]], top=10, shortlist=G, batch=16)
    _same(res, exact[name])


def test_global_index_folds_r_i_into_an_inner_product(data, flat, exact):
    """The global index's own top-M (before any re-rank) is the order of 2 t.g - r_i: a flat
    index searched with [t, 1] returns exactly the top of 2 T G^T - r_i."""
    shard = index.open_index(flat["crops"])
    q = np.concatenate([data["queries"], np.ones((len(data["queries"]), 1), np.float32)], 1)
    _, ids = shard.glob.search(q, 5)
    direct = 2 * data["queries"] @ data["images"].astype(np.float32).T - exact["crops"].r_i
    np.testing.assert_array_equal(np.sort(ids, 1), np.sort(np.argsort(-direct, 1)[:, :5], 1))


@pytest.mark.parametrize("pool", ["max", "mean"])
def test_fused_crop_vectors_are_the_csls_order(data, flat, exact, pool, tmp_path):
    """max_r [t, 1].[(1 - alpha) g + alpha c_r, -r_i / 2] = S - r_i / 2 (max pooling; the mean
    crop for mean pooling), S computed here in numpy from the float16 embeddings."""
    n = G if pool == "max" else 300
    if pool == "max":
        shard, r_i = index.open_index(flat["crops"]), exact["crops"].r_i
    else:
        bank = data["bank"]
        shard = index.open_index(index.build(
            index.Gallery.from_arrays(data["images"][:n], data["crops"][:n]), bank,
            tmp_path / "mean", factory="Flat", pool="mean", progress=False))
        r_i = stream.search(bank[:1], data["images"][:n], data["crops"][:n], bank=bank,
                            pool="mean").r_i
    t = data["queries"]
    ip, ids = shard.crops.search(np.concatenate([t, np.ones((len(t), 1), np.float32)], 1),
                                 shard.crops.ntotal)
    per = R if pool == "max" else 1
    best = np.full((len(t), n), -np.inf, np.float32)
    np.maximum.at(best, (np.arange(len(t))[:, None], ids // per), ip)
    g = data["images"][:n].astype(np.float32)
    c = np.einsum("qd,grd->qgr", t, data["crops"][:n].astype(np.float32))
    s = 0.6 * t @ g.T + 0.4 * (c.max(-1) if pool == "max" else c.mean(-1))
    np.testing.assert_allclose(best, s - r_i / 2, atol=1e-5)


def test_a_short_shortlist_keeps_the_exact_top_on_structured_data(data, flat, exact):
    res = index.search(data["queries"], [flat["crops"]], top=10, shortlist=50, batch=16)
    ref = exact["crops"]
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(res.indices, ref.indices)])
    assert overlap >= 0.95
    # where the same image comes back its score is the exact one, up to r_q over the shortlist
    same = res.indices[:, 0] == ref.indices[:, 0]
    assert same.mean() >= 0.9


def test_four_shards_searched_together_are_the_one_index(data, exact, tmp_path):
    paths = []
    for i in range(4):
        paths.append(tmp_path / f"shard{i}")
        index.build(index.Gallery.from_arrays(data["images"], data["crops"]), data["bank"],
                    paths[-1], factory="Flat", chunk=256, shard=(i, 4), progress=False)
    metas = [json.loads((p / "meta.json").read_text()) for p in paths]
    assert [m["offset"] for m in metas] == [0, 500, 1000, 1500]
    res = index.search(data["queries"], paths[::-1], top=10, shortlist=G, batch=16)
    _same(res, exact["crops"])
    with pytest.raises(index.IndexFileError, match=r"shards \[0, 1, 3\] of 4"):
        index.open_shards([paths[0], paths[1], paths[3]])


def _views_vmflags(path: Path) -> list[list[str]]:
    """VmFlags of this process's mappings of `path` (from /proc/self/smaps)."""
    out, mine = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:
            mine = line.endswith(str(path))
        elif mine and line.startswith("VmFlags:"):
            out.append(line.split()[1:])
    return out


def test_views_beyond_the_page_cache_are_advised_random_and_read_ahead_per_batch(
        data, flat, exact, monkeypatch):
    """A views.npy of more than half the memory is mapped MADV_RANDOM (VmFlags "rr") and each
    batch's rows are asked for at once (posix_fadvise WILLNEED per run of rows); a smaller one
    is neither. The results are the same either way."""
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: (calls.append(a[1:]), real(*a))[1])
    views = flat["crops"] / "views.npy"
    for ram, advised in ((1 << 50, False), (0, True)):
        monkeypatch.setattr(index_files, "_ram_bytes", lambda: ram)
        shard = index.open_index(flat["crops"])
        assert [("rr" in f) for f in _views_vmflags(views)] == [advised]
        calls.clear()
        _same(index.search(data["queries"], [shard], top=10, shortlist=G, batch=16),
              exact["crops"])
        # every batch shortlists the whole gallery: one run of G rows from the data's start
        row = shard.views.strides[0]
        assert calls == ([(shard.views.offset, G * row, os.POSIX_FADV_WILLNEED)] * 4
                         if advised else [])
        del shard


KILL = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from sclaro_jax.miner import index
    from sclaro_jax.miner.index import building
    step, chunk = sys.argv[2], int(sys.argv[3])
    def kill(s, c):
        if (s, c) == (step, chunk):
            os.kill(os.getpid(), signal.SIGKILL)
    building._after_chunk = kill
    d = np.load(sys.argv[1])
    index.build(index.Gallery.from_arrays(d["images"], d["crops"]), d["bank"], sys.argv[4],
                factory=sys.argv[5], chunk=256, progress=False)
""")


def _killed_build(data, tmp_path, step: str, chunk: int, factory: str):
    """The folder of a build of `data` SIGKILLed in a subprocess once `step` recorded `chunk`."""
    arrays = tmp_path / "data.npz"
    np.savez(arrays, images=data["images"], crops=data["crops"], bank=data["bank"])
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                       os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", KILL, str(arrays), step, str(chunk),
                           str(killed), factory], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    return killed


def test_a_build_killed_midway_resumes_to_the_same_files(data, tmp_path):
    """SIGKILL after the 3rd chunk is added (the 8 chunks all stored, the index trained); the
    rerun adds chunks 3..7 and assembles: the same bytes as an uninterrupted build."""
    killed = _killed_build(data, tmp_path, "added", 2, "IVF{nlist},Flat")
    man = json.loads((killed / "manifest.json").read_text())
    assert man["stored"] == list(range(8)) and man["trained"] and man["added"] == [0, 1, 2]
    assert not man["complete"] and not (killed / "global.faiss").exists()
    with pytest.raises(index.IndexFileError,
                       match="not finished .8 of 8 chunks stored, 3 added.; run the same"):
        index.open_index(killed)
    done = {p.name: p.read_bytes() for p in (killed / "parts").glob("*-0000[0-2].faiss")}
    gallery = index.Gallery.from_arrays(data["images"], data["crops"])
    calls = []
    building._after_chunk = lambda s, c: calls.append((s, c))
    try:
        index.build(gallery, data["bank"], killed, factory="IVF{nlist},Flat", chunk=256,
                    progress=False)
    finally:
        building._after_chunk = None
    assert calls == [("added", c) for c in range(3, 8)]  # nothing done before is redone
    whole = index.build(gallery, data["bank"], tmp_path / "whole", factory="IVF{nlist},Flat",
                        chunk=256, progress=False)
    for name in ("views.npy", "r_i.npy", "global.faiss", "crops.faiss", "meta.json"):
        assert (killed / name).read_bytes() == (whole / name).read_bytes(), name
    assert done and not (killed / "parts").exists()
    q = data["queries"]
    a = index.search(q, [killed], shortlist=200, nprobe=4)
    b = index.search(q, [whole], shortlist=200, nprobe=4)
    np.testing.assert_array_equal(a.indices, b.indices)


def test_the_global_index_takes_a_shortlist_of_its_own(data, flat, exact):
    """`shortlist_global`: the global index's candidates apart from the crop index's. Either
    index holding the whole gallery (flat) keeps the search exact, whatever the other's; a
    short global list with a short crop list gives exactly their union's candidates."""
    from sclaro_jax.miner.index import searching
    from sclaro_jax.miner.index.vectors import query_vectors
    shards = index.open_shards([flat["crops"]])
    _same(index.search(data["queries"], shards, shortlist=5, shortlist_global=G), exact["crops"])
    _same(index.search(data["queries"], shards, shortlist=G, shortlist_global=3), exact["crops"])
    q = data["queries"][:8]
    ids = searching.candidates(shards, q, 5, 1, 1, shortlist_global=3)
    sh = shards[0]
    glob = sh.glob.search(query_vectors(q, sh.glob.d), 3)[1]
    vecs = sh.crops.search(query_vectors(q, sh.crops.d), 5 * R)[1] // R
    for row, g, v in zip(ids, glob, vecs):
        crops = list(dict.fromkeys(v))[:5]  # the first five distinct images
        assert sorted(row[row >= 0]) == sorted(set(g) | set(crops))
        assert (row[len(set(g) | set(crops)):] == -1).all()


def test_ivf_visiting_every_list_is_exact(data, exact, tmp_path):
    path = index.build(index.Gallery.from_arrays(data["images"], data["crops"]), data["bank"],
                       tmp_path / "ivf", factory="IVF{nlist},Flat", chunk=1024, progress=False)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["factory_global"] == "IVF32,Flat" and meta["factory_crops"] == "IVF64,Flat"
    _same(index.search(data["queries"], [path], shortlist=G, nprobe=64), exact["crops"])
    # the fused crop index alone, probed whole, holds every image: still exact
    _same(index.search(data["queries"], [path], shortlist=G, nprobe=64, nprobe_global=1),
          exact["crops"])
    few = index.search(data["queries"], [path], shortlist=G, nprobe=1, nprobe_global=1)
    assert (few.indices != exact["crops"].indices).any()  # one list of 32 / 64 misses some
    # each fused crop vector sits in the list of its CROP's nearest centre, not its own
    crops = index.open_index(path).crops
    f = index.faiss()
    lists = np.full(G * R, -1)
    for j in range(crops.nlist):
        ids = f.rev_swig_ptr(crops.invlists.get_ids(j), crops.invlists.list_size(j))
        lists[np.asarray(ids)] = j
    views = np.concatenate([data["images"][:, None], data["crops"]], axis=1)
    _, want = crops.quantizer.search(index.route_vectors(views, 17, "max"), 1)
    np.testing.assert_array_equal(lists, want[:, 0])
    r_i = np.load(path / "r_i.npy")
    _, own = crops.quantizer.search(index.crop_vectors(views, r_i, 17, 0.4, "max"), 1)
    assert (own[:, 0] != lists).mean() > 0.05


def test_faiss_answers_blocks_of_queries_and_the_results_do_not_depend_on_the_block(
        data, tmp_path, monkeypatch):
    """`search` asks FAISS for the candidates of a block of re-rank batches at once
    (`searching.faiss_block`): 60 queries in batches of 16, FAISS blocks of 2 batches (2 calls),
    of one batch (4 calls, as before blocks) and of all of them (1 call) give the same
    results, with few lists probed (approximate candidates) and with crops."""
    from sclaro_jax.miner.index import searching
    path = index.build(index.Gallery.from_arrays(data["images"], data["crops"]), data["bank"],
                       tmp_path / "ivf", factory="IVF{nlist},Flat", chunk=1024, progress=False)
    shards = index.open_shards([path])
    calls = []
    real = searching.candidates

    def counted(shards, t, *args):
        calls.append(len(t))
        return real(shards, t, *args)
    monkeypatch.setattr(searching, "candidates", counted)
    width = 20 * (1 + R)  # shortlist 20: the global index's 20 and the crop index's 20 x 3
    results = {}
    for ids_per_call, want in ((width * 32, [32, 28]), (1, [16, 16, 16, 12]),
                               (1 << 30, [60])):
        monkeypatch.setattr(searching, "FAISS_BLOCK_IDS", ids_per_call)
        calls.clear()
        results[ids_per_call] = index.search(data["queries"], shards, shortlist=20, nprobe=2,
                                             nprobe_global=2, batch=16)
        assert calls == want, (ids_per_call, calls)
    first, *others = results.values()
    for res in others:
        _same(res, first)
    one = index.search(data["queries"][:16], shards, shortlist=20, nprobe=2, nprobe_global=2)
    np.testing.assert_array_equal(one.indices, first.indices[:16])


def test_the_cpu_fused_score_converts_every_half_exactly_and_equals_fuse(data):
    """`_cpu_fuse`: each of the 65,536 float16 values converts to numpy's float32 of it (NaNs
    stay NaN); `fused_rows` reads rows of float16 views in place and gives `kernels.fuse`'s
    fused score (jnp, float32, HIGHEST) for global-only, max and mean pooling to float32
    rounding, leaving the entries of rows -1 untouched; other inputs are refused."""
    from numba import njit

    from sclaro_jax.miner import _cpu_fuse
    from sclaro_jax.miner.kernels import fuse

    @njit
    def convert(bits):
        out = np.empty(bits.shape[0], np.float32)
        for i in range(bits.shape[0]):
            out[i] = _cpu_fuse._half(bits[i])
        return out
    bits = np.arange(1 << 16, dtype=np.uint16)
    got, want = convert(bits), bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan]).all() and nan.sum() == 2046

    views = np.concatenate([data["images"][:, None], data["crops"]], axis=1)  # [G, 1 + R, D]
    t = data["queries"][:7]
    rows = np.random.default_rng(5).integers(-1, G, (7, 30))
    for v, pool in ((views[:, :1], "max"), (views, "max"), (views, "mean")):
        out = np.full(rows.shape, 123.0, np.float32)
        _cpu_fuse.fused_rows(v, t, rows, 0.4, pool, out)
        for b in range(len(t)):
            ok = rows[b] >= 0
            crops = v[rows[b][ok], 1:] if v.shape[1] > 1 else None
            ref = np.asarray(fuse(t[b:b + 1], v[rows[b][ok], 0], crops, 0.4, pool,
                                  precision=jax.lax.Precision.HIGHEST))[0]
            np.testing.assert_allclose(out[b][ok], ref, rtol=0, atol=2e-6)
            assert (out[b][~ok] == 123.0).all()
    with pytest.raises(ValueError, match="float16"):
        _cpu_fuse.fused_rows(views.astype(np.float32), t, rows, 0.4, "max", out)
    with pytest.raises(ValueError, match="pool"):
        _cpu_fuse.fused_rows(views, t, rows, 0.4, "sum", out)


def test_first_distinct_keeps_each_rows_first_images_in_order():
    """`_cpu_fuse.first_distinct` against numpy's unique per row (the form it replaced): rows
    with repeats, -1 entries, fewer distinct ids than asked, ids up to 10^12."""
    from sclaro_jax.miner._cpu_fuse import first_distinct
    rng = np.random.default_rng(3)
    for n, width, m in ((50, 100, 20), (10**12, 500, 100), (5, 40, 40), (3, 7, 10)):
        ids = rng.integers(-1, n, (33, width))
        want = np.full((len(ids), m), -1, np.int64)
        for row, found in zip(want, ids):
            found = found[found >= 0]
            _, first = np.unique(found, return_index=True)
            keep = found[np.sort(first)][:m]
            row[:len(keep)] = keep
        np.testing.assert_array_equal(first_distinct(ids, m), want)
    assert first_distinct(np.array([[4, 4, -1, 2, 4, 7]]), 5).tolist() == [[4, 2, 7, -1, -1]]


def test_first_hits_gives_each_wanted_images_distinct_rank_and_first_position():
    """`_cpu_fuse.first_hits` (the calibration's crop ranks) against the numpy form it replaced
    (np.unique per row): wanted ids present once, several times, absent, and -1 (which the
    calibration masks: here only its own `big` is checked for an id the row lacks)."""
    from sclaro_jax.miner._cpu_fuse import first_hits
    big = np.iinfo(np.int32).max
    rng = np.random.default_rng(5)
    for n, width, k in ((40, 120, 10), (10**12, 300, 10), (6, 30, 4)):
        ids = rng.integers(-1, n, (25, width))
        want = np.where(rng.random((25, k)) < 0.8, ids[:, rng.integers(0, width, k)],
                        rng.integers(0, n, (25, k)) + n)  # some absent (ids >= n)
        want[want < 0] = n + 1
        rank, pos = np.full(want.shape, big), np.full(want.shape, big)
        for q, (row, w) in enumerate(zip(ids, want)):
            first = np.zeros(len(row), bool)
            valid = np.nonzero(row >= 0)[0]
            _, at = np.unique(row[valid], return_index=True)
            first[valid[at]] = True
            distinct = np.cumsum(first) - 1
            hit = row[:, None] == w[None, :]
            p = hit.argmax(0)
            pos[q] = np.where(hit.any(0), p, big)
            rank[q] = np.where(hit.any(0), distinct[p], big)
        got = first_hits(ids, want, big)
        np.testing.assert_array_equal(got[0], rank)
        np.testing.assert_array_equal(got[1], pos)
        assert (rank < big).any() and (rank == big).any()
    assert [a.tolist() for a in first_hits(np.array([[4, 4, -1, 2, 4, 7]]),
                                           np.array([[7, 4, 9]]), big)] == [[[2, 0, big]],
                                                                          [[5, 0, big]]]


@pytest.mark.parametrize("pool", ["max", "mean"])
def test_the_cpu_rerank_gives_the_jax_reranks_results(data, tmp_path, monkeypatch, pool):
    """`search` on a CPU backend scores with `_cpu_fuse` (views read in place); with it off,
    the gather and `_fused` in jax (both ranked by `_rank`): the same indices, scores and r_q
    (to float32 rounding), with crops and without, over two shards, with a short shortlist
    (candidates differ per query) and with every image shortlisted."""
    from sclaro_jax.miner.index import searching
    paths = {}
    for name, crops in (("crops", data["crops"]), ("global", None)):
        paths[name] = [index.build(index.Gallery.from_arrays(data["images"], crops),
                                   data["bank"], tmp_path / f"{name}{i}", factory="Flat",
                                   pool=pool, shard=(i, 2), progress=False) for i in range(2)]
    for name, shards in paths.items():
        for shortlist in (15, G):
            got = {}
            for cpu in (True, False):
                monkeypatch.setattr(searching, "CPU_RERANK", cpu)
                got[cpu] = index.search(data["queries"], shards, top=10, shortlist=shortlist,
                                        batch=16)
            np.testing.assert_array_equal(got[True].indices, got[False].indices)
            np.testing.assert_allclose(got[True].scores, got[False].scores, atol=2e-6)
            np.testing.assert_allclose(got[True].r_q, got[False].r_q, atol=2e-6)


def test_another_encoder_crop_rule_or_dim_is_refused_naming_both(data, flat, tmp_path):
    path = flat["crops"]
    for field, theirs, ours in (("encoder", "enc-a", "enc-b"), ("crop_rule", "rule-a", "rule-b"),
                                ("dim", D, 32)):
        with pytest.raises(index.IndexMismatchError,
                           match=f"built with {field} {theirs!r}, not {ours!r}"):
            index.open_shards([path], expect={field: ours})
    with pytest.raises(index.IndexMismatchError, match="built with dim 16, not 8"):
        index.search(np.zeros((2, 8), np.float32), [path])
    # a resumed build with other settings
    with pytest.raises(index.IndexMismatchError, match="built with alpha 0.4, not 0.5"):
        index.build(index.Gallery.from_arrays(data["images"], data["crops"], encoder="enc-a",
                                              crop_rule="rule-a"),
                    data["bank"], path, factory="Flat", chunk=512, alpha=0.5, progress=False)


@pytest.mark.parametrize("name, value", [
    ("top", 0), ("shortlist", -5), ("shortlist_global", 0), ("nprobe", 0),
    ("nprobe_global", 2**31), ("batch", 0), ("top", 2.5), ("nprobe", True)])
def test_search_arguments_outside_their_range_are_value_errors_naming_them(data, flat, name,
                                                                           value):
    """The Python API holds the command's ranges (`index.settings.RANGES`)."""
    with pytest.raises(ValueError, match=f"^{name} must be a whole number from 1 to "
                                         f"2147483647, not {value!r}$"):
        index.search(data["queries"], [flat["crops"]], **{name: value})


@pytest.mark.parametrize("name, value, words", [
    ("alpha", float("nan"), "a number from 0 to 1"), ("alpha", 1.5, "a number from 0 to 1"),
    ("k", 0, "a whole number from 1"), ("chunk", -5, "a whole number from 1"),
    ("pool", "min", "'max' or 'mean'"), ("factory", "Bogus", "FAISS cannot make 'Bogus'")])
def test_build_arguments_outside_their_range_are_refused_before_any_write(data, name, value,
                                                                          words, tmp_path):
    gallery = index.Gallery.from_arrays(data["images"][:64], data["crops"][:64])
    with pytest.raises(ValueError, match=re.escape(words)) as refused:
        index.build(gallery, data["bank"], tmp_path / "idx", progress=False, **{name: value})
    assert name in str(refused.value) and not (tmp_path / "idx").exists()


def test_a_build_refused_while_training_reruns_with_another_factory(data, tmp_path):
    """Too few vectors for PQ's 256 centres: one ValueError naming the factory; the stored
    chunks are kept and a rerun with another factory (not yet trained) reuses them."""
    gallery = index.Gallery.from_arrays(data["images"][:64], data["crops"][:64])
    with pytest.raises(ValueError, match=r"factory 'IVF\{nlist\},PQ3': FAISS cannot train "
                                         r"'IVF1,PQ3' on 64 global vectors \(.*at least as"):
        index.build(gallery, data["bank"], tmp_path / "idx", factory="IVF{nlist},PQ3", chunk=16,
                    progress=False)
    calls = []
    building._after_chunk = lambda s, c: calls.append((s, c))
    try:
        index.build(gallery, data["bank"], tmp_path / "idx", factory="Flat", chunk=16,
                    progress=False)
    finally:
        building._after_chunk = None
    assert calls == [("added", c) for c in range(4)]  # the 4 stored chunks are reused
    whole = index.build(gallery, data["bank"], tmp_path / "whole", factory="Flat", chunk=16,
                        progress=False)
    for name in ("views.npy", "r_i.npy", "global.faiss", "crops.faiss", "meta.json"):
        assert (tmp_path / "idx" / name).read_bytes() == (whole / name).read_bytes(), name


def _one_error_line(capsys, code):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_missing_or_truncated_index_files_are_one_error_line(data, flat, tmp_path, capsys):
    broken = tmp_path / "broken"
    import shutil
    shutil.copytree(flat["crops"], broken)
    q = tmp_path / "q.npy"
    np.save(q, data["queries"])
    argv = ["search", "--index", str(broken), "--queries", str(q), "--out", str(tmp_path / "o"),
            "--no-progress"]
    with open(broken / "crops.faiss", "r+b") as f:
        f.truncate(100)
    line = _one_error_line(capsys, index.main(argv))
    assert str(broken / "crops.faiss") in line and "truncated" in line
    (broken / "crops.faiss").unlink()
    line = _one_error_line(capsys, index.main(argv))
    assert f"{broken / 'crops.faiss'}: missing" in line
    (broken / "meta.json").unlink()
    line = _one_error_line(capsys, index.main(argv))
    assert f"{broken / 'meta.json'}: missing" in line
    line = _one_error_line(capsys, index.main(["search", "--index", str(tmp_path / "nope"),
                                               "--queries", str(q), "--out", str(tmp_path)]))
    assert str(tmp_path / "nope" / "meta.json") in line


def test_command_builds_from_npy_and_searches_like_the_library(data, flat, tmp_path, capsys):
    files = {}
    for name in ("images", "crops", "bank", "queries", "gt"):
        files[name] = tmp_path / f"{name}.npy"
        np.save(files[name], data[name])
    out = tmp_path / "idx"
    code = index.main(["build", "--images", str(files["images"]), "--crops", str(files["crops"]),
                       "--bank", str(files["bank"]), "--encoder", "enc-a", "--crop-rule",
                       "rule-a", "--factory", "Flat", "--chunk", "700", "--out", str(out),
                       "--no-progress"])
    assert code == 0 and "2000 images x 4 views" in capsys.readouterr().out
    code = index.main(["search", "--index", str(out), "--queries", str(files["queries"]),
                       "--gt", str(files["gt"]), "--shortlist", "2000", "--out",
                       str(tmp_path / "hits"), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    hits = np.load(tmp_path / "hits" / "hits.npz")
    ref = index.search(data["queries"], [flat["crops"]], shortlist=G)
    np.testing.assert_array_equal(hits["indices"], ref.indices)
    ranks = index.gt_ranks(ref.indices, data["gt"])
    assert f"R@1 {100 * np.mean(ranks < 1):.2f}" in printed
    assert np.mean(ranks < 10) > 0.5  # the planted queries find their images
    code = index.main(["build", "--images", str(files["images"]), "--out", str(tmp_path / "x"),
                       "--no-progress"])
    assert "--images needs --bank" in _one_error_line(capsys, code)


def test_rocs_evaluates_through_an_index_built_from_its_cache(tmp_path, capsys):
    """Built from eval.rocs's cache with the split's own queries as the bank, a flat index
    gives the MINER row (transductive CSLS: r_i over those queries)."""
    json_path = synthetic.make_planted_split(tmp_path / "planted", num_images=56, seed=0)
    out, cache = tmp_path / "out", tmp_path / "cache"
    base = ["--model", "planted-colours", "--split", f"planted={json_path}", "--cache-dir",
            str(cache), "--no-progress"]
    assert rocs.main([*base, "--out", str(out)]) == 0
    idx = tmp_path / "idx"  # --cache: the cache folder of one split, or its key folder
    # --recall 1: calibrated on the bank's rows, here the split's own queries, every one exact
    assert index.main(["build", "--cache", str(cache), "--factory", "Flat", "--out", str(idx),
                       "--recall", "1", "--no-progress"]) == 0
    meta = json.loads((idx / "meta.json").read_text())
    assert meta["encoder"] == "planted-colours" and meta["n_crops"] == 5
    capsys.readouterr()
    assert rocs.main([*base, "--out", str(tmp_path / "out2"), "--index", str(idx)]) == 0
    res = json.loads((tmp_path / "out2" / "results.json").read_text())["results"]["planted"]
    assert "| MINER (index) |" in capsys.readouterr().out
    for key in ("R@1", "R@5", "R@10"):
        assert res["MINER (index)"][key] == res["MINER"][key]
    assert res["MINER (index)"]["R@1"] >= 80
    code = rocs.main([*base, "--out", str(tmp_path / "out3"), "--index", str(idx), "--alpha",
                      "0.5"])
    assert "built with alpha 0.4, not 0.5" in _one_error_line(capsys, code)
    code = rocs.main([*base, "--out", str(tmp_path / "out3"), "--index", str(idx),
                      "--crop-shape", "square"])
    line = _one_error_line(capsys, code)
    assert "the index was built with crop_rule" in line, line


@pytest.mark.slow
def test_a_fast_scan_build_killed_while_storing_resumes_to_the_same_files(data, tmp_path):
    """The large-gallery factory (fast-scan PQ, built as its plain 4-bit twin, made fast-scan at
    the end): SIGKILL after the 4th of 8 chunks is stored; the rerun stores 4..7, trains, adds
    every chunk, assembles: the same bytes."""
    killed = _killed_build(data, tmp_path, "stored", 3, index.LARGE_FACTORY)
    man = json.loads((killed / "manifest.json").read_text())
    assert man["stored"] == [0, 1, 2, 3] and not man["trained"]
    gallery = index.Gallery.from_arrays(data["images"], data["crops"])
    calls = []
    building._after_chunk = lambda s, c: calls.append((s, c))
    try:
        index.build(gallery, data["bank"], killed, factory=index.LARGE_FACTORY, chunk=256,
                    progress=False)
    finally:
        building._after_chunk = None
    assert calls == [("stored", c) for c in range(4, 8)] + [("added", c) for c in range(8)]
    whole = index.build(gallery, data["bank"], tmp_path / "whole", factory=index.LARGE_FACTORY,
                        chunk=256, progress=False)
    for name in ("views.npy", "r_i.npy", "global.faiss", "crops.faiss", "meta.json"):
        assert (killed / name).read_bytes() == (whole / name).read_bytes(), name


def test_the_default_factory_is_exact_for_small_indexes_and_fast_scan_pq_for_large():
    assert index.resolve_factory("auto", index.FLAT_BELOW - 1, 16) == ("Flat", 16)
    # 20,000 vectors of dim 768 + 1: 2^round(log2(sqrt(20000))) = 128 lists, ceil(769 / 2) = 385
    # sub-quantizers, padded to 770 dimensions
    assert index.resolve_factory("auto", index.FLAT_BELOW, 769) == ("IVF128,PQ385x4fs", 770)
