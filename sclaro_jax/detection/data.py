"""Detection examples from SCLARO records, class statistics, sampling and copy-paste (host side).

Conventions:
- An example's `image` is RGB uint8 [H, W, 3] (channels last); `boxes` are float32 [K, 4]
  (x0, y0, x1, y1) in pixels of that image, x1/y1 exclusive (as in the records), so a box's
  area is (x1 - x0) * (y1 - y0) and a box lies inside the image when 0 <= x0 < x1 <= W and
  0 <= y0 < y1 <= H; `labels` are int32 [K] indices into a class list (by default the dataset's
  `objects` vocabulary).
- Class statistics count the TRAINING examples passed in: `class_instance_counts` (boxes per
  class), `class_image_counts` (images holding the class). LVIS's frequency groups
  (`class_frequency_groups`) and the rare classes that copy-paste targets (`rare_classes`) come
  from them.
- Sampling is deterministic in (seed, step) (`InstanceAwareSampler`), so a resumed run draws
  the same batches; `copy_paste` takes an explicit `np.random.Generator`.
- Detection input (`resize_for_detection`): "squash" resizes to size x size (aspect not kept);
  "longest_side" (ViTDet's) resizes so the long side equals size, aspect kept, and pads the
  bottom / right to size x size. The example then records its content region
  (`content_size`, the unpadded top-left part) and the size of the image it came from
  (`original_size`); `boxes_to_original` maps detections back to that image's pixels.

Everything here is numpy + PIL; no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from PIL import Image

from sclaro_jax.data import schema
from sclaro_jax.data.dataset import DatasetError, open_dataset

OCCLUDED = 0.9  # copy_paste removes boxes at least this much covered by pasted patches
RESIZE_MODES = ("squash", "longest_side")
# The padding pixel of "longest_side": CLIP's mean colour in uint8 (round(255 * mean)), so the
# padding normalises to about 0, as in ViTDet / detectron2, which pad the normalised image with 0.
PAD_PIXEL = (123, 117, 104)


@dataclasses.dataclass
class DetectionExample:
    """One image with its boxes (x0, y0, x1, y1 pixels of `image`) and class indices.

    `content_size` (height, width): the top-left part of `image` that holds the picture, the
    rest being padding (None: the whole image). `original_size` (height, width): the size of the
    image this one was resized from, whose pixels `boxes_to_original` maps back to (None: not
    resized). The boxes scale by (content width / original width, content height / original
    height) from the original to this image."""
    id: str
    image: np.ndarray  # uint8 [H, W, 3]
    boxes: np.ndarray  # float32 [K, 4]
    labels: np.ndarray  # int32 [K]
    content_size: tuple | None = None
    original_size: tuple | None = None

    def __post_init__(self):
        self.boxes = np.asarray(self.boxes, np.float32).reshape(-1, 4)
        self.labels = np.asarray(self.labels, np.int32).reshape(-1)
        if len(self.boxes) != len(self.labels):
            raise ValueError(f"example {self.id!r}: {len(self.boxes)} boxes but "
                             f"{len(self.labels)} labels")

    @property
    def content(self) -> tuple[int, int]:
        """(height, width) of the content region (the whole image when not padded)."""
        return tuple(self.content_size) if self.content_size is not None \
            else tuple(self.image.shape[:2])

    @property
    def scale(self) -> tuple[float, float]:
        """(sx, sy): pixels of this image per pixel of the original ((1, 1) if not resized)."""
        if self.original_size is None:
            return 1.0, 1.0
        (ch, cw), (oh, ow) = self.content, self.original_size
        return cw / ow, ch / oh


def clip_boxes(boxes: np.ndarray, width: int, height: int) -> np.ndarray:
    """Boxes clipped to the image [0, width] x [0, height] (float32 [K, 4])."""
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4).copy()
    boxes[:, 0::2] = np.clip(boxes[:, 0::2], 0, width)
    boxes[:, 1::2] = np.clip(boxes[:, 1::2], 0, height)
    return boxes


def _nonempty(boxes: np.ndarray) -> np.ndarray:
    return (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])


def load_examples(root: str, split: str, *, classes: Sequence[str] | None = None
                  ) -> tuple[list[DetectionExample], list[str]]:
    """Every record of `split` in the dataset folder `root` as a DetectionExample, and the class
    list its labels index.

    The image is the original photograph when the records keep it, else the stored training
    image (`train_image`, a downscale); the records' boxes (original pixels) are scaled to that
    image's size and clipped to it. `classes` defaults to the dataset's objects vocabulary;
    objects whose name is not in `classes`, and boxes that are empty after clipping, are
    dropped. A record with neither image raises DatasetError naming the folder, split and
    record.
    """
    ds = open_dataset(root)
    classes = list(ds.vocab.objects) if classes is None else [str(c) for c in classes]
    lookup = {name: i for i, name in enumerate(classes)}
    if len(lookup) != len(classes):
        raise ValueError("classes holds a name twice")
    examples = []
    for sample in ds.samples(split):
        data = sample.image if sample.image is not None else sample.train_image
        if data is None:
            raise DatasetError(
                f"{ds.root}: split {split!r}, record {sample.id!r} holds no image (neither the "
                "original photograph nor a training image); detection needs one of them")
        image = np.asarray(schema.decode_image(data, f"record {sample.id!r}'s image"))
        height, width = image.shape[:2]
        sx, sy = width / sample.width, height / sample.height
        keep = [(o.box, lookup[o.name]) for o in sample.objects if o.name in lookup]
        boxes = np.array([b for b, _ in keep], np.float64).reshape(-1, 4)
        boxes = clip_boxes(boxes * np.array([sx, sy, sx, sy]), width, height)
        labels = np.array([c for _, c in keep], np.int32)
        ok = _nonempty(boxes)
        examples.append(DetectionExample(sample.id, image, boxes[ok], labels[ok]))
    return examples, classes


def class_instance_counts(examples: Sequence[DetectionExample], num_classes: int) -> np.ndarray:
    """int64 [C]: the number of boxes of each class over `examples`."""
    labels = [e.labels for e in examples]
    labels = np.concatenate(labels) if labels else np.zeros(0, np.int32)
    return np.bincount(labels, minlength=num_classes)[:num_classes].astype(np.int64)


def class_image_counts(examples: Sequence[DetectionExample], num_classes: int) -> np.ndarray:
    """int64 [C]: the number of examples holding at least one box of each class."""
    labels = [np.unique(e.labels) for e in examples]
    labels = np.concatenate(labels) if labels else np.zeros(0, np.int32)
    return np.bincount(labels, minlength=num_classes)[:num_classes].astype(np.int64)


def instance_aware_weights(examples: Sequence[DetectionExample], num_classes: int
                           ) -> np.ndarray:
    """float64 [N] sampling weights summing to 1 (the LVIS-style "instance-aware" family:
    inverse per-class instance frequency).

    Rule: with n_c the number of boxes of class c over `examples` (the training set), an
    image's weight is the MAXIMUM over the classes present in it of 1 / n_c, so an image is
    drawn as often as its rarest class asks. Images without boxes get the smallest nonzero
    weight of the others (all images equal when none has a box). Then normalised to sum 1.
    """
    n = len(examples)
    if n == 0:
        raise ValueError("instance_aware_weights needs at least one example")
    counts = class_instance_counts(examples, num_classes).astype(np.float64)
    weights = np.zeros(n, np.float64)
    for i, e in enumerate(examples):
        if len(e.labels):
            weights[i] = np.max(1.0 / counts[e.labels])
    positive = weights > 0
    weights[~positive] = weights[positive].min() if positive.any() else 1.0
    return weights / weights.sum()


class InstanceAwareSampler:
    """Draws batches of example indices with replacement, P(i) = weights[i].

    `indices(step, batch_size)` depends only on (seed, step) (a fresh
    `np.random.default_rng([seed, step])` each call), so training resumed at a step draws
    exactly the batches the interrupted run would have.
    """

    def __init__(self, weights: np.ndarray, seed: int):
        weights = np.asarray(weights, np.float64).reshape(-1)
        if len(weights) == 0 or not np.all(np.isfinite(weights)) or np.any(weights < 0) \
                or weights.sum() <= 0:
            raise ValueError("sampler weights must be finite, non-negative and not all zero")
        self.weights = weights / weights.sum()
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.weights)

    def indices(self, step: int, batch_size: int) -> np.ndarray:
        """int64 [batch_size] indices into the examples for training step `step` (>= 0)."""
        rng = np.random.default_rng([self.seed, int(step)])
        return rng.choice(len(self.weights), size=int(batch_size), replace=True,
                          p=self.weights).astype(np.int64)


def rare_donors(examples: Sequence[DetectionExample], rare: np.ndarray) -> np.ndarray:
    """int64 indices of the examples holding at least one box of a class marked in `rare`
    (bool [C]): the donors of class-targeted copy-paste."""
    rare = np.asarray(rare, bool)
    return np.array([i for i, e in enumerate(examples)
                     if np.any(rare[e.labels[(e.labels >= 0) & (e.labels < len(rare))]])],
                    np.int64)


def rare_classes(counts: np.ndarray, threshold: int = 50) -> np.ndarray:
    """bool [C]: classes seen at least once but fewer than `threshold` times in `counts`."""
    counts = np.asarray(counts)
    return (counts > 0) & (counts < threshold)


def class_frequency_groups(image_counts: np.ndarray) -> np.ndarray:
    """'r' / 'c' / 'f' per class ('<U1' [C]) by LVIS's rule on the number of TRAINING images
    holding the class: rare 1-10 images, common 11-100, frequent more than 100. A class never
    seen in training (0 images) is rare."""
    counts = np.asarray(image_counts)
    return np.where(counts <= 10, "r", np.where(counts <= 100, "c", "f")).astype("<U1")


def _coverage(boxes: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The fraction of each box's area (continuous coordinates) lying on True pixels of `mask`
    ([H, W], pixel (r, c) covers [c, c+1) x [r, r+1))."""
    height, width = mask.shape
    cols, rows = np.arange(width), np.arange(height)
    out = np.zeros(len(boxes), np.float64)
    for k, (x0, y0, x1, y1) in enumerate(np.asarray(boxes, np.float64)):
        area = (x1 - x0) * (y1 - y0)
        if area <= 0:
            continue
        wx = np.clip(np.minimum(x1, cols + 1) - np.maximum(x0, cols), 0, None)
        wy = np.clip(np.minimum(y1, rows + 1) - np.maximum(y0, rows), 0, None)
        out[k] = wy @ mask.astype(np.float64) @ wx / area
    return out


