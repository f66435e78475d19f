"""The SCLARO sample record: one module that the writer (`data_prep`) and the reader (Grain) share.

A record is the bytes ``MAGIC + version (uint16, little-endian) + msgpack(payload)``. The payload
holds one annotated image:

    id, source, split, width, height (of the original photograph), action, caption,
    (action "" = the VLM gave none: such images are kept, appendix "label curation", and take
    no part in the global contrastive loss or the text distillation terms),
    mask_kind ("sam", "box" or "panoptic": what made the relation regions' masks: SAM, the
               boxes themselves, or a dataset's own panoptic segments, e.g. PSG's),
    objects:   [{name, box: (x0, y0, x1, y1) original pixels, x1/y1 exclusive, view}, ...]
    relations: [{subject, predicate, object, text, region, view}, ...]
               subject/object index into `objects`; `text` is the canonical triplet
               "subject predicate object"; `region` is the encoded focused-region image
               (appendix Eqs. 4-7, same size as the photograph).

Schema version 2 (written today) stores the *training views*: what the reference transforms
derive deterministically, computed once at write time at a view size S (`view_size`, 224 by
default, also in the manifest):

- `objects[k].view`: Resize(S) + CenterCrop(S) of the object's box crop (the reference's
  object transform before its colour jitter), a JPEG;
- `relations[k].view`: Resize(S) + CenterCrop(S) of the focused region, a JPEG;
- `train_image`: the photograph downscaled (bicubic, antialiased) to the smallest size from
  which RandomResizedCrop(S, scale 0.8-1, ratio 3/4-4/3) never upsamples (`train_image_size`).
- `image` (the original photograph) and `relations[k].region` only when the writer was told to
  keep the originals (`--keep-originals`); otherwise they are None and evaluations that need
  full resolution (localisation, MINER crops) say so. With them, a panoptic record may hold
  its dataset's segment masks (`panoptic`, in either version: `sclaro_jax.data.panoptic`).

Version 1 records (originals only, no views) stay readable: the pipeline makes their views on
the host, at the reference's 224 px.

Beside the shards a dataset folder holds vocabulary files (`actions.txt`, `objects.txt`,
`relations.txt`, `predicates.txt`, `sources.txt`: one label per line, sorted) and
`manifest.json` (schema version, view size, whether originals are kept, shards with record
counts and sha256, counts per split and source, the split rule). `SCHEMA_VERSION` changes
whenever the payload changes meaning; reading a record or a manifest of a version this code
does not know fails with `SchemaVersionError` saying what to do.

This module never imports torch; only numpy, PIL and msgpack.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import struct
from typing import Iterable, Sequence

import msgpack
import numpy as np
from PIL import Image

from sclaro_jax import bounds
from sclaro_jax.data import panoptic as pan

MAGIC = b"SCLARO"
SCHEMA_VERSION = 2  # what the writer writes
READABLE_VERSIONS = (1, 2)
LEGACY_VIEW_SIZE = 224  # the view size version-1 datasets are read at (the reference's)
DEFAULT_VIEW_SIZE = 224
# Stored views are JPEGs at this quality with 4:2:0 chroma (what photographs carry anyway; small
# views keep full chroma, `view_subsampling`): on
# the demo's 143 views 0.91 grey levels mean |diff| from the exact pixels (4:4:4 at 95: 0.82),
# decoded in 0.25 ms instead of 0.33 ms, the same bytes (bench/README.md, "Input pipeline").
VIEW_QUALITY = 97
FULL_CHROMA_BELOW = 160  # views (and their train_image) smaller than this keep 4:4:4 chroma


def view_subsampling(view_size: int) -> int:
    """PIL's JPEG chroma subsampling code for views of `view_size`: 2 (4:2:0) from
    `FULL_CHROMA_BELOW` px up, else 0 (4:4:4: at 64 px, 4:2:0 costs 3 grey levels mean)."""
    return 2 if view_size >= FULL_CHROMA_BELOW else 0
_HEADER = struct.Struct("<H")
SPLITS = ("train", "val", "test")
MASK_KINDS = ("sam", "box", "panoptic")
VOCAB_FILES = {
    "actions": "actions.txt",
    "objects": "objects.txt",
    "relations": "relations.txt",
    "predicates": "predicates.txt",
    "sources": "sources.txt",
}
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "sclaro-shards"


class RecordError(ValueError):
    """A record (or a sample about to become one) that cannot be used; the message names it."""


class SchemaVersionError(RecordError):
    """A record or manifest written with a schema version this code does not read."""


@dataclasses.dataclass(frozen=True)
class Object:
    name: str
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels; x1, y1 exclusive
    view: bytes | None = None  # v2: JPEG of Resize(S) + CenterCrop(S) of the box crop


@dataclasses.dataclass(frozen=True)
class Relation:
    subject: int
    predicate: str
    object: int
    text: str  # canonical triplet text: "subject predicate object"
    region: bytes | None  # encoded focused-region image, the photograph's size (None: not kept)
    view: bytes | None = None  # v2: JPEG of Resize(S) + CenterCrop(S) of the region


@dataclasses.dataclass(frozen=True)
class Sample:
    id: str
    source: str
    split: str
    image: bytes
    width: int
    height: int
    action: str
    caption: str
    objects: tuple[Object, ...] = ()
    relations: tuple[Relation, ...] = ()
    mask_kind: str = "sam"
    view_size: int | None = None  # v2: S of the stored views; None: originals only (v1)
    train_image: bytes | None = None  # v2: the photograph at train_image_size(w, h, S)
    panoptic: pan.Panoptic | None = None  # the dataset's segment masks, kept with the originals

    @property
    def has_views(self) -> bool:
        """Whether the record carries training views (schema version 2)."""
        return self.view_size is not None

    @property
    def has_originals(self) -> bool:
        """Whether the full-size photograph and relation regions are in the record."""
        return self.image is not None and all(r.region is not None for r in self.relations)


class MissingOriginalsError(RecordError):
    """A full-resolution image or region was asked of a record written without originals."""


def global_short_side(view_size: int) -> int:
    """The largest shorter side a stored global image gets for views of `view_size`: that of a
    square photograph, ceil(S / sqrt(0.8 * 3/4)) (290 for 224, 434 for 336); see
    `train_image_size` (the manifest records it)."""
    return int(math.ceil(view_size / math.sqrt(0.8 * 0.75) - 1e-9))


def train_image_size(width: int, height: int, view_size: int) -> tuple[int, int]:
    """(width, height) of the stored global image of a `width` x `height` photograph: the
    smallest downscale (aspect kept, sides rounded) from which RandomResizedCrop(S, scale
    0.8-1, ratio 3/4-4/3) never upsamples, or the photograph's own size when it is no larger.

    The rule: every crop RandomResizedCrop accepts has both sides >= sqrt(0.8 * 3/4 * W * H)
    (before torchvision rounds them) and its fallback keeps the whole shorter side, so
    W * H >= S^2 / 0.6 and min(W, H) >= S suffice. The shorter side is therefore
    max(S, S / sqrt(0.6 * long / short)), rounded up: 290 px for a square photograph at
    S = 224 (`global_short_side`), 251 x 335 for 4:3, 224 x 398 for 16:9."""
    short, long = sorted((int(width), int(height)))
    s = int(view_size)
    if short <= s:
        return int(width), int(height)
    side = max(s, int(math.ceil(s / math.sqrt(0.6 * long / short) - 1e-9)))
    while side < short and 0.6 * side * round(long * side / short) < s * s:
        side += 1  # the long side's rounding can take a little area away
    if side >= short:
        return int(width), int(height)
    other = int(round(long * side / short))
    return (side, other) if width <= height else (other, side)


def original_image(sample: Sample) -> bytes:
    """The full-size photograph's bytes; MissingOriginalsError naming the sample and the fix
    when the record was written without originals."""
    if sample.image is None:
        raise MissingOriginalsError(
            f"sample {sample.id!r} holds training views only (schema version 2 written without "
            f"--keep-originals); this needs the full-resolution photograph: use the dataset it "
            f"was converted from, or convert that one with `python -m data_prep reshard --in "
            f"SRC --out DIR --keep-originals`")
    return sample.image


def triplet_text(subject: str, predicate: str, obj: str) -> str:
    """The relation level's text: subject, predicate and object joined with spaces."""
    return " ".join(part.strip() for part in (subject, predicate, obj))


