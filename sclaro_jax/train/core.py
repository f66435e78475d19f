"""ScenarioCLIP training core: parameter groups, optimiser, EMA teacher, one jitted step.

Everything here is a pure function of pytrees, so the step jits once (static batch shapes from
`sclaro_jax.data.batch`) and the train state checkpoints as it is. The step runs
batch -> `level_inputs` (photometric augmentation of uint8 pixels, `ops.normalize`) ->
`encode` (the model's towers) -> `losses.scenarioclip_total`.

Recipe (docs/design.md, section 2): AdamW (lr 2e-5, betas 0.9/0.999, eps 1e-8, decoupled weight
decay 0.2 on the matrices and, as in the reference code, on the three contrastive logit scales;
biases and norm parameters get none; `decay_logit_scales=False` exempts the logit scales too),
linear warm-up over the first 10% of steps from 1e-3 x lr, then cosine to 0, per step;
gradient clipping at global norm 1.0; the KD temperature is its own group at 0.1 x lr without
weight decay (the reference code left it out of every group, so it never moved). Frozen
parameters, chosen by name (`frozen_patterns`: tower embeddings, first 6 vision / 10 text
blocks) get no update and no weight-grad computation (`stop_gradient`). EMA teacher: decay
0.9995 after every step; for the first `ema_warmup_steps` steps it copies the student.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from sclaro_jax import losses, ops
from sclaro_jax.data import batch as fields
from sclaro_jax.data import photometric
from sclaro_jax.recipes import TrainConfig
from sclaro_jax.run.params import label_params, param_name
from sclaro_jax.train import fused_update

PyTree = Any
FROZEN = "frozen"
# Named scopes of the step's parts (in the compiled module's op names, so a profile can tell
# them apart: bench/gpu_profile.py).
AUGMENT_SCOPE, LOSS_SCOPE, OPTIMIZER_SCOPE, EMA_SCOPE = "augment", "loss", "optimizer", "ema"


@struct.dataclass
class TrainState:
    step: jax.Array
    params: PyTree  # the student's nnx.Params as plain nested dicts of arrays (nnx.to_pure_dict)
    teacher: PyTree  # EMA of params (same structure)
    opt_state: PyTree  # over `trainable_part(params)`: keyed by the trainable parameters' names


def frozen_patterns(cfg: TrainConfig) -> list[str]:
    """Regexes over parameter names ("global_pair/vision_model/encoder/layers/0/...") of the
    frozen parameters: both towers' embeddings, the first `frozen_vision_layers` vision and
    `frozen_text_layers` text blocks, and with `freeze_pre_layernorm` the vision pre-LayerNorm
    (trainable by default, as in the reference, so gradients flow back through every vision
    block; freezing it lets the backward pass stop early)."""
    patterns = [r"(^|/)vision_model/embeddings/", r"(^|/)text_model/embeddings/"]
    for tower, count in (("vision_model", cfg.frozen_vision_layers),
                         ("text_model", cfg.frozen_text_layers)):
        if count > 0:
            blocks = "|".join(str(i) for i in range(count))
            patterns.append(rf"(^|/){tower}/encoder/layers/({blocks})/")
    if cfg.freeze_pre_layernorm:
        patterns.append(r"(^|/)vision_model/pre_layrnorm/")
    return patterns


def param_labels(params: PyTree, cfg: TrainConfig) -> PyTree:
    """Optimiser group of every parameter (`run.params.label_params`, by name): frozen, kd,
    decay (matrices) or no_decay (the other trainable ones; of these the logit scales decay
    unless `decay_logit_scales` is False)."""
    rules = [("|".join(frozen_patterns(cfg)), FROZEN), (r"(^|/)kd_log_scale$", "kd")]
    return label_params(params, rules,
                        lambda name, value: "decay" if value.ndim >= 2 else "no_decay")


def trainable_part(tree: PyTree, labels: PyTree) -> PyTree:
    """`tree` (nested dicts) with its frozen leaves, and dicts left empty, pruned. Its leaves
    flatten in the order the trainable leaves have in `tree`."""
    if not isinstance(labels, dict):
        return None if labels == FROZEN else tree
    out = {}
    for key, label in labels.items():
        part = trainable_part(tree[key], label)
        if part is not None:
            out[key] = part
    return out or None


def with_part(tree: PyTree, part: PyTree) -> PyTree:
    """`tree` with the leaves that `part` (a `trainable_part`) holds replaced by part's."""
    if not isinstance(part, dict):
        return part
    return {k: with_part(v, part[k]) if k in part else v for k, v in tree.items()}


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    warmup = max(1, int(cfg.warmup_fraction * cfg.total_steps))
    return optax.warmup_cosine_decay_schedule(
        init_value=cfg.warmup_init_factor * cfg.lr, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1), end_value=0.0)


