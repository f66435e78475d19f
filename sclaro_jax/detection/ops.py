"""Detection primitives as pure jnp functions, numerically matching torchvision's.

Conventions: boxes are float32 [N, 4] (x0, y0, x1, y1) in image pixels; feature maps are one
image's [H, W, C] (channels-last, NHWC without the batch axis; vmap over images). Every function
has static output shapes and is jit-able: where torchvision returns a variable number of entries
(nms, sampling), these return a fixed size plus a bool validity mask, and they vmap over images.
Anchors are static numpy arrays computed at trace time. The reference numbers are torchvision's
CPU kernels (float32, stable score sort).

- `roi_align`, `multiscale_roi_align` (+ `roi_levels`, the LevelMapper): torchvision.ops.roi_align
  / MultiScaleRoIAlign.
- `box_area`, `box_iou`, `nms`, `batched_nms`: torchvision.ops.box_area / box_iou / nms /
  batched_nms.
- `encode_boxes`, `decode_boxes`: torchvision's BoxCoder.encode_single / decode_single.
- `cell_anchors`, `anchor_grid`: torchvision's AnchorGenerator.
- `clip_boxes`, `small_boxes_mask`: clip_boxes_to_image / remove_small_boxes.
- `match`: torchvision's Matcher; `sample_labels`: BalancedPositiveNegativeSampler's rule.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

BELOW_LOW_THRESHOLD = -1
BETWEEN_THRESHOLDS = -2
DEFAULT_BBOX_CLIP = math.log(1000.0 / 16)


# --------------------------------------------------------------------------- float32 as torchvision
def _rounded(product):
    """`product` as is, but kept rounded to float32 before a following add: XLA's CPU backend
    otherwise fuses a multiply-add into one FMA, which moves RoIAlign's sample points or an IoU
    by an ulp from torchvision's kernels (a select on the product stops the fusion; the values
    are equal)."""
    return jnp.where(jnp.isnan(product), jnp.nan, product)


def _divide(x, constant: float):
    """x / constant as a true float32 division. XLA turns a division by a constant into a
    multiplication by its rounded reciprocal, which is off by an ulp from torchvision's kernel
    (for non-powers of two); a divisor the compiler cannot fold keeps the division."""
    return x / jnp.where(jnp.isnan(x), jnp.nan, np.float32(constant))


# --------------------------------------------------------------------------- RoIAlign
def _axis_samples(start, bin_size, size, output_size: int, grid: int):
    """One axis of RoIAlign's sampling grid, with torchvision's bilinear border rules.

    start, bin_size [N], size (the map's extent on this axis) [N] -> (low, high) int32 [N, S*g],
    (w_low, w_high) float32 [N, S*g]; samples outside [-1, size] get zero weights."""
    p = jnp.repeat(jnp.arange(output_size, dtype=jnp.float32), grid)
    i = jnp.tile(jnp.arange(grid, dtype=jnp.float32) + 0.5, output_size)
    bin_size, size = bin_size[:, None], size[:, None]
    coord = (start[:, None] + _rounded(p * bin_size)) + _divide(i * bin_size, grid)
    inside = (coord >= -1.0) & (coord <= size)
    coord = jnp.clip(coord, 0.0, size)
    low = jnp.floor(coord).astype(jnp.int32)
    last = size.astype(jnp.int32) - 1
    edge = low >= last
    low = jnp.where(edge, last, low)
    high = jnp.where(edge, last, low + 1)
    coord = jnp.where(edge, low.astype(jnp.float32), coord)
    frac = coord - low.astype(jnp.float32)
    keep = inside.astype(jnp.float32)
    return low, high, (1.0 - frac) * keep, frac * keep


def _roi_align_flat(flat, boxes, scale, height, width, offset, output_size: int,
                    sampling_ratio: int, aligned: bool):
    """RoIAlign from `flat` [sum of H*W, C] (maps flattened row-major, one after the other), each
    box [N, 4] on its own map: spatial scale, height, width and start row in `flat` per box [N]."""
    if sampling_ratio <= 0:
        raise ValueError(f"sampling_ratio must be > 0 for a static grid, got {sampling_ratio}")
    boxes = jax.lax.stop_gradient(jnp.asarray(boxes, jnp.float32))  # as torchvision: no box grad
    s, g = int(output_size), int(sampling_ratio)
    start = _rounded(boxes * scale[:, None]) - np.float32(0.5 if aligned else 0.0)
    size = start[:, 2:] - start[:, :2]
    if not aligned:
        size = jnp.maximum(size, 1.0)
    bins = _divide(size, s)
    y0, y1, wy0, wy1 = _axis_samples(start[:, 1], bins[:, 1], height.astype(jnp.float32), s, g)
    x0, x1, wx0, wx1 = _axis_samples(start[:, 0], bins[:, 0], width.astype(jnp.float32), s, g)
    width, offset = width[:, None, None], offset[:, None, None]

    def corner(ys, xs, wy, wx):
        index = offset + ys[:, :, None] * width + xs[:, None, :]  # [N, Sg, Sg]
        return (wy[:, :, None] * wx[:, None, :])[..., None] * jnp.take(flat, index, axis=0)

    value = (corner(y0, x0, wy0, wx0) + corner(y0, x1, wy0, wx1) + corner(y1, x0, wy1, wx0)
             + corner(y1, x1, wy1, wx1))
    value = value.reshape(boxes.shape[0], s, g, s, g, flat.shape[-1])
    return _divide(value.sum(axis=(2, 4)), g * g)


def roi_align(features, boxes, output_size: int, spatial_scale: float, sampling_ratio: int = 2,
              aligned: bool = True):
    """RoIAlign of `boxes` [N, 4] (image pixels) on one feature map [H, W, C] -> [N, S, S, C].

    The numbers of torchvision.ops.roi_align(features as [1, C, H, W], [boxes], output_size,
    spatial_scale, sampling_ratio, aligned), transposed to channels-last: each of the S x S bins
    averages sampling_ratio x sampling_ratio bilinear samples; samples with y < -1 or y > H (x
    likewise) count as 0, others are clamped into the map. aligned=True shifts the box by -0.5
    pixel; aligned=False forces boxes at least 1 feature pixel wide and high. sampling_ratio must
    be > 0 (torchvision's adaptive grid, sampling_ratio <= 0, has no static shape). Gradients
    reach the features, not the boxes (as torchvision)."""
    features = jnp.asarray(features, jnp.float32)
    height, width, channels = features.shape
    n = jnp.shape(boxes)[0]
    scale = jnp.full((n,), spatial_scale, jnp.float32)
    height_, width_, offset = (jnp.full((n,), v, jnp.int32) for v in (height, width, 0))
    return _roi_align_flat(features.reshape(height * width, channels), boxes, scale, height_,
                           width_, offset, output_size, sampling_ratio, aligned)


def roi_levels(boxes, scales: Sequence[float], canonical_scale: int = 224,
               canonical_level: int = 4):
    """torchvision's LevelMapper: the index into `scales` of the level each box [N, 4] is pooled
    from, int32 [N]: k = floor(k0 + log2(sqrt(area) / s0) + 1e-6) clamped to
    [-log2(scales[0]), -log2(scales[-1])], minus the lower bound."""
    k_min = int(-math.log2(scales[0]))
    k_max = int(-math.log2(scales[-1]))
    boxes = jnp.asarray(boxes, jnp.float32)
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    level = jnp.floor(canonical_level + jnp.log2(jnp.sqrt(area) / np.float32(canonical_scale))
                      + np.float32(1e-6))
    return (jnp.clip(level, k_min, k_max) - k_min).astype(jnp.int32)


def multiscale_roi_align(features: Sequence, boxes, output_size: int, scales: Sequence[float],
                         sampling_ratio: int = 2, canonical_scale: int = 224,
                         canonical_level: int = 4, aligned: bool = False):
    """torchvision's MultiScaleRoIAlign for one image: each box [N, 4] is pooled from the level
    `roi_levels` assigns it (features[l] [H_l, W_l, C] at spatial scale scales[l], finest first)
    -> [N, S, S, C]. The levels are flattened into one array and each box gathers from its own
    level only (static shapes, one level's cost). aligned=False as torchvision's
    MultiScaleRoIAlign (which calls roi_align with its default)."""
    features = [jnp.asarray(f, jnp.float32) for f in features]
    if len(features) != len(scales):
        raise ValueError(f"{len(features)} feature maps but {len(scales)} scales")
    level = roi_levels(boxes, scales, canonical_scale, canonical_level)
    heights = np.array([f.shape[0] for f in features], np.int32)
    widths = np.array([f.shape[1] for f in features], np.int32)
    offsets = np.concatenate([[0], np.cumsum(heights * widths)[:-1]]).astype(np.int32)
    flat = jnp.concatenate([f.reshape(-1, f.shape[-1]) for f in features])
    return _roi_align_flat(flat, boxes, jnp.asarray(np.asarray(scales, np.float32))[level],
                           jnp.asarray(heights)[level], jnp.asarray(widths)[level],
                           jnp.asarray(offsets)[level], output_size, sampling_ratio, aligned)


# --------------------------------------------------------------------------- IoU and NMS
def box_area(boxes):
    """(x1 - x0) * (y1 - y0) of boxes [..., 4]."""
    return _rounded((boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1]))


def box_iou(a, b):
    """IoU of every pair of a [N, 4] and b [M, 4] -> [N, M], torchvision.ops.box_iou's numbers.

    Where the union is 0 (two zero-area boxes: torchvision gives nan) the IoU is 0."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    lt = jnp.maximum(a[:, None, :2], b[None, :, :2])
    rb = jnp.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = jnp.maximum(rb - lt, 0.0)
    inter = _rounded(wh[..., 0] * wh[..., 1])
    union = box_area(a)[:, None] + box_area(b)[None, :] - inter
    nonzero = union != 0
    return jnp.where(nonzero, inter / jnp.where(nonzero, union, 1.0), 0.0)


def _greedy_nms(boxes, scores, iou_threshold, max_output: int, valid, labels, block_size: int):
    """Greedy NMS over the boxes in descending score order (ties in index order: torchvision's CPU
    kernel sorts stably), `block_size` sorted boxes at a time.

    Within a block the greedy choice is the fixed point of keep[i] = alive[i] and no kept j < i
    of the block overlaps i, reached by iterating from keep = alive (after t rounds the first t
    entries are final, so at most block_size rounds; in practice a few). The block's kept boxes
    then suppress every later box in one step. With `labels`, boxes only suppress boxes of the
    same label. Stops after the block in which max_output boxes are kept (later blocks cannot
    change earlier decisions). Returns the kept original indices, first max_output, padded."""
    boxes = jnp.asarray(boxes, jnp.float32)
    n = boxes.shape[0]
    if n == 0 or max_output == 0:
        return jnp.zeros((max_output,), jnp.int32), jnp.zeros((max_output,), bool)
    block = max(1, min(int(block_size), n))
    total = -(-n // block) * block
    order = jnp.argsort(-jnp.asarray(scores, jnp.float32), stable=True).astype(jnp.int32)
    valid = jnp.ones((n,), bool) if valid is None else jnp.asarray(valid, bool)
    pad = total - n
    sboxes = jnp.pad(boxes[order], ((0, pad), (0, 0)))
    alive0 = jnp.pad(valid[order], (0, pad))
    slabels = None if labels is None else jnp.pad(jnp.asarray(labels)[order], (0, pad))
    areas = box_area(sboxes)
    positions = jnp.arange(total)

    def overlaps(start, cols):
        """bool [block, len(cols)]: IoU of block rows with later columns > threshold (the CPU
        kernel's formula; nan never suppresses), same label where labels are given."""
        rows = jax.lax.dynamic_slice_in_dim(positions, start, block)
        r = sboxes[rows][:, None, :]
        c = sboxes[cols][None, :, :]
        w = jnp.maximum(jnp.minimum(r[..., 2], c[..., 2]) - jnp.maximum(r[..., 0], c[..., 0]), 0.0)
        h = jnp.maximum(jnp.minimum(r[..., 3], c[..., 3]) - jnp.maximum(r[..., 1], c[..., 1]), 0.0)
        inter = _rounded(w * h)
        iou = inter / (areas[rows][:, None] + areas[cols][None, :] - inter)
        hit = (iou > iou_threshold) & (cols[None, :] > rows[:, None])
        if slabels is not None:
            hit = hit & (slabels[rows][:, None] == slabels[cols][None, :])
        return hit

    def body(state):
        k, count, alive, kept = state
        start = k * block
        local = jax.lax.dynamic_slice_in_dim(positions, start, block)
        within = overlaps(start, local)
        candidates = jax.lax.dynamic_slice_in_dim(alive, start, block)

        def step(keep_changed):
            keep = keep_changed[0]
            new = candidates & ~jnp.any(within & keep[:, None], axis=0)
            return new, jnp.any(new != keep)

        keep = jax.lax.while_loop(lambda kc: kc[1], step, (candidates, jnp.array(True)))[0]
        alive = alive & ~jnp.any(overlaps(start, positions) & keep[:, None], axis=0)
        kept = jax.lax.dynamic_update_slice_in_dim(kept, keep, start, 0)
        return k + 1, count + jnp.sum(keep, dtype=jnp.int32), alive, kept

    def cond(state):
        return (state[0] * block < total) & (state[1] < max_output)

    init = (jnp.int32(0), jnp.int32(0), alive0, jnp.zeros((total,), bool))
    kept = jax.lax.while_loop(cond, body, init)[3]
    # the kept positions first, in sorted order, then padding up to max_output
    first = jnp.argsort(~kept, stable=True)
    if total < max_output:
        first = jnp.pad(first, (0, max_output - total))
        ok = jnp.pad(kept[first[:total]], (0, max_output - total))
    else:
        first = first[:max_output]
        ok = kept[first]
    index = jnp.pad(order, (0, pad))[first]
    return jnp.where(ok, index, 0).astype(jnp.int32), ok


def nms(boxes, scores, iou_threshold: float, max_output: int, *, valid=None,
        block_size: int = 256):
    """The boxes torchvision.ops.nms keeps: (indices int32 [max_output], valid bool [max_output]).

    boxes [N, 4], scores [N]. A box is dropped when its IoU with a kept, higher-scored box is
    > iou_threshold; scores are ordered descending with ties in index order (torchvision's CPU
    kernel sorts stably). Indices come in descending score order, the first max_output of
    torchvision's list; the rest is padding (index 0, valid False). `valid` [N] bool: entries
    False are neither kept nor suppress others. max_output (and block_size, the number of sorted
    boxes decided together: memory block_size x N) must be static under jit."""
    return _greedy_nms(boxes, scores, iou_threshold, int(max_output), valid, None, block_size)


def batched_nms(boxes, scores, labels, iou_threshold: float, max_output: int, *, valid=None,
                block_size: int = 256):
    """Per-label NMS, torchvision.ops.batched_nms: boxes only suppress boxes with the same label
    [N] int. Same output convention as `nms` (one list over all labels, descending score).

    torchvision shifts each label's boxes apart (the coordinate offset trick) and runs one nms;
    here the suppression is masked by label equality instead, which keeps the same boxes without
    the rounding of shifted coordinates. (Above 1000 boxes on CPU torchvision loops over labels
    and re-sorts the kept boxes with an unstable sort: equal scores may then come in another
    order; the boxes are the same.)"""
    return _greedy_nms(boxes, scores, iou_threshold, int(max_output), valid, labels, block_size)


# --------------------------------------------------------------------------- box coder
def _sizes_and_centres(boxes):
    """(width, height, centre x, centre y) of boxes [..., 4], float32, as torchvision's BoxCoder
    computes them."""
    boxes = jnp.asarray(boxes, jnp.float32)
    w = boxes[..., 2] - boxes[..., 0]
    h = boxes[..., 3] - boxes[..., 1]
    return w, h, boxes[..., 0] + 0.5 * w, boxes[..., 1] + 0.5 * h


def encode_boxes(reference, proposals, weights=(1.0, 1.0, 1.0, 1.0)):
    """Regression targets of `reference` boxes [N, 4] relative to `proposals` [N, 4] -> [N, 4]:
    BoxCoder(weights).encode_single(reference, proposals). Any leading axes that broadcast."""
    wx, wy, ww, wh = (np.float32(w) for w in weights)
    ex_w, ex_h, ex_x, ex_y = _sizes_and_centres(proposals)
    gt_w, gt_h, gt_x, gt_y = _sizes_and_centres(reference)
    return jnp.stack([wx * (gt_x - ex_x) / ex_w, wy * (gt_y - ex_y) / ex_h,
                      ww * jnp.log(gt_w / ex_w), wh * jnp.log(gt_h / ex_h)], axis=-1)


def decode_boxes(deltas, boxes, weights=(1.0, 1.0, 1.0, 1.0), clip: float = DEFAULT_BBOX_CLIP):
    """Boxes [N, 4] from `deltas` [N, 4] applied to `boxes` [N, 4]: BoxCoder(weights,
    bbox_xform_clip=clip).decode_single(deltas, boxes) (dw, dh clamped at `clip` before exp).
    Any leading axes that broadcast: per-class deltas [N, K, 4] on boxes [N, 1, 4] -> [N, K, 4]."""
    deltas = jnp.asarray(deltas, jnp.float32)
    wx, wy, ww, wh = (np.float32(w) for w in weights)
    widths, heights, ctr_x, ctr_y = _sizes_and_centres(boxes)
    dx, dy = deltas[..., 0] / wx, deltas[..., 1] / wy
    dw = jnp.minimum(deltas[..., 2] / ww, np.float32(clip))
    dh = jnp.minimum(deltas[..., 3] / wh, np.float32(clip))
    pred_x = dx * widths + ctr_x
    pred_y = dy * heights + ctr_y
    half_w = 0.5 * (jnp.exp(dw) * widths)
    half_h = 0.5 * (jnp.exp(dh) * heights)
    return jnp.stack([pred_x - half_w, pred_y - half_h, pred_x + half_w, pred_y + half_h], axis=-1)


# --------------------------------------------------------------------------- anchors
def cell_anchors(sizes: tuple, aspect_ratios: tuple) -> np.ndarray:
    """torchvision AnchorGenerator.generate_anchors: float32 [len(ratios) * len(sizes), 4] zero-
    centred anchors, ratio-major, rounded (half to even) as torchvision's .round()."""
    scales = np.asarray(sizes, np.float32)
    ratios = np.asarray(aspect_ratios, np.float32)
    h_ratios = np.sqrt(ratios)
    w_ratios = np.float32(1) / h_ratios
    ws = (w_ratios[:, None] * scales[None, :]).reshape(-1)
    hs = (h_ratios[:, None] * scales[None, :]).reshape(-1)
    return np.round(np.stack([-ws, -hs, ws, hs], axis=1) / np.float32(2)).astype(np.float32)


def anchor_grid(feature_size, stride, sizes: tuple, aspect_ratios: tuple) -> np.ndarray:
    """All anchors of one feature map of feature_size (h, w) at stride (sh, sw) image pixels ->
    float32 [h * w * A, 4], location-major (row by row), anchor-minor: torchvision's grid_anchors.
    torchvision's stride of a level is image_size // feature_size per axis."""
    (h, w), (sh, sw) = feature_size, stride
    shift_y, shift_x = np.meshgrid(np.arange(h, dtype=np.int64) * int(sh),
                                   np.arange(w, dtype=np.int64) * int(sw), indexing="ij")
    shift_x, shift_y = shift_x.reshape(-1), shift_y.reshape(-1)
    shifts = np.stack([shift_x, shift_y, shift_x, shift_y], axis=1).astype(np.float32)
    base = cell_anchors(sizes, aspect_ratios)
    return (shifts[:, None, :] + base[None, :, :]).reshape(-1, 4)


# --------------------------------------------------------------------------- clipping
def clip_boxes(boxes, size):
    """Boxes [..., 4] clamped into an image of size (h, w): x to [0, w], y to [0, h]
    (torchvision clip_boxes_to_image)."""
    height, width = size
    boxes = jnp.asarray(boxes)
    xs = jnp.clip(boxes[..., 0::2], 0, width)
    ys = jnp.clip(boxes[..., 1::2], 0, height)
    return jnp.stack([xs, ys], axis=-1).reshape(boxes.shape)


def small_boxes_mask(boxes, min_size: float):
    """bool [N]: True where width >= min_size and height >= min_size (the boxes torchvision's
    remove_small_boxes keeps)."""
    boxes = jnp.asarray(boxes)
    return ((boxes[:, 2] - boxes[:, 0]) >= min_size) & ((boxes[:, 3] - boxes[:, 1]) >= min_size)


# --------------------------------------------------------------------------- matching, sampling
def match(iou, gt_valid, high: float, low: float, allow_low_quality: bool):
    """torchvision's Matcher(high, low, allow_low_quality) on iou [G, N] -> int32 [N]: per
    prediction the index of its best gt (the first on ties), -1 if that IoU < low, -2 if in
    [low, high). allow_low_quality: every prediction that ties for some gt's highest IoU gets its
    best gt back (as torchvision: its overall argmax, not necessarily that gt). Rows with gt_valid
    False (padding) never match; no valid gt leaves every prediction at -1."""
    iou = jnp.asarray(iou, jnp.float32)
    if iou.shape[0] == 0:  # no gt rows at all (torchvision raises; here: all background)
        return jnp.full(iou.shape[1:], BELOW_LOW_THRESHOLD, jnp.int32)
    gt_valid = jnp.asarray(gt_valid, bool)
    quality = jnp.where(gt_valid[:, None], iou, -jnp.inf)
    best = jnp.max(quality, axis=0)
    all_matches = jnp.argmax(quality, axis=0).astype(jnp.int32)
    matches = jnp.where(best < low, BELOW_LOW_THRESHOLD,
                        jnp.where(best < high, BETWEEN_THRESHOLDS, all_matches))
    if allow_low_quality:
        row_best = jnp.max(quality, axis=1, keepdims=True)
        ties = jnp.any((quality == row_best) & gt_valid[:, None], axis=0)
        matches = jnp.where(ties, all_matches, matches)
    return matches.astype(jnp.int32)


def sample_labels(labels, key, batch_size_per_image: int, positive_fraction: float):
    """The BalancedPositiveNegativeSampler rule on labels [N] (>= 1 positive, 0 negative, < 0
    ignored) -> (pos_mask, neg_mask) bool [N]: at most int(batch_size_per_image *
    positive_fraction) positives, chosen uniformly at random among the positives, and negatives
    chosen likewise up to batch_size_per_image in total. Randomness comes from `key` (uniform
    random priorities, lowest first), so the draw cannot equal torch's randperm; the counts and
    the rule do."""
    labels = jnp.asarray(labels)
    num_pos_max = int(batch_size_per_image * positive_fraction)
    category = jnp.where(labels >= 1, 0, jnp.where(labels == 0, 1, 2)).astype(jnp.int32)
    priority = jax.random.bits(key, labels.shape, jnp.uint32)
    index = jnp.arange(labels.shape[0], dtype=jnp.int32)
    order = jax.lax.sort((category, priority, index), num_keys=2)[2]
    rank = jnp.zeros_like(index).at[order].set(index)  # position in (category, priority) order
    is_pos, is_neg = category == 0, category == 1
    num_pos = jnp.minimum(jnp.sum(is_pos), num_pos_max)
    pos_mask = is_pos & (rank < num_pos)
    neg_mask = is_neg & (rank - jnp.sum(is_pos) < batch_size_per_image - num_pos)
    return pos_mask, neg_mask
