"""The SCLARO sample record: one module that the writer (`data_prep`) and the reader (Grain) share.

A record is the bytes ``MAGIC + version (uint16, little-endian) + msgpack(payload)``. The payload
holds one annotated image:

    id, source, split, image (encoded bytes, JPEG or PNG), width, height, action, caption,
    (action "" = the VLM gave none: such images are kept, appendix "label curation", and take
    no part in the global contrastive loss or the text distillation terms),
    mask_kind ("sam" or "box": what made the relation regions' masks),
    objects:   [{name, box: (x0, y0, x1, y1) pixels, x1/y1 exclusive}, ...]
    relations: [{subject, predicate, object, text, region}, ...]
               subject/object index into `objects`; `text` is the canonical triplet
               "subject predicate object"; `region` is the encoded focused-region image
               (appendix Eqs. 4-7, same size as the image).

Beside the shards a dataset folder holds vocabulary files (`actions.txt`, `objects.txt`,
`relations.txt`, `predicates.txt`, `sources.txt`: one label per line, sorted) and
`manifest.json` (schema version, shards with record counts and sha256, counts per split and
source, the split rule). `SCHEMA_VERSION` changes whenever the payload changes meaning; reading
a record or a manifest of another version fails with `SchemaVersionError` saying what to do.

This module never imports torch; only numpy, PIL and msgpack.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import struct
from typing import Iterable, Sequence

import msgpack
import numpy as np
from PIL import Image

MAGIC = b"SCLARO"
SCHEMA_VERSION = 1
_HEADER = struct.Struct("<H")
SPLITS = ("train", "val", "test")
MASK_KINDS = ("sam", "box")
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


@dataclasses.dataclass(frozen=True)
class Relation:
    subject: int
    predicate: str
    object: int
    text: str  # canonical triplet text: "subject predicate object"
    region: bytes  # encoded focused-region image, same size as the sample's image


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


def triplet_text(subject: str, predicate: str, obj: str) -> str:
    """The relation level's text: subject, predicate and object joined with spaces."""
    return " ".join(part.strip() for part in (subject, predicate, obj))


# --------------------------------------------------------------------------- encode / decode

def encode(sample: Sample) -> bytes:
    """Sample -> record bytes. Does not validate: call `validate` first (the writer does)."""
    payload = {
        "id": sample.id, "source": sample.source, "split": sample.split,
        "image": sample.image, "width": int(sample.width), "height": int(sample.height),
        "action": sample.action, "caption": sample.caption, "mask_kind": sample.mask_kind,
        "objects": [[o.name, [float(v) for v in o.box]] for o in sample.objects],
        "relations": [[r.subject, r.predicate, r.object, r.text, r.region]
                      for r in sample.relations],
    }
    return MAGIC + _HEADER.pack(SCHEMA_VERSION) + msgpack.packb(payload, use_bin_type=True)


def record_version(record: bytes) -> int:
    """The schema version a record was written with; RecordError if it is not a SCLARO record."""
    if not isinstance(record, (bytes, bytearray, memoryview)):
        raise RecordError(f"a record must be bytes, got {type(record).__name__}")
    if bytes(record[:len(MAGIC)]) != MAGIC or len(record) < len(MAGIC) + _HEADER.size:
        raise RecordError("not a SCLARO record (bad magic bytes)")
    return _HEADER.unpack_from(record, len(MAGIC))[0]


def decode(record: bytes) -> Sample:
    """Record bytes -> Sample. Raises SchemaVersionError or RecordError naming the problem."""
    version = record_version(record)
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"record written with SCLARO schema version {version}; this code reads version "
            f"{SCHEMA_VERSION}. Rewrite the shards with this version of `python -m data_prep`.")
    try:
        p = msgpack.unpackb(bytes(record[len(MAGIC) + _HEADER.size:]), raw=False)
        return Sample(
            id=p["id"], source=p["source"], split=p["split"], image=p["image"],
            width=p["width"], height=p["height"], action=p["action"], caption=p["caption"],
            mask_kind=p["mask_kind"],
            objects=tuple(Object(name, tuple(box)) for name, box in p["objects"]),
            relations=tuple(Relation(s, pred, o, text, region)
                            for s, pred, o, text, region in p["relations"]))
    except RecordError:
        raise
    except Exception as e:  # msgpack errors, missing keys, wrong arity
        raise RecordError(f"corrupt SCLARO record payload: {type(e).__name__}: {e}") from None


# --------------------------------------------------------------------------- validation

def decode_image(data: bytes, what: str = "image", *, size: tuple[int, int] | None = None,
                 min_side: int | None = None) -> Image.Image:
    """Decode encoded image bytes to an RGB PIL image; RecordError naming `what` if they are
    corrupt or, with `size` (width, height), if the image has another size.

    `min_side`: JPEGs are decoded at the smallest DCT scale (PIL's draft mode: 1/2, 1/4, 1/8)
    whose shorter side stays >= min_side; for views that are downscaled to that size anyway.
    """
    try:
        img = Image.open(io.BytesIO(data))
        if size is not None and img.size != tuple(size):
            raise RecordError(f"{what} decodes to {img.size[0]}x{img.size[1]}, record says "
                              f"{size[0]}x{size[1]}")
        short = min(img.size)
        if min_side and img.format == "JPEG" and short > min_side:
            img.draft("RGB", tuple(int(np.ceil(v * min_side / short)) for v in img.size))
        img.load()
    except RecordError:
        raise
    except Exception as e:
        raise RecordError(f"{what} does not decode: {type(e).__name__}: {e}") from None
    return img if img.mode == "RGB" else img.convert("RGB")


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
    w, h = int(sample.width), int(sample.height)
    if w <= 0 or h <= 0:
        fail(f"image size {w}x{h} is empty")
    if decode_images:
        try:
            decode_image(sample.image, size=(w, h))
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
        if decode_images:
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
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.rstrip("\n")]