# --------------------------------------------------------------------------- encode / decode

def encode(sample: Sample) -> bytes:
    """Sample -> record bytes: version 2 for a sample with views, version 1 (originals only,
    the legacy layout) for one without. Does not validate: call `validate` first (the writer
    does)."""
    payload = {
        "id": sample.id, "source": sample.source, "split": sample.split,
        "image": sample.image, "width": int(sample.width), "height": int(sample.height),
        "action": sample.action, "caption": sample.caption, "mask_kind": sample.mask_kind,
        **pan.payload(sample.panoptic)}
    if not sample.has_views:
        payload["objects"] = [[o.name, [float(v) for v in o.box]] for o in sample.objects]
        payload["relations"] = [[r.subject, r.predicate, r.object, r.text, r.region]
                                for r in sample.relations]
        return MAGIC + _HEADER.pack(1) + msgpack.packb(payload, use_bin_type=True)
    payload.update(view_size=int(sample.view_size), train_image=sample.train_image)
    payload["objects"] = [[o.name, [float(v) for v in o.box], o.view] for o in sample.objects]
    payload["relations"] = [[r.subject, r.predicate, r.object, r.text, r.region, r.view]
                            for r in sample.relations]
    return MAGIC + _HEADER.pack(SCHEMA_VERSION) + msgpack.packb(payload, use_bin_type=True)


