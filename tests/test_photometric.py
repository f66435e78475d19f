"""Photometric augmentation on the device against torchvision's PIL path on the same parameters:
each op, the chain in a drawn order, the blur, the batch layout; PIL's HSV conversions and
Blend.c over every input; what dm-pix and torchvision's tensor path would give instead."""

import dm_pix
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import skimage.data
import torch
import torchvision.transforms.functional as F
from PIL import Image
from torchvision.transforms import _functional_tensor as F_t

from sclaro_jax.data import batch as fields
from sclaro_jax.data import photometric as P

F32 = np.float32
TV_OPS = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)
JAX_OPS = [jax.jit(op) for op in (P.adjust_brightness, P.adjust_contrast, P.adjust_saturation,
                                  P.adjust_hue)]
color_jitter = jax.jit(P.color_jitter)
gaussian_blur = jax.jit(P.gaussian_blur)


@pytest.fixture(scope="module")
def photos():
    """Three real photographs (astronaut, chelsea, coffee), 64x64 RGB uint8."""
    return [np.asarray(Image.fromarray(load()).convert("RGB").resize((64, 64), Image.BICUBIC))
            for load in (skimage.data.astronaut, skimage.data.chelsea, skimage.data.coffee)]


@pytest.fixture(scope="module")
def every_triple():
    """All 2^24 byte triples as a 4096x4096x3 image."""
    c = np.arange(2 ** 24, dtype=np.uint32)
    return np.stack([c >> 16, (c >> 8) & 255, c & 255], -1).astype(np.uint8).reshape(4096, 4096, 3)


def tv_chain(x: np.ndarray, order, factors) -> np.ndarray:
    """torchvision's ColorJitter ops on a PIL image in `order`, factors by op index."""
    img = Image.fromarray(x)
    for op in order:
        img = TV_OPS[op](img, float(factors[op]))
    return np.asarray(img)


def tv_blur(x: np.ndarray, sigma: float) -> np.ndarray:
    return np.asarray(F.gaussian_blur(Image.fromarray(x), [9, 9], [sigma, sigma]))


def max_diff(a, b) -> int:
    return int(np.abs(np.asarray(a, np.int32) - np.asarray(b, np.int32)).max())


@pytest.mark.parametrize("op, factors", [
    (0, (0.8, 1.2, 0.5, 1.5)), (1, (0.8, 1.2, 0.5, 1.5)), (2, (0.8, 1.2, 0.0, 2.0)),
    (3, (-0.05, 0.05, -0.3, 0.3, 0.5, -0.5, 0.0))])
def test_each_op_matches_torchvision_on_pil(photos, op, factors):
    worst = 0
    for factor in factors:
        f = float(F32(factor))
        for x in photos:
            worst = max(worst, max_diff(JAX_OPS[op](x, f), TV_OPS[op](Image.fromarray(x), f)))
    print(f"op {op}: max |device - torchvision PIL| = {worst}")
    assert worst <= 1


def test_chain_in_drawn_order_matches_torchvision(photos):
    rng = np.random.default_rng(0)
    worst = 0
    for i in range(24):
        order = rng.permutation(4).astype(np.int32)
        hue = 0.3 if i % 4 == 0 else 0.05
        factors = np.array([rng.uniform(0.8, 1.2), rng.uniform(0.8, 1.2), rng.uniform(0.8, 1.2),
                            rng.uniform(-hue, hue)], F32)
        x = photos[i % 3]
        worst = max(worst, max_diff(color_jitter(x, order, factors), tv_chain(x, order, factors)))
    print(f"chain in a drawn order: max |device - torchvision PIL| = {worst}")
    assert worst <= 1


@pytest.mark.slow
def test_pil_hsv_conversions_exact_on_every_input(every_triple):
    hsv = np.asarray(jax.jit(P.rgb_to_hsv)(every_triple))
    np.testing.assert_array_equal(hsv, np.asarray(Image.fromarray(every_triple).convert("HSV")))
    rgb = np.asarray(jax.jit(P.hsv_to_rgb)(every_triple))  # every triple read as (H, S, V)
    want = np.asarray(Image.fromarray(every_triple, "HSV").convert("RGB"))
    np.testing.assert_array_equal(rgb, want)