def copy_paste(target: DetectionExample, donors: Sequence[DetectionExample], rare: np.ndarray,
               rng: np.random.Generator, max_pastes: int = 3) -> DetectionExample:
    """Class-targeted copy-paste: paste donor instances of RARE classes only into `target`.

    Between 1 and `max_pastes` instances (fewer when fewer exist) are drawn without replacement
    from the donors' boxes whose class is marked in `rare` (bool [C]). Each is cropped from its
    donor at whole pixels (floor of x0/y0, ceil of x1/y1), scaled down with PIL bilinear when
    larger than the target's content region (aspect kept, to fit), and pasted at a uniformly
    random position fully inside that region (the whole image unless padded, never the
    padding); its box (the donor box at its sub-pixel place in the patch) and label are
    appended. Target boxes, and earlier pasted boxes, that end up at least 90% (`OCCLUDED`)
    covered by later patches are REMOVED. Returns a new example (`target`
    is not modified); with no rare donor instance, a copy of `target`.
    """
    return copy_paste_count(target, donors, rare, rng, max_pastes)[0]


def copy_paste_count(target: DetectionExample, donors: Sequence[DetectionExample],
                     rare: np.ndarray, rng: np.random.Generator, max_pastes: int = 3
                     ) -> tuple[DetectionExample, int]:
    """`copy_paste` and the number of instances it pasted (0: `target` unchanged)."""
    rare = np.asarray(rare, bool)
    height, width = target.content
    candidates = [(d, k) for d, donor in enumerate(donors)
                  for k in range(len(donor.labels))
                  if 0 <= donor.labels[k] < len(rare) and rare[donor.labels[k]]
                  and _nonempty(clip_boxes(donor.boxes[k], *donor.image.shape[1::-1]))[0]]
    image = target.image.copy()
    if not candidates or max_pastes < 1 or height == 0 or width == 0:
        return dataclasses.replace(target, image=image, boxes=target.boxes.copy(),
                                   labels=target.labels.copy()), 0
    count = min(int(rng.integers(1, max_pastes + 1)), len(candidates))
    chosen = rng.choice(len(candidates), size=count, replace=False)
    patches, boxes, labels = [], [], []
    for c in chosen:
        donor = donors[candidates[c][0]]
        k = candidates[c][1]
        dh, dw = donor.image.shape[:2]
        bx0, by0, bx1, by1 = clip_boxes(donor.boxes[k], dw, dh)[0].astype(np.float64)
        x0, y0 = int(math.floor(bx0)), int(math.floor(by0))
        x1, y1 = max(int(math.ceil(bx1)), x0 + 1), max(int(math.ceil(by1)), y0 + 1)
        crop = donor.image[y0:y1, x0:x1]
        ch, cw = crop.shape[:2]
        sx = sy = 1.0
        if ch > height or cw > width:  # shrink to fit, aspect kept (up to whole pixels)
            scale = min(height / ch, width / cw)
            size = (min(width, max(1, int(cw * scale))), min(height, max(1, int(ch * scale))))
            crop = np.asarray(Image.fromarray(crop).resize(size, Image.BILINEAR))
            sx, sy = size[0] / cw, size[1] / ch
            ch, cw = crop.shape[:2]
        px = int(rng.integers(0, width - cw + 1))
        py = int(rng.integers(0, height - ch + 1))
        image[py:py + ch, px:px + cw] = crop
        box = np.array([px + (bx0 - x0) * sx, py + (by0 - y0) * sy,
                        px + (bx1 - x0) * sx, py + (by1 - y0) * sy])
        patches.append((px, py, cw, ch))
        boxes.append(clip_boxes(box, width, height)[0])
        labels.append(int(donor.labels[k]))
    # Coverage by later patches: walk the pastes backwards, growing the mask.
    covered = np.zeros((height, width), bool)
    keep_pasted = np.ones(count, bool)
    for i in range(count - 1, -1, -1):
        keep_pasted[i] = _coverage(boxes[i][None], covered)[0] < OCCLUDED
        px, py, cw, ch = patches[i]
        covered[py:py + ch, px:px + cw] = True
    if len(target.boxes):
        keep_old = _coverage(clip_boxes(target.boxes, width, height), covered) < OCCLUDED
    else:
        keep_old = np.zeros(0, bool)
    new_boxes = np.concatenate([target.boxes[keep_old],
                                np.array(boxes, np.float32).reshape(-1, 4)[keep_pasted]])
    new_labels = np.concatenate([target.labels[keep_old],
                                 np.array(labels, np.int32)[keep_pasted]])
    return dataclasses.replace(target, image=image, boxes=new_boxes, labels=new_labels), count


