"""Linear probe on frozen ScenarioCLIP encoders (docs/design.md, section 3; appendix "linear
probing").

A Linear(D -> C) on the train split's embeddings, C = the classes present in the train split
for that task (action / object / relation); `epochs` 6, AdamW lr 2e-5 (betas 0.9/0.999, eps
1e-8) weight decay 5e-4 on weight and bias (torch's single parameter group), batch 128 shuffled
per epoch (the last, smaller batch averages over its own examples), mean cross-entropy; torch's
nn.Linear initialisation. Top-1/5/10 (percentages) on the test split; test labels absent from
the train split can never be predicted and count as misses (reported as `unseen_test`).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sclaro_jax.eval.protocols import metrics, registry
from sclaro_jax.eval.protocols.embedding import ScenarioEvaluator, SplitEmbeddings


def linear_probe(train_x: np.ndarray, train_y: Sequence, test_x: np.ndarray, test_y: Sequence,
                 *, epochs: int = 6, lr: float = 2e-5, weight_decay: float = 5e-4,
                 batch_size: int = 128, ks: Sequence[int] = metrics.DEFAULT_KS,
                 seed: int = 0) -> dict:
    """Train Linear(D -> C) on frozen features (this module's docstring) and report test top-k.

    `train_y` / `test_y` are labels of any sortable kind (class names); C = the sorted distinct
    train labels. Returns {"classes": C, "n_train", "unseen_test", "n", "top1", ...}.
    """
    train_x = np.asarray(train_x, np.float32)
    test_x = np.asarray(test_x, np.float32)
    train_y, test_y = np.asarray(train_y), np.asarray(test_y)
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise ValueError("features and labels differ in length")
    if len(train_x) == 0:
        raise ValueError("linear probe: the train split has no examples for this task")
    classes = np.unique(train_y)
    c, d = len(classes), train_x.shape[1]
    y_train = np.searchsorted(classes, train_y).astype(np.int32)
    seen, y_test = metrics.restrict_to_classes(test_y, classes)

    rng = np.random.default_rng(seed)
    bound = 1.0 / math.sqrt(d)  # torch nn.Linear: U(-1/sqrt(in), 1/sqrt(in)) for both
    params = {"w": jnp.asarray(rng.uniform(-bound, bound, (d, c)), jnp.float32),
              "b": jnp.asarray(rng.uniform(-bound, bound, (c,)), jnp.float32)}
    tx = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
    opt_state = tx.init(params)
    x_dev, y_dev = jnp.asarray(train_x), jnp.asarray(y_train)

    @jax.jit  # the features are arguments, not closed-over constants baked into the program
    def step(params, opt_state, x_all, y_all, idx, mask):
        def loss_fn(p):
            logits = x_all[idx] @ p["w"] + p["b"]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y_all[idx])
            return jnp.sum(ce * mask) / jnp.sum(mask)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    n = len(train_x)
    for _ in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            mask = np.zeros(batch_size, np.float32)
            mask[:len(idx)] = 1
            idx = np.concatenate([idx, np.zeros(batch_size - len(idx), idx.dtype)])
            params, opt_state, _ = step(params, opt_state, x_dev, y_dev, idx, mask)

    logits = test_x @ np.asarray(params["w"]) + np.asarray(params["b"])
    ks = tuple(ks)
    hits = {k: np.zeros(len(test_x), bool) for k in ks}
    if seen.any():
        h = metrics.topk_hits(logits[seen], y_test[seen], ks)
        for k in ks:
            hits[k][seen] = h[k]
    return {"classes": int(c), "n_train": int(n), "unseen_test": int((~seen).sum()),
            **metrics.summarise(hits)}


TASKS = ("action", "object", "relation")


def probe_tasks(train: SplitEmbeddings, test: SplitEmbeddings, *, features: str = "raw",
                tasks: Sequence[str] = TASKS, **kwargs) -> dict:
    """`linear_probe` for action (global), object and relation (focused region) embeddings
    (those of `tasks`). `features`: "raw" (the frozen encoder's head output) or "l2"
    (L2-normalised)."""
    if features not in ("raw", "l2"):
        raise ValueError(f"features {features!r} is not 'raw' or 'l2'")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"linear probe: unknown tasks {unknown}; known: {TASKS}")

    def x(e: SplitEmbeddings, level: str) -> np.ndarray:
        return e.raw(level) if features == "raw" else getattr(e, f"{level}_emb")

    out = {}
    for task, level, labels in (("action", "global", "actions"),
                                ("object", "object", "object_names"),
                                ("relation", "relation", "relation_texts")):
        if task not in tasks:
            continue
        xs, ys = [], []
        for e in (train, test):
            x_e, y_e = x(e, level), getattr(e, labels)
            if task == "action":  # images without an action have no class
                x_e, y_e = x_e[y_e != ""], y_e[y_e != ""]
            xs.append(x_e)
            ys.append(y_e)
        if task == "action" and not len(ys[0]):
            raise ValueError(f"linear probe: the {train.split} split has no action labels "
                             "(a dataset imported with --no-actions has none): probe the "
                             "objects and relations only (tasks=('object', 'relation'))")
        out[task] = linear_probe(xs[0], ys[0], xs[1], ys[1], **kwargs)
    return out


@registry.register("linear_probe")
class LinearProbe(ScenarioEvaluator):
    """`probe_tasks` trained on `train_split`, tested on the evaluator's split. Options:
    `epochs`, `lr`, `weight_decay`, `probe_batch_size`, `features` ("raw" / "l2"), `seed`,
    `tasks` (of action, object, relation; default all three)."""

    def __init__(self, *, epochs: int = 6, lr: float = 2e-5, weight_decay: float = 5e-4,
                 probe_batch_size: int = 128, features: str = "raw", seed: int = 0,
                 tasks: Sequence[str] = TASKS, **common):
        super().__init__(**common)
        self.features, self.tasks = features, tuple(tasks)
        self.probe = dict(epochs=epochs, lr=lr, weight_decay=weight_decay,
                          batch_size=probe_batch_size, seed=seed)

    def evaluate(self, model, test: SplitEmbeddings) -> dict:
        return probe_tasks(self.embed(model, self.train_split), test, features=self.features,
                           tasks=self.tasks, ks=self.ks, **self.probe)
