"""Classification / retrieval metrics for the ScenarioCLIP evaluators (numpy, vectorised).

Conventions used by every function here:

- `scores` is a float array [N, C]: one row per query, one column per class; higher is better.
- **Tie rule.** Classes are ranked by descending score, and classes with equal scores are
  ordered by ascending class index (a stable sort of ``-scores``). The rank of the true class
  of query i is therefore::

      rank_i = #{c : s_ic > s_iy} + #{c < y : s_ic == s_iy}          (0 = first)

  and query i is a top-k hit iff ``rank_i < k``. The top-k predictions of a row are the first k
  classes of that order, so strict and lenient top-k agree on which k labels were "predicted".
  NaN scores are not supported (ValueError).
- Accuracies and recalls are percentages in [0, 100]. `k` larger than the number of classes is
  allowed (every query is then a hit for the strict form).
- Labels are integer class indices in [0, C); anything else is a ValueError naming the query.

Rows are processed in chunks (`chunk` rows at a time) so that [N, C] temporaries stay small
for large vocabularies.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Mapping, Sequence

import numpy as np

DEFAULT_KS = (1, 5, 10)
_CHUNK = 2048


def _check_scores(scores) -> np.ndarray:
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise ValueError(f"scores must be [queries, classes], got shape {scores.shape}")
    if scores.dtype.kind not in "fiu":
        raise ValueError(f"scores must be numeric, got dtype {scores.dtype}")
    if scores.dtype.kind == "f" and np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    return scores


def _check_labels(labels, n: int, c: int, what: str = "labels") -> np.ndarray:
    labels = np.asarray(labels)
    if labels.shape != (n,):
        raise ValueError(f"{what} must have shape ({n},), got {labels.shape}")
    if n and labels.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integer class indices, got dtype {labels.dtype}")
    labels = labels.astype(np.int64)
    bad = np.flatnonzero((labels < 0) | (labels >= c))
    if bad.size:
        raise ValueError(f"{what}[{bad[0]}] = {labels[bad[0]]} is not a class index in [0, {c})")
    return labels


def _check_ks(ks: Iterable[int]) -> tuple[int, ...]:
    ks = tuple(int(k) for k in ks)
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must be positive integers, got {ks}")
    return ks


def true_class_rank(scores, labels, *, chunk: int = _CHUNK) -> np.ndarray:
    """int64 [N]: the 0-based rank of each query's true class under the tie rule above."""
    scores = _check_scores(scores)
    n, c = scores.shape
    labels = _check_labels(labels, n, c)
    ranks = np.empty(n, np.int64)
    cols = np.arange(c)
    for start in range(0, n, chunk):
        s = scores[start:start + chunk]
        y = labels[start:start + chunk]
        true = s[np.arange(len(y)), y][:, None]
        ranks[start:start + chunk] = ((s > true).sum(1)
                                      + ((s == true) & (cols[None, :] < y[:, None])).sum(1))
    return ranks


def topk_predictions(scores, k: int, *, chunk: int = _CHUNK) -> np.ndarray:
    """int64 [N, min(k, C)]: each row's k best classes, best first, ties by lower class index."""
    scores = _check_scores(scores)
    n, c = scores.shape
    k = min(int(k), c)
    out = np.empty((n, k), np.int64)
    for start in range(0, n, chunk):
        out[start:start + chunk] = np.argsort(-scores[start:start + chunk], axis=1,
                                              kind="stable")[:, :k]
    return out


def topk_hits(scores, labels, ks: Sequence[int] = DEFAULT_KS) -> dict[int, np.ndarray]:
    """Strict top-k: {k: bool [N]}, a hit when the true class ranks < k (tie rule above)."""
    ks = _check_ks(ks)
    ranks = true_class_rank(scores, labels)
    return {k: ranks < k for k in ks}


def lenient_topk_hits(scores, allowed: Sequence[Iterable[int]],
                      ks: Sequence[int] = DEFAULT_KS) -> dict[int, np.ndarray]:
    """Lenient top-k: {k: bool [N]}, a hit when any of the row's top-k predicted classes (tie
    rule above) is in `allowed[i]`, the set of labels that count for query i (the reference
    counts every label of the query's image). An empty allowed set is never a hit."""
    ks = _check_ks(ks)
    scores = _check_scores(scores)
    n, c = scores.shape
    if len(allowed) != n:
        raise ValueError(f"allowed has {len(allowed)} label sets for {n} queries")
    rows, cls = [], []
    for i, labels in enumerate(allowed):
        labels = np.unique(np.asarray(list(labels), np.int64))
        if labels.size and (labels.min() < 0 or labels.max() >= c):
            raise ValueError(f"allowed[{i}] has labels outside [0, {c}): {labels.tolist()}")
        rows.append(np.full(labels.size, i, np.int64))
        cls.append(labels)
    keys = (np.concatenate(rows) * c + np.concatenate(cls)) if n else np.zeros(0, np.int64)
    preds = topk_predictions(scores, max(ks))
    member = np.isin(np.arange(n)[:, None] * c + preds, keys)  # [N, min(kmax, C)]
    first = np.where(member.any(1), member.argmax(1), np.iinfo(np.int64).max)
    return {k: first < k for k in ks}


