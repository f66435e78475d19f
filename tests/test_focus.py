"""data_prep.focus against a plain per-pixel implementation of appendix Eqs. 4-7."""

import math

import numpy as np
import pytest

from data_prep import focus
from data_prep.focus import closest_instance_pair, focused_region


def reference_focused_region(image, mask1, mask2, sigma=100.0, blur_sigma=2.0):
    """Eqs. 4-7 pixel by pixel, written from the paper, with the module's degenerate rules."""
    h, w, _ = image.shape

    def com(mask):
        pts = [(r, c) for r in range(h) for c in range(w) if mask[r, c]]
        return None if not pts else (sum(p[0] for p in pts) / len(pts),
                                     sum(p[1] for p in pts) / len(pts))

    c1, c2 = com(mask1), com(mask2)
    c1, c2 = (c1 or c2), (c2 or c1)
    radius = int(4 * blur_sigma + 0.5)
    kernel = {(dy, dx): math.exp(-(dx * dx + dy * dy) / (2 * blur_sigma ** 2))
              / (2 * math.pi * blur_sigma ** 2)                                      # Eq. 7
              for dy in range(-radius, radius + 1) for dx in range(-radius, radius + 1)}
    total = sum(kernel.values())

    def reflect(i, n):  # d c b a | a b c d | d c b a
        while i < 0 or i >= n:
            i = -i - 1 if i < 0 else 2 * n - i - 1
        return i

    out = np.zeros_like(image)
    for r in range(h):
        for c in range(w):
            if mask1[r, c] or mask2[r, c]:
                d1 = math.hypot(r - c1[0], c - c1[1])
                d2 = math.hypot(r - c2[0], c - c2[1])
                rbf1 = math.exp(-d1 * d1 / (2 * sigma * sigma))                      # Eq. 4
                rbf2 = math.exp(-d2 * d2 / (2 * sigma * sigma))
                w1, w2 = (d2 / (d1 + d2), d1 / (d1 + d2)) if d1 + d2 > 0 else (0.5, 0.5)  # Eq. 5
                m = rbf1 * w1 + rbf2 * w2                                            # Eq. 6
                value = image[r, c] * m
            else:
                value = sum(kern * image[reflect(r + dy, h), reflect(c + dx, w)].astype(float)
                            for (dy, dx), kern in kernel.items()) / total
            out[r, c] = np.clip(np.rint(value), 0, 255)
    return out


def _scene(h=36, w=44, seed=0):
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    yy, xx = np.mgrid[:h, :w]
    mask1 = (yy - 10) ** 2 + (xx - 12) ** 2 < 60
    mask2 = (yy > 18) & (yy < 34) & (xx > 25) & (xx < 43)
    return image, mask1, mask2


@pytest.mark.parametrize("sigma", [100.0, 8.0])
def test_matches_per_pixel_equations(sigma):
    image, m1, m2 = _scene()
    ours = focused_region(image, m1, m2, sigma=sigma).astype(int)
    ref = reference_focused_region(image, m1, m2, sigma=sigma).astype(int)
    union = m1 | m2
    assert np.abs(ours - ref)[union].max() <= 1
    assert np.abs(ours - ref)[~union].max() <= 1
    # The foreground really is darkened by M < 1 and the background really is blurred.
    assert (ours[union] <= image[union]).all() and (ours[union] < image[union]).any()
    assert ours[~union].std() < image[~union].std() / 2


def test_degenerate_inputs_have_defined_output():
    image, m1, m2 = _scene(20, 24, seed=1)
    empty = np.zeros_like(m1)
    # One mask empty: the other's centre stands for both.
    np.testing.assert_array_equal(focused_region(image, m1, empty),
                                  reference_focused_region(image, m1, empty))
    # Both empty: the whole image is the blurred background.
    np.testing.assert_array_equal(focused_region(image, empty, empty),
                                  reference_focused_region(image, empty, empty))
    # Same mask twice: both centres equal, w = 1/2 at the centre pixel, no NaN.
    centre = np.zeros_like(m1)
    centre[9:12, 9:12] = True  # centre of mass exactly on pixel (10, 10)
    out = focused_region(image, centre, centre)
    np.testing.assert_array_equal(out, reference_focused_region(image, centre, centre))
    # Masks touching every border.
    border = np.zeros_like(m1)
    border[0, :] = border[-1, :] = border[:, 0] = border[:, -1] = True
    diff = focused_region(image, border, m2).astype(int) - \
        reference_focused_region(image, border, m2).astype(int)
    assert np.abs(diff).max() <= 1


def test_bad_input_is_named():
    image, m1, m2 = _scene(10, 12)
    with pytest.raises(ValueError, match="image must be uint8"):
        focused_region(image.astype(np.float32), m1, m2)
    with pytest.raises(ValueError, match=r"mask2 has shape \(3, 3\)"):
        focused_region(image, m1, np.zeros((3, 3), bool))


def test_an_images_regions_share_one_blur_and_equal_the_single_region(monkeypatch):
    """`Regions(image)` gives each relation's region byte for byte as `focused_region` does,
    blurring the image once for all of them; the reference equations check the result."""
    image, m1, m2 = _scene(24, 28, seed=2)
    empty = np.zeros_like(m1)
    pairs = [(m1, m2), (m2, m1), (m1, empty), (empty, empty), (m2, m2)]
    want = [focused_region(image, a, b) for a, b in pairs]
    blurs = []
    real = focus.gaussian_blur
    monkeypatch.setattr(focus, "gaussian_blur", lambda *a, **k: blurs.append(1) or real(*a, **k))
    regions = focus.Regions(image)
    got = [regions(a, b) for a, b in pairs]
    assert len(blurs) == 1
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    ref = reference_focused_region(image, m2, m1).astype(int)
    assert np.abs(got[1].astype(int) - ref).max() <= 1
    with pytest.raises(ValueError, match=r"background has shape \(3, 3, 3\)"):
        focused_region(image, m1, m2, background=np.zeros((3, 3, 3)))
    with pytest.raises(ValueError, match="image must be uint8"):  # as focused_region names it
        focus.Regions(image.astype(np.float32))(m1, m2)


def test_closest_instance_pair_by_box_centre():
    boxes = np.array([[0, 0, 10, 10],      # 0 person, centre (5, 5)
                      [100, 100, 120, 120],  # 1 person, centre (110, 110)
                      [12, 0, 22, 10],     # 2 cup, centre (17, 5)
                      [90, 100, 100, 110]])  # 3 cup, centre (95, 105)
    assert closest_instance_pair(boxes, [0, 1], [2, 3]) == (0, 2)
    assert closest_instance_pair(boxes, [1], [2, 3]) == (1, 3)
    # Same class on both sides ("person next to person"): never paired with itself.
    assert closest_instance_pair(boxes, [0, 1], [0, 1]) == (0, 1)
    assert closest_instance_pair(boxes, [0], [0]) is None
    assert closest_instance_pair(boxes, [], [2]) is None
