"""Faster R-CNN's computations around the network, with static shapes: anchors, proposal
selection, RPN and RoI-head targets and losses, and post-processing.

They follow torchvision's `RegionProposalNetwork` and `RoIHeads` rule for rule:

- anchors: `AnchorGenerator` (one size, three aspect ratios per level), in the order of the RPN
  head's outputs;
- proposals per image: the `pre_nms_top_n` best objectness logits of each level, decoded
  (weights 1, 1, 1, 1), clipped to the image, boxes under 1e-3 px dropped, NMS 0.7 per level,
  then the `post_nms_top_n` best (padded, with a validity mask);
- RPN targets: `Matcher(0.7, 0.3, allow_low_quality_matches=True)`, 256 anchors sampled per
  image with half positives; objectness BCE over the sampled anchors, smooth L1 (beta 1/9) on the
  positives, summed and divided by the number sampled;
- RoI targets: the proposals plus the ground-truth boxes, `Matcher(0.5, 0.5)`, 512 sampled per
  image with a quarter positives, box coder weights (10, 10, 5, 5); cross-entropy over the
  sampled RoIs, smooth L1 (beta 1/9) on the positives' own class deltas, divided by the number
  sampled;
- detection: softmax scores, per-class decoded boxes clipped to the image, scores above
  `box_score_thresh`, boxes under 1e-2 px dropped, per-class NMS at `box_nms_thresh`, at most
  `detections_per_img` per image.

Where torchvision uses a data-dependent size (the sampled indices, the boxes above a score) these
functions use a fixed size and a mask; the randomness of the samplers comes from a JAX key, so
the numbers are torchvision's rules, not its draws.

Ground truth comes padded: boxes [B, M, 4] (x0, y0, x1, y1 in input pixels), labels [B, M]
(0-based class indices), valid [B, M].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sclaro_jax.detection import ops
from sclaro_jax.detection.model import Detector, DetectorConfig

Array = jax.Array

RPN_WEIGHTS = (1.0, 1.0, 1.0, 1.0)
ROI_WEIGHTS = (10.0, 10.0, 5.0, 5.0)
BBOX_CLIP = math.log(1000.0 / 16)


def anchors(cfg: DetectorConfig) -> np.ndarray:
    """All RPN anchors [sum h*w*A, 4] for the configured image size (numpy: a constant)."""
    return np.concatenate([
        ops.anchor_grid(size, (stride, stride), (anchor,), tuple(cfg.aspect_ratios))
        for size, stride, anchor in zip(cfg.feature_sizes(), cfg.rpn_strides,
                                        cfg.anchor_sizes)]).astype(np.float32)


def level_sizes(cfg: DetectorConfig) -> list[int]:
    return [h * w * len(cfg.aspect_ratios) for h, w in cfg.feature_sizes()]


def smooth_l1(x: Array, y: Array, beta: float = 1.0 / 9) -> Array:
    d = jnp.abs(x - y)
    return jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


# --------------------------------------------------------------------------------------------
# Proposals
# --------------------------------------------------------------------------------------------


def select_proposals(cfg: DetectorConfig, objectness: Array, deltas: Array, *,
                     training: bool) -> tuple[Array, Array, Array]:
    """One image: objectness [A], deltas [A, 4] -> (proposals [P, 4], valid [P], logits [P])."""
    pre = cfg.rpn_pre_nms_top_n_train if training else cfg.rpn_pre_nms_top_n_test
    post = cfg.rpn_post_nms_top_n_train if training else cfg.rpn_post_nms_top_n_test
    all_anchors = jnp.asarray(anchors(cfg))
    objectness = jax.lax.stop_gradient(objectness)
    deltas = jax.lax.stop_gradient(deltas)
    picks, levels, start = [], [], 0
    for level, n in enumerate(level_sizes(cfg)):
        k = min(pre, n)
        _, idx = jax.lax.top_k(objectness[start:start + n], k)
        picks.append(idx + start)
        levels.append(jnp.full((k,), level, jnp.int32))
        start += n
    idx, levels = jnp.concatenate(picks), jnp.concatenate(levels)
    boxes = ops.decode_boxes(deltas[idx], all_anchors[idx], RPN_WEIGHTS, BBOX_CLIP)
    boxes = ops.clip_boxes(boxes, (cfg.image_size, cfg.image_size))
    logits = objectness[idx]
    valid = ops.small_boxes_mask(boxes, 1e-3) & jnp.isfinite(logits)
    keep, kept = ops.batched_nms(boxes, logits, levels, cfg.rpn_nms_thresh,
                                 min(post, idx.shape[0]), valid=valid)
    return boxes[keep], kept, logits[keep]


# --------------------------------------------------------------------------------------------
# Targets and losses
# --------------------------------------------------------------------------------------------


def rpn_losses(cfg: DetectorConfig, objectness: Array, deltas: Array, gt_boxes: Array,
               gt_valid: Array, key: Array) -> dict:
    """Batch: objectness [B, A], deltas [B, A, 4] -> {'loss_objectness', 'loss_rpn_box_reg'}."""
    all_anchors = jnp.asarray(anchors(cfg))

    def one(gt, valid, k):
        iou = ops.box_iou(gt, all_anchors)
        matched = ops.match(iou, valid, cfg.rpn_fg_iou_thresh, cfg.rpn_bg_iou_thresh, True)
        labels = jnp.where(matched >= 0, 1, jnp.where(matched == -1, 0, -1))
        labels = jnp.where(valid.any(), labels, 0)  # no ground truth: all background
        pos, neg = ops.sample_labels(labels, k, cfg.rpn_batch_size_per_image,
                                     cfg.rpn_positive_fraction)
        targets = ops.encode_boxes(gt[jnp.maximum(matched, 0)], all_anchors, RPN_WEIGHTS)
        return pos, neg, jnp.where(pos[:, None], targets, 0.0)

    keys = jax.random.split(key, objectness.shape[0])
    pos, neg, targets = jax.vmap(one)(gt_boxes, gt_valid, keys)
    sampled = (pos | neg).astype(jnp.float32)
    n = jnp.maximum(sampled.sum(), 1.0)
    bce = sigmoid_bce(objectness, pos.astype(jnp.float32))
    box = jnp.where(pos, smooth_l1(deltas, targets).sum(-1), 0.0).sum() / n
    return {"loss_objectness": (bce * sampled).sum() / n, "loss_rpn_box_reg": box}


def sigmoid_bce(logits: Array, labels: Array) -> Array:
    """Binary cross-entropy with logits, elementwise (torch's `binary_cross_entropy_with_logits`)."""
    return jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))


