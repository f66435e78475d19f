"""Training views at write time (schema version 2): what the reference transforms derive
deterministically from a record, computed once instead of every epoch.

`with_views(sample, view_size)` turns a sample that holds the originals (the photograph and the
full-size focused regions) into one that also carries, at view size S:
- each object's view: Resize(S) + CenterCrop(S) of its box crop (`augment.region_view`'s
  geometry, the reference's object transform before its colour jitter);
- each relation's view: Resize(S) + CenterCrop(S) of its focused region;
- `train_image`: the photograph downscaled to `schema.train_image_size` (the smallest size from
  which RandomResizedCrop at S never upsamples: 251 x 335 for a 4:3 photograph at 224).
Views are JPEGs at `schema.VIEW_QUALITY` with 4:2:0 chroma (4:4:4 below
`schema.FULL_CHROMA_BELOW` px); the originals are dropped
unless `keep_originals`. Encoding is deterministic, so the same input gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
from PIL import Image

from sclaro_jax.data import augment, schema


def encode_view(img: Image.Image | np.ndarray, view_size: int,
                quality: int = schema.VIEW_QUALITY) -> bytes:
    """A view (or train_image) for `view_size` px views as JPEG bytes, with the chroma
    subsampling `schema.view_subsampling(view_size)` and no optimisation passes (the same bytes
    every time)."""
    if isinstance(img, np.ndarray):
        img = Image.fromarray(img)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality,
             subsampling=schema.view_subsampling(view_size))
    return buf.getvalue()


def train_image(photo: Image.Image, data: bytes, view_size: int,
                quality: int = schema.VIEW_QUALITY) -> bytes:
    """The stored global image: `data` itself when the photograph is already no larger than
    `schema.train_image_size`, else a bicubic (antialiased) downscale as JPEG."""
    size = schema.train_image_size(*photo.size, view_size)
    if size == photo.size:
        return data
    return encode_view(photo.resize(size, Image.BICUBIC), view_size, quality)


def with_views(sample: schema.Sample, view_size: int = schema.DEFAULT_VIEW_SIZE, *,
               keep_originals: bool = False, quality: int = schema.VIEW_QUALITY
               ) -> schema.Sample:
    """`sample` with training views at `view_size` (schema version 2).

    A sample that already has views of that size is returned as it is (originals dropped
    unless `keep_originals`); one with views of another size needs its originals, else a
    `schema.MissingOriginalsError` naming the sample.
    """
    if sample.view_size == view_size:
        return sample if keep_originals else drop_originals(sample)
    if not sample.has_originals:
        raise schema.MissingOriginalsError(
            f"sample {sample.id!r} holds {sample.view_size} px views and no originals: views "
            f"at {view_size} px need the full-resolution photograph and regions (convert the "
            f"dataset it came from, or one written with --keep-originals)")
    where = f"sample {sample.id!r}"
    photo = schema.decode_image(sample.image, f"{where}: image",
                                size=(sample.width, sample.height))
    objects = tuple(dataclasses.replace(
        o, view=encode_view(augment.resize_centre_crop(augment.box_crop(photo, o.box),
                                                       view_size), view_size, quality))
        for o in sample.objects)
    relations = []
    for k, r in enumerate(sample.relations):
        region = schema.decode_image(r.region, f"{where}: relation {k} ({r.text!r}) region",
                                     size=photo.size)
        relations.append(dataclasses.replace(
            r, view=encode_view(augment.resize_centre_crop(region, view_size), view_size,
                                quality)))
    out = dataclasses.replace(
        sample, view_size=int(view_size), objects=objects, relations=tuple(relations),
        train_image=train_image(photo, sample.image, view_size, quality))
    return out if keep_originals else drop_originals(out)


def drop_originals(sample: schema.Sample) -> schema.Sample:
    """A version-2 sample without its full-size photograph, regions and panoptic masks."""
    return dataclasses.replace(
        sample, image=None, panoptic=None,
        relations=tuple(dataclasses.replace(r, region=None) for r in sample.relations))


def drop_views(sample: schema.Sample) -> schema.Sample:
    """A version-1 sample (originals only) from a version-2 one that kept its originals."""
    return dataclasses.replace(
        sample, view_size=None, train_image=None,
        objects=tuple(dataclasses.replace(o, view=None) for o in sample.objects),
        relations=tuple(dataclasses.replace(r, view=None) for r in sample.relations))
