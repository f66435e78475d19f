"""Augmentations (the host's geometry, the photometric draw) against torchvision's own
functions on the same PIL images."""

import os

import numpy as np
import pytest
import skimage
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F
from PIL import Image

from sclaro_jax.data import augment, batch as fields, photometric


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
    draws = [augment.sample_params(np.random.default_rng([1, i]), 640, 480, train=True)
             for i in range(4000)]
    assert abs(np.mean([d.jitter is not None for d in draws]) - 0.2) < 0.025
    assert abs(np.mean([d.object_jitter is not None for d in draws]) - 0.2) < 0.025
    assert abs(np.mean([d.blur_sigma is not None for d in draws]) - 0.1) < 0.02
    for level, got in (("global", [d.jitter for d in draws]),
                       ("object", [d.object_jitter for d in draws]),
                       ("relation", [d.relation_jitter for d in draws])):
        factors = np.array([[f for _, f in sorted(j)] for j in got if j])
        b, c, s, h = augment.JITTER_STRENGTHS[level]
        assert factors[:, :3].min() >= 1 - b and factors[:, :3].max() <= 1 + b
        assert np.abs(factors[:, 3]).max() <= h
        assert factors[:, :3].min() < 1 - 0.9 * b and np.abs(factors[:, 3]).max() > 0.9 * h
    assert augment.sample_params(rng, 640, 480, train=False) == augment.SampleParams(
        None, None, None)


def test_crop_levels_share_one_draw_from_the_start_of_the_samples_stream():
    """The reference's structure (`temp_seed(s)` around every view's transform): the object
    crops and relation regions take the stream's first draws (decision, order, four uniforms)
    at their own strengths; the global view's first draw is RandomResizedCrop's scale, its
    jitter comes after."""
    seen = set()
    for i in range(400):
        params = augment.sample_params(np.random.default_rng([2, i]), 640, 480, train=True)
        assert params == augment.sample_params(np.random.default_rng([2, i]), 640, 480,
                                               train=True)
        first = augment.Draws.from_generator(np.random.default_rng([2, i]))
        applied = not np.float32(0.2) < np.float32(first.unit())
        assert (params.object_jitter is not None) == applied
        assert (params.relation_jitter is not None) == applied
        if applied:
            objects, relations = params.object_jitter, params.relation_jitter
            assert [op for op, _ in objects] == [op for op, _ in relations]
            for (op, fo), (_, fr) in zip(objects, relations):
                # one uniform u per op: fo = lo_o + u (hi_o - lo_o), fr = lo_r + u (hi_r - lo_r)
                so, sr = (augment.JITTER_STRENGTHS[k][op] for k in ("object", "relation"))
                u_o = (fo + so) / (2 * so) if op == 3 else (fo - 1 + so) / (2 * so)
                u_r = (fr + sr) / (2 * sr) if op == 3 else (fr - 1 + sr) / (2 * sr)
                assert abs(u_o - u_r) < 1e-5, (i, op, fo, fr)
        seen.add((applied, params.jitter is not None))
    assert seen == {(True, True), (True, False), (False, True), (False, False)}


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
    seen_jitter = seen_blur = seen_crops = False
    for i in range(80):
        params = augment.sample_params(np.random.default_rng([7, i]), *photo.size, train=True)
        f = augment.photometric_fields(params)
        assert {k: (v.dtype, v.shape) for k, v in f.items()} == {
            name: (np.dtype(dtype), shape) for name, dtype, shape in fields.PHOTOMETRIC}
        for flag, order, level_factors in (
                (fields.JITTER, fields.JITTER_ORDER,
                 ((fields.JITTER_FACTORS, params.jitter),)),
                (fields.CROP_JITTER, fields.CROP_JITTER_ORDER,
                 ((fields.OBJECT_JITTER_FACTORS, params.object_jitter),
                  (fields.RELATION_JITTER_FACTORS, params.relation_jitter)))):
            for name, drawn in level_factors:
                assert bool(f[flag]) == (drawn is not None)
                if drawn:
                    assert f[order].tolist() == [op for op, _ in drawn]
                    np.testing.assert_array_equal(
                        f[name], np.array([factor for _, factor in sorted(drawn)], np.float32))
                else:
                    assert f[order].tolist() == [0, 1, 2, 3]
                    assert f[name].tolist() == [1, 1, 1, 0]
        seen_jitter |= params.jitter is not None
        seen_crops |= params.object_jitter is not None
        seen_blur |= params.blur_sigma is not None
        assert f[fields.BLUR_SIGMA] == np.float32(params.blur_sigma or 0)
    assert seen_jitter and seen_blur and seen_crops
    identity = augment.photometric_fields(augment.sample_params(None, 9, 9, train=False))
    for name, value in fields.IDENTITY_PHOTOMETRIC.items():
        np.testing.assert_array_equal(identity[name], value)