def record_version(record: bytes) -> int:
    """The schema version a record was written with; RecordError if it is not a SCLARO record."""
    if not isinstance(record, (bytes, bytearray, memoryview)):
        raise RecordError(f"a record must be bytes, got {type(record).__name__}")
    if bytes(record[:len(MAGIC)]) != MAGIC or len(record) < len(MAGIC) + _HEADER.size:
        raise RecordError("not a SCLARO record (bad magic bytes)")
    return _HEADER.unpack_from(record, len(MAGIC))[0]


def decode(record: bytes) -> Sample:
    """Record bytes (version 1 or 2) -> Sample. Raises SchemaVersionError or RecordError naming
    the problem."""
    version = record_version(record)
    if version not in READABLE_VERSIONS:
        raise SchemaVersionError(
            f"record written with SCLARO schema version {version}; this code reads versions "
            f"{READABLE_VERSIONS}. Rewrite the shards with this version of `python -m data_prep`"
            f" (`reshard` converts a dataset).")
    try:
        p = msgpack.unpackb(bytes(record[len(MAGIC) + _HEADER.size:]), raw=False)
        common = dict(
            id=p["id"], source=p["source"], split=p["split"], image=p["image"],
            width=p["width"], height=p["height"], action=p["action"], caption=p["caption"],
            mask_kind=p["mask_kind"], panoptic=pan.from_payload(p.get("panoptic")))
        if version == 1:
            sample = Sample(
                **common, objects=tuple(Object(name, tuple(box)) for name, box in p["objects"]),
                relations=tuple(Relation(s, pred, o, text, region)
                                for s, pred, o, text, region in p["relations"]))
        else:
            sample = Sample(
                **common, view_size=p["view_size"], train_image=p["train_image"],
                objects=tuple(Object(n, tuple(b), v) for n, b, v in p["objects"]),
                relations=tuple(Relation(s, pred, o, text, region, view)
                                for s, pred, o, text, region, view in p["relations"]))
    except Exception as e:  # msgpack errors, missing keys, wrong arity
        raise RecordError(f"corrupt SCLARO record payload (version {version}): "
                          f"{type(e).__name__}: {e}") from None
    return _typed(sample, version)


_BYTES = (bytes, type(None))
_SAMPLE_TYPES = [(f, (str,)) for f in ("id", "source", "split", "action", "caption", "mask_kind")
                 ] + [("width", (int,)), ("height", (int,)), ("image", _BYTES),
                      ("view_size", (int, type(None))), ("train_image", _BYTES)]
_RELATION_TYPES = (("subject", (int,)), ("predicate", (str,)), ("object", (int,)),
                   ("text", (str,)), ("region", _BYTES), ("view", _BYTES))


