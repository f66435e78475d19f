"""The reference code's image transforms (docs/design.md, section 2): the geometry, on the host.

Global view: RandomResizedCrop(224, scale=(0.8, 1), ratio=(3/4, 4/3), bicubic) for training,
Resize(224) + CenterCrop(224) for evaluation. Object crops and relation regions: Resize(224) +
CenterCrop(224). The reference's photometric transforms are *drawn* here, with the geometry
(`sample_params`), and *applied on the accelerator* to the uint8 batch
(`sclaro_jax.data.photometric`): the host only crops and resamples, and passes each sample's
draw on as batch fields (`photometric_fields`, `sclaro_jax.data.batch.PHOTOMETRIC`):
- global view: RandomApply(ColorJitter(0.2, 0.2, 0.2, 0.05), p=0.2), then
  RandomApply(GaussianBlur(9, sigma 0.1-1.5), p=0.1);
- object crops: RandomApply(ColorJitter(0.15, 0.15, 0.15, 0.03), p=0.2), no blur;
- relation regions: RandomApply(ColorJitter(0.10, 0.10, 0.10, 0.02), p=0.2), no blur.

The draws are the reference's, call for call. It seeds every view's transform with the sample's
seed (`temp_seed(s)`), so each view reads the sample's random stream from its start:
- an object crop's or relation region's first draw is its apply-decision, then the jitter's
  order (a permutation of the four ops) and four uniform draws. Every object crop and relation
  region of a sample therefore shares one decision, one order and the same four uniforms, each
  scaled by its own level's strengths (`level_factor`);
- the global view draws RandomResizedCrop's parameters first, so its jitter decision, order and
  uniforms come later in the same stream (and its crop's first uniform is the crops' decision).

`sample_params` draws a sample's stream from a numpy Generator (`Draws`: 64 uniform 24-bit
fractions, scaled in float32 as torch's `uniform_` scales its `rand`) and reads it from its
start for each view. Given torch's own stream instead (any object with `unit`, `randint` and
`randperm`), it returns the reference's parameters exactly. Random parameters follow
torchvision's algorithms (`RandomResizedCrop.get_params`, `ColorJitter.get_params`,
`GaussianBlur.get_params`).

Resize + CenterCrop is one bicubic resample of exactly the part of the region that the two-step
transform keeps (`resize_centre_crop`: the same pixels, no full-size intermediate).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from PIL import Image

from sclaro_jax.data import batch as fields


Jitter = tuple[tuple[int, float], ...]  # (op index, factor) in application order

# ColorJitter's (brightness, contrast, saturation, hue) strengths per level, as the reference.
JITTER_STRENGTHS = {"global": (0.2, 0.2, 0.2, 0.05), "object": (0.15, 0.15, 0.15, 0.03),
                    "relation": (0.10, 0.10, 0.10, 0.02)}
_UNIT = 1 << 24  # torch's float32 uniform draws are 24-bit fractions


@dataclasses.dataclass(frozen=True)
class SampleParams:
    """One sample's augmentation parameters. `jitter` is the global view's ColorJitter (None:
    not applied); `object_jitter` / `relation_jitter` the one shared by all the sample's object
    crops / relation regions (applied together or not at all, in the same order, from the same
    uniform draws; see the module docstring)."""
    crop: tuple[int, int, int, int] | None  # global RandomResizedCrop box (x0, y0, x1, y1)
    jitter: Jitter | None  # global view
    blur_sigma: float | None  # global view
    object_jitter: Jitter | None = None
    relation_jitter: Jitter | None = None


class Draws:
    """The random calls that torchvision's transforms make (`torch.rand(1)`, `torch.randint`,
    `torch.randperm`; `uniform_` is a scaled `rand`), answered from one sample's uniform draws
    `units` (24-bit fractions in [0, 1), as torch's float32 `rand`), read from the start."""

    SIZE = 64  # more than one sample's transforms read (RandomResizedCrop's ten tries: 40)

    def __init__(self, units):
        self.units = units
        self.at = 0

    @classmethod
    def from_generator(cls, rng: np.random.Generator) -> "Draws":
        """A sample's draws from a numpy Generator (advanced by one call)."""
        return cls((np.floor(rng.random(cls.SIZE) * _UNIT) * (1.0 / _UNIT)).tolist())

    def unit(self) -> float:
        if self.at == len(self.units):
            raise RuntimeError(f"augment.Draws: the sample's {len(self.units)} draws are spent")
        self.at += 1
        return self.units[self.at - 1]

    def randint(self, low: int, high: int) -> int:
        return low + min(int(self.unit() * (high - low)), high - low - 1)

    def randperm(self, n: int) -> list[int]:
        keys = [self.unit() for _ in range(n)]
        return sorted(range(n), key=keys.__getitem__)

    def restart(self) -> "Draws":
        """The same draws from their start (the next view's transform)."""
        return Draws(self.units)


def scaled(unit: float, low: float, high: float) -> float:
    """torch's float32 `uniform_(low, high)` of the draw whose `rand` is `unit` (float32 bounds
    and difference, the product and sum in double, the result rounded to float32)."""
    lo, width = _float32_bounds(low, high)
    return float(np.float32(unit * width + lo))


@functools.lru_cache(maxsize=256)
def _float32_bounds(low: float, high: float) -> tuple[float, float]:
    lo, hi = np.float32(low), np.float32(high)
    return float(lo), float(hi - lo)


def level_factor(unit: float, op: int, strengths) -> float:
    """ColorJitter's factor for op `op` (0 brightness, 1 contrast, 2 saturation, 3 hue) at a
    level's `strengths` from the uniform draw `unit`: U(max(0, 1 - s), 1 + s), hue U(-h, h)."""
    s = strengths[op]
    return scaled(unit, -s, s) if op == 3 else scaled(unit, max(0.0, 1.0 - s), 1.0 + s)


def random_resized_crop_box(rng, width: int, height: int,
                            scale=(0.8, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, as an (x0, y0, x1, y1) box. `rng`: a numpy
    Generator or a `Draws`-like stream (the same calls as torchvision's, float32 where its are)."""
    draws = Draws.from_generator(rng) if isinstance(rng, np.random.Generator) else rng
    area = width * height
    log_ratio = (np.log(np.float32(ratio[0])), np.log(np.float32(ratio[1])))
    for _ in range(10):
        target_area = area * scaled(draws.unit(), scale[0], scale[1])
        aspect = float(np.exp(np.float32(scaled(draws.unit(), log_ratio[0], log_ratio[1]))))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            i = draws.randint(0, height - h + 1)
            j = draws.randint(0, width - w + 1)
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


def _applies(draws, p: float) -> bool:
    """RandomApply's decision: torchvision skips when `p < torch.rand(1)` (float32)."""
    return not np.float32(p) < np.float32(draws.unit())


def _jitter(draws, p: float, *levels) -> list[Jitter | None]:
    """RandomApply(ColorJitter) from `draws`: the decision, the order, four uniforms; one
    `Jitter` per strengths in `levels`, all from the same draws (None each when not applied)."""
    if not _applies(draws, p):
        return [None] * len(levels)
    order = draws.randperm(4)
    units = [draws.unit() for _ in range(4)]
    return [tuple((k, level_factor(units[k], k, strengths)) for k in order)
            for strengths in levels]


def sample_params(rng, width: int, height: int, *, train: bool, jitter_p: float = 0.2,
                  strengths: dict | None = None, blur_p: float = 0.1, blur_sigma=(0.1, 1.5),
                  crop_scale=(0.8, 1.0)) -> SampleParams:
    """Draw one sample's augmentation parameters, as the reference's per-view transforms draw
    them from the sample's seed (module docstring).

    `rng`: the sample's numpy Generator (one call draws the sample's `Draws`, which every view
    reads from its start), or a callable that returns a fresh stream at the start of the
    sample's seed (anything with `unit`, `randint`, `randperm`, e.g. torch's global generator
    after `torch.manual_seed(s)`). `strengths`: ColorJitter strengths per level (default
    `JITTER_STRENGTHS`)."""
    if not train:
        return SampleParams(None, None, None)
    strengths = {**JITTER_STRENGTHS, **(strengths or {})}
    if isinstance(rng, np.random.Generator):
        stream = Draws.from_generator(rng).restart
    else:
        stream = rng
    draws = stream()  # the global view's transform
    crop = random_resized_crop_box(draws, width, height, crop_scale)
    (ops,) = _jitter(draws, jitter_p, strengths["global"])
    sigma = scaled(draws.unit(), *blur_sigma) if _applies(draws, blur_p) else None
    # an object crop's (a relation region's) transform: the same stream from its start
    objects, relations = _jitter(stream(), jitter_p, strengths["object"], strengths["relation"])
    return SampleParams(crop, ops, sigma, objects, relations)


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
    if params.object_jitter:
        out[fields.CROP_JITTER] = np.bool_(True)
        out[fields.CROP_JITTER_ORDER] = np.array([op for op, _ in params.object_jitter],
                                                 np.int32)
        for name, ops in ((fields.OBJECT_JITTER_FACTORS, params.object_jitter),
                          (fields.RELATION_JITTER_FACTORS, params.relation_jitter)):
            for op, factor in ops:
                out[name][op] = factor
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


def box_crop(img: Image.Image, box) -> Image.Image:
    """`img.crop(box)`, the box rounded as PIL rounds it, at least one pixel wide and high: a
    box thinner than a pixel (a record may hold one: its corners need only be in order) is the
    pixel it lies in, not an empty image that no resize can scale."""
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    if x1 <= x0:
        x0 = max(0, min(x0, img.width - 1))
        x1 = x0 + 1
    if y1 <= y0:
        y0 = max(0, min(y0, img.height - 1))
        y1 = y0 + 1
    return img.crop((x0, y0, x1, y1))


def region_view(img: Image.Image, box, size: int) -> np.ndarray:
    """Object crop / relation region: crop `box` (`box_crop`; None = the whole image), then
    Resize(size) + CenterCrop(size)."""
    return np.asarray(resize_centre_crop(img if box is None else box_crop(img, box), size))


def canvas_view(img: Image.Image, box, size: int,
                photo_size: tuple[int, int] | None = None) -> np.ndarray:
    """The reference code's object view: the crop pasted on a black canvas the image's size,
    then Resize + CenterCrop (`photo_size` as in `resize_centre_crop`)."""
    canvas = Image.new("RGB", img.size)
    box = tuple(int(round(v)) for v in box)
    canvas.paste(img.crop(box), box[:2])
    return np.asarray(resize_centre_crop(canvas, size, photo_size))