def is_logit_scale(name: str) -> bool:
    """Whether the parameter named `name` is a contrastive logit scale (`<level>_logit_scale`)."""
    return name.rsplit("/", 1)[-1].endswith("logit_scale")


def weight_decay(name: str, group: str, cfg: TrainConfig) -> float:
    """The decoupled weight decay of the parameter `name` in optimiser `group`: the decay
    group's, the no_decay group's logit scales' when `cfg.decay_logit_scales`, else none."""
    if group == "decay" or (group == "no_decay" and cfg.decay_logit_scales
                            and is_logit_scale(name)):
        return cfg.weight_decay
    return 0.0


def group_learning_rates(cfg: TrainConfig) -> dict[str, optax.Schedule]:
    """Optimiser group -> its learning-rate schedule: the kd group at `kd_lr_factor` x."""
    lr = learning_rate(cfg)

    def kd_lr(step):
        return cfg.kd_lr_factor * lr(step)

    return {"decay": lr, "no_decay": lr, "kd": kd_lr}


def adam_decaying_logit_scales(lr: optax.Schedule, cfg: TrainConfig
                               ) -> optax.GradientTransformation:
    """The `no_decay` group's Adam, with AdamW's decoupled weight decay on the logit scales
    when `cfg.decay_logit_scales`: their update is -lr * (adam + weight_decay * value), exactly
    what the `decay` group's `optax.adamw` does to its members.

    Its state is `optax.adam`'s, leaf for leaf (scale_by_adam, then the schedule's count), so
    the logit scales stay in the `no_decay` group and checkpoints restore whatever the
    option: moving them into the `decay` group would move their Adam moments in the
    optimiser-state tree, and older checkpoints would no longer restore."""
    adam = optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    scale = optax.scale_by_learning_rate(lr)

    def init(params):
        return adam.init(params), scale.init(params)

    def update(updates, state, params=None):
        updates, adam_state = adam.update(updates, state[0], params)
        if cfg.decay_logit_scales and cfg.weight_decay:
            def decayed(path, u, p):
                w = weight_decay(param_name(path), "no_decay", cfg)
                return u + w * p if w else u
            updates = jax.tree_util.tree_map_with_path(decayed, updates, params)
        updates, scale_state = scale.update(updates, state[1], params)
        return updates, (adam_state, scale_state)

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: TrainConfig, labels: PyTree) -> optax.GradientTransformation:
    """AdamW groups over the trainable parameters; `labels` (the trainable part of
    `param_labels`) holds decay / no_decay / kd. The logit scales are `no_decay` members that
    decay by default (`adam_decaying_logit_scales`)."""
    lr = group_learning_rates(cfg)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.multi_transform({
            "decay": optax.adamw(lr["decay"], b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay),
            "no_decay": adam_decaying_logit_scales(lr["no_decay"], cfg),
            "kd": optax.adam(lr["kd"], b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        }, labels))


