"""Train and evaluate the Faster R-CNN detector: the recipe (a config), one jitted train step,
checkpoints with exact resume, and evaluation.

The recipe (`default_config`; the appendix protocol): 10 epochs of AdamW, the pretrained
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

Run folder (`out`): `checkpoints/` (orbax), `metrics.jsonl` (step, the four losses, loss,
examples_per_sec, copy_paste_rate: the fraction of the images since the last line that received
pasted instances), `results.json` and `results.md` (written by `sclaro_jax.eval.detect`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

from sclaro_jax import ops as pixel_ops
from sclaro_jax.detection import data, rcnn
from sclaro_jax.detection.model import Detector, DetectorConfig, is_backbone
from sclaro_jax.train import core, runs, sharding, trainer

log = logging.getLogger(__name__)


def default_config(variant: str | None = None) -> ml_collections.ConfigDict:
    """The detection recipe. `variant` "demo": a few CPU minutes on the bundled demo data
    (smaller images and heads, more epochs, larger rates for a randomly initialised tiny
    encoder)."""
    c = ml_collections.ConfigDict()
    c.epochs = 10
    c.batch_size = 16
    c.backbone_lr = 1e-5
    c.head_lr = 1e-4
    c.weight_decay = 0.05
    c.warmup_fraction = 0.05
    c.seed = 0
    c.dtype = "auto"  # bfloat16 compute on a GPU / TPU, float32 on a CPU
    c.sharding = "none"  # none | dp | fsdp, as the trainer
    c.input_resize = "squash"  # squash | longest_side (ViTDet's resize + pad); data.RESIZE_MODES
    c.copy_paste_threshold = 50  # classes with fewer training instances are pasted
    c.copy_paste_prob = 0.5  # P(a drawn training image receives 1..copy_paste_max pasted instances)
    c.copy_paste_max = 3
    c.train_split = "train"
    c.eval_split = "test"
    c.eval_batch_size = 8
    c.log_every = 10
    c.checkpoint_every = 500
    c.keep_checkpoints = 2
    c.compilation_cache = "workdir"  # JAX's persistent cache in OUT/jax_cache ("" for off)
    c.detector = ml_collections.ConfigDict({
        f.name: f.default for f in DetectorConfig.__dataclass_fields__.values()
        if f.name != "num_classes"})
    if variant == "demo":
        # An overfit check: evaluated on its own training images. Every demo class is rare
        # (under 50 instances), so copy-paste would paste into every image; it is off here.
        c.epochs, c.batch_size, c.backbone_lr, c.head_lr = 100, 4, 1e-4, 1e-3
        c.eval_split, c.log_every, c.checkpoint_every = "train", 5, 100
        c.copy_paste_prob = 0.0
        c.detector.update(image_size=128, pyramid_dim=32, fpn_dim=32, representation_size=128,
                          rpn_pre_nms_top_n_train=256, rpn_post_nms_top_n_train=128,
                          rpn_pre_nms_top_n_test=256, rpn_post_nms_top_n_test=128,
                          rpn_batch_size_per_image=64, box_batch_size_per_image=64,
                          box_candidates=512, detections_per_img=100, max_boxes=16)
    elif variant is not None:
        raise ValueError(f"unknown detection config variant {variant!r}; known: demo")
    return c


def detector_config(config, num_classes: int) -> DetectorConfig:
    d = dict(config.detector)
    for k in ("strides", "anchor_sizes", "aspect_ratios"):
        d[k] = tuple(d[k])
    return DetectorConfig(num_classes=num_classes, **d)


def compute_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32
    return jnp.dtype(name)


def total_steps(config, examples: int) -> int:
    return max(1, math.ceil(config.epochs * examples / config.batch_size))


def make_optimizer(config, params, steps: int) -> optax.GradientTransformation:
    """AdamW with two learning rates (encoders / everything else), both warm-up + cosine."""
    warmup = max(1, int(config.warmup_fraction * steps))

    def schedule(peak):
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), 0.0)

    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: "backbone" if is_backbone(core.param_name(path)) else "head", params)
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


def _manager(out: str, config) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.abspath(os.path.join(out, "checkpoints")),
                                 options=ocp.CheckpointManagerOptions(
                                     max_to_keep=config.keep_checkpoints, create=True))


def train(config, out: str, model: Detector, examples: list, num_classes: int, *,
          progress: bool = True, stop_at: int | None = None):
    """Train `model` on `examples` (`data.DetectionExample`s at the detection size) into `out`,
    resuming from its newest checkpoint. Returns (graphdef, state, info): info holds
    `steps` (the run's total), `start` (the step it resumed from) and `compiles` (how many
    times the train step was compiled in this call: 1, or 0 when no step was taken).
    `stop_at`: stop after that step with a checkpoint, as an interrupt would."""
    cfg = model.cfg
    steps = total_steps(config, len(examples))
    trainer.use_compilation_cache(config, out)
    graphdef, state, tx = init_state(model, config, steps)
    del model
    mesh = sharding.make_mesh(config.sharding)
    step_fn, state = sharding.jit_step(make_train_step(graphdef, tx, config.seed), state, mesh,
                                       config.sharding)
    manager = _manager(out, config)
    start = manager.latest_step() or 0
    if start:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        log.info("resumed detection training from %s at step %d", out, start)
    runs.truncate_logs(out, start)
    info = {"steps": steps, "start": start, "compiles": 0}
    if start >= steps:
        log.info("%s already holds a checkpoint at step %d of %d: nothing to train", out, start,
                 steps)
        manager.close()
        return graphdef, state, info
    counts = data.class_instance_counts(examples, num_classes)
    rare = data.rare_classes(counts, config.copy_paste_threshold)
    donors = data.rare_donors(examples, rare)
    sampler = data.InstanceAwareSampler(data.instance_aware_weights(examples, num_classes),
                                        config.seed)
    stop = runs.GracefulStop()
    done = start
    metrics_path = os.path.join(out, "metrics.jsonl")
    bar = tqdm(total=steps, initial=start, desc="detect train", unit="step", disable=not progress)
    try:
        with stop, open(metrics_path, "a", encoding="utf-8") as metrics_file:
            t_last, n_last, n_pasted = time.perf_counter(), 0, 0
            for step in range(start, steps):
                if stop.requested or (stop_at is not None and step >= stop_at):
                    break
                batch = make_batch(examples, sampler.indices(step, config.batch_size), cfg,
                                   config, rare, step, donors)
                n_pasted += int(batch.pop("pasted").sum())
                state, metrics = step_fn(state, sharding.put_batch(batch, mesh))
                done, n_last = step + 1, n_last + config.batch_size
                bar.update(1)
                if done % config.log_every == 0 or done == steps:
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    if not np.isfinite(metrics["loss"]):
                        raise FloatingPointError(f"detection loss became {metrics['loss']} at "
                                                 f"step {done}; lower head_lr / backbone_lr")
                    now = time.perf_counter()
                    metrics.update(step=done, examples_per_sec=n_last / (now - t_last),
                                   copy_paste_rate=n_pasted / max(1, n_last))
                    t_last, n_last, n_pasted = now, 0, 0
                    metrics_file.write(json.dumps(metrics) + "\n")
                    metrics_file.flush()
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}")
                if done % config.checkpoint_every == 0:
                    manager.save(done, args=ocp.args.StandardSave(state), force=True)
            # the last step taken: the end, a stop_at, or a SIGINT / SIGTERM
            if done > start and done not in manager.all_steps():
                manager.save(done, args=ocp.args.StandardSave(state), force=True)
    finally:
        bar.close()
        manager.wait_until_finished()
        manager.close()
    if stop.requested and done < steps:
        log.warning("stopped at step %d of %d (%s); rerun the same command to continue", done,
                    steps, stop.requested)
    info["compiles"] = step_fn._cache_size()
    return graphdef, state, info


def predict(graphdef, params, examples: list, batch_size: int) -> list[tuple]:
    """Detections per example: (boxes [D, 4], scores [D], labels [D]) in the example's pixels."""
    detect = jax.jit(lambda p, images: rcnn.detect(nnx.merge(graphdef, p),
                                                   pixel_ops.normalize(images)))
    out = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        images = np.stack([ex.image for ex in chunk])
        pad = batch_size - len(chunk)
        if pad:
            images = np.concatenate([images, np.zeros((pad,) + images.shape[1:], images.dtype)])
        res = jax.device_get(detect(params, images))
        for i in range(len(chunk)):
            keep = res["valid"][i]
            out.append((res["boxes"][i][keep], res["scores"][i][keep], res["labels"][i][keep]))
    return out