def _typed(s: Sample, version: int) -> Sample:
    """`s`, or RecordError naming its first field of another type than `encode` writes (a
    number where a string is, a bool for a width, ...)."""
    fields = [(f, getattr(s, f), t) for f, t in _SAMPLE_TYPES]
    for i, o in enumerate(s.objects):
        fields += [(f"object {i} name", o.name, (str,)), (f"object {i} view", o.view, _BYTES)]
        fields += [(f"object {i} box", v, (int, float)) for v in o.box]
    for j, r in enumerate(s.relations):
        fields += [(f"relation {j} {f}", getattr(r, f), t) for f, t in _RELATION_TYPES]
    fields += pan.typed_fields(s.panoptic)
    for name, v, types in fields:
        if type(v) not in types:
            raise RecordError(f"corrupt SCLARO record payload (version {version}): {name} is "
                              f"a {type(v).__name__}")
    return s


# --------------------------------------------------------------------------- validation

def decode_image(data: bytes, what: str = "image", *, size: tuple[int, int] | None = None,
                 min_side: int | None = None) -> Image.Image:
    """Decode encoded image bytes to an RGB PIL image; RecordError naming `what` if they are
    corrupt or, with `size` (width, height), if the image has another size.

    `min_side`: JPEGs are decoded at the smallest DCT scale (PIL's draft mode: 1/2, 1/4, 1/8)
    whose shorter side stays >= min_side; for views that are downscaled to that size anyway.
    """
    try:
        img = bounds.open_image(io.BytesIO(data), what)
        if size is not None and img.size != tuple(size):
            raise RecordError(f"{what} decodes to {img.size[0]}x{img.size[1]}, record says "
                              f"{size[0]}x{size[1]}")
        short = min(img.size)
        if min_side and img.format == "JPEG" and short > min_side:
            img.draft("RGB", tuple(int(np.ceil(v * min_side / short)) for v in img.size))
        img.load()
    except RecordError:
        raise
    except bounds.BoundsError as e:
        raise RecordError(str(e)) from None
    except Exception as e:
        raise RecordError(f"{what} does not decode: {type(e).__name__}: {e}") from None
    return img if img.mode == "RGB" else img.convert("RGB")


def _check_labels(sample: Sample, fail) -> None:
    """`fail` naming the first label (action, object name, predicate) that cannot enter a
    vocabulary (`bounds.label_problem`: too long, or holding control characters)."""
    labels = [("action", sample.action)] + [(f"object {i} name", o.name)
                                            for i, o in enumerate(sample.objects)]
    for what, label in labels + [(f"relation {j} predicate", r.predicate)
                                 for j, r in enumerate(sample.relations)]:
        problem = isinstance(label, str) and bounds.label_problem(label)
        if problem:
            fail(f"{what} '{bounds.printable(label[:80])}': {problem.replace('_', ' ')} "
                 f"(labels are at most {bounds.label_limit()} characters, no control "
                 "characters)")


