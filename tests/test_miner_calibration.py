"""The build-time calibration of a MINER ANN index's search settings (`sclaro_jax.miner.index`'s
`calibration`): on galleries it was not tuned on, held-out queries (never used to calibrate,
not in the bank) reach the recall asked against the exact MINER + CSLS order with the settings
the build chose; a higher recall never picks cheaper settings; flags override the stored ones;
an index built before calibration searches with the defaults and says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faiss")

from sclaro_jax.miner import index, stream  # noqa: E402
from sclaro_jax.miner.index import calibration, forms  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
N, R, DIM, BANK, HELD_OUT = 4000, 5, 32, 1000, 1000
# the large-gallery factory (IVF + fast-scan PQ), so that the lists probed matter
FACTORY = index.LARGE_FACTORY


def _norm(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _topics(folder: Path) -> dict:
    """bench/miner_gallery.py's topics gallery, small: 128 topics, queries on one crop."""
    import miner_gallery
    miner_gallery.make(str(folder), N, crops=R, dim=DIM, queries=HELD_OUT, bank=BANK,
                       topics=128, gamma=1.0, progress=False)
    load = {n: np.load(folder / f"{n}.npy") for n in ("global", "crops", "queries", "bank")}
    return dict(images=load["global"], crops=load["crops"], queries=load["queries"],
                bank=load["bank"])


def _scenes(folder: Path) -> dict:
    """bench/bench_miner_index.py's scenes gallery, small."""
    from bench_miner_index import generate_scenes
    d = generate_scenes(folder, N, R, DIM, HELD_OUT, BANK, noise=1.4)
    return {k: np.asarray(d[k]) for k in ("images", "crops", "queries", "bank")}


def _anisotropic(folder: Path) -> dict:
    """Another structure, ours alone: 23 clusters, each stretched along 3 of its own
    directions (x4) and thin elsewhere, of very unequal sizes (Zipf-like); each crop is its
    image's cluster centre moved along one of the cluster's directions plus its own noise, the
    global view the mean of its crops; queries and bank on one crop each (noise 0.5)."""
    rng = np.random.default_rng(7)
    k = 23
    centres = _norm(rng.standard_normal((k, DIM)))
    axes = _norm(rng.standard_normal((k, 3, DIM)))
    sizes = 1.0 / np.arange(1, k + 1)
    cluster = rng.choice(k, N, p=sizes / sizes.sum())
    along = rng.standard_normal((N, R, 3)) * 0.4
    c = (centres[cluster][:, None] + np.einsum("nrj,njd->nrd", along, axes[cluster])
         + 0.1 * rng.standard_normal((N, R, DIM)))
    crops = _norm(c)
    images = _norm(crops.mean(1) + 0.05 * rng.standard_normal((N, DIM)))
    picks = rng.choice(N, HELD_OUT + BANK, replace=False)
    planted = _norm(crops[picks, rng.integers(0, R, len(picks))]
                    + 0.5 * _norm(rng.standard_normal((len(picks), DIM))))
    return dict(images=images.astype(np.float16), crops=crops.astype(np.float16),
                queries=planted[:HELD_OUT], bank=planted[HELD_OUT:])


GALLERIES = {"topics": _topics, "scenes": _scenes, "anisotropic": _anisotropic}


@pytest.fixture(scope="module")
def galleries(tmp_path_factory):
    return {name: make(tmp_path_factory.mktemp(name)) for name, make in GALLERIES.items()}


@pytest.fixture(scope="module")
def built(galleries, tmp_path_factory):
    """(gallery, with crops, pool) -> its index at the default `--recall 0.95`, each built once
    for the module (the held-out test and `topics_index` share the topics max-pool build)."""
    made = {}

    def get(gallery: str, with_crops: bool, pool: str = "max"):
        key = (gallery, with_crops, pool)
        if key not in made:
            d = galleries[gallery]
            made[key] = index.build(
                index.Gallery.from_arrays(d["images"], d["crops"] if with_crops else None),
                d["bank"], tmp_path_factory.mktemp("_".join(map(str, key))) / "idx",
                factory=FACTORY, pool=pool, chunk=1500, progress=False)
        return made[key]
    return get


def _recall(res, ref) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in
                          zip(res.indices, ref.indices)]))


