"""What a scene-graph reader hands the import: one `Graph` per image, as the dataset gives it
(nothing checked against the photograph yet), and the `SceneGraphs` of a whole dataset."""

from __future__ import annotations

import dataclasses

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