def roi_targets(cfg: DetectorConfig, proposals: Array, valid: Array, gt_boxes: Array,
                gt_labels: Array, gt_valid: Array, key: Array):
    """One image -> (rois [R, 4], labels [R] (0 = background, c + 1 = class c), weight [R]
    (1 for a sampled RoI), regression targets [R, 4]), R = box_batch_size_per_image."""
    boxes = jnp.concatenate([proposals, gt_boxes])
    candidate = jnp.concatenate([valid, gt_valid])
    iou = ops.box_iou(gt_boxes, boxes)
    matched = ops.match(iou, gt_valid, cfg.box_fg_iou_thresh, cfg.box_bg_iou_thresh, False)
    labels = jnp.where(matched >= 0, gt_labels[jnp.maximum(matched, 0)] + 1,
                       jnp.where(matched == -1, 0, -1))
    labels = jnp.where(candidate, jnp.where(gt_valid.any(), labels, 0), -1)
    sample = jnp.where(labels > 0, 1, labels)
    pos, neg = ops.sample_labels(sample, key, cfg.box_batch_size_per_image,
                                 cfg.box_positive_fraction)
    chosen = pos | neg
    r = min(cfg.box_batch_size_per_image, boxes.shape[0])
    order = jnp.argsort(~chosen, stable=True)[:r]
    rois = boxes[order]
    weight = chosen[order].astype(jnp.float32)
    roi_labels = jnp.where(weight > 0, jnp.maximum(labels[order], 0), 0)
    targets = ops.encode_boxes(gt_boxes[jnp.maximum(matched[order], 0)], rois, ROI_WEIGHTS)
    targets = jnp.where(roi_labels[:, None] > 0, targets, 0.0)  # no inf from padded gt boxes
    return rois, roi_labels, weight, targets


def fast_rcnn_losses(logits: Array, box_deltas: Array, labels: Array, weight: Array,
                     targets: Array) -> dict:
    """torchvision's `fastrcnn_loss` over the RoIs with weight 1: logits [R, K + 1], deltas
    [R, K + 1, 4], labels [R] (0 background), targets [R, 4] -> {'loss_classifier',
    'loss_box_reg'}."""
    n = jnp.maximum(weight.sum(), 1.0)
    logp = jax.nn.log_softmax(logits, -1)
    ce = -jnp.take_along_axis(logp, labels[:, None], -1)[:, 0]
    own = jnp.take_along_axis(box_deltas, labels[:, None, None], 1)[:, 0]
    positive = weight * (labels > 0)
    return {"loss_classifier": (ce * weight).sum() / n,
            "loss_box_reg": jnp.where(positive > 0, smooth_l1(own, targets).sum(-1),
                                      0.0).sum() / n}


