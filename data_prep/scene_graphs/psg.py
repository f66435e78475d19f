"""OpenPSG (panoptic scene graphs on COCO images) as released: psg.json, the COCO images, the
COCO panoptic PNGs and the COCO captions.

    <root>/psg.json          (or <root>/psg/psg.json) {"data": [{"file_name":
                             "train2017/000000000009.jpg", "image_id", "height", "width",
                             "pan_seg_file_name": "panoptic_train2017/000000000009.png",
                             "segments_info": [{"id", "category_id", "isthing", ...}],
                             "annotations": [{"bbox": [x0, y0, x1, y1], "category_id"}],
                             "relations": [[subject, object, predicate], ...]}, ...],
                             "thing_classes", "stuff_classes", "predicate_classes",
                             "test_image_ids"}
    <root>/coco/<file_name>, <root>/coco/<pan_seg_file_name>
    <root>/coco/annotations/captions_*.json   COCO captions (train2017 and val2017)

Objects are the segments in order: the class `thing_classes + stuff_classes`[category_id] written as
words (`class_words`), the box `annotations[k].bbox` (xyxy, the list parallel to `segments_info`;
without it the segment's COCO `bbox` [x, y, w, h], else the mask's box). Segment k's mask is the
pixels of the panoptic PNG whose id R + 256 G + 256^2 B equals `segments_info[k].id`. Relations are
[subject, object, predicate] indices (a predicate index past predicate_classes is kept as None: the
import counts the relation as out of range). Captions are matched by the image's file name through
the captions file's "images" (else by image id) and ordered by caption id. The split is PSG's:
"test" for `test_image_ids`, "train" otherwise. Ids and indices are whole numbers (image ids
may be strings), boxes finite numbers, class names strings: an entry with another type is an
error naming the file and `data[i]`. A `file_name` or `pan_seg_file_name` that
resolves outside <root>/coco (absolute, `..`, a link out of it) makes the image a skip
(`outside_root`): neither file is opened.
"""

from __future__ import annotations

import collections
import glob
import os
import reprlib

from data_prep.scene_graphs.graph import Graph, SceneGraphs, clean, ident, numbers, text, whole
from data_prep.source_items import SourceError, id_key, load_json
from data_prep.sources import openpsg_files
from sclaro_jax.paths import OUTSIDE_ROOT, inside_root

TITLE = "OpenPSG"
LAYOUT = ("<root>/psg.json (or <root>/psg/psg.json), images and panoptic PNGs under "
          "<root>/coco/ at the json's file_name and pan_seg_file_name, COCO captions in "
          "<root>/coco/annotations/captions_*.json (or --captions FILE)")


def class_words(name: str) -> str:
    """A COCO panoptic class name as words: the suffixes -merged, then -other and -stuff
    dropped, hyphens as spaces: "sky-other-merged" -> "sky", "door-stuff" -> "door",
    "wall-brick" -> "wall brick", "traffic light" stays."""
    name = name.removesuffix("-merged")
    for suffix in ("-other", "-stuff"):
        name = name.removesuffix(suffix)
    return clean(name.replace("-", " "))


def read_captions(paths: list[str]) -> tuple[dict, dict]:
    """COCO captions files -> ({image file name: image id}, {image id: captions by caption
    id}); ids as strings. Ids are strings or whole numbers (caption ids whole numbers) and
    captions strings: SourceError naming the file and the entry otherwise."""
    names, by_id = {}, collections.defaultdict(list)
    for path in paths:
        doc = load_json("COCO captions", path)
        where = "the top level"
        try:
            for i, image in enumerate(doc.get("images", [])):
                where = f"images[{i}]"
                names[os.path.basename(image["file_name"])] = ident(image["id"], "id")
            for i, ann in enumerate(doc["annotations"]):
                where = f"annotations[{i}]"
                by_id[ident(ann["image_id"], "image_id")].append(
                    (whole(ann.get("id", 0), "id"), text(ann["caption"], "caption")))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise SourceError(f"COCO captions: {path} is not a COCO captions file (images, "
                              f"annotations with image_id and caption): {where}: "
                              f"{type(e).__name__}: {e}") from None
    return names, {k: [c for _, c in sorted(v) if c] for k, v in by_id.items()}


def _segments(entry: dict) -> list[dict]:
    segments = entry["segments_info"]
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        raise TypeError("segments_info is not a list of objects")
    return segments


