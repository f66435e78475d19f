"""sclaro_jax.eval.protocols.metrics against plain Python-loop implementations on hand-made
cases."""

import numpy as np
import pytest

from sclaro_jax.eval.protocols import metrics


# ----------------------------------------------------------------- plain reference versions

def plain_order(row):
    """Classes best first; equal scores by lower class index (the documented tie rule)."""
    return sorted(range(len(row)), key=lambda c: (-row[c], c))


def plain_topk(scores, labels, k):
    return [labels[i] in plain_order(list(scores[i]))[:k] for i in range(len(labels))]


def plain_lenient(scores, allowed, k):
    return [any(c in set(allowed[i]) for c in plain_order(list(scores[i]))[:k])
            for i in range(len(allowed))]


def plain_mean_recall(scores, labels, k):
    hits = plain_topk(scores, labels, k)
    per = {}
    for h, y in zip(hits, labels):
        per.setdefault(y, []).append(h)
    return 100.0 * sum(sum(v) / len(v) for v in per.values()) / len(per)


# ----------------------------------------------------------------- tests

def test_tie_rule_lower_index_wins():
    # all four classes tie: class 0 is first, class 3 last
    scores = np.zeros((4, 4), np.float32)
    labels = np.array([0, 1, 2, 3])
    np.testing.assert_array_equal(metrics.true_class_rank(scores, labels), [0, 1, 2, 3])
    hits = metrics.topk_hits(scores, labels, ks=(1, 2, 4))
    np.testing.assert_array_equal(hits[1], [True, False, False, False])
    np.testing.assert_array_equal(hits[2], [True, True, False, False])
    assert hits[4].all()
    # the true class ties with a lower-index class above it, and a higher-index class after it
    scores = np.array([[0.5, 0.9, 0.9, 0.9, 0.1]])
    assert metrics.true_class_rank(scores, [2])[0] == 1
    assert metrics.true_class_rank(scores, [1])[0] == 0
    assert metrics.true_class_rank(scores, [3])[0] == 2
    np.testing.assert_array_equal(metrics.topk_predictions(scores, 3), [[1, 2, 3]])


def test_topk_matches_plain_with_many_ties(rng):
    scores = rng.integers(0, 4, size=(200, 12)).astype(np.float32)  # heavy ties
    labels = rng.integers(0, 12, size=200)
    for k in (1, 5, 10, 20):
        got = metrics.topk_hits(scores, labels, ks=(k,))[k]
        np.testing.assert_array_equal(got, plain_topk(scores, labels, k))
    acc = metrics.summarise(metrics.topk_hits(scores, labels))
    assert acc["n"] == 200
    for k in (1, 5, 10):
        assert acc[f"top{k}"] == pytest.approx(100 * np.mean(plain_topk(scores, labels, k)))
    # chunking does not change anything
    np.testing.assert_array_equal(metrics.true_class_rank(scores, labels, chunk=7),
                                  metrics.true_class_rank(scores, labels))
    np.testing.assert_array_equal(metrics.topk_predictions(scores, 5, chunk=3),
                                  [plain_order(list(r))[:5] for r in scores])


def test_lenient_vs_strict():
    scores = np.array([[0.9, 0.8, 0.1],    # predicts 0; true 1; image also has 0
                       [0.1, 0.2, 0.9],    # predicts 2; true 2
                       [0.9, 0.1, 0.2]])   # predicts 0; true 1; image has {1, 2}
    labels = np.array([1, 2, 1])
    allowed = [{0, 1}, {2}, {1, 2}]
    strict = metrics.topk_hits(scores, labels, ks=(1, 2))
    lenient = metrics.lenient_topk_hits(scores, allowed, ks=(1, 2))
    np.testing.assert_array_equal(strict[1], [False, True, False])
    np.testing.assert_array_equal(lenient[1], [True, True, False])
    np.testing.assert_array_equal(strict[2], [True, True, False])
    np.testing.assert_array_equal(lenient[2], [True, True, True])
    # lenient with only the own label equals strict
    own = metrics.lenient_topk_hits(scores, [[y] for y in labels], ks=(1, 2))
    for k in (1, 2):
        np.testing.assert_array_equal(own[k], strict[k])
    # an empty allowed set never hits
    assert not metrics.lenient_topk_hits(scores[:1], [[]], ks=(3,))[3][0]


def test_lenient_matches_plain(rng):
    scores = rng.integers(0, 5, size=(150, 9)).astype(np.float64)
    allowed = [set(rng.choice(9, size=rng.integers(0, 4), replace=False).tolist())
               for _ in range(150)]
    got = metrics.lenient_topk_hits(scores, allowed, ks=(1, 3, 5, 12))
    for k in (1, 3, 5, 12):
        np.testing.assert_array_equal(got[k], plain_lenient(scores, allowed, k))