def pool(cfg: DetectorConfig, feats: list[Array], rois: Array) -> Array:
    """Batch: RoI maps (strides 4-32) [B, h, w, C], rois [B, R, 4] -> [B * R, S, S, C]."""
    scales = tuple(1.0 / s for s in cfg.strides)

    def one(fs, boxes):
        return ops.multiscale_roi_align(fs, boxes, cfg.roi_output_size, scales,
                                        sampling_ratio=2)

    pooled = jax.vmap(one)(feats, rois)
    return pooled.reshape(-1, *pooled.shape[2:])


def losses(model: Detector, pixels: Array, gt_boxes: Array, gt_labels: Array, gt_valid: Array,
           key: Array) -> dict:
    """The four Faster R-CNN losses of a batch (float32 scalars) and their sum, 'loss'."""
    cfg = model.cfg
    rpn_feats, roi_feats = model.features(pixels)
    objectness, deltas = model.rpn_head(rpn_feats)
    k_rpn, k_roi = jax.random.split(key)
    out = rpn_losses(cfg, objectness, deltas, gt_boxes, gt_valid, k_rpn)
    proposals, valid, _ = jax.vmap(lambda o, d: select_proposals(cfg, o, d, training=True))(
        objectness, deltas)
    keys = jax.random.split(k_roi, pixels.shape[0])
    rois, labels, weight, targets = jax.vmap(
        lambda p, v, g, l, gv, k: roi_targets(cfg, p, v, g, l, gv, k))(
        proposals, valid, gt_boxes, gt_labels, gt_valid, keys)
    logits, box_deltas = model.box_head(pool(cfg, roi_feats, rois))
    out.update(fast_rcnn_losses(logits, box_deltas, labels.reshape(-1), weight.reshape(-1),
                                targets.reshape(-1, 4)))
    out["loss"] = sum(out[k] for k in ("loss_objectness", "loss_rpn_box_reg",
                                       "loss_classifier", "loss_box_reg"))
    return out


# --------------------------------------------------------------------------------------------
# Inference
# --------------------------------------------------------------------------------------------


def postprocess(cfg: DetectorConfig, proposals: Array, valid: Array, logits: Array,
                box_deltas: Array) -> dict:
    """One image: proposals [P, 4], class logits [P, K + 1], deltas [P, K + 1, 4] -> boxes
    [D, 4], scores [D], labels [D] (0-based classes), valid [D]; D = detections_per_img."""
    k = cfg.num_classes
    scores = jax.nn.softmax(logits, -1)[:, 1:]
    props = jnp.broadcast_to(proposals[:, None], (proposals.shape[0], k, 4))
    boxes = ops.decode_boxes(box_deltas[:, 1:].reshape(-1, 4), props.reshape(-1, 4), ROI_WEIGHTS,
                             BBOX_CLIP)
    boxes = ops.clip_boxes(boxes, (cfg.image_size, cfg.image_size))
    scores = jnp.where(valid[:, None], scores, -1.0).reshape(-1)
    labels = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (proposals.shape[0], k)).reshape(-1)
    top, idx = jax.lax.top_k(scores, min(cfg.box_candidates, scores.shape[0]))
    boxes, labels = boxes[idx], labels[idx]
    ok = (top > cfg.box_score_thresh) & ops.small_boxes_mask(boxes, 1e-2)
    keep, kept = ops.batched_nms(boxes, top, labels, cfg.box_nms_thresh,
                                 min(cfg.detections_per_img, top.shape[0]), valid=ok)
    return {"boxes": boxes[keep], "scores": jnp.where(kept, top[keep], 0.0),
            "labels": labels[keep], "valid": kept}


def detect(model: Detector, pixels: Array) -> dict:
    """CLIP-normalised pixels [B, S, S, 3] -> per image detections (see `postprocess`), in
    input pixels."""
    cfg = model.cfg
    rpn_feats, roi_feats = model.features(pixels)
    objectness, deltas = model.rpn_head(rpn_feats)
    proposals, valid, _ = jax.vmap(lambda o, d: select_proposals(cfg, o, d, training=False))(
        objectness, deltas)
    logits, box_deltas = model.box_head(pool(cfg, roi_feats, proposals))
    b, p = proposals.shape[:2]
    return jax.vmap(lambda pr, v, lg, bd: postprocess(cfg, pr, v, lg, bd))(
        proposals, valid, logits.reshape(b, p, -1), box_deltas.reshape(b, p, -1, 4))
