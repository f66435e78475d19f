"""MINER region candidates (docs/design.md, section 4; MINER paper, section 4.1 and appendix H).

Boxes are `(x0, y0, x1, y1)` in pixels with `x1`/`y1` exclusive, so `image[y0:y1, x0:x1]` is the
crop; the encoder resizes each crop like the global view.

The default rule (`shape="aspect"`) is the MINER authors' current one: each side scales on its
own, so a crop keeps the image's aspect ratio and a fixed crop covers ratio^2 of the image (36%
at 0.6, as the paper says). `shape="square"` is an earlier rule of theirs, squares of side
ratio x the short side (27% of a 4:3 image, 20% of a 16:9 one), kept for comparison.
"""

from __future__ import annotations

import random

import numpy as np

KINDS = ("fixed5", "grid3x3", "random")
SHAPES = ("aspect", "square")

RULES = {
    "aspect": "aspect-keeping: cw = max(1, int(r w)), ch = max(1, int(r h)); fixed5 corners "
              "TL, TR, BL, BR then the centre ((w - cw) // 2, (h - ch) // 2); grid3x3 cells of "
              "(w // 3) x (h // 3); random: one ratio U(0.3, 0.7) for both sides, corner by "
              "randint (Python's random.Random(seed))",
    "square": "squares: s = max(1, int(r min(w, h))); fixed5 centre first, then TL, TR, BL, "
              "BR; grid3x3 corners at round(linspace(0, w - s, 3)); random: s from "
              "U(0.3, 0.7) (numpy default_rng(seed))",
}


def crop_boxes(width: int, height: int, kind: str = "fixed5", ratio: float = 0.6, *,
               n: int | None = None, seed: int = 0, shape: str = "aspect") -> np.ndarray:
    """Crop boxes, int `[R, 4]` as (x0, y0, x1, y1), x1/y1 exclusive.

    `shape="aspect"` (the default; the MINER authors' current rule):
    - "fixed5": cw = max(1, int(ratio * w)), ch = max(1, int(ratio * h)); top-left at (0, 0),
      (w - cw, 0), (0, h - ch), (w - cw, h - ch), then the centre ((w - cw) // 2,
      (h - ch) // 2).
    - "grid3x3": the nine cells (x * cw, y * ch, (x + 1) * cw, (y + 1) * ch) of cw = w // 3,
      ch = h // 3, row by row (y outer, x inner); the last w % 3 columns and h % 3 rows fall
      outside every cell. `ratio` does not apply; an image under 3 pixels a side has no grid.
    - "random": `n` boxes (default 5), each of one ratio r ~ U(0.3, 0.7) for both sides
      (cw = max(1, int(w * r)), ch = max(1, int(h * r))), top-left corner x = randint(0,
      w - cw), y = randint(0, h - ch), in that order from `random.Random(seed)`: seed 0 gives
      the authors' default boxes. `ratio` does not apply.

    `shape="square"` (an earlier rule, for comparison): squares of side s = max(1, int(ratio *
    min(w, h))); "fixed5" centre first ((w - s) // 2, (h - s) // 2), then TL, TR, BL, BR;
    "grid3x3" nine squares with top-left corners at round(linspace(0, w - s, 3)) x
    round(linspace(0, h - s, 3)); "random" sides int(U(0.3, 0.7) * min(w, h)) from
    `np.random.default_rng(seed)`.

    Raises ValueError for an unknown kind or shape, ratio outside (0, 1], non-positive sizes,
    `n` that is not a positive count (or given for a fixed kind), or a grid larger than the
    image.
    """
    if int(width) != width or int(height) != height or width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive integers, got width={width}, "
                         f"height={height}")
    if kind not in KINDS:
        raise ValueError(f"unknown crop kind {kind!r}; expected one of {KINDS}")
    if shape not in SHAPES:
        raise ValueError(f"unknown crop shape {shape!r}; expected one of {SHAPES}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if kind != "random" and n is not None:
        raise ValueError(f"n applies to kind='random' only; {kind!r} has a fixed count")
    count = 5 if n is None else n
    if kind == "random" and (int(count) != count or count <= 0):
        raise ValueError(f"n must be a positive integer, got {n}")
    width, height, count = int(width), int(height), int(count)
    if shape == "square":
        return _square(width, height, kind, ratio, count, seed)
    if kind == "fixed5":
        cw, ch = max(1, int(ratio * width)), max(1, int(ratio * height))
        right, bottom = width - cw, height - ch
        corners = [(0, 0), (right, 0), (0, bottom), (right, bottom), (right // 2, bottom // 2)]
        return np.array([(x, y, x + cw, y + ch) for x, y in corners], dtype=np.int64)
    if kind == "grid3x3":
        cw, ch = width // 3, height // 3
        if min(cw, ch) < 1:
            raise ValueError(f"a 3 x 3 grid needs an image of at least 3 x 3 pixels, got "
                             f"{width} x {height}")
        return np.array([(x * cw, y * ch, (x + 1) * cw, (y + 1) * ch)
                         for y in range(3) for x in range(3)], dtype=np.int64)
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        r = rng.uniform(0.3, 0.7)
        cw, ch = max(1, int(width * r)), max(1, int(height * r))
        x0 = rng.randint(0, width - cw)
        y0 = rng.randint(0, height - ch)
        rows.append((x0, y0, x0 + cw, y0 + ch))
    return np.array(rows, dtype=np.int64)


def _square(width: int, height: int, kind: str, ratio: float, count: int,
            seed: int) -> np.ndarray:
    def side(fraction: float) -> int:
        return max(1, int(fraction * min(width, height)))

    def boxes(corners, s):
        return np.array([(x, y, x + s, y + s) for x, y in corners], dtype=np.int64)

    if kind == "random":
        rng = np.random.default_rng(seed)
        rows = []
        for _ in range(count):
            s = side(rng.uniform(0.3, 0.7))
            x0 = int(rng.integers(0, width - s + 1))
            y0 = int(rng.integers(0, height - s + 1))
            rows.append((x0, y0, x0 + s, y0 + s))
        return np.array(rows, dtype=np.int64)
    s = side(ratio)
    right, bottom = width - s, height - s
    if kind == "fixed5":
        return boxes([(right // 2, bottom // 2), (0, 0), (right, 0), (0, bottom),
                      (right, bottom)], s)
    xs = np.rint(np.linspace(0, right, 3)).astype(int)
    ys = np.rint(np.linspace(0, bottom, 3)).astype(int)
    return boxes([(int(x), int(y)) for y in ys for x in xs], s)


def crop_images(image: np.ndarray, boxes: np.ndarray) -> list[np.ndarray]:
    """`image[y0:y1, x0:x1]` for each box (views, no copy), for the image encoder."""
    return [image[y0:y1, x0:x1] for x0, y0, x1, y1 in np.asarray(boxes).tolist()]