def validate(sample: Sample, *, decode_images: bool = True) -> None:
    """Check a sample before it is written; RecordError naming the sample and the field."""
    name = f"sample {sample.id!r}"

    def fail(msg: str):
        raise RecordError(f"{name}: {msg}")

    if not isinstance(sample.id, str) or not sample.id:
        fail("empty id")
    if sample.split not in SPLITS:
        fail(f"split {sample.split!r} is not one of {SPLITS}")
    if sample.mask_kind not in MASK_KINDS:
        fail(f"mask_kind {sample.mask_kind!r} is not one of {MASK_KINDS}")
    if not isinstance(sample.source, str) or not sample.source.strip():
        fail("empty source")
    if not isinstance(sample.action, str):
        fail(f"action must be a string, got {type(sample.action).__name__}")
    if sample.action != sample.action.strip():
        fail(f"action {sample.action!r} has surrounding whitespace (write '' for no action)")
    if not isinstance(sample.caption, str):
        fail("caption must be a string")
    _check_labels(sample, fail)
    w, h = int(sample.width), int(sample.height)
    if w <= 0 or h <= 0:
        fail(f"image size {w}x{h} is empty")
    v = sample.view_size
    if v is None:
        if sample.image is None or any(r.region is None for r in sample.relations):
            fail("a record without training views (schema version 1) must hold the original "
                 "image and every relation region")
    elif not isinstance(v, (int, np.integer)) or v < 1:
        fail(f"view_size {v!r} is not a positive integer")
    elif sample.train_image is None or any(o.view is None for o in sample.objects) or any(
            r.view is None for r in sample.relations):
        fail(f"view_size {v} but the train_image or an object / relation view is missing")
    pan.validate(sample, fail, decode_images)
    if decode_images:
        try:
            if sample.image is not None:
                decode_image(sample.image, size=(w, h))
            if v is not None:
                decode_image(sample.train_image, "train_image",
                             size=train_image_size(w, h, v))
                for i, obj in enumerate(sample.objects):
                    decode_image(obj.view, f"object {i} ({obj.name!r}) view", size=(v, v))
                for j, rel in enumerate(sample.relations):
                    decode_image(rel.view, f"relation {j} ({rel.text!r}) view", size=(v, v))
        except RecordError as e:
            fail(str(e))
    for i, obj in enumerate(sample.objects):
        if not isinstance(obj.name, str) or not obj.name.strip():
            fail(f"object {i} has an empty name")
        box = np.asarray(obj.box, dtype=np.float64)
        if box.shape != (4,) or not np.all(np.isfinite(box)):
            fail(f"object {i} ({obj.name!r}) box {obj.box} is not four finite numbers")
        x0, y0, x1, y1 = box
        if not (0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h):
            fail(f"object {i} ({obj.name!r}) box {tuple(obj.box)} is empty or lies outside "
                 f"the {w}x{h} image")
    n = len(sample.objects)
    for j, rel in enumerate(sample.relations):
        for role in ("subject", "object"):
            k = getattr(rel, role)
            if not isinstance(k, (int, np.integer)) or not 0 <= k < n:
                fail(f"relation {j} ({rel.text!r}) {role} index {k} is out of range for "
                     f"{n} objects")
        if not rel.predicate.strip():
            fail(f"relation {j} has an empty predicate")
        expected = triplet_text(sample.objects[rel.subject].name, rel.predicate,
                                sample.objects[rel.object].name)
        if rel.text != expected:
            fail(f"relation {j} text {rel.text!r} is not the canonical triplet {expected!r}")
        if decode_images and rel.region is not None:
            try:
                decode_image(rel.region, f"relation {j} ({rel.text!r}) region", size=(w, h))
            except RecordError as e:
                fail(str(e))


# --------------------------------------------------------------------------- splits, vocab

def assign_splits(ids: Iterable[str], seed: int = 42,
                  fractions: Sequence[float] = (0.7, 0.1, 0.2)) -> dict[str, str]:
    """Deterministic train/val/test split: rank ids by sha256(seed:id), cut at the fractions.

    The result depends only on the set of ids and the seed (not on their order), and the
    split sizes are exact: round(0.7 n) train, round(0.1 n) val, the rest test.
    """
    ids = list(ids)
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise RecordError(f"duplicate sample ids: {dup}")
    if len(fractions) != 3 or abs(sum(fractions) - 1.0) > 1e-9 or min(fractions) < 0:
        raise ValueError(f"split fractions {tuple(fractions)} must be three numbers summing to 1")
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    n = len(ranked)
    n_train = int(round(fractions[0] * n))
    n_val = min(int(round(fractions[1] * n)), n - n_train)
    out = {}
    for rank, i in enumerate(ranked):
        out[i] = "train" if rank < n_train else "val" if rank < n_train + n_val else "test"
    return out


def file_sha256(path) -> str:
    """Hex sha256 of a file's bytes (the manifest's checksum)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_vocab(path) -> list[str]:
    """The labels of a vocabulary file, one a line; a line holding a control character is
    refused naming the file and line (no writer here writes one)."""
    with open(path, encoding="utf-8") as f:
        labels = [line.rstrip("\n") for line in f]
    for n, label in enumerate(labels, 1):
        if bounds.has_control(label):
            raise bounds.BoundsError(
                f"{path} line {n}: label '{bounds.printable(label[:80])}' holds control "
                "characters; a vocabulary file holds one plain label a line (rewrite the "
                "dataset with `python -m data_prep`)")
    return [label for label in labels if label]
