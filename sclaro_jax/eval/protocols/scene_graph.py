"""PredCls and SGCls: predicate classification with ScenarioCLIP's relation pair
(docs/design.md, section 3; appendix "PredCls", "SGCls").

- PredCls (`predcls`): predicate vocabulary P = predicates with >= `min_instances` (5) test
  relation instances; relations with another predicate are left out. For each relation, the
  relation image encoder embeds the union of the subject and object boxes (cropped from the
  image, Resize + CenterCrop: `SplitEmbeddings.union_emb`); the relation text encoder embeds
  "subject predicate object" for every predicate in P with the ground-truth names; predicates
  are ranked by cosine; mean Recall@1/5/10 over predicates (and the micro R@K), percentages.
- SGCls (`sgcls`): object vocabulary = the object names of the train split; each test object
  crop is classified (top-1) against their object-pair text embeddings; the predicted names
  replace the ground truth in the prompts; predicates ranked as in PredCls. mR@K counts a hit
  when the true predicate is in the top K (the appendix's wording); `graph_mR@K` additionally
  requires both objects to be classified correctly (the scene-graph convention of Xu et al.).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from sclaro_jax.data import schema
from sclaro_jax.eval.protocols import metrics, registry
from sclaro_jax.eval.protocols.embedding import (DEFAULT_TEXT_LENGTH, SCORE_ELEMENTS,
                                                 ScenarioEvaluator, SplitEmbeddings,
                                                 encode_texts, split_labels)


def predicate_ranks(model, union_emb: np.ndarray, subject_names: Sequence[str],
                    object_names: Sequence[str], true_predicates: np.ndarray,
                    predicates: Sequence[str], *, text_batch_size: int = 256,
                    text_length: int = DEFAULT_TEXT_LENGTH, block_texts: int = 16384,
                    progress: bool = False) -> np.ndarray:
    """int64 [R]: rank (0 = best, `metrics` tie rule) of each relation's true predicate (index
    into `predicates`) when the relation text encoder embeds "subject p object" for every p in
    `predicates` and they are scored by cosine against `union_emb`. Prompts are built once per
    distinct (subject, object) pair, encoded `block_texts` at a time."""
    r = len(union_emb)
    ranks = np.zeros(r, np.int64)
    if r == 0:
        return ranks
    pairs: dict[tuple[str, str], list[int]] = {}
    for i, (s, o) in enumerate(zip(subject_names, object_names)):
        pairs.setdefault((str(s), str(o)), []).append(i)
    items = list(pairs.items())
    per_block = max(1, block_texts // max(1, len(predicates)))
    blocks = range(0, len(items), per_block)
    for start in tqdm(blocks, desc="predicate prompts", unit="block", disable=not progress,
                      leave=False):
        block = items[start:start + per_block]
        prompts = [schema.triplet_text(s, p, o) for (s, o), _ in block for p in predicates]
        text = encode_texts(model, "relation", prompts, batch_size=text_batch_size,
                            text_length=text_length)
        text = text.reshape(len(block), len(predicates), -1)
        for j, (_, rows) in enumerate(block):
            rows = np.asarray(rows)
            scores = union_emb[rows] @ text[j].T
            ranks[rows] = metrics.true_class_rank(scores, true_predicates[rows])
    return ranks


def _predicate_vocab(emb: SplitEmbeddings, min_instances: int):
    predicates = metrics.frequent_classes(emb.relation_predicates, min_instances)
    keep, labels = metrics.restrict_to_classes(emb.relation_predicates, predicates)
    return [str(p) for p in predicates], keep, labels


def _recall_report(ranks: np.ndarray, labels: np.ndarray, ks, predicates, keep,
                   extra_hit: np.ndarray | None = None) -> dict:
    hits = {k: ranks < k for k in ks}
    out = {"predicates": len(predicates), "relations_total": int(len(keep)),
           **metrics.mean_recall_at_k(None, labels, ks, hits=hits)}
    if extra_hit is not None:
        graph = metrics.mean_recall_at_k(None, labels, ks,
                                         hits={k: h & extra_hit for k, h in hits.items()})
        out.update({f"graph_{k}": v for k, v in graph.items() if k.startswith(("mR@", "R@"))})
    return out


def predcls(model, emb: SplitEmbeddings, *, min_instances: int = 5,
            ks: Sequence[int] = metrics.DEFAULT_KS, text_batch_size: int = 256,
            text_length: int = DEFAULT_TEXT_LENGTH, progress: bool = False) -> dict:
    """PredCls (this module's docstring): {"predicates", "relations_total", "n" (relations kept),
    "classes", "mR@K", "R@K"}."""
    ks = tuple(ks)
    predicates, keep, labels = _predicate_vocab(emb, min_instances)
    ranks = predicate_ranks(model, emb.union_emb[keep], emb.relation_subject_names[keep],
                            emb.relation_object_names[keep], labels[keep], predicates,
                            text_batch_size=text_batch_size, text_length=text_length,
                            progress=progress)
    return {"min_instances": min_instances,
            **_recall_report(ranks, labels[keep], ks, predicates, keep)}


def sgcls(model, emb: SplitEmbeddings, object_vocab: Sequence[str], *, min_instances: int = 5,
          ks: Sequence[int] = metrics.DEFAULT_KS, text_batch_size: int = 256,
          text_length: int = DEFAULT_TEXT_LENGTH, progress: bool = False) -> dict:
    """SGCls (this module's docstring). `object_vocab`: the train split's object names (deduplicated
    and sorted here). Adds "object_top1" (object classification accuracy, %) and the
    `graph_mR@K` / `graph_R@K` variant to PredCls's keys."""
    ks = tuple(ks)
    vocab = sorted(set(str(v) for v in object_vocab))
    if not vocab:
        raise ValueError("SGCls: the object vocabulary (train split object names) is empty")
    text = encode_texts(model, "object", vocab, batch_size=text_batch_size,
                        text_length=text_length, progress=progress)
    pred = np.zeros(len(emb.object_emb), np.int64)
    rows = max(1, SCORE_ELEMENTS // len(vocab))
    for start in range(0, len(pred), rows):
        pred[start:start + rows] = metrics.topk_predictions(
            emb.object_emb[start:start + rows] @ text.T, 1)[:, 0]
    names = np.asarray(vocab, dtype=str)[pred] if len(pred) else np.zeros(0, str)
    correct = names == emb.object_names
    predicates, keep, labels = _predicate_vocab(emb, min_instances)
    subj, obj = emb.relation_subject[keep], emb.relation_object[keep]
    ranks = predicate_ranks(model, emb.union_emb[keep], names[subj], names[obj], labels[keep],
                            predicates, text_batch_size=text_batch_size,
                            text_length=text_length, progress=progress)
    return {"min_instances": min_instances, "object_classes": len(vocab),
            "object_top1": float(100.0 * correct.mean()) if len(correct) else None,
            **_recall_report(ranks, labels[keep], ks, predicates, keep,
                             extra_hit=correct[subj] & correct[obj])}


class _PredicateEvaluator(ScenarioEvaluator):
    """Option: `min_instances`, the test instances a predicate needs to be in P."""

    def __init__(self, *, min_instances: int = 5, **common):
        super().__init__(**common)
        self.min_instances = min_instances


@registry.register("predcls")
class PredCls(_PredicateEvaluator):
    """`predcls` on the evaluator's split."""

    def evaluate(self, model, test: SplitEmbeddings) -> dict:
        return predcls(model, test, min_instances=self.min_instances, ks=self.ks,
                       **self.text_kw)


@registry.register("sgcls")
class SGCls(_PredicateEvaluator):
    """`sgcls` on the evaluator's split, objects named from `train_split`'s object names."""

    def evaluate(self, model, test: SplitEmbeddings) -> dict:
        names = split_labels(self.data_dir, self.train_split)["objects"]
        return sgcls(model, test, names, min_instances=self.min_instances, ks=self.ks,
                     **self.text_kw)
