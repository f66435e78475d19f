"""The reference code's image transforms (docs/design.md, section 2): the geometry, on the host.

Global view: RandomResizedCrop(224, scale=(0.8, 1), ratio=(3/4, 4/3), bicubic) for training,
Resize(224) + CenterCrop(224) for evaluation. Object crops and relation regions: Resize(224) +
CenterCrop(224). The reference's photometric transforms (ColorJitter(0.2, 0.2, 0.2, 0.05) with
p=0.2 on every view, GaussianBlur(kernel 9, sigma 0.1-1.5) with p=0.1 on the global view) are
*drawn* here, with the geometry (`sample_params`), and *applied on the accelerator* to the
uint8 batch (`sclaro_jax.data.photometric`): the host only crops and resamples, and passes each
sample's draw on as batch fields (`photometric_fields`, `sclaro_jax.data.batch.PHOTOMETRIC`).

Random parameters follow torchvision's algorithms (`RandomResizedCrop.get_params`,
`ColorJitter.get_params`, `GaussianBlur`), in the order the reference draws them (crop, jitter,
blur), so a sample looks as it would in the reference pipeline. Differences, on purpose:
- one set of random parameters per sample (`SampleParams`) is shared by the three levels: the
  colour jitter that hits the global view hits that sample's object crops and relation regions
  too (docs/design.md, section 2: "all levels share one per-sample seed");
- Resize + CenterCrop is one bicubic resample of exactly the part of the region that the
  two-step transform keeps (`resize_centre_crop`: the same pixels, no full-size intermediate).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from PIL import Image

from sclaro_jax.data import batch as fields


@dataclasses.dataclass(frozen=True)
class SampleParams:
    crop: tuple[int, int, int, int] | None  # global RandomResizedCrop box (x0, y0, x1, y1)
    jitter: tuple[tuple[int, float], ...] | None  # (op index, factor) in application order
    blur_sigma: float | None


def random_resized_crop_box(rng: np.random.Generator, width: int, height: int,
                            scale=(0.8, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, as an (x0, y0, x1, y1) box."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            i = int(rng.integers(0, height - h + 1))
            j = int(rng.integers(0, width - w + 1))
            return j, i, j + w, i + h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    i, j = (height - h) // 2, (width - w) // 2
    return j, i, j + w, i + h


def sample_params(rng: np.random.Generator, width: int, height: int, *, train: bool,
                  jitter_p: float = 0.2, jitter=(0.2, 0.2, 0.2, 0.05), blur_p: float = 0.1,
                  blur_sigma=(0.1, 1.5), crop_scale=(0.8, 1.0)) -> SampleParams:
    """Draw one sample's augmentation parameters (shared by its three levels)."""
    if not train:
        return SampleParams(None, None, None)
    crop = random_resized_crop_box(rng, width, height, crop_scale)
    ops = None
    if rng.uniform() < jitter_p:
        order = rng.permutation(4)
        b, c, s, h = jitter
        factors = (rng.uniform(1 - b, 1 + b), rng.uniform(1 - c, 1 + c),
                   rng.uniform(1 - s, 1 + s), rng.uniform(-h, h))
        ops = tuple((int(k), float(factors[k])) for k in order)
    sigma = float(rng.uniform(*blur_sigma)) if rng.uniform() < blur_p else None
    return SampleParams(crop, ops, sigma)


def photometric_fields(params: SampleParams) -> dict:
    """A sample's jitter and blur parameters as the batch fields of
    `sclaro_jax.data.batch.PHOTOMETRIC` (applied on the accelerator)."""
    out = {k: np.array(v) for k, v in fields.IDENTITY_PHOTOMETRIC.items()}
    if params.jitter:
        out[fields.JITTER] = np.bool_(True)
        out[fields.JITTER_ORDER] = np.array([op for op, _ in params.jitter], np.int32)
        for op, factor in params.jitter:
            out[fields.JITTER_FACTORS][op] = factor
    if params.blur_sigma is not None:
        out[fields.BLUR_SIGMA] = np.float32(params.blur_sigma)
    return out


def resize_centre_crop(img: Image.Image, size: int,
                       photo_size: tuple[int, int] | None = None) -> Image.Image:
    """torchvision's Resize(size, bicubic) + CenterCrop(size), as one resample.

    The box handed to PIL is exactly the part of the image that the resized-then-cropped
    output covers (torchvision's output size `int(size * long / short)` and crop offset
    `int(round((new - size) / 2))`), and PIL's filter scale is the same, so the pixels equal
    the two-step result without building the full-size intermediate image.

    `photo_size`: the (width, height) of the photograph `img` is a downscaled copy of (a
    stored `train_image`): the box is the one the transform takes from the photograph, scaled
    to `img`, so the view covers the same part of the scene as the photograph's own (the
    rounded size of the copy would otherwise shift it by up to a pixel of the output).
    """
    w, h = photo_size or img.size
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    sx, sy = img.size[0] / new_w, img.size[1] / new_h
    box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
    return img.resize((size, size), Image.BICUBIC, box=box)


def global_view(img: Image.Image, params: SampleParams, size: int,
                photo_size: tuple[int, int] | None = None) -> np.ndarray:
    """Global level: RandomResizedCrop of `params.crop` (train; crop, then resize, as
    torchvision does) or Resize + CenterCrop (eval; `photo_size` as in `resize_centre_crop`)."""
    if params.crop is not None:
        return np.asarray(img.crop(params.crop).resize((size, size), Image.BICUBIC))
    return np.asarray(resize_centre_crop(img, size, photo_size))


def scale_box(box, sx: float, sy: float) -> tuple[float, float, float, float]:
    """An (x0, y0, x1, y1) box of the photograph on a copy of it scaled by (sx, sy) (a stored
    `train_image`)."""
    return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)


def region_view(img: Image.Image, box, size: int) -> np.ndarray:
    """Object crop / relation region: crop `box` (PIL rounds it; None = the whole image), then
    Resize(size) + CenterCrop(size)."""
    return np.asarray(resize_centre_crop(img if box is None else img.crop(box), size))


def canvas_view(img: Image.Image, box, size: int,
                photo_size: tuple[int, int] | None = None) -> np.ndarray:
    """The reference code's object view: the crop pasted on a black canvas the image's size,
    then Resize + CenterCrop (`photo_size` as in `resize_centre_crop`)."""
    canvas = Image.new("RGB", img.size)
    box = tuple(int(round(v)) for v in box)
    canvas.paste(img.crop(box), box[:2])
    return np.asarray(resize_centre_crop(canvas, size, photo_size))
