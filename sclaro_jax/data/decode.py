"""Encoded image bytes -> uint8 RGB pixels for the input pipeline, by the fastest decoder here.

JPEGs go through simplejpeg (`simplejpeg.decode_jpeg`, which bundles libjpeg-turbo: the same
library Pillow's wheels bundle, same IDCT, same upsampling) when it is importable, straight
into a caller's array (`out=`: `pipeline.collate` passes the batch's row for the view, no
copy); everything else (PNG, CMYK JPEGs, simplejpeg missing, a JPEG simplejpeg refuses) goes
through PIL (`schema.decode_image`). simplejpeg decodes the stored views in about two thirds of
PIL's time (`Image.open(...).load()` + `np.asarray`; bench/bench_input.py and bench/README.md
give the figures), to the same pixels (`tests/test_pipeline.py` holds them within 1 grey level).
PyTurboJPEG was not measured: it needs the system libturbojpeg, which the machine this was
written on lacks.

Errors are `schema.RecordError` naming `what` (the sample and field), like `schema.decode_image`;
an image whose header says more pixels than `bounds.max_pixels()` (Pillow's decompression-bomb
limit, which simplejpeg does not apply) is one, before the decoder allocates.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from sclaro_jax import bounds
from sclaro_jax.data import schema

try:
    import simplejpeg
except ImportError:  # PIL decodes everything then
    simplejpeg = None

BACKENDS = ("auto", "simplejpeg", "pil")
_TURBO_COLORSPACES = ("YCbCr", "Gray", "RGB")


def backend_name(backend: str = "auto") -> str:
    """The JPEG decoder `backend` resolves to here: "simplejpeg" or "pil"."""
    if backend not in BACKENDS:
        raise ValueError(f"decoder {backend!r} is not one of {BACKENDS}")
    if backend == "simplejpeg" and simplejpeg is None:
        raise ValueError("decoder 'simplejpeg' asked for but simplejpeg is not installed "
                         "(pip install simplejpeg), or use decoder='auto'")
    if backend == "auto":
        return "pil" if simplejpeg is None else "simplejpeg"
    return backend


def is_jpeg(data) -> bool:
    return bytes(data[:3]) == b"\xff\xd8\xff"


def _turbo_header(data, what: str, size):
    """simplejpeg's (height, width) of a JPEG it can decode to RGB, or None (PIL then)."""
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, KeyError):  # KeyError: a chroma subsampling simplejpeg has no name for
        return None  # PIL decides: decodes it, or raises the RecordError naming `what`
    try:
        bounds.check_pixels(width, height, what)
    except bounds.BoundsError as e:
        raise schema.RecordError(str(e)) from None
    if colorspace not in _TURBO_COLORSPACES:
        return None
    if size is not None and (width, height) != tuple(size):
        raise schema.RecordError(f"{what} decodes to {width}x{height}, record says "
                                 f"{size[0]}x{size[1]}")
    return height, width


def decode_array(data: bytes, what: str = "image", *, size: tuple[int, int] | None = None,
                 out: np.ndarray | None = None, backend: str = "auto") -> np.ndarray:
    """uint8 [H, W, 3] pixels of encoded image bytes.

    `size` (width, height): RecordError unless the image has that size. `out`: a C-contiguous
    uint8 [H, W, 3] array to decode into (returned). `backend`: "auto" (simplejpeg for JPEGs
    when installed, else PIL), "simplejpeg" or "pil"."""
    if out is not None and (out.dtype != np.uint8 or not out.flags.c_contiguous):
        raise ValueError("out must be a C-contiguous uint8 array")
    if backend_name(backend) == "simplejpeg" and is_jpeg(data):
        shape = _turbo_header(data, what, size)
        if shape is not None:
            if out is not None and out.shape != (*shape, 3):
                raise schema.RecordError(f"{what} decodes to {shape[1]}x{shape[0]}, expected "
                                         f"{out.shape[1]}x{out.shape[0]}")
            try:
                return simplejpeg.decode_jpeg(data, "RGB", buffer=out)
            except ValueError:
                pass  # a JPEG libjpeg-turbo's strict mode refuses: PIL decodes or names it
    pixels = np.asarray(schema.decode_image(data, what, size=size))
    if out is None:
        return pixels
    if out.shape != pixels.shape:
        raise schema.RecordError(f"{what} decodes to {pixels.shape[1]}x{pixels.shape[0]}, "
                                 f"expected {out.shape[1]}x{out.shape[0]}")
    out[...] = pixels
    return out


def decode_image(data: bytes, what: str = "image", *, size: tuple[int, int] | None = None,
                 backend: str = "auto") -> Image.Image:
    """An RGB PIL image of encoded image bytes (for resampling), decoded like `decode_array`."""
    if backend_name(backend) == "simplejpeg" and is_jpeg(data):
        return Image.fromarray(decode_array(data, what, size=size, backend=backend))
    return schema.decode_image(data, what, size=size)