def resize_for_detection(example: DetectionExample, size: int, mode: str = "squash"
                         ) -> DetectionExample:
    """The (unpadded) example as a `size` x `size` detection input, PIL bilinear.

    mode "squash": resized to size x size, aspect NOT kept; boxes scaled by (size / W,
    size / H). mode "longest_side" (ViTDet's test-time input): resized to (w, h) =
    (round(W * s), round(H * s)), s = size / max(W, H), so the long side is `size` and the
    aspect is kept, then pasted at the top-left of a size x size canvas of `PAD_PIXEL`; boxes
    scaled by (w / W, h / H), so they lie in the content region and never in the padding. The
    result records `content_size` (h, w) and `original_size` (H, W)."""
    if mode not in RESIZE_MODES:
        raise ValueError(f"unknown resize mode {mode!r}; known: {', '.join(RESIZE_MODES)}")
    if example.original_size is not None:
        raise ValueError(f"example {example.id!r} is resized already; resize the original")
    height, width = example.image.shape[:2]
    if mode == "squash":
        new_w = new_h = int(size)
    else:
        s = size / max(width, height)
        new_w = min(size, max(1, int(math.floor(width * s + 0.5))))
        new_h = min(size, max(1, int(math.floor(height * s + 0.5))))
    resized = np.asarray(Image.fromarray(example.image).resize((new_w, new_h), Image.BILINEAR))
    if (new_h, new_w) == (size, size):
        image = resized
    else:
        image = np.empty((size, size, 3), np.uint8)
        image[...] = np.asarray(PAD_PIXEL, np.uint8)
        image[:new_h, :new_w] = resized
    scale = np.array([new_w / width, new_h / height] * 2, np.float64)
    boxes = clip_boxes(example.boxes.astype(np.float64) * scale, new_w, new_h)
    return DetectionExample(example.id, image, boxes, example.labels.copy(),
                            content_size=(new_h, new_w), original_size=(height, width))