@pytest.mark.slow
@pytest.mark.parametrize("gallery", list(GALLERIES))
@pytest.mark.parametrize("mode", ["global", "max", "mean"])
def test_held_out_queries_reach_the_recall_asked_with_the_chosen_settings(galleries, built,
                                                                          gallery, mode):
    d = galleries[gallery]
    crops = None if mode == "global" else d["crops"]
    pool = "mean" if mode == "mean" else "max"
    path = built(gallery, crops is not None, pool)
    cal = json.loads((path / "meta.json").read_text())["calibration"]
    assert cal["asked"] == 0.95 and cal["recall_lower"] >= 0.95 and cal["queries"] == BANK
    exact = stream.search(d["queries"], d["images"], crops, bank=d["bank"], pool=pool, top=10)
    got = _recall(index.search(d["queries"], [path]), exact)
    print(f"{gallery} {mode}: held-out recall@10 {got:.3f} with {cal}")
    assert got >= 0.95, (gallery, mode, got, cal)


@pytest.fixture(scope="module")
def topics_index(built):
    """The topics gallery's max-pool index with crops (the tests below recalibrate it and
    build it again at the default recall, which leaves it as built)."""
    return built("topics", True)


def test_a_higher_recall_never_picks_cheaper_settings(galleries, topics_index):
    shard = index.open_index(topics_index)
    data = np.load(topics_index / "calibration.npz")
    table = calibration.measure(shard, data["queries"], data["exact"])
    asked = [0.5, 0.8, 0.9, 0.95, 0.97, 0.99, 0.999, 1.0]
    costs = [(calibration.choose(table, r) or {"cost": np.inf})["cost"] for r in asked]
    assert costs == sorted(costs)
    # through the build: a finished index built again with another recall is calibrated again
    # (against the build's own calibration at the default 0.95: one measurement of the grid
    # fewer than asking 0.8 as well)
    d = galleries["topics"]
    low = json.loads((topics_index / "meta.json").read_text())["calibration"]
    assert low["asked"] == 0.95
    high = index.recalibrate(topics_index, 0.99)
    assert high["asked"] == 0.99 and high["recall_lower"] >= 0.99
    assert high["cost_bytes"] >= low["cost_bytes"]
    index.build(index.Gallery.from_arrays(d["images"], d["crops"]), d["bank"], topics_index,
                factory=FACTORY, chunk=1500, progress=False)
    again = json.loads((topics_index / "meta.json").read_text())["calibration"]
    assert again["asked"] == 0.95 and again["recall_lower"] >= 0.95


def _grid_against_candidates(path: Path, tol: float) -> None:
    from sclaro_jax.miner.index import searching

    shards = index.open_shards([path])
    data = np.load(path / "calibration.npz")
    table = calibration.measure(shards[0], data["queries"], data["exact"])
    assert {t["shortlist_global"] for t in table} >= {None, 10, 1024}
    assert all(t["shortlist_global"] != t["shortlist"] for t in table)
    rng = np.random.default_rng(0)
    own = [t for t in table if t["shortlist_global"] is not None]
    picked = [own[i] for i in rng.choice(len(own), 8, replace=False)]
    picked += [t for t in table if t["shortlist_global"] is None][:2]
    exact = data["exact"]
    for t in picked:
        ids = searching.candidates(shards, data["queries"], t["shortlist"], t["nprobe"],
                                   t["nprobe_global"], t["shortlist_global"])
        held = [np.isin(e[e >= 0], c).mean() for e, c in zip(exact, ids)]
        assert np.mean(held) == pytest.approx(t["recall"], abs=tol), t
        sg = t["shortlist_global"] or t["shortlist"]
        assert (ids >= 0).sum(1).max() <= sg + t["shortlist"]
        assert t["cost"] == calibration.cost(shards[0], t["shortlist"], t["nprobe"],
                                             t["nprobe_global"], t["shortlist_global"])


