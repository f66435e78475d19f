"""The image helpers of both sides: the records' writers (`data_prep`) and the library's readers
(`sclaro_jax.eval`) draw box masks by one rule (`box_mask`), and relation regions are stored as
JPEG by one encoder (`encode_jpeg`). numpy and PIL only."""

from __future__ import annotations

import io
from typing import Sequence

import numpy as np
from PIL import Image


def box_mask(box: Sequence[float], width: int, height: int) -> np.ndarray:
    """bool [height, width]: the pixels whose centres lie inside the (x0, y0, x1, y1) box
    (x1, y1 exclusive): the demo's box masks, and relation localisation's boxes."""
    x0, y0, x1, y1 = box
    cols = np.arange(width) + 0.5
    rows = np.arange(height) + 0.5
    return ((rows >= y0) & (rows < y1))[:, None] & ((cols >= x0) & (cols < x1))[None, :]


def encode_jpeg(pixels: np.ndarray, quality: int = 95) -> bytes:
    """uint8 RGB pixels [H, W, 3] as JPEG bytes at `quality`."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