def summarise(hits: Mapping[int, np.ndarray]) -> dict:
    """{k: bool [N]} -> {"n": N, "top1": %, "top5": %, ...} (percentages; NaN-free: n=0 gives
    None for each accuracy)."""
    out: dict = {}
    n = None
    for k, h in sorted(hits.items()):
        h = np.asarray(h, bool)
        n = h.size if n is None else n
        if h.size != n:
            raise ValueError("hit arrays of different lengths")
        out[f"top{k}"] = float(100.0 * h.mean()) if n else None
    return {"n": int(n or 0), **out}


def summarise_by_group(hits: Mapping[int, np.ndarray], groups: Sequence[Hashable]) -> dict:
    """Per-group breakdown (e.g. by source dataset): {group: summarise(hits of that group)},
    groups in sorted order (as strings for JSON); every query belongs to exactly one group."""
    groups = np.asarray(groups)
    n = len(groups)
    for k, h in hits.items():
        if len(h) != n:
            raise ValueError(f"top{k} hits have {len(h)} entries for {n} group labels")
    out = {}
    for g in sorted(set(groups.tolist()), key=str):
        sel = groups == g
        out[str(g)] = summarise({k: np.asarray(h, bool)[sel] for k, h in hits.items()})
    return out


def per_class_recall(hits: np.ndarray, labels) -> dict[int, float]:
    """{class: recall %} for every class with at least one query (classes absent are absent)."""
    hits = np.asarray(hits, bool)
    labels = np.asarray(labels, np.int64)
    if hits.shape != labels.shape:
        raise ValueError(f"hits {hits.shape} and labels {labels.shape} differ in shape")
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    found = np.bincount(inverse, weights=hits.astype(np.float64), minlength=classes.size)
    return {int(c): float(100.0 * f / n) for c, f, n in zip(classes, found, counts)}


def mean_recall_at_k(scores, labels, ks: Sequence[int] = DEFAULT_KS, *,
                     hits: Mapping[int, np.ndarray] | None = None) -> dict:
    """Mean Recall@K over classes: for each class with >= 1 query, the fraction of its queries
    whose true class ranks < K (tie rule above), then the unweighted mean over those classes.
    Classes with no query are skipped (not counted as 0). Pass precomputed `hits` ({K: bool [N]},
    e.g. with an extra condition applied) to average those instead of the strict top-K hits.

    Returns {"n": queries, "classes": classes averaged, "mR@K": %, "R@K": % (micro recall)}.
    """
    ks = _check_ks(ks)
    labels = np.asarray(labels, np.int64)
    if hits is None:
        hits = topk_hits(scores, labels, ks)
    out: dict = {"n": int(labels.size), "classes": int(np.unique(labels).size)}
    for k in ks:
        rec = per_class_recall(hits[k], labels)
        out[f"mR@{k}"] = float(np.mean(list(rec.values()))) if rec else None
    for k in ks:
        out[f"R@{k}"] = float(100.0 * np.mean(hits[k])) if labels.size else None
    return out


def frequent_classes(labels, min_instances: int = 5) -> np.ndarray:
    """Sorted unique labels that occur at least `min_instances` times in `labels` (the PredCls
    predicate vocabulary: predicates with >= 5 test instances). Works for ints or strings."""
    if min_instances < 1:
        raise ValueError(f"min_instances must be >= 1, got {min_instances}")
    values, counts = np.unique(np.asarray(labels), return_counts=True)
    return values[counts >= min_instances]


def restrict_to_classes(labels, classes) -> tuple[np.ndarray, np.ndarray]:
    """(keep bool [N], new_labels int64 [N]): which queries have a label in `classes` and their
    index into `classes` (-1 where not kept). `classes` must hold unique values."""
    labels = np.asarray(labels)
    classes = np.asarray(classes)
    if np.unique(classes).size != classes.size:
        raise ValueError("classes must be unique")
    if classes.size == 0:
        return np.zeros(labels.shape, bool), np.full(labels.shape, -1, np.int64)
    order = np.argsort(classes, kind="stable")
    pos = np.clip(np.searchsorted(classes[order], labels), 0, classes.size - 1)
    keep = classes[order][pos] == labels
    return keep, np.where(keep, order[pos], -1).astype(np.int64)
