"""Augmentations (the host's geometry, the photometric draw) against torchvision's own
functions on the same PIL images."""

import os

import numpy as np
import pytest
import skimage
import torchvision.transforms.functional as F
from PIL import Image

from sclaro_jax.data import augment, batch as fields


@pytest.fixture(scope="module")
def photo():
    img = Image.open(os.path.join(os.path.dirname(skimage.__file__), "data", "chelsea.png"))
    return img.convert("RGB").resize((96, 64), Image.BICUBIC)


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


def test_global_view_equals_torchvision_resized_crop(photo):
    rng = np.random.default_rng(3)
    for _ in range(5):
        params = augment.sample_params(rng, *photo.size, train=True)
        x0, y0, x1, y1 = params.crop
        ref = F.resized_crop(photo, y0, x0, y1 - y0, x1 - x0, [48, 48],
                             F.InterpolationMode.BICUBIC)
        np.testing.assert_array_equal(augment.global_view(photo, params, 48), np.asarray(ref))


def test_resize_centre_crop_of_a_downscaled_copy_covers_the_photographs_view(photo):
    """With photo_size, the view of a downscaled copy takes the part of the scene that
    Resize + CenterCrop takes from the photograph (here the 'copy' is the photograph itself,
    so the pixels must equal the plain transform's)."""
    for size in (24, 40):
        want = np.asarray(augment.resize_centre_crop(photo, size))
        np.testing.assert_array_equal(
            np.asarray(augment.resize_centre_crop(photo, size, photo.size)), want)
    # 512x600 stored at 83x97 (schema.train_image_size for 64 px views): at 64 px the
    # photograph's view is 64x75 cropped at row 6, the copy's own would be 64x74 at row 5
    big = photo.resize((512, 600), Image.BICUBIC)
    small = big.resize((83, 97), Image.BICUBIC)
    want = np.asarray(augment.resize_centre_crop(big, 64)).astype(int)
    plain = np.abs(np.asarray(augment.resize_centre_crop(small, 64)) - want).mean()
    scaled = np.abs(np.asarray(augment.resize_centre_crop(small, 64, big.size)) - want).mean()
    assert scaled < 0.5 * plain, (scaled, plain)


def test_photometric_fields_carry_the_draw(photo):
    rng = np.random.default_rng(7)
    seen_jitter = seen_blur = False
    for _ in range(60):
        params = augment.sample_params(rng, *photo.size, train=True)
        f = augment.photometric_fields(params)
        assert {k: (v.dtype, v.shape) for k, v in f.items()} == {
            name: (np.dtype(dtype), shape) for name, dtype, shape in fields.PHOTOMETRIC}
        assert bool(f[fields.JITTER]) == (params.jitter is not None)
        if params.jitter:
            seen_jitter = True
            assert f[fields.JITTER_ORDER].tolist() == [op for op, _ in params.jitter]
            np.testing.assert_allclose(f[fields.JITTER_FACTORS],
                                       [factor for _, factor in sorted(params.jitter)],
                                       rtol=1e-6)
        else:
            assert f[fields.JITTER_ORDER].tolist() == [0, 1, 2, 3]
            assert f[fields.JITTER_FACTORS].tolist() == [1, 1, 1, 0]
        seen_blur |= params.blur_sigma is not None
        assert f[fields.BLUR_SIGMA] == np.float32(params.blur_sigma or 0)
    assert seen_jitter and seen_blur
    identity = augment.photometric_fields(augment.sample_params(rng, 9, 9, train=False))
    for name, value in fields.IDENTITY_PHOTOMETRIC.items():
        np.testing.assert_array_equal(identity[name], value)