def test_per_source_breakdown():
    hits = {1: np.array([1, 0, 1, 1, 0], bool), 5: np.array([1, 1, 1, 1, 0], bool)}
    groups = ["coco", "vg", "coco", "kitti", "vg"]
    out = metrics.summarise_by_group(hits, groups)
    assert list(out) == ["coco", "kitti", "vg"]
    assert out["coco"] == {"n": 2, "top1": 100.0, "top5": 100.0}
    assert out["kitti"] == {"n": 1, "top1": 100.0, "top5": 100.0}
    assert out["vg"] == {"n": 2, "top1": 0.0, "top5": 50.0}
    # the plain per-group loop
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        assert out[g]["top1"] == pytest.approx(100 * sum(hits[1][i] for i in idx) / len(idx))
    assert metrics.summarise({1: np.zeros(0, bool)}) == {"n": 0, "top1": None}


def test_mean_recall_skips_absent_classes(rng):
    # 6 classes, class 2 and 5 have no query: they are skipped, not averaged in as 0
    scores = np.array([[0.9, 0.1, 0.0, 0.0, 0.0, 0.0],   # y=0 hit@1
                       [0.9, 0.1, 0.0, 0.0, 0.0, 0.0],   # y=1 rank 1
                       [0.0, 0.0, 0.0, 0.9, 0.0, 0.0],   # y=3 hit@1
                       [0.0, 0.0, 0.0, 0.0, 0.1, 0.9],   # y=4 rank 1
                       [0.0, 0.0, 0.0, 0.0, 0.9, 0.1]])  # y=4 hit@1
    labels = np.array([0, 1, 3, 4, 4])
    out = metrics.mean_recall_at_k(scores, labels, ks=(1, 2))
    assert out["classes"] == 4 and out["n"] == 5
    assert out["mR@1"] == pytest.approx(100 * (1 + 0 + 1 + 0.5) / 4)
    assert out["mR@2"] == pytest.approx(100.0)
    assert out["R@1"] == pytest.approx(60.0)
    assert metrics.per_class_recall(metrics.topk_hits(scores, labels, (1,))[1], labels) == {
        0: 100.0, 1: 0.0, 3: 100.0, 4: 50.0}
    # random, against the plain loop
    scores = rng.integers(0, 3, size=(300, 20)).astype(np.float32)
    labels = rng.choice([0, 3, 4, 7, 19], size=300)
    got = metrics.mean_recall_at_k(scores, labels, ks=(1, 5, 10))
    for k in (1, 5, 10):
        assert got[f"mR@{k}"] == pytest.approx(plain_mean_recall(scores, labels, k))


def test_mean_recall_with_given_hits():
    labels = np.array([0, 0, 1])
    hits = {1: np.array([True, False, False])}
    out = metrics.mean_recall_at_k(None, labels, ks=(1,), hits=hits)
    assert out["mR@1"] == pytest.approx(25.0)


def test_min_instances_rule():
    preds = ["on"] * 5 + ["under"] * 4 + ["near"] * 7 + ["has"]
    assert metrics.frequent_classes(preds, 5).tolist() == ["near", "on"]
    assert metrics.frequent_classes(preds, 1).tolist() == ["has", "near", "on", "under"]
    assert metrics.frequent_classes(preds, 8).tolist() == []
    # plain: count with a dict
    counts = {}
    for p in preds:
        counts[p] = counts.get(p, 0) + 1
    for m in range(1, 9):
        assert metrics.frequent_classes(preds, m).tolist() == sorted(
            p for p, c in counts.items() if c >= m)
    keep, idx = metrics.restrict_to_classes(preds, ["on", "near"])
    assert keep.sum() == 12
    assert all((p in ("on", "near")) == k for p, k in zip(preds, keep))
    assert idx.tolist() == [0] * 5 + [-1] * 4 + [1] * 7 + [-1]
    keep, idx = metrics.restrict_to_classes(preds, [])
    assert not keep.any() and (idx == -1).all()


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"labels\[1\] = 3"):
        metrics.topk_hits(np.zeros((2, 3)), [0, 3])
    with pytest.raises(ValueError, match="NaN"):
        metrics.topk_hits(np.array([[np.nan, 1.0]]), [0])
    with pytest.raises(ValueError, match="allowed"):
        metrics.lenient_topk_hits(np.zeros((2, 3)), [[0]])
    with pytest.raises(ValueError, match="min_instances"):
        metrics.frequent_classes([1], 0)
