"""The reference code's image transforms (docs/design.md, section 2), in PIL + numpy.

Global view: RandomResizedCrop(224, scale=(0.8, 1), ratio=(3/4, 4/3), bicubic),
ColorJitter(0.2, 0.2, 0.2, 0.05) with p=0.2, GaussianBlur(kernel 9, sigma 0.1-1.5) with p=0.1.
Object crops and relation regions: Resize(224) + CenterCrop(224), ColorJitter with p=0.2.

Random parameters follow torchvision's algorithms (`RandomResizedCrop.get_params`,
`ColorJitter.get_params`, `GaussianBlur`) and the jitter operations are the ones torchvision
applies to PIL images (ImageEnhance brightness/contrast/colour, hue shift in PIL's HSV), so a
sample looks as it would in the reference pipeline. Differences, on purpose:
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
from PIL import Image, ImageEnhance

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


def resize_centre_crop(img: Image.Image, size: int) -> Image.Image:
    """torchvision's Resize(size, bicubic) + CenterCrop(size), as one resample.

    The box handed to PIL is exactly the part of the image that the resized-then-cropped
    output covers (torchvision's output size `int(size * long / short)` and crop offset
    `int(round((new - size) / 2))`), and PIL's filter scale is the same, so the pixels equal
    the two-step result without building the full-size intermediate image.
    """
    w, h = img.size
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    sx, sy = w / new_w, h / new_h
    box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
    return img.resize((size, size), Image.BICUBIC, box=box)


def adjust_hue(img: Image.Image, factor: float) -> Image.Image:
    """torchvision's PIL hue shift: add int(factor*255) (mod 256) to PIL's HSV hue channel."""
    if factor == 0:
        return img
    h, s, v = img.convert("HSV").split()
    np_h = np.asarray(h, dtype=np.uint8) + np.uint8(int(factor * 255) % 256)
    return Image.merge("HSV", (Image.fromarray(np_h, "L"), s, v)).convert("RGB")


def color_jitter(img: Image.Image, ops) -> Image.Image:
    if not ops:
        return img
    for op, factor in ops:
        if op == 0:
            img = ImageEnhance.Brightness(img).enhance(factor)
        elif op == 1:
            img = ImageEnhance.Contrast(img).enhance(factor)
        elif op == 2:
            img = ImageEnhance.Color(img).enhance(factor)
        else:
            img = adjust_hue(img, factor)
    return img


def gaussian_blur(x: np.ndarray, sigma: float, kernel_size: int = 9) -> np.ndarray:
    """torchvision GaussianBlur on a uint8 HWC array: separable kernel, reflect padding."""
    half = (kernel_size - 1) * 0.5
    t = np.linspace(-half, half, kernel_size)
    k = np.exp(-0.5 * (t / sigma) ** 2)
    k = (k / k.sum()).astype(np.float32)
    r = kernel_size // 2
    f = np.pad(x.astype(np.float32), ((r, r), (r, r), (0, 0)), mode="reflect")
    h, w = x.shape[:2]
    rows = sum(k[i] * f[i:i + h] for i in range(kernel_size))
    out = sum(k[i] * rows[:, i:i + w] for i in range(kernel_size))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def global_view(img: Image.Image, params: SampleParams, size: int) -> np.ndarray:
    """Global level: RandomResizedCrop (train) or Resize + CenterCrop (eval), then jitter, blur."""
    if params.crop is not None:
        view = img.crop(params.crop).resize((size, size), Image.BICUBIC)
    else:
        view = resize_centre_crop(img, size)
    view = np.asarray(color_jitter(view, params.jitter))
    if params.blur_sigma is not None:
        view = gaussian_blur(view, params.blur_sigma)
    return view


def region_view(img: Image.Image, box, params: SampleParams, size: int) -> np.ndarray:
    """Object crop / relation region: crop `box` (PIL rounds it; None = the whole image), then
    Resize(size) + CenterCrop(size), then the sample's colour jitter."""
    view = resize_centre_crop(img if box is None else img.crop(box), size)
    return np.asarray(color_jitter(view, params.jitter))


def canvas_view(img: Image.Image, box, params: SampleParams, size: int) -> np.ndarray:
    """The reference code's object view: the crop pasted on a black canvas the image's size."""
    canvas = Image.new("RGB", img.size)
    box = tuple(int(round(v)) for v in box)
    canvas.paste(img.crop(box), box[:2])
    return region_view(canvas, None, params, size)
