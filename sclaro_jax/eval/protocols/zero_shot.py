"""Zero-shot retrieval of actions, objects and relations (docs/design.md, section 3).

Every class string of the dataset folder's vocabulary file (`actions.txt`, `objects.txt`,
`relations.txt`) is encoded by that level's text encoder, no template; queries are ranked by
cosine similarity. Action: each test image's global embedding vs all actions. Object: each
object crop (object pair) vs all object names. Relation: each relation's focused-region image
(relation pair) vs all relation triplets. Top-1/5/10 accuracy (percentages), strict (the
query's own label) and, for objects and relations, lenient (a hit when any top-k label is one
of the labels of the query's image, as the reference counts); overall and per source dataset
(appendix Table A2). Ties are ordered by lower class index (`metrics`'s rule).
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

from sclaro_jax.data import schema
from sclaro_jax.data.dataset import DatasetError, Vocab, open_dataset
from sclaro_jax.eval.protocols import metrics, registry
from sclaro_jax.eval.protocols.embedding import (DEFAULT_TEXT_LENGTH, SCORE_ELEMENTS,
                                                 ScenarioEvaluator, SplitEmbeddings, encode_texts)


def _label_indices(names: Iterable[str], vocab: Vocab, kind: str, root: str) -> np.ndarray:
    idx = np.asarray([vocab.index(kind, n) for n in names], np.int64)
    bad = np.flatnonzero(idx < 0)
    if bad.size:
        missing = sorted({list(names)[i] for i in bad[:5]})
        raise DatasetError(f"{os.path.join(root, schema.VOCAB_FILES[kind])}: labels of the "
                           f"split are not in the vocabulary, e.g. {missing}")
    return idx


def _chunked_hits(queries: np.ndarray, classes: np.ndarray, labels: np.ndarray | None,
                  allowed: Sequence | None, ks: Sequence[int]) -> dict[int, np.ndarray]:
    """Cosine scores queries @ classes.T in query chunks -> strict (labels) or lenient
    (allowed) top-k hits."""
    n = len(queries)
    rows = max(1, SCORE_ELEMENTS // max(1, len(classes)))
    out = {k: np.zeros(n, bool) for k in ks}
    for start in range(0, n, rows):
        s = queries[start:start + rows] @ classes.T
        if allowed is None:
            h = metrics.topk_hits(s, labels[start:start + rows], ks)
        else:
            h = metrics.lenient_topk_hits(s, allowed[start:start + rows], ks)
        for k in ks:
            out[k][start:start + rows] = h[k]
    return out


def _report(hits: dict[int, np.ndarray], groups: np.ndarray) -> dict:
    return {"all": metrics.summarise(hits), "by_source": metrics.summarise_by_group(hits, groups)}


def zero_shot(model, emb: SplitEmbeddings, vocab: Vocab, *, root: str = "",
              ks: Sequence[int] = metrics.DEFAULT_KS, text_batch_size: int = 256,
              text_length: int = DEFAULT_TEXT_LENGTH, progress: bool = False) -> dict:
    """Zero-shot retrieval of actions, objects and relations (this module's docstring). Returns
    {"action": {"classes", "strict"}, "object" / "relation": {"classes", "strict", "lenient"}},
    each form {"all": {"n", "top1", ...}, "by_source": {source: {...}}}."""
    ks = tuple(ks)
    out = {}
    acted = np.flatnonzero(emb.actions != "")  # images without an action have no class
    tasks = (("action", "global", "actions", emb.global_emb[acted], emb.actions[acted], acted),
             ("object", "object", "objects", emb.object_emb, emb.object_names, emb.object_image),
             ("relation", "relation", "relations", emb.relation_emb, emb.relation_texts,
              emb.relation_image))
    for task, level, kind, queries, names, image in tasks:
        class_names = getattr(vocab, kind)
        labels = _label_indices(names, vocab, kind, root)
        text = encode_texts(model, level, class_names, batch_size=text_batch_size,
                            text_length=text_length, progress=progress)
        groups = emb.sources[image] if len(image) else np.zeros(0, str)
        res = {"classes": len(class_names),
               "strict": _report(_chunked_hits(queries, text, labels, None, ks), groups)}
        if task != "action":  # one action per image: lenient == strict
            per_image: dict[int, set] = {}
            for i, y in zip(image.tolist(), labels.tolist()):
                per_image.setdefault(i, set()).add(y)
            allowed = [per_image[i] for i in image.tolist()]
            res["lenient"] = _report(_chunked_hits(queries, text, None, allowed, ks), groups)
        out[task] = res
    return out


@registry.register("zero_shot")
class ZeroShot(ScenarioEvaluator):
    """`zero_shot` on the evaluator's split; yields ("action" | "object" | "relation", ...)."""

    def evaluate(self, model, test: SplitEmbeddings) -> dict:
        ds = open_dataset(self.data_dir)
        return zero_shot(model, test, ds.vocab, root=ds.root, ks=self.ks, **self.text_kw)
