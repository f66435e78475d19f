"""Train the Faster R-CNN detector: one jitted train step, its batches, and the run (through
`sclaro_jax.run.run_steps`, as ScenarioCLIP's trainer: checkpoints with exact resume, graceful
stop, config drift refused, metrics.jsonl / TensorBoard). A trained detector is read back and run
by `sclaro_jax.detection.evaluate` (`restore_params`, `predict`).

    python launch/train.py --config configs/detection.py[:demo] --workdir DIR [--config.x.y=V]

The recipe (configs/detection.py; the appendix protocol): 10 epochs of AdamW, the pretrained
encoders at `backbone_lr` 1e-5 and the pyramids, FPN and heads at `head_lr` 1e-4, 5% linear
warm-up then cosine decay to 0; training images drawn by the instance-aware sampler
(`data.InstanceAwareSampler`) with class-targeted copy-paste for classes with fewer than
`copy_paste_threshold` (50) training instances, applied to each drawn image with probability
`copy_paste_prob` (0.5; the run logs the measured rate as `copy_paste_rate`); the input made by
`input_resize` ("squash" to image_size x image_size, the default, or ViTDet's "longest_side":
long side to image_size, aspect kept, padded bottom / right); inference with score threshold
1e-4, NMS 0.5 and 300 detections per image (`model.DetectorConfig`).

Exact resume: a step's images, copy-paste draws and the samplers' JAX key depend only on
(seed, step), and a checkpoint holds the parameters, the optimiser state and the step, so a run
stopped (SIGINT / SIGTERM save a checkpoint after the current step) and restarted takes the
same steps as an uninterrupted one.

Run folder (`out`): `checkpoints/` (orbax; one item, the state {step, params, opt_state}),
`config.json`, `metrics.jsonl` (step, the four losses, loss, examples_per_sec, copy_paste_rate:
the fraction of the images since the last line that received pasted instances), `tensorboard/`,
`results.json` and `results.md` (the evaluation: `sclaro_jax.detection.task`).
"""

from __future__ import annotations

import json
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from sclaro_jax import ops as pixel_ops
from sclaro_jax.config import recipe_ranges, validate
from sclaro_jax.detection import data, rcnn
from sclaro_jax.detection.model import BACKBONE, Detector, DetectorConfig
from sclaro_jax.run import Checkpoints, Hooks, LoopSpec, run_steps
from sclaro_jax.run import folder, sharding
from sclaro_jax.run.ahead import kept_step, state_shapes
from sclaro_jax.run.opening import open_run
from sclaro_jax.run.params import label_params

log = logging.getLogger(__name__)

def detector_config(config, num_classes: int) -> DetectorConfig:
    d = dict(config.detector)
    for k in ("strides", "anchor_sizes", "aspect_ratios"):
        d[k] = tuple(d[k])
    return DetectorConfig(num_classes=num_classes, **d)


def compute_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32
    return jnp.dtype(name)


def check_recipe(config) -> None:
    """ValueError naming the key: every numeric and path key in its range
    (configs/detection.py's `RANGES`, `config.validate`), an unknown `input_resize`."""
    validate(config, recipe_ranges("detection"))
    if config.input_resize not in data.RESIZE_MODES:
        raise ValueError(f"unknown resize mode {config.input_resize!r} (input_resize); known: "
                         f"{', '.join(data.RESIZE_MODES)}")


def total_steps(config, examples: int) -> int:
    return max(1, math.ceil(config.epochs * examples / config.batch_size))


def make_optimizer(config, params, steps: int) -> optax.GradientTransformation:
    """AdamW with two learning rates (encoders / everything else), both warm-up + cosine."""
    warmup = max(1, int(config.warmup_fraction * steps))

    def schedule(peak):
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), 0.0)

    labels = label_params(params, [(BACKBONE, "backbone")], "head")
    return optax.multi_transform({
        "backbone": optax.adamw(schedule(config.backbone_lr), weight_decay=config.weight_decay),
        "head": optax.adamw(schedule(config.head_lr), weight_decay=config.weight_decay)}, labels)


def init_state(model: Detector, config, steps: int):
    """(graphdef, state {step, params, opt_state}, optimiser)."""
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = make_optimizer(config, params, steps)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
    return graphdef, state, tx


def make_train_step(graphdef, tx, seed: int):
    """(state, batch) -> (state, metrics): one jitted step; batch = image uint8 [B, S, S, 3],
    boxes [B, M, 4], labels [B, M], valid [B, M]."""
    base = jax.random.key(seed)

    def step(state, batch):
        key = jax.random.fold_in(base, state["step"])

        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            out = rcnn.losses(model, pixel_ops.normalize(batch["image"]), batch["boxes"],
                              batch["labels"], batch["valid"], key)
            return out["loss"], out

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return step


