"""ROCS-style benchmark construction (MINER section 3): the selection steps as pure functions.

From any detection-annotated image set (a COCO instances file), ROCS keeps:

1. the high-clutter subset: the top `top_fraction` (10%) of images by object count
   (`high_clutter`; ties at the cut are broken by image id, lower first, so the subset is the
   same on every run);
2. the rare objects of each such image: instances of a class that appears exactly once in that
   image (`rare_instances`);
3. of those, the ones whose segmentation mask covers at most `max_mask_area` (5%) of the image
   (`small_enough`; larger ones are visually dominant and dropped); an image stays when at least
   one rare instance survives;
4. a caption per kept (image, rare object) that names the object (`caption_names`: the class
   name, or its plural, as whole words, case-insensitive).

`figure_stats` gives the numbers of the paper's Figure 3 for a stage: objects per image, class
diversity, and for the rare objects the median box area and the share under 1% of the image.

These functions read annotations and masks only; the model stages (GroundingDINO boxes for sets
without instances, SAM masks, the re-captioning VLM) live in `detect`, `segment` and `vlm`.
Crowd annotations (`iscrowd` 1: one box over a group) are not objects and are skipped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sclaro_jax import bounds

TOP_FRACTION = 0.1
MAX_MASK_AREA = 0.05
SMALL_BOX_AREA = 0.01  # Figure 3's "share of rare objects under 1% of the image"


class InstancesError(ValueError):
    """A COCO instances file that cannot be read; the message names the file and the field."""


@dataclass(frozen=True)
class Instance:
    id: int
    image_id: int
    category: str
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels

    @property
    def box_area(self) -> float:
        return max(0.0, self.box[2] - self.box[0]) * max(0.0, self.box[3] - self.box[1])


@dataclass(frozen=True)
class AnnotatedImage:
    id: int
    file_name: str
    width: int
    height: int
    instances: tuple[Instance, ...] = ()

    @property
    def area(self) -> int:
        return self.width * self.height


def _field(path, where: str, obj: dict, key: str, kind, describe: str):
    if not isinstance(obj, dict) or key not in obj:
        raise InstancesError(f"{path}: {where}.{key} is missing ({describe})")
    value = obj[key]
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise InstancesError(f"{path}: {where}.{key} is {value!r}; expected {describe}")
    return value


def read_instances(path: str | Path) -> list[AnnotatedImage]:
    """A COCO instances JSON (`images`, `annotations`, `categories`) -> its images with their
    instances (boxes converted from [x, y, w, h] to corners), in the file's image order.
    Raises InstancesError naming the file and the field at fault."""
    path = Path(path)
    try:
        raw = bounds.read_json(path)
    except FileNotFoundError:
        raise InstancesError(f"{path}: no such instances file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InstancesError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise InstancesError(f"{path}: expected a JSON object with 'images', 'annotations' and "
                             "'categories' (a COCO instances file)")
    for key in ("images", "annotations", "categories"):
        if not isinstance(raw.get(key), list):
            raise InstancesError(f"{path}: '{key}' is missing or not a list (a COCO instances "
                                 "file has 'images', 'annotations' and 'categories')")
    names = {}
    for i, cat in enumerate(raw["categories"]):
        cid = _field(path, f"categories[{i}]", cat, "id", int, "an integer id")
        names[cid] = _field(path, f"categories[{i}]", cat, "name", str, "the class name")
    images, order = {}, []
    for i, im in enumerate(raw["images"]):
        where = f"images[{i}]"
        iid = _field(path, where, im, "id", int, "an integer id")
        if iid in images:
            raise InstancesError(f"{path}: {where}.id {iid} appears twice")
        images[iid] = dict(file_name=_field(path, where, im, "file_name", str, "a file name"),
                           width=_field(path, where, im, "width", int, "the width in pixels"),
                           height=_field(path, where, im, "height", int, "the height in pixels"),
                           instances=[])
        order.append(iid)
    for i, ann in enumerate(raw["annotations"]):
        where = f"annotations[{i}]"
        if isinstance(ann, dict) and ann.get("iscrowd", 0):
            continue
        iid = _field(path, where, ann, "image_id", int, "the id of an entry of 'images'")
        if iid not in images:
            raise InstancesError(f"{path}: {where}.image_id {iid} is not the id of any image")
        cid = _field(path, where, ann, "category_id", int, "the id of an entry of 'categories'")
        if cid not in names:
            raise InstancesError(f"{path}: {where}.category_id {cid} is not the id of any "
                                 "category")
        bbox = ann.get("bbox") if isinstance(ann, dict) else None
        if (not isinstance(bbox, list) or len(bbox) != 4 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in bbox) or bbox[2] < 0 or bbox[3] < 0):
            raise InstancesError(f"{path}: {where}.bbox is {bbox!r}; expected [x, y, width, "
                                 "height], four finite numbers with width, height >= 0")
        x, y, w, h = (float(v) for v in bbox)
        aid = ann.get("id", i)
        images[iid]["instances"].append(Instance(int(aid), iid, names[cid], (x, y, x + w, y + h)))
    return [AnnotatedImage(iid, images[iid]["file_name"], images[iid]["width"],
                           images[iid]["height"], tuple(images[iid]["instances"]))
            for iid in order]


def high_clutter(images: list[AnnotatedImage], top_fraction: float = TOP_FRACTION
                 ) -> list[AnnotatedImage]:
    """The ceil(top_fraction x N) images with the most objects (ties at the cut: lower image id
    first), in decreasing object count."""
    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    n = math.ceil(top_fraction * len(images))
    return sorted(images, key=lambda im: (-len(im.instances), im.id))[:n]


def rare_instances(image: AnnotatedImage) -> list[Instance]:
    """The instances whose class appears exactly once in the image, in annotation order."""
    counts: dict[str, int] = {}
    for inst in image.instances:
        counts[inst.category] = counts.get(inst.category, 0) + 1
    return [inst for inst in image.instances if counts[inst.category] == 1]


def mask_fraction(mask: np.ndarray) -> float:
    """The share of the image a boolean mask [H, W] covers."""
    mask = np.asarray(mask, bool)
    return float(mask.sum()) / mask.size


def small_enough(fraction: float, max_mask_area: float = MAX_MASK_AREA) -> bool:
    """Whether a rare instance whose mask covers `fraction` of the image stays (at most
    `max_mask_area`; larger ones are visually dominant)."""
    return fraction <= max_mask_area


def caption_names(caption: str, name: str) -> bool:
    """Whether `caption` names the object `name`: its words in sequence (or with the last one
    in a plural form: +s, +es, y -> ies), whole words, case-insensitive."""
    words = name.lower().split()
    if not words:
        return False
    last = re.escape(words[-1])
    plural = last + "(?:s|es)?"
    if words[-1].endswith("y"):
        plural = f"(?:{plural}|{re.escape(words[-1][:-1])}ies)"
    pattern = r"\b" + r"\s+".join([re.escape(w) for w in words[:-1]] + [plural]) + r"\b"
    return re.search(pattern, caption.lower()) is not None


def figure_stats(images: list[AnnotatedImage], rare: list[tuple[AnnotatedImage, Instance]]
                 | None = None) -> dict:
    """Figure 3's numbers for one stage: objects per image (mean, median), class diversity
    (distinct classes per image: mean; and distinct classes over the stage); with `rare`, the
    (image, instance) pairs kept, the median rare-object box area as a share of the image and
    the share of them under 1% of the image."""
    counts = [len(im.instances) for im in images]
    diversity = [len({i.category for i in im.instances}) for im in images]
    out = {"images": len(images),
           "objects_per_image_mean": float(np.mean(counts)) if counts else 0.0,
           "objects_per_image_median": float(np.median(counts)) if counts else 0.0,
           "classes_per_image_mean": float(np.mean(diversity)) if diversity else 0.0,
           "classes": len({i.category for im in images for i in im.instances})}
    if rare is not None:
        shares = np.array([inst.box_area / im.area for im, inst in rare], np.float64)
        out.update(rare_objects=len(rare),
                   rare_box_area_median=float(np.median(shares)) if len(shares) else 0.0,
                   rare_under_1pct=float((shares < SMALL_BOX_AREA).mean()) if len(shares)
                   else 0.0)
    return out