def init_state(model: nnx.Module, cfg: TrainConfig) -> tuple[nnx.GraphDef, TrainState,
                                                               optax.GradientTransformation]:
    """Split the model; the optimiser (and its state) covers only the trainable parameters, so
    frozen ones cost no gradient, no Adam moments and no EMA arithmetic. An abstract model
    (`nnx.eval_shape`) gives the state's shapes alone (`jax.ShapeDtypeStruct` leaves), e.g. a
    target to restore a checkpoint into without initialising anything."""
    graphdef, params = nnx.split(model, nnx.Param)
    # Plain dicts of arrays, not nnx.State: jax flattens them in C++, so passing the state to the
    # jitted step costs less host time per call (nnx.merge takes them as they are).
    params = nnx.to_pure_dict(params)
    labels = param_labels(params, cfg)
    tx = make_optimizer(cfg, trainable_part(labels, labels))

    def state_of(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          teacher=jax.tree.map(jnp.copy, params),
                          opt_state=tx.init(trainable_part(params, labels)))

    abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    return graphdef, jax.eval_shape(state_of, params) if abstract else state_of(params), tx


def ema_update(teacher: PyTree, params: PyTree, step: jax.Array, cfg: TrainConfig) -> PyTree:
    """Teacher after optimiser step number `step` (1-based): a copy of the student while
    step <= ema_warmup_steps, then decay * teacher + (1 - decay) * student
    (`fused_update.ema`)."""
    copy = step <= cfg.ema_warmup_steps
    return jax.tree.map(lambda t, p: fused_update.ema(t, p, copy, cfg.ema_decay), teacher, params)


class LevelInput(NamedTuple):
    """One level's inputs to the towers: CLIP-normalised pixels, tokens, the mask of valid rows
    and, for a crop level of a packed batch, the image index of each crop (else None)."""
    pixels: jax.Array
    tokens: jax.Array
    mask: jax.Array
    segments: jax.Array | None = None


def level_inputs(batch: dict) -> dict[str, LevelInput]:
    """Level -> `LevelInput`: the global level's mask marks valid images with an action text
    (batches without `has_action` count every valid image), a crop level's its valid crops of
    valid images. Crop levels come caps ([B, N]) or packed ([K] with `segments`).

    uint8 pixels get the batch's ColorJitter / GaussianBlur (`data.photometric.augment_batch`,
    when the batch carries the photometric fields), then `ops.normalize`. float32 pixels were
    CLIP-normalised on the host (`PipelineConfig(pixels="float32")`) and are used as they are."""
    if batch[fields.IMAGE].dtype == jnp.uint8:
        with jax.named_scope(AUGMENT_SCOPE):  # unchanged without the photometric fields
            batch = photometric.augment_batch(batch)
    valid = jnp.asarray(batch[fields.VALID])
    has = batch.get(fields.HAS_ACTION)
    out = {}
    for level, f in fields.LEVEL_FIELDS.items():
        segments = batch.get(f.segments) if f.segments else None
        if f.mask is None:
            mask = valid if has is None else valid & has
        elif segments is None:
            mask = batch[f.mask] & valid[:, None]
        else:
            mask = batch[f.mask] & valid[jnp.clip(segments, 0, valid.shape[0] - 1)]
        pixels = batch[f.pixels]
        pixels = ops.normalize(pixels) if pixels.dtype == jnp.uint8 else pixels
        out[level] = LevelInput(pixels, batch[f.tokens], mask, segments)
    return out


def crop_metrics(batch: dict) -> dict:
    """Per crop level: real crops in the batch (`crops_objects`), the fraction of its slots that
    are padding (`padding_objects`), and with the packed layout `packed_size` (slots of both
    levels: the compiled size the step ran at)."""
    valid = jnp.asarray(batch[fields.VALID])
    out, slots = {}, 0
    for level in fields.CROP_LEVELS:
        f = fields.LEVEL_FIELDS[level]
        mask = batch[f.mask]
        if f.segments in batch:
            real = mask & valid[jnp.clip(batch[f.segments], 0, valid.shape[0] - 1)]
        else:
            real = mask & valid[:, None]
        name = "objects" if level == "object" else "relations"
        crops = jnp.sum(real)
        out[f"crops_{name}"] = crops
        out[f"padding_{name}"] = 1.0 - crops / max(real.size, 1)
        slots += real.size
    if fields.LEVEL_FIELDS["object"].segments in batch:
        out["packed_size"] = jnp.asarray(slots, jnp.int32)
    return out


