"""Augmentations against torchvision's own functions on the same PIL images."""

import os

import numpy as np
import pytest
import skimage
import torch
import torchvision.transforms.functional as F
from PIL import Image

from sclaro_jax.data import augment


@pytest.fixture(scope="module")
def photo():
    img = Image.open(os.path.join(os.path.dirname(skimage.__file__), "data", "chelsea.png"))
    return img.convert("RGB").resize((96, 64), Image.BICUBIC)


@pytest.mark.parametrize("op, factor, reference", [
    (0, 1.17, F.adjust_brightness), (1, 0.83, F.adjust_contrast),
    (2, 1.12, F.adjust_saturation), (3, 0.043, F.adjust_hue), (3, -0.037, F.adjust_hue)])
def test_colour_jitter_ops_equal_torchvision(photo, op, factor, reference):
    got = np.asarray(augment.color_jitter(photo, ((op, factor),)))
    np.testing.assert_array_equal(got, np.asarray(reference(photo, factor)))


def test_jitter_applies_ops_in_the_drawn_order(photo):
    ops = ((3, 0.05), (0, 0.8), (2, 1.2), (1, 1.1))
    want = photo
    for fn, f in ((F.adjust_hue, 0.05), (F.adjust_brightness, 0.8),
                  (F.adjust_saturation, 1.2), (F.adjust_contrast, 1.1)):
        want = fn(want, f)
    np.testing.assert_array_equal(np.asarray(augment.color_jitter(photo, ops)), np.asarray(want))


@pytest.mark.parametrize("sigma", [0.1, 0.7, 1.5])
def test_gaussian_blur_equals_torchvision(photo, sigma):
    x = np.asarray(photo)
    ref = F.gaussian_blur(torch.from_numpy(x.copy()).permute(2, 0, 1), [9, 9], [sigma, sigma])
    diff = np.abs(augment.gaussian_blur(x, sigma).astype(int) - ref.permute(1, 2, 0).numpy())
    assert diff.max() <= 1  # float32 sums in another order; rounding may differ by one


def test_random_resized_crop_box_follows_torchvision_bounds():
    rng = np.random.default_rng(0)
    for w, h in ((640, 480), (300, 451), (100, 100), (1000, 90)):
        for _ in range(200):
            x0, y0, x1, y1 = augment.random_resized_crop_box(rng, w, h)
            assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
            if (w, h) != (1000, 90):  # that one falls back to the centre crop of ratio 4/3
                assert 0.8 * w * h * 0.97 <= (x1 - x0) * (y1 - y0) <= w * h
                assert 3 / 4 * 0.9 <= (x1 - x0) / (y1 - y0) <= 4 / 3 * 1.1
    assert augment.random_resized_crop_box(rng, 1000, 90) == (440, 0, 560, 90)


def test_sample_params_probabilities_and_eval():
    rng = np.random.default_rng(1)
    draws = [augment.sample_params(rng, 640, 480, train=True) for _ in range(4000)]
    assert abs(np.mean([d.jitter is not None for d in draws]) - 0.2) < 0.025
    assert abs(np.mean([d.blur_sigma is not None for d in draws]) - 0.1) < 0.02
    factors = np.array([[f for _, f in sorted(d.jitter)] for d in draws if d.jitter])
    assert factors[:, :3].min() >= 0.8 and factors[:, :3].max() <= 1.2
    assert np.abs(factors[:, 3]).max() <= 0.05
    assert augment.sample_params(rng, 640, 480, train=False) == augment.SampleParams(
        None, None, None)


def test_resize_centre_crop_equals_torchvision_two_steps(photo):
    for box in ((0, 0, 96, 64), (10, 5, 30, 60), (3, 3, 90, 20)):
        crop = photo.crop(box)
        for size in (32, 224):
            ref = F.center_crop(F.resize(crop, size, F.InterpolationMode.BICUBIC), size)
            diff = np.abs(np.asarray(augment.resize_centre_crop(crop, size)).astype(int)
                          - np.asarray(ref))
            assert diff.max() <= 2 and diff.mean() < 0.5, (box, size, diff.max())
