"""Faster R-CNN's computations (`sclaro_jax.detection.rcnn`) against torchvision's own
`RegionProposalNetwork` and `RoIHeads` on the same numbers: anchors, proposal selection, RPN
targets and losses, RoI sampling and the Fast R-CNN losses, post-processing. Sampler sizes are
made larger than the candidate sets so both sides sample every candidate (the draws of the two
samplers cannot be equal; their rule is checked in test_detection_ops)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.roi_heads import RoIHeads, fastrcnn_loss
from torchvision.models.detection.rpn import RegionProposalNetwork, concat_box_prediction_layers

from sclaro_jax.detection import rcnn
from sclaro_jax.detection.model import DetectorConfig

ALL = 10 ** 6  # a sampler batch larger than any candidate set: every candidate is sampled
CFG = DetectorConfig(num_classes=4, image_size=64, rpn_pre_nms_top_n_train=40,
                     rpn_post_nms_top_n_train=30, rpn_batch_size_per_image=ALL,
                     rpn_positive_fraction=1.0, box_batch_size_per_image=ALL,
                     box_positive_fraction=1.0, box_candidates=10 ** 5, detections_per_img=50,
                     box_score_thresh=0.05)


# Each computation as one jitted program (as it runs inside the train and detect steps), not op by
# op: one compile per function and shape instead of one per primitive.
rpn_losses = jax.jit(rcnn.rpn_losses, static_argnums=0)
select_proposals = jax.jit(rcnn.select_proposals, static_argnums=0, static_argnames="training")
roi_targets = jax.jit(rcnn.roi_targets, static_argnums=0)
fast_rcnn_losses = jax.jit(rcnn.fast_rcnn_losses)
postprocess = jax.jit(rcnn.postprocess, static_argnums=0)


def _t(x):
    return torch.from_numpy(np.asarray(x).copy())


def _gt(rng, n, size=64):
    xy = rng.uniform(0, size - 20, (n, 2))
    wh = rng.uniform(8, 30, (n, 2))
    return np.concatenate([xy, np.minimum(xy + wh, size)], 1).astype(np.float32)


def _torch_rpn(cfg):
    gen = AnchorGenerator(tuple((s,) for s in cfg.anchor_sizes),
                          (tuple(cfg.aspect_ratios),) * len(cfg.anchor_sizes))
    rpn = RegionProposalNetwork(
        gen, None, cfg.rpn_fg_iou_thresh, cfg.rpn_bg_iou_thresh, cfg.rpn_batch_size_per_image,
        cfg.rpn_positive_fraction, {"training": cfg.rpn_pre_nms_top_n_train, "testing": 1},
        {"training": cfg.rpn_post_nms_top_n_train, "testing": 1}, cfg.rpn_nms_thresh)
    return gen, rpn.train()


def _torch_anchors(cfg, batch):
    gen, _ = _torch_rpn(cfg)
    images = ImageList(torch.zeros(batch, 3, cfg.image_size, cfg.image_size),
                       [(cfg.image_size, cfg.image_size)] * batch)
    feats = [torch.zeros(batch, 1, h, w) for h, w in cfg.feature_sizes()]
    return gen(images, feats)


@pytest.mark.parametrize("size", [64, 224, 96])
def test_anchors_equal_torchvision(size):
    """Also where the extra (max-pooled) level rounds up: 7 x 7 -> 4 x 4 at 224 px."""
    cfg = dataclasses.replace(CFG, image_size=size)
    np.testing.assert_array_equal(rcnn.anchors(cfg), _torch_anchors(cfg, 1)[0].numpy())
    assert rcnn.anchors(cfg).shape[0] == sum(rcnn.level_sizes(cfg))


@pytest.mark.slow
def test_rpn_outputs_line_up_with_the_anchors_at_224():
    from flax import nnx

    from sclaro_jax.detection.model import Detector
    from sclaro_jax.models import clip

    cfg = dataclasses.replace(CFG, image_size=224, pyramid_dim=8, fpn_dim=8,
                              representation_size=16)
    # shapes only: the detector built abstractly (no weights drawn) and traced by eval_shape
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: Detector(cfg, clip.create("tiny").vision_model, 8)))
    rpn, _ = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s).features(x), state,
                            jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32))
    assert [f.shape[1:3] for f in rpn] == cfg.feature_sizes() == [(56, 56), (28, 28), (14, 14),
                                                                  (7, 7), (4, 4)]
    objectness, _ = jax.eval_shape(lambda s, fs: nnx.merge(graphdef, s).rpn_head(fs), state, rpn)
    assert objectness.shape == (1, rcnn.anchors(cfg).shape[0])


@pytest.mark.slow
def test_rpn_losses_and_proposals_equal_torchvision():
    rng = np.random.default_rng(0)
    b, a = 2, sum(rcnn.level_sizes(CFG))
    objectness = rng.normal(0, 2, (b, a)).astype(np.float32)
    deltas = rng.normal(0, 0.3, (b, a, 4)).astype(np.float32)
    gts = [_gt(rng, 3), _gt(rng, 5)]
    boxes = np.zeros((b, 6, 4), np.float32)
    valid = np.zeros((b, 6), bool)
    for i, g in enumerate(gts):
        boxes[i, :len(g)], valid[i, :len(g)] = g, True

    _, rpn = _torch_rpn(CFG)
    anchors = _torch_anchors(CFG, b)
    targets = [{"boxes": _t(g)} for g in gts]
    labels, matched = rpn.assign_targets_to_anchors(anchors, targets)
    reg = rpn.box_coder.encode(matched, anchors)
    # the layout torchvision's heads give: per level [B, A*, H, W] and [B, A* x 4, H, W]
    obj_levels, del_levels, start = [], [], 0
    for (h, w), n in zip(CFG.feature_sizes(), rcnn.level_sizes(CFG)):
        o = objectness[:, start:start + n].reshape(b, h, w, 3).transpose(0, 3, 1, 2)
        d = deltas[:, start:start + n].reshape(b, h, w, 12).transpose(0, 3, 1, 2)
        obj_levels.append(_t(o))
        del_levels.append(_t(d))
        start += n
    obj_flat, del_flat = concat_box_prediction_layers(obj_levels, del_levels)
    want_obj, want_box = rpn.compute_loss(obj_flat, del_flat, labels, reg)
    got = rpn_losses(CFG, jnp.asarray(objectness), jnp.asarray(deltas), jnp.asarray(boxes),
                     jnp.asarray(valid), jax.random.key(0))
    np.testing.assert_allclose(float(got["loss_objectness"]), float(want_obj), rtol=1e-5)
    np.testing.assert_allclose(float(got["loss_rpn_box_reg"]), float(want_box), rtol=1e-5)

    proposals = rpn.box_coder.decode(del_flat.detach(), anchors).view(b, -1, 4)
    want_boxes, want_scores = rpn.filter_proposals(
        proposals, obj_flat, [(CFG.image_size, CFG.image_size)] * b, rcnn.level_sizes(CFG))
    for i in range(b):
        props, kept, logits = select_proposals(CFG, jnp.asarray(objectness[i]),
                                               jnp.asarray(deltas[i]), training=True)
        kept = np.asarray(kept)
        np.testing.assert_allclose(np.asarray(props)[kept], want_boxes[i].numpy(), atol=1e-4)
        np.testing.assert_allclose(jax.nn.sigmoid(np.asarray(logits)[kept]),
                                   want_scores[i].numpy(), atol=1e-6)


def _roi_heads(cfg):
    return RoIHeads(None, None, None, cfg.box_fg_iou_thresh, cfg.box_bg_iou_thresh,
                    cfg.box_batch_size_per_image, cfg.box_positive_fraction, None,
                    cfg.box_score_thresh, cfg.box_nms_thresh, cfg.detections_per_img)


@pytest.mark.slow
def test_roi_sampling_and_fast_rcnn_losses_equal_torchvision():
    rng = np.random.default_rng(1)
    gt = _gt(rng, 4)
    gt_labels = np.array([0, 3, 1, 3], np.int32)
    jitter = rng.normal(0, 4, (24, 4)).astype(np.float32)
    props = np.concatenate([gt[rng.integers(0, 4, 24)] + jitter, _gt(rng, 16)])
    props[:, 2:] = np.maximum(props[:, 2:], props[:, :2] + 1)
    heads = _roi_heads(CFG)
    want_props, _, want_labels, want_reg = heads.select_training_samples(
        [_t(props)], [{"boxes": _t(gt), "labels": _t(gt_labels.astype(np.int64) + 1)}])
    pad = np.zeros((2, 4), np.float32)
    gt_valid = np.array([True] * 4 + [False] * 2)
    rois, labels, weight, targets = roi_targets(
        CFG, jnp.asarray(props), jnp.ones(len(props), bool), jnp.asarray(np.r_[gt, pad]),
        jnp.asarray(np.r_[gt_labels, np.zeros(2, np.int32)]), jnp.asarray(gt_valid),
        jax.random.key(0))
    n = int(np.asarray(weight).sum())
    assert n == len(want_props[0])
    np.testing.assert_allclose(np.asarray(rois)[:n], want_props[0].numpy(), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(labels)[:n], want_labels[0].numpy())
    fg = want_labels[0].numpy() > 0  # torchvision also encodes background rows (unused)
    assert fg.sum() >= 4
    np.testing.assert_allclose(np.asarray(targets)[:n][fg], want_reg[0].numpy()[fg], atol=1e-4)

    k = CFG.num_classes + 1
    logits = rng.normal(0, 1, (len(rois), k)).astype(np.float32)
    box = rng.normal(0, 0.5, (len(rois), k, 4)).astype(np.float32)
    want_cls, want_box = fastrcnn_loss(_t(logits[:n]), _t(box[:n].reshape(n, -1)),
                                       [want_labels[0]], [want_reg[0]])
    got = fast_rcnn_losses(jnp.asarray(logits), jnp.asarray(box), labels, weight, targets)
    np.testing.assert_allclose(float(got["loss_classifier"]), float(want_cls), rtol=1e-5)
    np.testing.assert_allclose(float(got["loss_box_reg"]), float(want_box), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_postprocess_equals_torchvision(seed):
    rng = np.random.default_rng(seed)
    p, k = 60, CFG.num_classes + 1
    props = _gt(rng, p)
    logits = rng.normal(0, 2, (p, k)).astype(np.float32)
    box = rng.normal(0, 0.3, (p, k, 4)).astype(np.float32)
    valid = np.ones(p, bool)
    valid[-5:] = False  # padding proposals take no part
    heads = _roi_heads(CFG)
    want_boxes, want_scores, want_labels = heads.postprocess_detections(
        _t(logits[valid]), _t(box[valid].reshape(int(valid.sum()), -1)), [_t(props[valid])],
        [(CFG.image_size, CFG.image_size)])
    got = postprocess(CFG, jnp.asarray(props), jnp.asarray(valid), jnp.asarray(logits),
                      jnp.asarray(box))
    keep = np.asarray(got["valid"])
    assert keep.sum() == len(want_scores[0]) > 0
    np.testing.assert_allclose(np.asarray(got["scores"])[keep], want_scores[0].numpy(),
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got["labels"])[keep], want_labels[0].numpy() - 1)
    np.testing.assert_allclose(np.asarray(got["boxes"])[keep], want_boxes[0].numpy(), atol=1e-4)
