"""MINER region candidates (docs/design.md, section 4; MINER paper, section 4.1 and appendix H).

Boxes are `(x0, y0, x1, y1)` in pixels with `x1`/`y1` exclusive, so `image[y0:y1, x0:x1]` is the
crop. Every generator makes squares; the encoder resizes each crop like the global view.
"""

from __future__ import annotations

import numpy as np

KINDS = ("fixed5", "grid3x3", "random")


def _square_side(fraction: float, width: int, height: int) -> int:
    """int(fraction * min(w, h)), at least one pixel."""
    return max(1, int(fraction * min(width, height)))


def _boxes(corners: list[tuple[int, int]], side: int) -> np.ndarray:
    return np.array([(x, y, x + side, y + side) for x, y in corners], dtype=np.int64)


def crop_boxes(width: int, height: int, kind: str = "fixed5", ratio: float = 0.6, *,
               n: int | None = None, seed: int = 0) -> np.ndarray:
    """Square crop boxes, int `[R, 4]` as (x0, y0, x1, y1), x1/y1 exclusive.

    - "fixed5" (MINER's default): side s = int(ratio * min(w, h)); centre at
      ((w - s) // 2, (h - s) // 2), then top-left, top-right, bottom-left, bottom-right.
    - "grid3x3": nine squares of side s, top-left corners at round(linspace(0, w - s, 3)) x
      round(linspace(0, h - s, 3)), row by row (y outer, x inner).
    - "random": `n` squares (default 5), side int(U(0.3, 0.7) * min(w, h)), top-left corner
      uniform over the positions that keep the square inside; `np.random.default_rng(seed)`, so
      the same arguments give the same boxes. `ratio` does not apply.

    A side is at least one pixel. Raises ValueError for an unknown kind, ratio outside (0, 1],
    non-positive sizes, or `n` that is not a positive count (or given for a fixed kind).
    """
    if int(width) != width or int(height) != height or width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive integers, got width={width}, "
                         f"height={height}")
    if kind not in KINDS:
        raise ValueError(f"unknown crop kind {kind!r}; expected one of {KINDS}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if kind != "random" and n is not None:
        raise ValueError(f"n applies to kind='random' only; {kind!r} has a fixed count")
    width, height = int(width), int(height)
    if kind == "random":
        count = 5 if n is None else n
        if int(count) != count or count <= 0:
            raise ValueError(f"n must be a positive integer, got {n}")
        rng = np.random.default_rng(seed)
        rows = []
        for _ in range(int(count)):
            side = _square_side(rng.uniform(0.3, 0.7), width, height)
            x0 = int(rng.integers(0, width - side + 1))
            y0 = int(rng.integers(0, height - side + 1))
            rows.append((x0, y0, x0 + side, y0 + side))
        return np.array(rows, dtype=np.int64)
    side = _square_side(ratio, width, height)
    right, bottom = width - side, height - side
    if kind == "fixed5":
        return _boxes([(right // 2, bottom // 2), (0, 0), (right, 0), (0, bottom),
                       (right, bottom)], side)
    xs = np.rint(np.linspace(0, right, 3)).astype(int)
    ys = np.rint(np.linspace(0, bottom, 3)).astype(int)
    return _boxes([(int(x), int(y)) for y in ys for x in xs], side)


def crop_images(image: np.ndarray, boxes: np.ndarray) -> list[np.ndarray]:
    """`image[y0:y1, x0:x1]` for each box (views, no copy), for the image encoder."""
    return [image[y0:y1, x0:x1] for x0, y0, x1, y1 in np.asarray(boxes).tolist()]
