"""Focused-region images for relation triplets (SCLARO appendix A, Stage 3, Eqs. 4-7).

For a relation (object1, relation, object2) with masks m1, m2 and mask centres of mass c1, c2:

    RBF_k(x) = exp(-|x - c_k|^2 / (2 sigma^2))                      (Eq. 4, sigma = 100 px)
    w1(x) = d2(x) / (d1(x) + d2(x)),  w2(x) = d1(x) / (d1(x) + d2(x)),  d_k = |x - c_k|   (Eq. 5)
    M(x) = RBF_1(x) w1(x) + RBF_2(x) w2(x)                            (Eq. 6)

Pixels inside m1 | m2 become image * M; pixels outside become the image blurred with a Gaussian
of sigma 2 (Eq. 7). Everything is vectorised numpy over the pixel grid.

Degenerate input, with defined output:
- both centres equal: at that one pixel d1 + d2 = 0 and Eq. 5 is 0/0; there w1 = w2 = 1/2
  (the limit along any path, since RBF_1 = RBF_2 there, M = RBF either way);
- one mask empty: its centre does not exist; the other mask's centre stands for both, so M is
  that object's RBF;
- both masks empty: the union is empty and the whole image is the blurred background;
- masks touching the border: nothing special; the blur reflects at the image edge
  (`scipy.ndimage` "reflect" mode, kernel truncated at 4 sigma).
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

SIGMA = 100.0
BLUR_SIGMA = 2.0


def centre_of_mass(mask: np.ndarray) -> np.ndarray | None:
    """(row, col) centre of mass of a boolean mask, or None if it is empty."""
    rows, cols = np.nonzero(mask)
    if rows.size == 0:
        return None
    return np.array([rows.mean(), cols.mean()])


def rbf(sq_dist: np.ndarray, sigma: float) -> np.ndarray:
    """Appendix Eq. 4: exp(-|x - c|^2 / (2 sigma^2)) from squared distances."""
    return np.exp(-sq_dist / (2.0 * sigma * sigma))


def distance_weights(d1: np.ndarray, d2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Appendix Eq. 5: w1 = d2 / (d1 + d2), w2 = d1 / (d1 + d2); 1/2 each where d1 + d2 = 0."""
    total = d1 + d2
    safe = np.where(total > 0, total, 1.0)
    w1 = np.where(total > 0, d2 / safe, 0.5)
    return w1, 1.0 - w1


def blend_mask(shape: tuple[int, int], c1: np.ndarray, c2: np.ndarray, sigma: float = SIGMA
               ) -> np.ndarray:
    """Appendix Eq. 6: M(x) = RBF_1 w1 + RBF_2 w2 over an `shape` (H, W) pixel grid."""
    rows = np.arange(shape[0], dtype=np.float64)[:, None]
    cols = np.arange(shape[1], dtype=np.float64)[None, :]
    sq1 = (rows - c1[0]) ** 2 + (cols - c1[1]) ** 2
    sq2 = (rows - c2[0]) ** 2 + (cols - c2[1]) ** 2
    w1, w2 = distance_weights(np.sqrt(sq1), np.sqrt(sq2))
    return rbf(sq1, sigma) * w1 + rbf(sq2, sigma) * w2


def gaussian_blur(image: np.ndarray, sigma: float = BLUR_SIGMA) -> np.ndarray:
    """Appendix Eq. 7: each channel convolved with a 2-D Gaussian of `sigma` (float64 out)."""
    return ndimage.gaussian_filter(image.astype(np.float64), sigma=(sigma, sigma, 0),
                                   mode="reflect", truncate=4.0)


def focused_region(image: np.ndarray, mask1: np.ndarray, mask2: np.ndarray,
                   sigma: float = SIGMA, blur_sigma: float = BLUR_SIGMA, *,
                   background: np.ndarray | None = None) -> np.ndarray:
    """The focused-region image of a relation: appendix Eqs. 4-7 (see the module docstring).

    `image` uint8 [H, W, 3]; `mask1`, `mask2` bool [H, W]. Returns uint8 [H, W, 3].
    `background`: `gaussian_blur(image, blur_sigma)` when the caller has it already (the
    regions of an image's relations share it: `Regions`); computed here otherwise.
    """
    image = _checked_image(image)
    for name, mask in (("mask1", mask1), ("mask2", mask2)):
        if np.shape(mask) != image.shape[:2]:
            raise ValueError(f"{name} has shape {np.shape(mask)}, image is {image.shape[:2]}")
    mask1, mask2 = np.asarray(mask1, bool), np.asarray(mask2, bool)
    union = mask1 | mask2
    if background is None:
        background = gaussian_blur(image, blur_sigma)
    elif np.shape(background) != image.shape:
        raise ValueError(f"background has shape {np.shape(background)}, image is {image.shape}")
    if not union.any():
        return _to_uint8(background)
    c1, c2 = centre_of_mass(mask1), centre_of_mass(mask2)
    c1 = c2 if c1 is None else c1
    c2 = c1 if c2 is None else c2
    weight = blend_mask(image.shape[:2], c1, c2, sigma)
    out = np.where(union[..., None], image * weight[..., None], background)
    return _to_uint8(out)


class Regions:
    """The focused regions of one image's relations: `regions(mask1, mask2)` is
    `focused_region(image, mask1, mask2)`, the blurred background (Eq. 7's outside) computed
    once for the image, at its first region, instead of once a relation."""

    def __init__(self, image: np.ndarray, sigma: float = SIGMA, blur_sigma: float = BLUR_SIGMA):
        self.image, self.sigma, self.blur_sigma = image, sigma, blur_sigma
        self.background = None

    def __call__(self, mask1: np.ndarray, mask2: np.ndarray) -> np.ndarray:
        if self.background is None:
            self.background = gaussian_blur(_checked_image(self.image), self.blur_sigma)
        return focused_region(self.image, mask1, mask2, self.sigma, self.blur_sigma,
                              background=self.background)


def _checked_image(image) -> np.ndarray:
    """`image` as an array, refused by name unless it is uint8 [H, W, 3]."""
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
    return image


def _to_uint8(values: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


def box_centres(boxes: np.ndarray) -> np.ndarray:
    """(x0, y0, x1, y1) boxes [N, 4] -> centres [N, 2] as (x, y)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return (boxes[:, :2] + boxes[:, 2:]) / 2.0


def closest_instance_pair(boxes: np.ndarray, subject_ids, object_ids) -> tuple[int, int] | None:
    """The (subject, object) pair of detections whose box centres are closest (appendix Stage 3).

    `boxes` [N, 4] are all detections of an image; `subject_ids` / `object_ids` index the
    instances of the subject's and the object's class. A detection is never paired with itself
    (e.g. "person next to person"). Ties go to the lowest (subject, object) indices. None when no
    pair exists.
    """
    subject_ids = np.asarray(subject_ids, dtype=np.int64).reshape(-1)
    object_ids = np.asarray(object_ids, dtype=np.int64).reshape(-1)
    if subject_ids.size == 0 or object_ids.size == 0:
        return None
    centres = box_centres(boxes)
    diff = centres[subject_ids][:, None, :] - centres[object_ids][None, :, :]
    dist = np.sqrt((diff ** 2).sum(-1))
    dist[subject_ids[:, None] == object_ids[None, :]] = np.inf
    if not np.isfinite(dist).any():
        return None
    i, j = np.unravel_index(np.argmin(dist), dist.shape)
    return int(subject_ids[i]), int(object_ids[j])
