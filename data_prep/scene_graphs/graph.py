"""What a scene-graph reader hands the import: one `Graph` per image, as the dataset gives it
(nothing checked against the photograph yet), and the `SceneGraphs` of a whole dataset; and
the type checks the readers apply to the fields they use (`whole`, `ident`, `numbers`, `text`:
a ValueError naming the field, which a reader reports naming the file and the entry)."""

from __future__ import annotations

import dataclasses
import math
import reprlib

Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels, x1 / y1 exclusive


@dataclasses.dataclass(frozen=True)
class Graph:
    id: str  # the record id, "<source>/<image id>"
    split: str  # the dataset's own split: "train" or "test"
    image: str  # path of the photograph
    objects: tuple[tuple[str, Box | None], ...]  # (name, box); None: the box of its mask
    relations: tuple[tuple[int, str | None, int], ...]  # (subject, predicate, object); None:
    # a predicate the dataset's index does not name
    captions: tuple[str, ...] = ()  # in the dataset's order
    panoptic: str | None = None  # PSG: the panoptic PNG; None: box masks
    segments: tuple[int, ...] = ()  # PSG: each object's segment id in the PNG
    skip: str = ""  # a reason the reader found to skip the image unread: "outside_root" (a
    # path the dataset names resolves outside its root, `sclaro_jax.paths.inside_root`)


@dataclasses.dataclass(frozen=True)
class SceneGraphs:
    source: str  # the records' source field
    mask_kind: str  # "panoptic" (PSG's segments) or "box"
    graphs: list[Graph]
    split_rule: dict  # the manifest's description of the split
    files: dict  # what was read: {"annotations": path, "captions": [paths], ...}


def clean(text) -> str:
    """A dataset's free text on one line: whitespace collapsed, ends stripped ("" for None)."""
    return " ".join(str(text).split()) if text is not None else ""


_INT64 = 1 << 63


def whole(value, what: str) -> int:
    """An index or id of a dataset's json: an int (a float without a fraction, as some
    writers give them) of at most 64 bits; ValueError naming `what` otherwise (a bool, a
    string, a list, infinity, ...)."""
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int or not -_INT64 <= value < _INT64:
        raise ValueError(f"{what} {reprlib.repr(value)} is not a whole number")
    return value


def ident(value, what: str) -> str:
    """An image id as the readers key it: a string as is, a whole number written out."""
    return value if isinstance(value, str) else str(whole(value, what))


def numbers(values, count: int, what: str) -> tuple[float, ...]:
    """`count` finite numbers (a box's coordinates) as floats; ValueError naming `what`."""
    if isinstance(values, (list, tuple)) and len(values) == count and all(
            type(v) in (int, float) for v in values):
        try:
            out = tuple(float(v) for v in values)
        except OverflowError:  # an int past a float's range
            out = (math.inf,)
        if all(math.isfinite(v) for v in out):
            return out
    raise ValueError(f"{what} {reprlib.repr(values)} is not {count} finite numbers")


def text(value, what: str) -> str:
    """A name, predicate or caption: a string (None as ""), whitespace collapsed by `clean`;
    ValueError naming `what` for a number, a list or an object."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{what} {reprlib.repr(value)} is not a string")
    return clean(value)