def boxes_to_original(boxes: np.ndarray, example: DetectionExample, min_size: float = 1e-2
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Detections in `example`'s pixels -> (boxes float32 [K, 4] in the pixels of the image it
    was resized from, keep bool [K]).

    Each box is clipped to the content region (so a box reaching into the padding ends at the
    picture's edge), boxes then narrower or lower than `min_size` detection pixels are marked
    not kept (torchvision's small-box rule, applied after its clip to the unpadded image), and
    the rest is divided by `example.scale` and clipped to the original image."""
    ch, cw = example.content
    boxes = clip_boxes(boxes, cw, ch).astype(np.float64)
    keep = ((boxes[:, 2] - boxes[:, 0]) >= min_size) & ((boxes[:, 3] - boxes[:, 1]) >= min_size)
    sx, sy = example.scale
    boxes = boxes / np.array([sx, sy, sx, sy])
    if example.original_size is not None:
        oh, ow = example.original_size
        boxes = clip_boxes(boxes, ow, oh)
    return boxes.astype(np.float32), keep


def pad_targets(boxes: np.ndarray, labels: np.ndarray, max_boxes: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fixed-size targets for jit: (boxes float32 [M, 4], labels int32 [M], valid bool [M]) with
    M = max_boxes. Beyond `max_boxes` the FIRST max_boxes boxes are kept (in the given order,
    not by area); padding rows are zero boxes with label 0 and valid False."""
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)[:max_boxes]
    labels = np.asarray(labels, np.int32).reshape(-1)[:max_boxes]
    n = len(boxes)
    out_boxes = np.zeros((max_boxes, 4), np.float32)
    out_labels = np.zeros(max_boxes, np.int32)
    valid = np.zeros(max_boxes, bool)
    out_boxes[:n], out_labels[:n], valid[:n] = boxes, labels, True
    return out_boxes, out_labels, valid
