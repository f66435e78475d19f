"""ScenarioCLIP training core: parameter groups, optimiser, EMA teacher, losses, one jitted step.

Everything here is a pure function of pytrees, so the step jits once (static batch shapes from
`sclaro_jax.data.pipeline`) and the train state checkpoints as it is.

Recipe (DESIGN.md section 2): AdamW (lr 2e-5, betas 0.9/0.999, eps 1e-8, weight decay 0.2 on
matrices only: biases, norm parameters, embeddings' 1-D vectors and logit scales get none),
linear warm-up over the first 10% of steps from 1e-3 x lr, then cosine to 0, per step;
gradient clipping at global norm 1.0; the KD temperature is its own group at 0.1 x lr without
weight decay (the reference code left it out of every group, so it never moved). Frozen
parameters (tower embeddings, first 6 vision / 10 text blocks) get no update and no weight-grad
computation (`stop_gradient`). EMA teacher: decay 0.9995 after every step; for the first
`ema_warmup_steps` steps it copies the student.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from sclaro_jax import losses
from sclaro_jax.data.augment import normalize_jnp as normalize
from sclaro_jax.models.scenarioclip import is_frozen

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    total_steps: int
    lr: float = 2e-5
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.2
    warmup_fraction: float = 0.1
    warmup_init_factor: float = 1e-3
    grad_clip: float = 1.0
    kd_lr_factor: float = 0.1
    ema_decay: float = 0.9995
    ema_warmup_steps: int = 2000
    lambda_ca: float = 1.0
    lambda_kd: float = 1.0  # 0 gives ScenarioCLIP w/o KD
    kd_direction: str = "both"  # "both", "vision" (global->crops) or "text" (crops->global)
    duplicate_aware: bool = False  # same-label crops are not negatives of each other
    frozen_vision_layers: int = 6
    frozen_text_layers: int = 10
    freeze_pre_layernorm: bool = False

    def __post_init__(self):
        if self.kd_direction not in ("both", "vision", "text"):
            raise ValueError(f"kd_direction {self.kd_direction!r} is not both / vision / text")
        if self.total_steps < 1:
            raise ValueError("total_steps must be at least 1")


@struct.dataclass
class TrainState:
    step: jax.Array
    params: PyTree  # the student's nnx.Params as plain nested dicts of arrays (nnx.to_pure_dict)
    teacher: PyTree  # EMA of params (same structure)
    opt_state: PyTree


def _names(key_path) -> tuple:
    out = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
    return tuple(out)


def param_labels(params: PyTree, cfg: TrainConfig) -> PyTree:
    """Optimiser group of every parameter: frozen, kd, decay (matrices) or no_decay."""
    def label(key_path, value):
        path = _names(key_path)
        if is_frozen(path, vision_layers=cfg.frozen_vision_layers,
                     text_layers=cfg.frozen_text_layers,
                     freeze_pre_layernorm=cfg.freeze_pre_layernorm):
            return "frozen"
        if path[-1] == "kd_log_scale":
            return "kd"
        return "decay" if value.ndim >= 2 else "no_decay"
    return jax.tree_util.tree_map_with_path(label, params)


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    warmup = max(1, int(cfg.warmup_fraction * cfg.total_steps))
    return optax.warmup_cosine_decay_schedule(
        init_value=cfg.warmup_init_factor * cfg.lr, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1), end_value=0.0)


def make_optimizer(cfg: TrainConfig, labels: PyTree) -> optax.GradientTransformation:
    """AdamW groups over the trainable parameters; `labels` holds decay / no_decay / kd."""
    lr = learning_rate(cfg)

    def kd_lr(step):
        return cfg.kd_lr_factor * lr(step)

    adam = functools.partial(optax.adam, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.multi_transform({
            "decay": optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay),
            "no_decay": adam(lr),
            "kd": adam(kd_lr),
        }, labels))


def trainable_indices(labels: PyTree) -> list[int]:
    """Positions (in `jax.tree.leaves` order) of the parameters that train."""
    return [i for i, lab in enumerate(jax.tree.leaves(labels)) if lab != "frozen"]


def init_state(model: nnx.Module, cfg: TrainConfig) -> tuple[nnx.GraphDef, TrainState,
                                                               optax.GradientTransformation]:
    """Split the model; the optimiser (and its state) covers only the trainable parameters, so
    frozen ones cost no gradient, no Adam moments and no EMA arithmetic."""
    graphdef, params = nnx.split(model, nnx.Param)
    # Plain dicts of arrays, not nnx.State: jax flattens them in C++, so passing the state to the
    # jitted step costs ~3x less host time per call (nnx.merge takes them as they are).
    params = nnx.to_pure_dict(params)
    labels = param_labels(params, cfg)
    index = trainable_indices(labels)
    label_leaves = jax.tree.leaves(labels)
    tx = make_optimizer(cfg, [label_leaves[i] for i in index])
    leaves = jax.tree.leaves(params)
    teacher = jax.tree.map(jnp.copy, params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, teacher=teacher,
                       opt_state=tx.init([leaves[i] for i in index]))
    return graphdef, state, tx


def ema_update(teacher: PyTree, params: PyTree, step: jax.Array, cfg: TrainConfig) -> PyTree:
    """Teacher after optimiser step number `step` (1-based): a copy of the student while
    step <= ema_warmup_steps, then decay * teacher + (1 - decay) * student."""
    copy = step <= cfg.ema_warmup_steps
    return jax.tree.map(
        lambda t, p: jnp.where(copy, p, cfg.ema_decay * t + (1 - cfg.ema_decay) * p),
        teacher, params)


def _has_action(batch: dict) -> jax.Array:
    """[B] bool: valid images with an action text (batches made without `has_action`, e.g.
    synthetic ones, count every valid image)."""
    has = batch.get("has_action")
    return batch["valid"] if has is None else batch["valid"] & has


def _level_inputs(batch: dict, level: str):
    if level == "global":
        return normalize(batch["image"]), batch["action_tokens"], _has_action(batch)
    key = level + "s"
    mask = batch[level + "_mask"] & batch["valid"][:, None]
    return normalize(batch[key]), batch[level + "_tokens"], mask


def shared_text_layers(model, teacher, cfg: TrainConfig) -> int:
    """Text blocks whose work the student and its EMA teacher can share: the frozen ones (the
    text embeddings are frozen too), all but the last, and only when the text KD terms run."""
    if teacher is None or not cfg.lambda_kd or cfg.kd_direction == "vision":
        return 0
    layers = len(model.pair("object").text_model.encoder.layers)
    return max(0, min(cfg.frozen_text_layers, layers - 1))


def compute_losses(model, teacher, batch: dict, cfg: TrainConfig, *,
                   share_frozen_text: bool = False) -> tuple[jax.Array, dict]:
    """L_total = lambda_CA * (L_global + L_object + L_relation) + lambda_KD * L_KD on a caps
    batch. `teacher` is the EMA model (or None without KD).

    `share_frozen_text=True` promises that the teacher's frozen text weights are the student's
    (the train step builds the teacher that way): the teacher's object / relation text targets
    then continue from the student's hidden state after the frozen blocks instead of
    recomputing them (`shared_text_layers`; 10 of 12 blocks in the recipe). Same numbers."""
    inputs = {level: _level_inputs(batch, level) for level in ("global", "object", "relation")}
    shared = shared_text_layers(model, teacher, cfg) if share_frozen_text else 0
    prefixes = {}
    emb = {}
    metrics = {}
    l_ca = 0.0
    for level, (pixels, tokens, mask) in inputs.items():
        pair = model.pair(level)
        img = pair.encode_image(pixels)
        if shared and level != "global":
            prefixes[level] = pair.text_prefix(tokens, shared)
            txt = pair.encode_text_from(prefixes[level], tokens, shared)
        else:
            txt = pair.encode_text(tokens)
        emb[level] = (img, txt, mask)
        d = img.shape[-1]
        labels = None
        if cfg.duplicate_aware and level != "global":
            labels = batch[level + "_labels"].reshape(-1)
        loss = losses.clip_contrastive(img.reshape(-1, d), txt.reshape(-1, d),
                                       model.logit_scale(level), mask.reshape(-1), labels)
        metrics[f"loss_{level}"] = loss
        metrics[f"logit_scale_{level}"] = jnp.exp(model.logit_scale(level))
        l_ca = l_ca + loss
    l_kd = jnp.zeros((), jnp.float32)
    if teacher is not None and cfg.lambda_kd:
        g_img, g_txt, _ = emb["global"]
        log_scale = model.kd_log_scale[...]
        if cfg.kd_direction in ("both", "vision"):
            t_img = teacher.pair("global").encode_image(inputs["global"][0])
            for level in ("object", "relation"):
                img, _, mask = emb[level]
                l_kd += losses.kd_one_teacher_many_students(t_img, img, mask, log_scale)
        if cfg.kd_direction in ("both", "text"):
            # The student is the action text: images without an action sit these terms out.
            with_action = _has_action(batch)[:, None]
            for level in ("object", "relation"):
                _, tokens, mask = inputs[level]
                if level in prefixes:
                    t_txt = teacher.pair(level).encode_text_from(prefixes[level], tokens, shared)
                else:
                    t_txt = teacher.pair(level).encode_text(tokens)
                l_kd += losses.kd_many_teachers_one_student(t_txt, mask & with_action, g_txt,
                                                            log_scale)
        metrics["kd_temperature"] = losses.student_temperature(log_scale)
    total = cfg.lambda_ca * l_ca + cfg.lambda_kd * l_kd
    metrics.update(loss=total, loss_ca=l_ca, loss_kd=l_kd)
    return total, metrics


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, cfg: TrainConfig,
                    labels: PyTree, *, share_frozen_text: bool = True):
    """The step `(state, batch) -> (state, metrics)`, to be jitted with the state donated.

    Gradients, optimiser and EMA touch only the trainable leaves; frozen leaves pass through
    (student and teacher hold the same frozen values for ever). `share_frozen_text=False`
    recomputes the teacher's frozen text blocks (same numbers; for benchmarks)."""
    index = trainable_indices(labels)
    lr = learning_rate(cfg)

    def with_leaves(tree, chosen):
        leaves, treedef = jax.tree.flatten(tree)
        for i, leaf in zip(index, chosen):
            leaves[i] = leaf
        return jax.tree.unflatten(treedef, leaves)

    def pick(tree):
        leaves = jax.tree.leaves(tree)
        return [leaves[i] for i in index]

    def loss_fn(trainable, params, teacher_params, batch):
        frozen = jax.tree.map(jax.lax.stop_gradient, params)
        model = nnx.merge(graphdef, with_leaves(frozen, trainable))
        teacher = None
        if model.has_kd and cfg.lambda_kd:
            # The teacher's trainable leaves with the student's frozen ones (the same values:
            # init copies them and no step changes them), so the frozen text blocks' work is
            # shared by construction.
            teacher = nnx.merge(graphdef, with_leaves(
                frozen, jax.lax.stop_gradient(pick(teacher_params))))
        return compute_losses(model, teacher, batch, cfg, share_frozen_text=share_frozen_text)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        trainable = pick(state.params)
        grads, metrics = jax.grad(loss_fn, has_aux=True)(trainable, state.params, state.teacher,
                                                          batch)
        updates, opt_state = tx.update(grads, state.opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        new_step = state.step + 1
        teacher = ema_update(pick(state.teacher), trainable, new_step, cfg)
        metrics["lr"] = lr(state.step)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["bad_records"] = jnp.sum(batch["bad_record"])
        return TrainState(new_step, with_leaves(state.params, trainable),
                          with_leaves(state.teacher, teacher), opt_state), metrics

    return step