def test_each_settings_recall_in_the_grid_is_what_its_candidates_hold(topics_index, tmp_path):
    """`calibration.measure`'s recall of a setting (the global index's own shortlist among
    them) against the candidates `searching.candidates` returns with that setting: the share of
    each calibration query's exact top 10 that they hold. Exact with float distances
    (IVF-Flat: a shorter list is a prefix of a longer one); with fast-scan PQ within 0.002,
    since its 4-bit distances tie and FAISS breaks the ties at the cut by k (0.0002 here)."""
    images, crops, bank = _small(5, n=1200)
    flat = index.build(index.Gallery.from_arrays(images, crops), bank, tmp_path / "ivf",
                       factory="IVF{nlist},Flat", progress=False)
    _grid_against_candidates(flat, 1e-9)
    _grid_against_candidates(topics_index, 0.002)
    # the global index's own shortlist: fewer view bytes than the same setting without it
    shard = index.open_index(topics_index)
    assert (calibration.cost(shard, 200, 4, 4) - calibration.cost(shard, 200, 4, 4, 10)
            == 190 * (1 + R) * DIM * 2)


def test_explicit_search_settings_override_the_stored_ones(galleries, topics_index, tmp_path,
                                                           capsys):
    shards = index.open_shards([topics_index])
    cal = shards[0].meta["calibration"]
    chosen, line = index.search_settings(shards)
    assert chosen == {k: cal[k] for k in ("shortlist", "shortlist_global", "nprobe",
                                          "nprobe_global")}
    assert line.startswith(f"calibrated at build time: recall@10 {cal['recall']:.3f}")
    # a shortlist given alone is both indexes' (the calibrated global one gives way)
    chosen, line = index.search_settings(shards, shortlist=7, nprobe=1)
    assert chosen == {"shortlist": 7, "shortlist_global": None, "nprobe": 1,
                      "nprobe_global": cal["nprobe_global"]}
    assert "shortlist 7 (given), nprobe 1 (given)" in line
    q = galleries["topics"]["queries"][:20]
    a = index.search(q, shards, shortlist=7, nprobe=1)
    b = index.search(q, shards, shortlist=7, nprobe=1, nprobe_global=cal["nprobe_global"])
    np.testing.assert_array_equal(a.indices, b.indices)
    np.save(tmp_path / "q.npy", q)
    assert index.main(["search", "--index", str(topics_index), "--queries",
                       str(tmp_path / "q.npy"), "--shortlist", "7", "--out",
                       str(tmp_path / "o"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "index search: calibrated at build time" in out and "shortlist 7 (given)" in out
    np.testing.assert_array_equal(np.load(tmp_path / "o" / "hits.npz")["indices"],
                                  index.search(q, shards, shortlist=7).indices)


def _small(seed=0, n=300):
    rng = np.random.default_rng(seed)
    images = _norm(rng.standard_normal((n, 16)))
    crops = _norm(images[:, None] + 0.6 * _norm(rng.standard_normal((n, 3, 16))))
    return images.astype(np.float16), crops.astype(np.float16), _norm(
        rng.standard_normal((120, 16)))


def test_an_index_built_before_calibration_searches_with_the_defaults(tmp_path, capsys):
    images, crops, bank = _small()
    path = index.build(index.Gallery.from_arrays(images, crops), bank, tmp_path / "idx",
                       factory="Flat", progress=False)
    meta = json.loads((path / "meta.json").read_text())
    del meta["calibration"], meta["calibration_hash"], meta["calibration_queries"]
    del meta["files"]["calibration.npz"]
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "calibration.npz").unlink()
    shards = index.open_shards([path])
    chosen, line = index.search_settings(shards)
    assert chosen == {"shortlist": index.DEFAULT_SHORTLIST, "shortlist_global": None,
                      "nprobe": index.DEFAULT_NPROBE,
                      "nprobe_global": index.DEFAULT_NPROBE_GLOBAL}
    assert line.startswith("uncalibrated index (built before calibration)")
    ref = stream.search(bank[:10], images, crops, bank=bank, top=10)
    np.testing.assert_array_equal(index.search(bank[:10], shards).indices, ref.indices)
    # the same build command again: the index is kept, and said to be uncalibrated
    capsys.readouterr()
    index.build(index.Gallery.from_arrays(images, crops), bank, path, factory="Flat",
                progress=False)
    assert "built before calibration" in capsys.readouterr().err
    assert "calibration" not in json.loads((path / "meta.json").read_text())


def test_when_no_setting_measured_reaches_the_recall_the_index_is_searched_exhaustively(
        tmp_path, monkeypatch):
    images, crops, bank = _small(1, n=1200)
    monkeypatch.setattr(calibration, "SHORTLISTS", (10,))
    path = index.build(index.Gallery.from_arrays(images, crops), bank, tmp_path / "idx",
                       factory=FACTORY, recall=1.0, progress=False)
    meta = json.loads((path / "meta.json").read_text())
    cal = meta["calibration"]
    assert cal["exhaustive"] and cal["shortlist"] == 1200
    # every list of each index
    assert "IVF" in meta["factory_crops"] and "IVF" in meta["factory_global"]
    assert cal["nprobe"] == int(meta["factory_crops"].split(",")[0][3:])
    assert cal["nprobe_global"] == int(meta["factory_global"].split(",")[0][3:])
    assert "exhaustive" in index.search_settings(index.open_shards([path]))[1]
    ref = stream.search(bank[:10], images, crops, bank=bank, top=10)
    np.testing.assert_array_equal(index.search(bank[:10], [path]).indices, ref.indices)


def test_shards_are_calibrated_each_and_searched_with_the_largest_setting(tmp_path):
    images, crops, bank = _small(2, n=1200)
    paths = [index.build(index.Gallery.from_arrays(images, crops), bank, tmp_path / f"s{i}",
                         factory="IVF{nlist},Flat", shard=(i, 2), progress=False)
             for i in range(2)]
    cals = [json.loads((p / "meta.json").read_text())["calibration"] for p in paths]
    chosen, line = index.search_settings(index.open_shards(paths))
    for k in ("shortlist", "nprobe", "nprobe_global"):
        assert chosen[k] == max(c[k] for c in cals)
    own = max(c["shortlist_global"] or c["shortlist"] for c in cals)
    assert chosen["shortlist_global"] == (None if own == chosen["shortlist"] else own)
    assert f"recall@10 {min(cals, key=lambda c: c['recall_lower'])['recall']:.3f}" in line


def test_calibration_queries_from_a_file_are_recorded_and_a_resumed_build_checks_them(
        tmp_path):
    images, crops, bank = _small(3)
    queries = _norm(np.random.default_rng(9).standard_normal((40, 16)))
    path = index.build(index.Gallery.from_arrays(images, crops), bank, tmp_path / "idx",
                       factory="Flat", calibration_queries=queries, progress=False)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["calibration_queries"] == {"count": 40, "source": "given"}
    assert meta["calibration"]["queries"] == 40
    np.testing.assert_array_equal(np.load(path / "calibration.npz")["queries"], queries)
    with pytest.raises(index.IndexMismatchError, match="built with calibration_hash"):
        index.build(index.Gallery.from_arrays(images, crops), bank, path, factory="Flat",
                    calibration_queries=queries[:20], progress=False)


def test_add_preassigned_fills_the_same_lists_as_add_core(tmp_path):
    """`forms.add_routed` (faiss.contrib.ivf_tools.add_preassigned) against add_core with the
    lists given: the same ids and codes in every list."""
    f = index.faiss()
    rng = np.random.default_rng(4)
    x, routes = _norm(rng.standard_normal((2000, 16))), _norm(rng.standard_normal((2000, 16)))
    a = f.index_factory(16, "IVF16,PQ4x4", f.METRIC_INNER_PRODUCT)
    forms.train_routed(a, x, routes)
    b = f.clone_index(a)
    forms.add_routed(a, x, routes)
    _, lists = b.quantizer.search(routes, 1)
    lists = np.ascontiguousarray(lists[:, 0], np.int64)
    b.add_core(len(x), f.swig_ptr(x), None, f.swig_ptr(lists))
    for j in range(a.nlist):
        size = a.invlists.list_size(j)
        assert size == b.invlists.list_size(j)
        for get, width in ((lambda il: il.get_ids(j), 8), (lambda il: il.get_codes(j), 1)):
            ra = f.rev_swig_ptr(get(a.invlists), size * (1 if width == 8 else a.code_size))
            rb = f.rev_swig_ptr(get(b.invlists), size * (1 if width == 8 else b.code_size))
            np.testing.assert_array_equal(np.asarray(ra), np.asarray(rb))