def shared_text_layers(model, teacher, cfg: TrainConfig) -> int:
    """Text blocks whose work the student and its EMA teacher can share: the frozen ones (the
    text embeddings are frozen too), all but the last, and only when the text KD terms run."""
    if teacher is None or not cfg.lambda_kd or cfg.kd_direction == "vision":
        return 0
    return max(0, min(cfg.frozen_text_layers, model.pair("object").num_text_layers - 1))


def encode(model, teacher, inputs: dict, cfg: TrainConfig, shared: int) -> dict:
    """The embeddings `losses.scenarioclip_total` takes: `embeddings` level -> (image, text)
    from the student, and with a teacher its `teacher_image` (global) and `teacher_texts`
    (crop levels) as `cfg.kd_direction` needs them. With `shared` > 0 the crop levels' text
    runs its first `shared` blocks once for student and teacher (`text_prefix`)."""
    prefixes, embeddings = {}, {}
    for level, (pixels, tokens, _, _) in inputs.items():
        pair = model.pair(level)
        img = pair.encode_image(pixels)
        if shared and level != "global":
            prefixes[level] = pair.text_prefix(tokens, shared)
            txt = pair.encode_text_from(prefixes[level], tokens, shared)
        else:
            txt = pair.encode_text(tokens)
        embeddings[level] = (img, txt)
    out = dict(embeddings=embeddings)
    if teacher is None:
        return out
    if cfg.kd_direction in ("both", "vision"):
        out["teacher_image"] = teacher.pair("global").encode_image(inputs["global"].pixels)
    if cfg.kd_direction in ("both", "text"):
        out["teacher_texts"] = {}
        for level in losses.CROP_LEVELS:
            pair, tokens = teacher.pair(level), inputs[level].tokens
            out["teacher_texts"][level] = (pair.encode_text_from(prefixes[level], tokens, shared)
                                           if level in prefixes else pair.encode_text(tokens))
    return out