class TorchDraws:
    """torch's global generator answering `augment.sample_params`'s calls, as torchvision's
    transforms make them."""

    def unit(self):
        return torch.rand(1).item()

    def randint(self, low, high):
        return int(torch.randint(low, high, size=(1,)).item())

    def randperm(self, n):
        return torch.randperm(n).tolist()


def _reference_transforms(size):
    """The official code's per-level training transforms (PIL in, PIL out; ToTensor and
    Normalize left off)."""
    bicubic = T.InterpolationMode.BICUBIC

    def crops(b, h):
        return T.Compose([T.Resize(size, bicubic), T.CenterCrop(size),
                          T.RandomApply([T.ColorJitter(b, b, b, h)], p=0.2)])

    return {"global": T.Compose([
        T.RandomResizedCrop(size, scale=(0.8, 1.0), interpolation=bicubic),
        T.RandomApply([T.ColorJitter(0.2, 0.2, 0.2, 0.05)], p=0.2),
        T.RandomApply([T.GaussianBlur(9, sigma=(0.1, 1.5))], p=0.1)]),
        "object": crops(0.15, 0.03), "relation": crops(0.10, 0.02)}


def test_views_equal_the_reference_transforms_under_its_seeding(photo):
    """With torch's stream in place of numpy's, one sample's draws are the reference's: each
    view's transform under `torch.manual_seed(s)` (its `temp_seed`), the global view, two
    object crops and two relation regions, give the same apply-decisions and the same pixels
    from `sample_params` + the device's `augment_batch` (the blur within 1 grey level)."""
    size = 32
    ref = _reference_transforms(size)
    regions = {"object": [(0, 0, 60, 50), (30, 10, 96, 64)],
               "relation": [(5, 5, 90, 40), (20, 0, 70, 64)]}
    cases = set()
    torch_state = torch.random.get_rng_state()
    try:
        for seed in range(60):
            def stream():
                torch.manual_seed(seed)
                return TorchDraws()

            params = augment.sample_params(stream, *photo.size, train=True)
            torch.manual_seed(seed)
            want_global = np.asarray(ref["global"](photo))
            # the views' geometry as torchvision makes it; the photometric part from our draw
            views = {level: [np.asarray(F.center_crop(F.resize(
                photo.crop(box), size, F.InterpolationMode.BICUBIC), size)) for box in boxes]
                for level, boxes in regions.items()}
            want = {}
            for level, boxes in regions.items():
                want[level] = []
                for box in boxes:
                    torch.manual_seed(seed)
                    want[level].append(np.asarray(ref[level](photo.crop(box))))
            batch = {fields.IMAGE: augment.global_view(photo, params, size)[None],
                     "objects": np.stack(views["object"])[None],
                     "relations": np.stack(views["relation"])[None],
                     **{k: v[None] for k, v in augment.photometric_fields(params).items()}}
            out = photometric.augment_batch(batch)
            blurred = params.blur_sigma is not None
            diff = np.abs(np.asarray(out[fields.IMAGE][0], int) - want_global)
            assert diff.max() <= (1 if blurred else 0), (seed, params)
            crops_on = params.object_jitter is not None
            for level, name in (("object", "objects"), ("relation", "relations")):
                for j in range(2):
                    np.testing.assert_array_equal(out[name][0, j], want[level][j],
                                                  err_msg=f"seed {seed} {level} {j}")
                    # the reference's decision, seen in its pixels
                    assert (not np.array_equal(want[level][j], views[level][j])) == crops_on
            cases.add((params.jitter is not None, crops_on, blurred))
    finally:
        torch.random.set_rng_state(torch_state)
    # global jitter with and without the crops', and the crops' alone; a blurred global view
    assert {(True, False), (True, True), (False, True)} <= {c[:2] for c in cases}, cases
    assert any(c[2] for c in cases), cases
