"""sclaro_jax.detection.ops against torchvision on the same inputs (float parity within 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler  # noqa: E402
from torchvision.models.detection._utils import BoxCoder, Matcher  # noqa: E402
from torchvision.models.detection.anchor_utils import AnchorGenerator  # noqa: E402
from torchvision.models.detection.image_list import ImageList  # noqa: E402
from torchvision.ops import boxes as tv_boxes  # noqa: E402
from torchvision.ops.poolers import MultiScaleRoIAlign, initLevelMapper  # noqa: E402

from sclaro_jax.detection import ops  # noqa: E402

ATOL = 1e-5
# jitted as the model uses them (and one compile per configuration instead of op-by-op dispatch)
roi_align = jax.jit(ops.roi_align, static_argnums=(2, 3, 4, 5))
multiscale_roi_align = jax.jit(ops.multiscale_roi_align, static_argnums=(2, 3, 4))
nms = jax.jit(ops.nms, static_argnames=("max_output", "block_size"))
batched_nms = jax.jit(ops.batched_nms, static_argnames=("max_output", "block_size"))
match = jax.jit(ops.match, static_argnums=(2, 3, 4))


def random_boxes(rng, n, extent=100.0, min_size=1.0, max_size=40.0):
    xy = rng.uniform(0, extent, (n, 2))
    wh = rng.uniform(min_size, max_size, (n, 2))
    return np.concatenate([xy, xy + wh], axis=1).astype(np.float32)


def tv_roi_align(features, boxes, output_size, scale, sampling_ratio, aligned):
    feat = torch.from_numpy(np.ascontiguousarray(features.transpose(2, 0, 1)))[None]
    out = torchvision.ops.roi_align(feat, [torch.from_numpy(boxes)], output_size, scale,
                                    sampling_ratio, aligned)
    return out.numpy().transpose(0, 2, 3, 1)


def roi_boxes(rng, image_h, image_w):
    """Random boxes, plus boxes partly and entirely outside the image, zero-area and tiny ones."""
    inside = random_boxes(rng, 20, extent=min(image_h, image_w) * 0.8, max_size=image_w * 0.5)
    special = np.array([
        [-10, -8, 15, 12],                                 # partly outside, top-left
        [image_w - 5, image_h - 7, image_w + 20, image_h + 9],  # partly outside, bottom-right
        [image_w + 10, 5, image_w + 30, 25],               # entirely outside (right)
        [-40, -40, -20, -25],                              # entirely outside (top-left)
        [10, 10, 10, 10],                                  # zero area
        [12.3, 4.1, 12.3, 30.0],                           # zero width
        [5.2, 6.7, 5.9, 7.1],                              # tiny
        [0, 0, image_w, image_h],                          # the whole image
        [3.5, 2.25, image_w - 0.5, image_h - 1.75],
    ], np.float32)
    return np.concatenate([inside, special]).astype(np.float32)


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("scale,sampling_ratio", [(1.0, 2), (0.5, 1), (0.25, 3), (0.125, 2)])
def test_roi_align_matches_torchvision(aligned, scale, sampling_ratio):
    rng = np.random.default_rng(int(scale * 1000) + sampling_ratio + 7 * aligned)
    image_h, image_w = 88, 136
    h, w = int(image_h * scale), int(image_w * scale)  # non-square feature map
    features = rng.normal(size=(h, w, 5)).astype(np.float32)
    boxes = roi_boxes(rng, image_h, image_w)
    for output_size in (7, 3):
        got = roi_align(features, boxes, output_size, scale, sampling_ratio, aligned)
        want = tv_roi_align(features, boxes, output_size, scale, sampling_ratio, aligned)
        assert got.shape == (len(boxes), output_size, output_size, 5)
        np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)
    # the entirely-outside boxes pool to exactly 0; N = 1
    assert np.all(np.asarray(got)[[len(boxes) - 7, len(boxes) - 6]] == 0)
    one = roi_align(features, boxes[-2:-1], 3, scale, sampling_ratio, aligned)
    np.testing.assert_allclose(np.asarray(one), want[-2:-1], atol=ATOL, rtol=0)


def test_roi_align_gradient_matches_torchvision():
    rng = np.random.default_rng(11)
    features = rng.normal(size=(12, 17, 3)).astype(np.float32)
    boxes = roi_boxes(rng, 24, 34)
    cotangent = rng.normal(size=(len(boxes), 4, 4, 3)).astype(np.float32)
    loss = lambda f: jnp.sum(ops.roi_align(f, boxes, 4, 0.5, 2, True) * cotangent)  # noqa: E731
    got = jax.jit(jax.grad(loss))(features)
    feat = torch.from_numpy(np.ascontiguousarray(features.transpose(2, 0, 1)))[None]
    feat.requires_grad_(True)
    out = torchvision.ops.roi_align(feat, [torch.from_numpy(boxes)], 4, 0.5, 2, True)
    out.backward(torch.from_numpy(np.ascontiguousarray(cotangent.transpose(0, 3, 1, 2))))
    np.testing.assert_allclose(np.asarray(got), feat.grad[0].numpy().transpose(1, 2, 0),
                               atol=ATOL, rtol=0)


def test_roi_align_needs_a_static_sampling_grid():
    with pytest.raises(ValueError, match="sampling_ratio"):
        ops.roi_align(np.zeros((4, 4, 1), np.float32), np.zeros((1, 4), np.float32), 2, 1.0, 0)


def test_multiscale_roi_align_matches_torchvision():
    rng = np.random.default_rng(3)
    image_h, image_w = 256, 384
    scales = (1 / 4, 1 / 8, 1 / 16)
    feats = [rng.normal(size=(int(image_h * s), int(image_w * s), 4)).astype(np.float32)
             for s in scales]
    side = np.exp(rng.uniform(np.log(8), np.log(380), 40))
    xy = rng.uniform(-20, 200, (40, 2))
    boxes = np.concatenate([xy, xy + side[:, None] * rng.uniform(0.6, 1.4, (40, 2))], 1)
    boxes = np.concatenate([boxes, [[5, 5, 5, 5], [0, 0, image_w, image_h]]]).astype(np.float32)
    pooler = MultiScaleRoIAlign(["a", "b", "c"], output_size=7, sampling_ratio=2)
    tv_feats = {k: torch.from_numpy(np.ascontiguousarray(f.transpose(2, 0, 1)))[None]
                for k, f in zip("abc", feats)}
    want = pooler(tv_feats, [torch.from_numpy(boxes)], [(image_h, image_w)])
    assert pooler.scales == list(scales)
    got = multiscale_roi_align(feats, boxes, 7, scales, 2)
    np.testing.assert_allclose(np.asarray(got), want.numpy().transpose(0, 2, 3, 1), atol=ATOL,
                               rtol=0)
    levels = np.asarray(ops.roi_levels(boxes, scales))
    mapper = initLevelMapper(2, 4)
    np.testing.assert_array_equal(levels, mapper([torch.from_numpy(boxes)]).numpy())
    assert set(levels.tolist()) == {0, 1, 2}  # every level is exercised
    one_level = MultiScaleRoIAlign(["b"], output_size=5, sampling_ratio=3)
    want = one_level({"b": tv_feats["b"]}, [torch.from_numpy(boxes)], [(image_h, image_w)])
    got = multiscale_roi_align(feats[1:2], boxes, 5, scales[1:2], 3)
    np.testing.assert_allclose(np.asarray(got), want.numpy().transpose(0, 2, 3, 1), atol=ATOL,
                               rtol=0)


def test_box_iou_matches_torchvision_and_is_zero_where_torchvision_is_nan():
    rng = np.random.default_rng(0)
    a = np.concatenate([random_boxes(rng, 30, extent=50), [[3, 3, 3, 3], [0, 0, 0, 5]]])
    b = np.concatenate([random_boxes(rng, 20, extent=50), [[3, 3, 3, 3], [1, 1, 4, 4]]])
    a, b = a.astype(np.float32), b.astype(np.float32)
    want = tv_boxes.box_iou(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    assert np.isnan(want).sum() == 2  # zero-area vs zero-area
    finite = np.isfinite(want)
    for box_iou in (ops.box_iou, jax.jit(ops.box_iou)):
        got = np.asarray(box_iou(a, b))
        np.testing.assert_array_equal(got[finite], want[finite])  # the same float32 roundings
        assert np.all(got[~finite] == 0)


def nms_case(seed, n, ties):
    rng = np.random.default_rng(seed)
    centres = rng.uniform(0, 60, (max(n // 8, 1), 2))  # clusters, so that boxes overlap
    pick = centres[rng.integers(0, len(centres), n)] + rng.normal(0, 4, (n, 2))
    wh = rng.uniform(4, 20, (n, 2))
    boxes = np.concatenate([pick - wh / 2, pick + wh / 2], 1).astype(np.float32)
    if n > 4:
        boxes[rng.integers(0, n, 2)] = [[7, 7, 7, 7], [9, 3, 9, 12]]  # zero-area boxes
    scores = rng.uniform(size=n).astype(np.float32)
    if ties:
        scores = np.round(scores * 4).astype(np.float32) / 4  # many equal scores
    return boxes, scores


def tv_nms(boxes, scores, threshold, labels=None):
    b, s = torch.from_numpy(boxes), torch.from_numpy(scores)
    if labels is None:
        return torchvision.ops.nms(b, s, threshold).numpy()
    return torchvision.ops.batched_nms(b, s, torch.from_numpy(labels), threshold).numpy()


def kept(indices, valid):
    indices, valid = np.asarray(indices), np.asarray(valid)
    assert np.all(valid[:-1] >= valid[1:]), "valid entries come first"
    assert np.all(indices[~valid] == 0)
    return indices[valid]


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.7])
def test_nms_matches_torchvision(threshold):
    for seed in range(12):
        n = (1, 2, 40, 150)[seed % 4]
        boxes, scores = nms_case(seed, n, ties=seed % 3 == 0)
        want = tv_nms(boxes, scores, threshold)
        # one block; several blocks, the last one partial
        for block_size in (256, 16, 7) if n > 100 else (256,):
            got = kept(*nms(boxes, scores, threshold, max_output=n + 3, block_size=block_size))
            np.testing.assert_array_equal(got, want)  # the same boxes in the same order


def test_nms_ties_follow_index_order():
    boxes = np.array([[0, 0, 10, 10], [20, 20, 30, 30], [0, 0, 10, 10.5], [40, 40, 50, 50],
                      [20, 20, 30, 31], [0, 0, 10, 10]], np.float32)
    scores = np.full(6, 0.5, np.float32)
    want = tv_nms(boxes, scores, 0.5)
    np.testing.assert_array_equal(want, [0, 1, 3])  # torchvision sorts stably
    np.testing.assert_array_equal(kept(*nms(boxes, scores, 0.5, 6)), want)
    scores[5] = 0.6  # a higher duplicate wins instead
    np.testing.assert_array_equal(kept(*nms(boxes, scores, 0.5, 6)), tv_nms(boxes, scores, 0.5))


def test_nms_truncation_and_valid_mask():
    boxes, scores = nms_case(5, 120, ties=True)
    want = tv_nms(boxes, scores, 0.5)
    assert len(want) > 10
    for block_size in (256, 7):
        indices, valid = nms(boxes, scores, 0.5, 10, block_size=block_size)
        assert indices.shape == (10,) and indices.dtype == jnp.int32 and bool(np.all(valid))
        np.testing.assert_array_equal(np.asarray(indices), want[:10])
    mask = np.random.default_rng(1).uniform(size=120) < 0.6
    subset = np.flatnonzero(mask)
    want = subset[tv_nms(boxes[mask], scores[mask], 0.5)]  # masked-out boxes take no part
    for block_size in (256, 7):
        got = kept(*nms(boxes, scores, 0.5, 120, valid=mask, block_size=block_size))
        np.testing.assert_array_equal(got, want)
    indices, valid = nms(boxes, scores, 0.5, 120, valid=np.zeros(120, bool))
    assert not np.any(np.asarray(valid)) and not np.any(np.asarray(indices))


def test_nms_compiles_once_for_inputs_of_one_shape():
    traces = []

    def counted(*args, **kwargs):
        traces.append(1)
        return ops.nms(*args, **kwargs)

    jitted = jax.jit(counted, static_argnames=("max_output",))
    for seed, threshold in ((0, 0.5), (1, 0.7)):  # new boxes, scores and threshold: no retrace
        boxes, scores = nms_case(seed, 64, ties=False)
        got = kept(*jitted(boxes, scores, threshold, max_output=20))
        np.testing.assert_array_equal(got, tv_nms(boxes, scores, threshold)[:20])
    assert len(traces) == 1 and jitted._cache_size() == 1


def test_nms_and_roi_align_vmap_over_images():
    cases = [nms_case(seed, 60, ties=False) for seed in (3, 4)]
    boxes, scores = (np.stack(x) for x in zip(*cases))
    indices, valid = jax.jit(jax.vmap(lambda b, s: ops.nms(b, s, 0.5, 30, block_size=16)))(
        boxes, scores)
    for i, (b, s) in enumerate(cases):
        np.testing.assert_array_equal(kept(indices[i], valid[i]), tv_nms(b, s, 0.5)[:30])
    features = np.random.default_rng(0).normal(size=(2, 9, 11, 2)).astype(np.float32)
    pooled = jax.jit(jax.vmap(lambda f, b: ops.roi_align(f, b, 3, 0.125, 2)))(features, boxes)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(pooled[i]),
                                   tv_roi_align(features[i], boxes[i], 3, 0.125, 2, True),
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.7])
def test_batched_nms_matches_torchvision(threshold):
    for seed in range(10):
        n = (1, 30, 160)[seed % 3]
        boxes, scores = nms_case(100 + seed, n, ties=seed % 2 == 0)
        labels = np.random.default_rng(seed).integers(0, 4, n)
        want = tv_nms(boxes, scores, threshold, labels)
        for block_size in (256, 12) if n > 100 else (256,):
            got = kept(*batched_nms(boxes, scores, labels, threshold, n, block_size=block_size))
            np.testing.assert_array_equal(got, want)
    mask = np.random.default_rng(2).uniform(size=n) < 0.5
    subset = np.flatnonzero(mask)
    want = subset[tv_nms(boxes[mask], scores[mask], 0.5, labels[mask])][:25]
    got = kept(*batched_nms(boxes, scores, labels, 0.5, 25, valid=mask))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)])
def test_box_coder_matches_torchvision(weights):
    rng = np.random.default_rng(4)
    reference, proposals = random_boxes(rng, 50), random_boxes(rng, 50)
    coder = BoxCoder(weights)
    want = coder.encode_single(torch.from_numpy(reference), torch.from_numpy(proposals)).numpy()
    got = np.asarray(ops.encode_boxes(reference, proposals, weights))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-6)
    deltas = rng.normal(0, 2, (50, 4)).astype(np.float32)
    deltas[:5, 2:] = 9.0  # above the exp clip
    want = coder.decode_single(torch.from_numpy(deltas), torch.from_numpy(proposals)).numpy()
    got = np.asarray(ops.decode_boxes(deltas, proposals, weights))
    # pixel coordinates up to ~1e4 (exp(4.1) * 40): a few float32 ulps, relative
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-6)
    per_class = rng.normal(0, 1, (50, 3 * 4)).astype(np.float32)  # torchvision's [N, K * 4]
    want = coder.decode_single(torch.from_numpy(per_class), torch.from_numpy(proposals)).numpy()
    got = ops.decode_boxes(per_class.reshape(50, 3, 4), proposals[:, None], weights)
    np.testing.assert_allclose(np.asarray(got), want.reshape(50, 3, 4), atol=ATOL, rtol=1e-6)
    roundtrip = ops.decode_boxes(ops.encode_boxes(reference, proposals, weights), proposals,
                                 weights)
    np.testing.assert_allclose(np.asarray(roundtrip), reference, atol=1e-4)


@pytest.mark.parametrize("sizes,ratios", [(((32,), (64,), (128,)), ((0.5, 1.0, 2.0),) * 3),
                                          (((16, 24), (48, 50)), ((0.5, 1.0, 2.0, 3.0),) * 2)])
def test_anchors_match_torchvision(sizes, ratios):
    image_h, image_w = 100, 148
    grids = [(25, 37), (13, 19), (7, 10)][:len(sizes)]
    generator = AnchorGenerator(sizes=sizes, aspect_ratios=ratios)
    images = ImageList(torch.zeros(1, 3, image_h, image_w), [(image_h, image_w)])
    want = generator(images, [torch.zeros(1, 2, h, w) for h, w in grids])[0].numpy()
    got = np.concatenate([
        ops.anchor_grid((h, w), (image_h // h, image_w // w), size, ratio)
        for (h, w), size, ratio in zip(grids, sizes, ratios)])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    for size, ratio in zip(sizes, ratios):
        np.testing.assert_array_equal(ops.cell_anchors(size, ratio),
                                      generator.generate_anchors(size, ratio).numpy())


def test_clip_and_small_boxes_match_torchvision():
    rng = np.random.default_rng(6)
    boxes = random_boxes(rng, 60, extent=120, min_size=0.0, max_size=8.0) - 10
    got = np.asarray(ops.clip_boxes(boxes, (90, 70)))
    want = tv_boxes.clip_boxes_to_image(torch.from_numpy(boxes), (90, 70)).numpy()
    np.testing.assert_array_equal(got, want)
    boxes[:3, 2] = boxes[:3, 0]  # zero width
    for min_size in (1e-3, 2.0, 4.5):
        keep = np.asarray(ops.small_boxes_mask(boxes, min_size))
        want = tv_boxes.remove_small_boxes(torch.from_numpy(boxes), min_size).numpy()
        np.testing.assert_array_equal(np.flatnonzero(keep), want)
        assert not keep.all() and keep.any()
    assert np.array_equal(ops.small_boxes_mask(boxes[4:5], 0.0), [True])


@pytest.mark.parametrize("high,low,allow", [(0.7, 0.3, True), (0.7, 0.3, False),
                                            (0.5, 0.5, False), (0.5, 0.4, True)])
def test_match_matches_torchvision(high, low, allow):
    matcher = Matcher(high, low, allow_low_quality_matches=allow)
    for seed in range(8):
        rng = np.random.default_rng(seed)
        g, n = (1, 3, 6, 10)[seed % 4], 80
        iou = np.round(rng.uniform(0, 0.9, (g, n)) ** 2 * 10) / 10  # coarse: many ties
        iou[:, rng.integers(0, n, 5)] = 0.0
        iou = iou.astype(np.float32)
        gt_valid = np.ones(g, bool)
        padded, valid = iou, gt_valid
        if seed % 2:  # interleave padded rows that must never match
            extra = rng.uniform(0.8, 1.0, (g, n)).astype(np.float32)
            padded = np.stack([iou, extra], 1).reshape(2 * g, n)
            valid = np.stack([gt_valid, np.zeros(g, bool)], 1).reshape(-1)
        want = matcher(torch.from_numpy(iou)).numpy()
        got = np.asarray(match(padded, valid, high, low, allow))
        if seed % 2:
            assert np.all(got[got >= 0] % 2 == 0), "a padded row matched"
            got = np.where(got >= 0, got // 2, got)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    none = ops.match(np.full((3, 5), 0.9, np.float32), np.zeros(3, bool), high, low, allow)
    np.testing.assert_array_equal(np.asarray(none), -1)
    empty = ops.match(np.zeros((0, 5), np.float32), np.zeros(0, bool), high, low, allow)
    np.testing.assert_array_equal(np.asarray(empty), np.full(5, -1))


def test_sample_labels_counts_and_candidates():
    rng = np.random.default_rng(8)
    sample = jax.jit(ops.sample_labels, static_argnums=(2, 3))
    for n_pos, n_neg in [(5, 1000), (300, 700), (10, 20), (0, 50), (400, 0)]:
        labels = np.concatenate([rng.integers(1, 4, n_pos), np.zeros(n_neg, int),
                                 np.full(1037 - n_pos - n_neg, -1)])  # one shape: one compile
        labels = rng.permutation(labels)
        torch.manual_seed(0)
        tv_pos, tv_neg = BalancedPositiveNegativeSampler(256, 0.25)([torch.from_numpy(labels)])
        seen = np.zeros(len(labels), bool)
        for seed in range(4):
            pos, neg = map(np.asarray, sample(labels, jax.random.key(seed), 256, 0.25))
            assert pos.sum() == tv_pos[0].sum().item() == min(n_pos, 64)
            assert neg.sum() == tv_neg[0].sum().item() == min(n_neg, 256 - pos.sum())
            assert np.all(labels[pos] >= 1) and np.all(labels[neg] == 0)
            seen |= pos | neg
        if n_neg > 300:  # different keys draw different negatives
            assert seen[labels == 0].sum() > min(n_neg, 256 - min(n_pos, 64))