def test_hue_shift_truncates_like_torchvision():
    """Every float32 factor within 2048 steps of each k / 255 (where truncation could go
    wrong), both signs, and the drawn ranges' ends."""
    steps = np.arange(-2048, 2049, dtype=np.int32)
    near = [(F32(k / 255).view(np.int32) + steps).view(F32) for k in range(1, 128)]
    factors = np.concatenate(near + [np.array([0.05, 0.3, 0.5, 0.0], F32)])
    factors = np.concatenate([factors, -factors])
    got = np.asarray(jax.jit(P.hue_shift)(factors))
    want = (factors.astype(np.float64) * 255).astype(np.int32).astype(np.uint8)
    np.testing.assert_array_equal(got, want)


def test_blend_equals_pillow_on_every_pixel_pair():
    a, b = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8),
                       indexing="ij")
    rng = np.random.default_rng(1)
    blend = jax.jit(P._blend)
    for f in np.concatenate([rng.uniform(0.8, 1.2, 40), [0.0, 0.5, 0.8, 1.0, 1.2, 2.5]]):
        f = F32(f)
        want = np.asarray(Image.blend(Image.fromarray(a), Image.fromarray(b), float(f)))
        np.testing.assert_array_equal(np.asarray(blend(a, b, f)), want, err_msg=f"factor {f}")


@pytest.mark.parametrize("sigma", [0.1, 0.8, 1.5])
def test_blur_matches_torchvision(photos, sigma):
    kernel = F_t._get_gaussian_kernel1d(9, sigma, torch.float32, torch.device("cpu")).numpy()
    x = jnp.zeros((9, 9, 1)).at[4, 4, 0].set(1.0)  # dm-pix's kernel, read off an impulse
    dm_kernel = np.asarray(dm_pix.gaussian_blur(x, sigma, 9))[..., 0].sum(axis=1)
    np.testing.assert_allclose(dm_kernel, kernel, atol=1e-7)
    worst = max(max_diff(gaussian_blur(x, F32(sigma)), tv_blur(x, float(F32(sigma))))
                for x in photos)
    print(f"blur sigma {sigma}: max |device - torchvision| = {worst}")
    assert worst <= 1


def _batch(photos, jitter, order, factors, sigma, n=2, crops=None):
    """A B-sample batch: global views, n object and n relation views per sample (crops of
    the photographs, 32x32). `crops`: (decision, order, object factors, relation factors) of
    the crop levels per sample (default: the global view's draw at every level)."""
    b = len(jitter)
    views = [photos[i % 3][8 * j:8 * j + 32, 4 * j:4 * j + 32] for i in range(b)
             for j in range(1 + 2 * n)]
    views = np.stack(views).reshape(b, 1 + 2 * n, 32, 32, 3)
    crop_jitter, crop_order, obj_factors, rel_factors = crops or (jitter, order, factors, factors)
    batch = {fields.IMAGE: views[:, 0], "objects": views[:, 1:1 + n],
             "relations": views[:, 1 + n:], fields.JITTER: np.array(jitter),
             fields.JITTER_ORDER: np.array(order, np.int32),
             fields.JITTER_FACTORS: np.array(factors, F32),
             fields.BLUR_SIGMA: np.array(sigma, F32), fields.VALID: np.ones(b, bool),
             fields.CROP_JITTER: np.array(crop_jitter),
             fields.CROP_JITTER_ORDER: np.array(crop_order, np.int32),
             fields.OBJECT_JITTER_FACTORS: np.array(obj_factors, F32),
             fields.RELATION_JITTER_FACTORS: np.array(rel_factors, F32)}
    return batch