def make_batch(examples, indices, cfg: DetectorConfig, config, rare, step: int,
               donors: np.ndarray | None = None) -> dict:
    """The host batch of `indices` (examples already at the detection size), copy-paste drawn
    from (seed, step): each image, with probability `config.copy_paste_prob`, receives 1 to
    `config.copy_paste_max` instances of `rare` classes taken from up to 8 examples drawn
    (without replacement) from `donors` (`data.rare_donors(examples, rare)`, computed here
    when None), so every draw pastes at least one instance. `pasted` (bool [B]): which images
    received instances (the train loop removes it before the step)."""
    rng = np.random.default_rng([config.seed, step, 1])
    if donors is None:
        donors = data.rare_donors(examples, rare)
    images, boxes, labels, valid, pasted = [], [], [], [], []
    for i in indices:
        ex = examples[i]
        count = 0
        if len(donors) and rng.random() < config.copy_paste_prob:
            chosen = rng.choice(donors, size=min(8, len(donors)), replace=False)
            ex, count = data.copy_paste_count(ex, [examples[j] for j in chosen], rare, rng,
                                              max_pastes=config.copy_paste_max)
        b, lab, v = data.pad_targets(ex.boxes, ex.labels, cfg.max_boxes)
        images.append(ex.image)
        boxes.append(b)
        labels.append(lab)
        valid.append(v)
        pasted.append(count > 0)
    return {"image": np.stack(images), "boxes": np.stack(boxes), "labels": np.stack(labels),
            "valid": np.stack(valid), "pasted": np.array(pasted, bool)}


def _restore(checkpoints: Checkpoints, state):
    start = checkpoints.start
    if start:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = checkpoints.manager.restore(start, args=ocp.args.StandardRestore(abstract))
    return state


def _batches(config, examples, num_classes: int, cfg: DetectorConfig, mesh):
    """(batch_of(step), log_fields): a step's batch (copy-paste drawn from (seed, step)) on the
    mesh, and the metrics line's `copy_paste_rate` since the last line."""
    rare = data.rare_classes(data.class_instance_counts(examples, num_classes),
                             config.copy_paste_threshold)
    donors = data.rare_donors(examples, rare)
    sampler = data.InstanceAwareSampler(data.instance_aware_weights(examples, num_classes),
                                        config.seed)
    counts = {"images": 0, "pasted": 0}

    def batch_of(step):
        batch = make_batch(examples, sampler.indices(step, config.batch_size), cfg, config,
                           rare, step, donors)
        counts["pasted"] += int(batch.pop("pasted").sum())
        counts["images"] += config.batch_size
        return sharding.put_batch(batch, mesh)

    def log_fields(wall, step):
        rate = counts["pasted"] / max(1, counts["images"])
        counts.update(images=0, pasted=0)
        return {"copy_paste_rate": rate}

    return batch_of, log_fields


def train(config, out: str, model: Detector, examples: list, num_classes: int, *,
          progress: bool = True, stop_at: int | None = None,
          allow_config_change: bool = False):
    """Train `model` on `examples` (`data.DetectionExample`s at the detection size) into `out`,
    resuming from its newest checkpoint. Returns (graphdef, state, info): info holds
    `steps` (the run's total), `start` (the step it resumed from) and `compiles` (how many
    times the train step was compiled in this call: 1, or 0 when no step was taken or an
    earlier run of this process had compiled it: `run.ahead.kept_step`).
    `stop_at`: stop after that step with a checkpoint, as an interrupt would. The run is opened
    as every task opens one (`run.opening.open_run`: the one writer of `out`; a resumed run
    whose config differs from OUT/config.json in more than `folder.SAFE_KEYS` is refused
    unless `allow_config_change`)."""
    cfg = model.cfg
    steps = total_steps(config, len(examples))
    with open_run(config, out, ocp.args.StandardSave,
                  allow_config_change=allow_config_change) as run:
        start = run.start
        graphdef, state, tx = init_state(model, config, steps)
        del model
        mesh = sharding.make_mesh(config.sharding)
        step_fn, state = sharding.jit_step(make_train_step(graphdef, tx, config.seed), state,
                                           mesh, config.sharding)
        # the recipe as a whole (the optimiser and seed come from it): a key more specific
        # than the step needs, never less
        step_fn = kept_step(step_fn, ("detection", graphdef, steps, mesh, config.sharding,
                                      json.dumps(config.to_dict(), sort_keys=True, default=str),
                                      state_shapes(state)))
        compiled_before = step_fn._cache_size()
        state = _restore(run.checkpoints, state)
        if start:
            log.info("resumed detection training from %s at step %d", out, start)
        info = {"steps": steps, "start": start, "compiles": 0}
        if start >= steps:
            log.info("%s already holds a checkpoint at step %d of %d: nothing to train", out,
                     start, steps)
            return graphdef, state, info
        batch_of, log_fields = _batches(config, examples, num_classes, cfg, mesh)
        spec = LoopSpec(workdir=out, start=start, steps=steps, log_every=config.log_every,
                        checkpoint_every=config.checkpoint_every,
                        examples_per_step=config.batch_size,
                        progress=progress and config.get("progress_bar", True),
                        desc="detect train", stop_at=stop_at,
                        hint="lower head_lr / backbone_lr.")
        hooks = Hooks(started=lambda: folder.write_config(out, config, step=start,
                                                          unsafe=run.unsafe),
                      log_fields=log_fields)
        state = run_steps(step_fn, state, batch_of, run.checkpoints, spec, hooks).state
        info["compiles"] = step_fn._cache_size() - compiled_before
        return graphdef, state, info
