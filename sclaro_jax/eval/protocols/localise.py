"""Relation localisation (ScenarioCLIP appendix, "relation localisation"; docs/design.md,
section 3).

For every annotated relation (subject, predicate, object) of a record:

- **input**: the image with every pixel outside the union of the subject's and the object's
  bounding boxes set to zero (a pixel is inside a box when its centre is:
  `sclaro_jax.data.images.box_mask`, the rule of the demo's box masks);
- **target**: the relation mask, the union of the subject's and the object's masks. Records with
  `mask_kind == "box"` (the demo) used the boxes themselves as the masks, so the target is the
  union of the two boxes. Records with `mask_kind == "panoptic"` (PSG's import) hold the
  dataset's own segment masks when imported with `--keep-originals` (`sclaro_jax.data.panoptic`: the
  panoptic PNG and each object's segment id), so the target is the union of the two segments; a
  panoptic record without them (an import from before they were kept) raises `LocaliseError`
  naming the import command. Records with `mask_kind == "sam"` store only the focused-region
  image, not the SAM masks, and the masks cannot be recovered from it reliably: inside the masks the
  region is `rint(image * M)` with M the RBF blend of appendix Eqs. 4-6, which depends on the
  masks' centres of mass (not stored) and is close to 1 near them; outside it is the image
  blurred with sigma 2, which equals the image wherever the image is flat; and JPEG coding of
  the region blurs both cases further. So "sam" records raise `LocaliseError` unless a
  `mask_fn(sample, relation_index) -> bool [H, W]` is passed that supplies the masks (e.g. from
  the SAM outputs kept by the data preparation run).

Both are brought to the encoder's input size S by the evaluation view of relation regions
(`augment.region_view`: Resize(S) + CenterCrop(S), bicubic; the mask resampled the same way and
thresholded at 1/2), so prediction, target and metrics live on that S x S grid.

Model: the relation pair's vision tower; its last hidden state (the final encoder layer's
output, before the post-LayerNorm, which Hugging Face calls `last_hidden_state`) without the
class token, reshaped to [h, w, D] (row-major patch order, as `clip.patchify` lays patches out);
`MaskDecoder` (Conv3x3-256-ReLU-Conv3x3-64-ReLU-Conv1x1-1, SAME padding) gives patch-level
logits, bilinearly upsampled (half-pixel centres) to S x S, then a sigmoid. Loss: mean squared
error between the sigmoid and the {0, 1} target; Adam, learning rate 1e-4. Variants: `frozen`
(only the decoder is trained) and `trainable` (the encoder is trained too; the caller's model is
never modified: training works on a functional copy of its parameters).

Metrics on the test split (`segmentation_metrics`): Dice and IoU of the prediction thresholded
at 0.5 (sigmoid >= 0.5), and the mean absolute error between the sigmoid and the target, each
computed per relation and averaged over relations. Empty masks: Dice = IoU = 1 when prediction
and target are both empty, 0 when exactly one is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from PIL import Image

from sclaro_jax import ops
from sclaro_jax.data import augment, panoptic, schema
from sclaro_jax.data.images import box_mask
from sclaro_jax.eval.encoders import Batcher
from sclaro_jax.eval.protocols import registry
from sclaro_jax.eval.protocols.embedding import read_samples

VARIANTS = ("frozen", "trainable")
MaskFn = Callable[[schema.Sample, int], np.ndarray]


class LocaliseError(ValueError):
    """Relation localisation cannot run on what was given; the message says why."""


# --------------------------------------------------------------------------- masks and inputs

def _relation(sample: schema.Sample, index: int) -> schema.Relation:
    if not 0 <= index < len(sample.relations):
        raise LocaliseError(f"sample {sample.id!r} has {len(sample.relations)} relations; "
                            f"no relation {index}")
    return sample.relations[index]


def relation_box_union(sample: schema.Sample, index: int) -> np.ndarray:
    """bool [H, W]: the union of relation `index`'s subject and object boxes."""
    rel = _relation(sample, index)
    w, h = int(sample.width), int(sample.height)
    return (box_mask(sample.objects[rel.subject].box, w, h)
            | box_mask(sample.objects[rel.object].box, w, h))


