"""A panoptic record's own segment masks: the optional `panoptic` key of a SCLARO record
(`sclaro_jax.data.schema`, either version).

A `mask_kind == "panoptic"` record written with its originals (`python -m data_prep import
--source psg --keep-originals`) holds `Panoptic`: `png`, the dataset's panoptic PNG as released
(the photograph's size, each pixel's segment id R + 256 G + 256^2 B, COCO's encoding), and
`segments`, objects[k]'s segment id; object k's mask is the pixels whose id is `segments[k]`
(`object_mask`). Relation localisation's targets come from it. It is stored as
``payload["panoptic"] = [png, [segment ids]]``; records without the key (older imports, other
sources) read as `panoptic=None`, and a reader that predates the key ignores it (the other keys
keep their meaning, so the schema version stays 2). Writers drop it with the originals
(`data_prep.views.drop_originals`).
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np

from sclaro_jax import bounds


class PanopticError(ValueError):
    """A record's panoptic masks are missing or do not decode; the message names the sample."""


@dataclasses.dataclass(frozen=True)
class Panoptic:
    """A panoptic record's segment masks: the dataset's PNG and each object's segment id."""
    png: bytes  # PNG, the photograph's size; segment id of a pixel = R + 256 G + 256^2 B
    segments: tuple[int, ...]  # objects[k]'s segment id


def payload(p: Panoptic | None) -> dict:
    """The record payload's keys for `p` (none for None)."""
    return {} if p is None else {"panoptic": [p.png, [int(i) for i in p.segments]]}


def from_payload(value) -> Panoptic | None:
    """`Panoptic` of a payload's "panoptic" value (None when the record has none)."""
    if value is None:
        return None
    png, segments = value
    return Panoptic(png, tuple(segments))


def typed_fields(p: Panoptic | None) -> list:
    """(name, value, allowed types) of `p`'s fields, for `schema`'s type check of a record."""
    if p is None:
        return []
    return [("panoptic png", p.png, (bytes,))] + [
        (f"panoptic segment {k}", v, (int,)) for k, v in enumerate(p.segments)]


def validate(sample, fail, decode_images: bool) -> None:
    """`fail` naming what is wrong with `sample.panoptic`: another mask kind, no photograph,
    a segment id count other than the objects', a PNG that does not decode at the
    photograph's size (with `decode_images`)."""
    p = sample.panoptic
    if p is None:
        return
    if sample.mask_kind != "panoptic":
        fail(f"panoptic masks in a record of mask_kind {sample.mask_kind!r}")
    if sample.image is None:
        fail("panoptic masks without the original photograph (they are kept with it)")
    if len(p.segments) != len(sample.objects):
        fail(f"{len(p.segments)} panoptic segment ids for {len(sample.objects)} objects")
    if decode_images:
        try:
            _segment_ids(p.png, "panoptic PNG", (sample.width, sample.height))
        except PanopticError as e:
            fail(str(e))


def _segment_ids(png: bytes, what: str, size) -> np.ndarray:
    """int64 [H, W] segment ids of a panoptic PNG of `size` (width, height); PanopticError
    naming `what` when it does not decode or has another size."""
    try:
        img = bounds.open_image(io.BytesIO(png), what)
        if img.size != tuple(int(v) for v in size):
            raise PanopticError(f"{what} is {img.size[0]}x{img.size[1]}, the photograph "
                                f"{size[0]}x{size[1]}")
        rgb = np.asarray(img.convert("RGB"), np.int64)
    except PanopticError:
        raise
    except Exception as e:  # PIL's errors, bounds.BoundsError
        raise PanopticError(f"{what} does not decode: {type(e).__name__}: {e}") from None
    return rgb[..., 0] + 256 * rgb[..., 1] + 65536 * rgb[..., 2]


def ids(sample) -> np.ndarray:
    """int64 [H, W]: the segment id of every pixel of the record's panoptic PNG (R + 256 G +
    256^2 B); PanopticError when the record has none or it does not decode at the
    photograph's size."""
    if sample.panoptic is None:
        raise PanopticError(f"sample {sample.id!r} holds no panoptic masks")
    return _segment_ids(sample.panoptic.png, f"sample {sample.id!r} panoptic PNG",
                        (sample.width, sample.height))


def object_mask(sample, k: int, segment_ids: np.ndarray | None = None) -> np.ndarray:
    """bool [H, W]: object k's segment mask (`segment_ids`: the record's `ids`, when already
    decoded)."""
    segment_ids = ids(sample) if segment_ids is None else segment_ids
    return segment_ids == sample.panoptic.segments[k]