def _objects(entry: dict, classes: list[str]) -> list:
    anns = entry.get("annotations") or []
    objects, segments = [], _segments(entry)
    for k, seg in enumerate(segments):
        if len(anns) == len(segments):
            box = numbers(anns[k]["bbox"], 4, f"annotations[{k}].bbox")
        elif seg.get("bbox"):
            x, y, w, h = numbers(seg["bbox"], 4, f"segments_info[{k}].bbox")
            box = numbers((x, y, x + w, y + h), 4, f"segments_info[{k}].bbox")
        else:
            box = None
        c = whole(seg["category_id"], f"segments_info[{k}].category_id")
        if not 0 <= c < len(classes):
            raise IndexError(f"segments_info[{k}].category_id {c} is past the "
                             f"{len(classes)} classes")
        objects.append((class_words(classes[c]), box))
    return objects


def _predicate(predicates: list[str], p) -> str | None:
    """Predicate class p as words; None past the list (the import counts the relation as
    index_out_of_range)."""
    p = whole(p, "relation predicate")
    return clean(predicates[p]) if 0 <= p < len(predicates) else None


def _relations(entry: dict, predicates: list[str]) -> tuple:
    """(subject, predicate, object) of each [subject, object, predicate] of the entry."""
    return tuple((whole(s, "relation subject"), _predicate(predicates, p),
                  whole(o, "relation object")) for s, o, p in entry["relations"])


def _coco_paths(coco: str, entry: dict) -> tuple[str, str, str]:
    """(image, panoptic PNG, skip reason) of an entry: the paths under `coco`, and
    "outside_root" when either resolves outside it."""
    names = [entry["file_name"], entry["pan_seg_file_name"]]
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"file_name and pan_seg_file_name must be strings, got {names!r}")
    inside = [inside_root(coco, n) for n in names]
    paths = [os.path.join(coco, n.replace("\0", "\\0")) for n in names]
    return paths[0], paths[1], "" if None not in inside else OUTSIDE_ROOT


def read(root: str, captions: tuple[str, ...] = ()) -> SceneGraphs:
    """Every image of psg.json as a `Graph`, in the file's order."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise SourceError(f"{TITLE}: root folder {root} not found; expected {LAYOUT}")
    path, coco = openpsg_files(root, LAYOUT)
    caption_files = list(captions) or sorted(
        glob.glob(os.path.join(coco, "annotations", "captions_*.json")))
    if not caption_files:
        raise SourceError(f"{TITLE}: no COCO captions_*.json in "
                          f"{os.path.join(coco, 'annotations')}; expected {LAYOUT}")
    doc = load_json(TITLE, path)
    names, by_id = read_captions(caption_files)
    try:
        classes = list(doc["thing_classes"]) + list(doc["stuff_classes"])
        predicates = list(doc["predicate_classes"])
        odd = [n for n in classes + predicates if not isinstance(n, str)]
        if odd:
            raise TypeError(f"class or predicate name {reprlib.repr(odd[0])} is not a string")
        test_ids = {ident(i, "test_image_ids entry") for i in doc.get("test_image_ids", [])}
        data = list(doc["data"])
    except (KeyError, TypeError, ValueError) as e:
        what = f"lacks {e}" if isinstance(e, KeyError) else f"is malformed ({e})"
        raise SourceError(f"{TITLE}: {path} {what} (data, thing_classes, stuff_classes, "
                          f"predicate_classes); expected {LAYOUT}") from None
    graphs = []
    for i, entry in enumerate(data):
        try:
            image_id = ident(entry["image_id"], "image_id")
            coco_id = names.get(os.path.basename(entry["file_name"]), image_id)
            image, panoptic, skip = _coco_paths(coco, entry)
            graphs.append(Graph(
                id=f"openpsg/{id_key(image_id)}",
                split="test" if image_id in test_ids else "train",
                image=image,
                objects=tuple(_objects(entry, classes)),
                relations=_relations(entry, predicates),
                captions=tuple(by_id.get(coco_id, ())),
                panoptic=panoptic, skip=skip,
                segments=tuple(whole(seg["id"], "segment id") for seg in _segments(entry))))
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
            raise SourceError(f"{TITLE}: {path} data[{i}] is malformed ({type(e).__name__}: "
                              f"{e}); expected {LAYOUT}") from None
    return SceneGraphs(
        source="openpsg", mask_kind="panoptic", graphs=graphs,
        split_rule={"method": "dataset", "rule": "PSG's test_image_ids are test, the rest "
                                                  "train"},
        files={"annotations": path, "captions": caption_files})