def relation_mask(sample: schema.Sample, index: int, mask_fn: MaskFn | None = None, *,
                  ids: np.ndarray | None = None) -> np.ndarray:
    """bool [H, W]: relation `index`'s target mask (the union of its subject and object masks).

    `mask_fn(sample, index)` supplies it when given; otherwise `mask_kind == "box"` records use
    the union of the two boxes, `"panoptic"` records the union of the two segments of their
    stored panoptic PNG (`ids`: its `panoptic.ids`, when already decoded), and `"sam"`
    records raise `LocaliseError` (the record does not store the masks; see the module
    docstring)."""
    if mask_fn is not None:
        mask = np.asarray(mask_fn(sample, index), bool)
        if mask.shape != (int(sample.height), int(sample.width)):
            raise LocaliseError(f"mask_fn gave a {mask.shape} mask for sample {sample.id!r} "
                                f"of size {sample.height}x{sample.width} (H x W)")
        return mask
    if sample.mask_kind == "box":
        return relation_box_union(sample, index)
    if sample.mask_kind == "panoptic" and sample.panoptic is not None:
        rel = _relation(sample, index)
        try:
            ids = panoptic.ids(sample) if ids is None else ids
        except panoptic.PanopticError as e:
            raise LocaliseError(str(e)) from None
        return (panoptic.object_mask(sample, rel.subject, ids)
                | panoptic.object_mask(sample, rel.object, ids))
    if sample.mask_kind == "panoptic":
        raise LocaliseError(
            f"sample {sample.id!r} has mask_kind 'panoptic' but holds no panoptic masks (an "
            "import from before they were kept with the photographs): import it again with "
            "`python -m data_prep import ... --keep-originals`, or pass "
            "mask_fn=(sample, relation_index) -> bool [H, W]")
    raise LocaliseError(
        f"sample {sample.id!r} has mask_kind {sample.mask_kind!r}: its relation masks are not "
        "stored in the record (only the focused-region image, from which they cannot be "
        "recovered reliably); pass mask_fn=(sample, relation_index) -> bool [H, W] with the "
        "SAM or panoptic masks, or evaluate on box-mask data")


def relation_input(image: np.ndarray, sample: schema.Sample, index: int) -> np.ndarray:
    """uint8 [H, W, 3]: `image` with the pixels outside the union of relation `index`'s
    subject and object boxes set to zero."""
    image = np.asarray(image)
    if image.shape != (int(sample.height), int(sample.width), 3):
        raise LocaliseError(f"image of shape {image.shape} for sample {sample.id!r} of size "
                            f"{sample.height}x{sample.width}")
    return np.where(relation_box_union(sample, index)[..., None], image, 0).astype(np.uint8)