def compute_losses(model, teacher, batch: dict, cfg: TrainConfig, *,
                   share_frozen_text: bool = False) -> tuple[jax.Array, dict]:
    """L_total and its metrics on a batch (`losses.scenarioclip_total`). `teacher` is the EMA
    model (or None without KD).

    `share_frozen_text=True` promises that the teacher's frozen text weights are the student's
    (the train step builds the teacher that way): the teacher's object / relation text targets
    then continue from the student's hidden state after the frozen blocks instead of
    recomputing them (`shared_text_layers`). Same numbers."""
    inputs = level_inputs(batch)
    if not cfg.lambda_kd:
        teacher = None
    shared = shared_text_layers(model, teacher, cfg) if share_frozen_text else 0
    encoded = encode(model, teacher, inputs, cfg, shared)
    labels = None
    if cfg.duplicate_aware:
        labels = {level: batch[fields.LEVEL_FIELDS[level].labels] for level in losses.CROP_LEVELS}
    with jax.named_scope(LOSS_SCOPE):
        return losses.scenarioclip_total(
            encoded["embeddings"], {level: x.mask for level, x in inputs.items()},
            {level: model.logit_scale(level) for level in losses.LEVELS},
            lambda_ca=cfg.lambda_ca, lambda_kd=cfg.lambda_kd,
            kd_log_scale=None if teacher is None else model.kd_log_scale[...],
            teacher_image=encoded.get("teacher_image"),
            teacher_texts=encoded.get("teacher_texts"),
            kd_direction=cfg.kd_direction, labels=labels, kd_teacher_floor=cfg.kd_teacher_floor,
            segments={level: inputs[level].segments for level in losses.CROP_LEVELS
                      if inputs[level].segments is not None})


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, cfg: TrainConfig,
                    *, share_frozen_text: bool = True, fused_update: bool = False):
    """The step `(state, batch) -> (state, metrics)`, to be jitted with the state donated.

    Gradients, optimiser and EMA touch only the trainable parameters (`trainable_part`, by
    name); frozen leaves pass through (student and teacher hold the same frozen values for
    ever). `share_frozen_text=False` recomputes the teacher's frozen text blocks (same numbers;
    for benchmarks). `fused_update=True` computes `tx`'s update (`make_optimizer`'s chain) and
    the EMA teacher in one pass over flat buffers (`fused_update.update`: same numbers, same
    optimiser state), all of it in the optimizer scope."""
    lr = learning_rate(cfg)
    update = optimizer_update(tx, cfg, fused=fused_update)

    def loss_fn(trainable, params, teacher_params, batch):
        labels = param_labels(params, cfg)
        frozen = jax.tree.map(jax.lax.stop_gradient, params)
        model = nnx.merge(graphdef, with_part(frozen, trainable))
        teacher = None
        if model.has_kd and cfg.lambda_kd:
            # The teacher's trainable leaves with the student's frozen ones (the same values:
            # init copies them and no step changes them), so the frozen text blocks' work is
            # shared by construction.
            teacher = nnx.merge(graphdef, with_part(
                frozen, jax.lax.stop_gradient(trainable_part(teacher_params, labels))))
        return compute_losses(model, teacher, batch, cfg, share_frozen_text=share_frozen_text)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        labels = param_labels(state.params, cfg)
        trainable = trainable_part(state.params, labels)
        grads, metrics = jax.grad(loss_fn, has_aux=True)(trainable, state.params, state.teacher,
                                                          batch)
        new_step = state.step + 1
        trainable, teacher, opt_state = update(grads, state.opt_state, trainable,
                                               trainable_part(state.teacher, labels), new_step,
                                               trainable_part(labels, labels))
        metrics["lr"] = lr(state.step)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["bad_records"] = jnp.sum(batch[fields.BAD_RECORD])
        metrics.update(crop_metrics(batch))
        for name in (fields.DROPPED_OBJECTS, fields.DROPPED_RELATIONS):
            metrics[name] = jnp.sum(batch[name])
        return TrainState(new_step, with_part(state.params, trainable),
                          with_part(state.teacher, teacher), opt_state), metrics

    return step


def optimizer_update(tx: optax.GradientTransformation, cfg: TrainConfig, *, fused: bool = False):
    """The step's update `(grads, opt_state, params, teacher, step, labels) -> (params,
    teacher, opt_state)` of the trainable parameters (`labels`: their groups) after optimiser
    step `step` (1-based): `tx`'s update (`make_optimizer`'s chain) then `ema_update`, or with
    `fused` the same numbers and optimiser state in one pass (`fused_update.update`)."""
    learning_rates = group_learning_rates(cfg)

    def chain(grads, opt_state, params, teacher, step, labels):
        with jax.named_scope(OPTIMIZER_SCOPE):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        with jax.named_scope(EMA_SCOPE):
            teacher = ema_update(teacher, params, step, cfg)
        return params, teacher, opt_state

    def one_pass(grads, opt_state, params, teacher, step, labels):
        decays = jax.tree_util.tree_map_with_path(
            lambda path, group: weight_decay(param_name(path), group, cfg), labels)
        with jax.named_scope(OPTIMIZER_SCOPE):  # the EMA's work is part of the one pass
            return fused_update.update(grads, opt_state, params, teacher, step, labels=labels,
                                       weight_decays=decays, learning_rates=learning_rates,
                                       cfg=cfg)

    return one_pass if fused else chain