def test_augment_batch_equals_per_sample_torchvision(photos):
    """Each view gets its own level's draw: the global view its jitter and blur, the object
    crops and relation regions the crop levels' decision and order with their own factors."""
    jitter = [True, False, True, False]
    order = [[3, 0, 2, 1], [0, 1, 2, 3], [1, 2, 0, 3], [2, 3, 1, 0]]
    factors = [[1.15, 0.85, 1.1, -0.04], [1.2, 1.2, 1.2, 0.3], [0.82, 1.19, 0.9, 0.05],
               [0.9, 0.9, 0.9, 0.01]]
    sigma = [0.0, 1.2, 0.6, 0.0]
    crop_jitter = [True, True, False, False]
    crop_order = [[1, 3, 0, 2], [2, 0, 3, 1], [0, 1, 2, 3], [3, 2, 1, 0]]
    level_factors = {"objects": [[0.86, 1.14, 0.9, 0.03], [1.1, 0.88, 1.05, -0.02],
                                 [1.2, 1.2, 1.2, 0.2], [0.5, 0.5, 0.5, 0.1]],
                     "relations": [[0.91, 1.09, 0.93, 0.02], [1.07, 0.92, 1.03, -0.013],
                                   [1.2, 1.2, 1.2, 0.2], [0.5, 0.5, 0.5, 0.1]]}
    batch = _batch(photos, jitter, order, factors, sigma,
                   crops=(crop_jitter, crop_order, level_factors["objects"],
                          level_factors["relations"]))
    out = P.augment_batch(batch)
    worst = 0
    for i in range(4):
        want = tv_chain(batch[fields.IMAGE][i], order[i], np.array(factors[i], F32)) \
            if jitter[i] else batch[fields.IMAGE][i]
        want = tv_blur(want, float(F32(sigma[i]))) if sigma[i] > 0 else want
        worst = max(worst, max_diff(out[fields.IMAGE][i], want))
        for name in ("objects", "relations"):
            for j in range(2):
                got, x = out[name][i, j], batch[name][i, j]
                if crop_jitter[i]:
                    want = tv_chain(x, crop_order[i], np.array(level_factors[name][i], F32))
                    assert max_diff(got, want) == 0, (i, name, j)
                    assert max_diff(got, x) > 0
                else:
                    np.testing.assert_array_equal(got, x)
    assert worst <= 1  # the blur: separable sums may round the other way
    np.testing.assert_array_equal(out[fields.IMAGE][3], batch[fields.IMAGE][3])  # off, sigma 0
    assert out[fields.VALID] is batch[fields.VALID]


def test_identity_parameters_leave_pixels_bit_exact(photos):
    batch = _batch(photos, [False] * 4, [[3, 2, 1, 0]] * 4, [[0.5, 2.0, 0.0, 0.5]] * 4, [0.0] * 4)
    out = P.augment_batch(batch)
    for name in (fields.IMAGE, "objects", "relations"):
        np.testing.assert_array_equal(np.asarray(out[name]), batch[name])


def test_batch_without_fields_is_unchanged_and_float_pixels_are_refused(photos):
    batch = _batch(photos, [True], [[0, 1, 2, 3]], [[1.1, 1.1, 1.1, 0.02]], [1.0])
    bare = {k: v for k, v in batch.items() if k not in dict(fields.IDENTITY_PHOTOMETRIC)}
    assert P.augment_batch(bare) is bare
    batch["objects"] = batch["objects"].astype(F32)
    with pytest.raises(TypeError, match="'objects'.*uint8"):
        P.augment_batch(batch)


def test_other_implementations_are_not_torchvisions_pil_path(photos):
    """Why the PIL path is the target and dm-pix serves only the blur: torchvision's uint8
    tensor hue (float HSV) and dm-pix's float colour ops land several grey levels away."""
    def tensor(x):
        return torch.from_numpy(x.copy()).permute(2, 0, 1)

    def dm(fn, x, f):
        y = np.asarray(fn(jnp.asarray(x, jnp.float32) / 255.0, f))
        return np.clip(np.round(y * 255.0), 0, 255)

    report = {}
    for f in (-0.05, 0.05, 0.3):
        pil = [np.asarray(F.adjust_hue(Image.fromarray(x), f)) for x in photos]
        report[f"tensor hue {f}"] = max(max_diff(F.adjust_hue(tensor(x), f).permute(1, 2, 0), p)
                                        for x, p in zip(photos, pil))
        report[f"dm-pix hue {f}"] = max(max_diff(dm(dm_pix.adjust_hue, x, f), p)
                                        for x, p in zip(photos, pil))
    for name, fn, ref in (("contrast", dm_pix.adjust_contrast, F.adjust_contrast),
                          ("saturation", dm_pix.adjust_saturation, F.adjust_saturation)):
        report[f"dm-pix {name} 1.2"] = max(max_diff(dm(fn, x, 1.2), ref(Image.fromarray(x), 1.2))
                                           for x in photos)
    print(report)
    assert min(report.values()) > 1
    x = jnp.asarray(photos[0], jnp.float32) / 255.0  # dm-pix brightness adds a delta
    np.testing.assert_allclose(dm_pix.adjust_brightness(x, 0.2), x + 0.2)