def relation_examples(samples: Iterable[schema.Sample], image_size: int, *,
                      mask_fn: MaskFn | None = None, max_relations: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(inputs uint8 [N, S, S, 3], targets float32 {0, 1} [N, S, S]) for every relation of
    `samples` (in order, at most `max_relations`), at the encoder's input size S (Resize +
    CenterCrop evaluation view; the mask resampled the same way and thresholded at 1/2).
    Needs the full-size photographs: `schema.MissingOriginalsError` for a version-2 record
    written without them."""
    inputs, targets = [], []
    for sample in samples:
        if max_relations is not None and len(inputs) >= max_relations:
            break
        image = np.asarray(schema.decode_image(schema.original_image(sample),
                                               f"sample {sample.id!r} image"))
        ids = (panoptic.ids(sample) if mask_fn is None and sample.relations
               and sample.mask_kind == "panoptic" and sample.panoptic is not None else None)
        for j in range(len(sample.relations)):
            if max_relations is not None and len(inputs) >= max_relations:
                break
            mask = relation_mask(sample, j, mask_fn, ids=ids)
            view = augment.region_view(Image.fromarray(relation_input(image, sample, j)), None,
                                       image_size)
            m = augment.resize_centre_crop(Image.fromarray(mask.astype(np.uint8) * 255, "L"),
                                           image_size)
            inputs.append(view)
            targets.append((np.asarray(m) >= 128).astype(np.float32))
    if not inputs:
        return (np.zeros((0, image_size, image_size, 3), np.uint8),
                np.zeros((0, image_size, image_size), np.float32))
    return np.stack(inputs), np.stack(targets)


# --------------------------------------------------------------------------- model

def vision_tower(model, level: str = "relation"):
    """The vision tower to use: `model.pair(level).vision_model` for ScenarioCLIP /
    PyramidCLIP, `model.vision_model` for a CLIPPair / CLIPModel, or `model` itself when it
    is a tower (callable as `tower(pixels) -> (last hidden state [B, 1 + h*w, D], pooled)`)."""
    if hasattr(model, "pair"):
        return model.pair(level).vision_model
    if hasattr(model, "vision_model"):
        return model.vision_model
    if callable(model):
        return model
    raise TypeError(f"cannot find a vision tower in {type(model).__name__}")


def patch_grid(hidden: jax.Array) -> jax.Array:
    """Last hidden state [B, 1 + h*w, D] -> patch tokens [B, h, w, D] (class token dropped,
    row-major patch order)."""
    b, n, d = hidden.shape
    side = math.isqrt(n - 1)
    if side * side != n - 1:
        raise LocaliseError(f"{n - 1} patch tokens do not form a square grid")
    return hidden[:, 1:].reshape(b, side, side, d)


class MaskDecoder(nnx.Module):
    """Conv3x3-256-ReLU-Conv3x3-64-ReLU-Conv1x1-1 on a [B, h, w, D] feature map -> logits
    [B, h, w, 1] (float32, SAME padding)."""

    def __init__(self, in_features: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(in_features, 256, (3, 3), padding="SAME", rngs=rngs)
        self.conv2 = nnx.Conv(256, 64, (3, 3), padding="SAME", rngs=rngs)
        self.conv3 = nnx.Conv(64, 1, (1, 1), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.conv1(x.astype(jnp.float32)))
        x = jax.nn.relu(self.conv2(x))
        return self.conv3(x)


def predict_masks(tower, decoder: MaskDecoder, pixels: jax.Array) -> jax.Array:
    """CLIP-normalised pixels [B, S, S, 3] -> mask probabilities [B, S, S]: patch tokens,
    decoder logits, bilinear upsampling to S x S, sigmoid."""
    hidden, _ = tower(pixels)
    logits = decoder(patch_grid(hidden.astype(jnp.float32)))
    b, s = pixels.shape[0], pixels.shape[1]
    up = jax.image.resize(logits, (b, s, pixels.shape[2], 1), method="bilinear")
    return jax.nn.sigmoid(up[..., 0])


@dataclasses.dataclass
class Localiser:
    """A trained localiser: the encoder (a copy when trained) and decoder, and the loss per
    step."""

    tower: nnx.Module
    decoder: MaskDecoder
    losses: list[float]
    variant: str

    def predict(self, inputs: np.ndarray, batch_size: int = 32) -> np.ndarray:
        """uint8 [N, S, S, 3] inputs -> float32 probabilities [N, S, S]."""
        g_t, s_t = nnx.split(self.tower)
        g_d, s_d = nnx.split(self.decoder)

        @jax.jit
        def run(s_t, s_d, x):
            return predict_masks(nnx.merge(g_t, s_t), nnx.merge(g_d, s_d), x)

        if len(inputs) == 0:
            return np.zeros(inputs.shape[:3], np.float32)
        batcher = Batcher(lambda x: run(s_t, s_d, ops.normalize(x)),
                          min(batch_size, len(inputs)))
        batcher.push(inputs)
        return batcher.result()


def train_localiser(tower: nnx.Module, inputs: np.ndarray, targets: np.ndarray, *,
                    variant: str = "frozen", epochs: int = 1, max_steps: int | None = None,
                    batch_size: int = 16, learning_rate: float = 1e-4, seed: int = 0
                    ) -> Localiser:
    """Train a `MaskDecoder` (and, `variant="trainable"`, the tower too) on `inputs` uint8
    [N, S, S, 3] / `targets` {0, 1} [N, S, S] with MSE on the sigmoid and Adam.

    Runs `epochs` passes of ceil(N / batch_size) steps (each epoch a new shuffle; the last batch
    of an epoch is filled up with the epoch's first examples so every step has the same shape),
    stopping after `max_steps` steps if given. `tower` is not modified: the returned
    `Localiser.tower` is a trained copy (trainable) or `tower` itself (frozen)."""
    if variant not in VARIANTS:
        raise LocaliseError(f"variant {variant!r} is not one of {VARIANTS}")
    n = len(inputs)
    if n == 0:
        raise LocaliseError("no training relations")
    if targets.shape != inputs.shape[:3]:
        raise LocaliseError(f"targets {targets.shape} do not match inputs {inputs.shape}")
    g_t, p_t, rest_t = nnx.split(tower, nnx.Param, ...)
    probe = jax.eval_shape(lambda x: tower(x)[0],
                           jax.ShapeDtypeStruct((1,) + inputs.shape[1:], jnp.float32))
    decoder = MaskDecoder(probe.shape[-1], rngs=nnx.Rngs(seed))
    g_d, p_d = nnx.split(decoder, nnx.Param)
    trainable = variant == "trainable"
    params = (p_t, p_d) if trainable else p_d
    opt = optax.adam(learning_rate)
    opt_state = opt.init(params)

    def loss_fn(params, frozen_t, x, y):
        pt, pd = params if trainable else (frozen_t, params)
        probs = predict_masks(nnx.merge(g_t, pt, rest_t), nnx.merge(g_d, pd), x)
        return jnp.mean((probs - y) ** 2)

    @jax.jit
    def step(params, opt_state, frozen_t, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, frozen_t, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    bs = min(batch_size, n)
    per_epoch = math.ceil(n / bs)
    total = epochs * per_epoch if max_steps is None else min(epochs * per_epoch, max_steps)
    rng = np.random.default_rng(seed)
    losses: list[float] = []
    order = np.zeros(0, np.int64)
    for k in range(total):
        if k % per_epoch == 0:
            perm = rng.permutation(n)
            order = np.concatenate([perm, perm[:per_epoch * bs - n]])
        idx = order[(k % per_epoch) * bs:(k % per_epoch + 1) * bs]
        params, opt_state, loss = step(params, opt_state, p_t,
                                       ops.normalize(inputs[idx]), targets[idx])
        losses.append(float(loss))
    if trainable:
        p_t, p_d = params
        tower = nnx.merge(g_t, p_t, rest_t)
    else:
        p_d = params
    return Localiser(tower, nnx.merge(g_d, p_d), losses, variant)


# --------------------------------------------------------------------------- metrics

def per_example_metrics(probs: np.ndarray, targets: np.ndarray, threshold: float = 0.5
                        ) -> dict[str, np.ndarray]:
    """Per-example Dice, IoU (prediction = probs >= threshold) and MAE (mean |probs - target|)
    for probs / targets [N, H, W]; Dice = IoU = 1 where both masks are empty."""
    probs = np.asarray(probs, np.float64)
    targets = np.asarray(targets, np.float64)
    if probs.shape != targets.shape or probs.ndim != 3:
        raise LocaliseError(f"probs {probs.shape} and targets {targets.shape} must both be "
                            "[N, H, W]")
    pred = probs >= threshold
    truth = targets >= 0.5
    inter = (pred & truth).sum((1, 2)).astype(np.float64)
    sizes = pred.sum((1, 2)) + truth.sum((1, 2)).astype(np.float64)
    union = (pred | truth).sum((1, 2)).astype(np.float64)
    empty = sizes == 0
    dice = np.where(empty, 1.0, 2 * inter / np.where(empty, 1.0, sizes))
    iou = np.where(empty, 1.0, inter / np.where(empty, 1.0, union))
    mae = np.abs(probs - targets).mean((1, 2))
    return {"dice": dice, "iou": iou, "mae": mae}


def segmentation_metrics(probs: np.ndarray, targets: np.ndarray, threshold: float = 0.5
                         ) -> dict[str, float]:
    """Mean over examples of `per_example_metrics`: {"dice", "iou", "mae"}."""
    per = per_example_metrics(probs, targets, threshold)
    if len(per["dice"]) == 0:
        raise LocaliseError("no examples to score")
    return {k: float(v.mean()) for k, v in per.items()}


# --------------------------------------------------------------------------- end to end

def evaluate_localisation(model, data_dir: str, *, variant: str = "frozen", epochs: int = 1,
                          max_steps: int | None = None, batch_size: int = 16,
                          learning_rate: float = 1e-4, level: str = "relation",
                          image_size: int | None = None, train_split: str = "train",
                          test_split: str = "test", max_relations: int | None = None,
                          mask_fn: MaskFn | None = None, seed: int = 0) -> dict:
    """Train the relation-localisation decoder on `train_split` of the SCLARO dataset at
    `data_dir` and score it on `test_split`. The records must hold the full-size photographs
    (version 1, or version 2 written with --keep-originals): `schema.MissingOriginalsError`
    naming the dataset, the sample and the fix otherwise.

    `model`: ScenarioCLIP / PyramidCLIP (its `level` pair's vision tower is used), a CLIPPair
    or a vision tower. `image_size` defaults to the tower's configured input size. Returns
    {"variant", "level", "dice", "iou", "mae", "num_train", "num_test", "test_empty_targets",
    "steps", "first_loss", "last_loss", "image_size"}."""
    tower = vision_tower(model, level)
    if image_size is None:
        cfg = getattr(getattr(model, "pair", lambda _: model)(level), "config", None)
        if cfg is None:
            raise LocaliseError("pass image_size: the model has no CLIP config to read it from")
        image_size = cfg.vision.image_size
    kw = dict(mask_fn=mask_fn, max_relations=max_relations)
    try:
        x_train, y_train = relation_examples(read_samples(data_dir, train_split), image_size,
                                             **kw)
        x_test, y_test = relation_examples(read_samples(data_dir, test_split), image_size, **kw)
    except schema.MissingOriginalsError as e:
        raise schema.MissingOriginalsError(
            f"{data_dir}: relation localisation needs the full-size photographs, which this "
            f"dataset does not keep: {e}") from None
    if len(x_test) == 0:
        raise LocaliseError(f"{data_dir}: split {test_split!r} has no relations to score")
    loc = train_localiser(tower, x_train, y_train, variant=variant, epochs=epochs,
                          max_steps=max_steps, batch_size=batch_size,
                          learning_rate=learning_rate, seed=seed)
    scores = segmentation_metrics(loc.predict(x_test, batch_size), y_test)
    return {"variant": variant, "level": level, **scores, "num_train": int(len(x_train)),
            "num_test": int(len(x_test)),
            "test_empty_targets": int((y_test.reshape(len(y_test), -1).max(1) == 0).sum()),
            "steps": len(loc.losses), "first_loss": loc.losses[0], "last_loss": loc.losses[-1],
            "image_size": int(image_size)}


@registry.register("localisation")
class Localisation(registry.Evaluator):
    """`evaluate_localisation` of each of `variants`, trained on `train_split`, scored on the
    evaluator's split; yields (variant, result). Options: `variants`, `epochs`,
    `max_relations`, `train_split`, `level`, `batch_size`, `learning_rate`, `seed`."""

    def __init__(self, *, variants: Sequence[str] = VARIANTS, epochs: int = 1,
                 max_relations: int | None = None, train_split: str = "train",
                 level: str = "relation", batch_size: int = 16, learning_rate: float = 1e-4,
                 seed: int = 0, **common):
        super().__init__(**common)
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"evaluator {self.name!r}: unknown variants {unknown}; known: "
                             f"{VARIANTS}")
        self.variants = tuple(variants)
        self.options = dict(epochs=epochs, max_relations=max_relations, level=level,
                            train_split=train_split, batch_size=batch_size,
                            learning_rate=learning_rate, seed=seed)

    def run(self, model):
        for variant in self.variants:
            yield variant, evaluate_localisation(
                model, self.data_dir, variant=variant, image_size=self.image_size or None,
                test_split=self.split, **self.options)
