"""The bundled demo dataset: real photographs from PyPI wheels, hand-written annotations.

`data_prep/demo/annotations.json` lists photographs that scikit-image, scikit-learn and
matplotlib ship inside their wheels, each with a hand-written action word, caption, objects with
boxes and relation triplets. `build_demo(out_dir)` turns them into SCLARO shards with the same
writer as the full pipeline: schema version 2 with 224 px training views by default, and, unlike
`annotate`, the originals kept (the evaluation suite's localisation runs on the demo). Relation
regions use focused_region (appendix Eqs. 4-7) with *box masks standing in for SAM masks*
(recorded as `mask_kind="box"` in every record and in the manifest), since SAM weights cannot
be downloaded here.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os

import numpy as np
from PIL import Image

from data_prep import focus
from data_prep.shards import write_dataset
from sclaro_jax.data import schema
from sclaro_jax.data.images import box_mask, encode_jpeg

ANNOTATIONS = os.path.join(os.path.dirname(__file__), "demo", "annotations.json")


class DemoError(RuntimeError):
    pass


def load_annotations(path: str = ANNOTATIONS) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("format") != "sclaro-demo-annotations" or doc.get("version") != 1:
        raise DemoError(f"{path}: not a version-1 sclaro demo annotation file")
    return doc["images"]


def image_path(entry: dict) -> str:
    """Where the annotated photograph lies inside its installed package, found from the
    package's import spec without importing it (scikit-learn's import alone takes a second or
    more, and a demo build needs only its files)."""
    try:
        spec = importlib.util.find_spec(entry["package"])
    except (ImportError, ValueError):  # a parent package missing, or a malformed name
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise DemoError(
            f"demo image {entry['id']!r} ships with the {entry['source']!r} package, which is "
            f"not installed: pip install -c constraints.txt -e \".[demo]\"")
    path = os.path.join(folders[0], entry["path"])
    if not os.path.exists(path):
        raise DemoError(f"demo image {entry['id']!r}: {path} not found in the installed "
                        f"{entry['source']} package")
    return path


def make_sample(entry: dict) -> schema.Sample:
    path = image_path(entry)
    with open(path, "rb") as f:
        data = f.read()
    img = Image.open(io.BytesIO(data))
    width, height = img.size
    rgb = np.asarray(img.convert("RGB"))
    objects = tuple(schema.Object(o["name"], tuple(float(v) for v in o["box"]))
                    for o in entry["objects"])
    relations = []
    regions = focus.Regions(rgb)  # the image's blurred background once, for all its relations
    for r in entry["relations"]:
        s, o = r["subject"], r["object"]
        if not (0 <= s < len(objects) and 0 <= o < len(objects)):
            raise schema.RecordError(f"sample {entry['id']!r}: relation {r} index out of range")
        region = regions(box_mask(objects[s].box, width, height),
                         box_mask(objects[o].box, width, height))
        relations.append(schema.Relation(
            s, r["predicate"], o, schema.triplet_text(objects[s].name, r["predicate"],
                                                      objects[o].name), encode_jpeg(region)))
    return schema.Sample(
        id=entry["id"], source=entry["source"], split="train", image=data, width=width,
        height=height, action=entry["action"], caption=entry["caption"], objects=objects,
        relations=tuple(relations), mask_kind="box")


def build_demo(out_dir: str, *, overwrite: bool = False, split_seed: int = 42,
               records_per_shard: int = 4, progress: bool = True,
               annotations: str = ANNOTATIONS,
               image_size: int | None = schema.DEFAULT_VIEW_SIZE,
               keep_originals: bool = True) -> dict:
    """Write the demo shards to `out_dir`; returns the manifest.

    Schema version 2 with `image_size` px training views (None: the legacy version 1), and
    the originals kept by default: the evaluation suite's localisation needs the full-size
    photographs and regions."""
    entries = load_annotations(annotations)
    return write_dataset((make_sample(e) for e in entries), out_dir,
                         ids=[e["id"] for e in entries], split_seed=split_seed,
                         records_per_shard=records_per_shard, overwrite=overwrite,
                         progress=progress, view_size=image_size, keep_originals=keep_originals)
