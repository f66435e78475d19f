"""Scripted stage-1 material for tests and benchmarks: scikit-image's sample photographs with
hand-written action / objects / relations, and a reply in the shape the appendix's prompt asks
for (its own example's missing commas and a code fence included); the writers of scene-graph
fixtures in their released formats (`write_json`, COCO panoptic's `rgb_encode`)."""

from __future__ import annotations

import json
import os

import numpy as np

from sclaro_jax.files import write_replacing

SCENES = {  # skimage.data name -> (action, objects, relations)
    "astronaut": ("posing", ["woman", "flag", "helmet"],
                  [("woman", "holding", "helmet"), ("flag", "behind", "woman")]),
    "coffee": ("drinking", ["cup", "saucer", "spoon"],
               [("cup", "on", "saucer"), ("spoon", "on", "saucer")]),
    "chelsea": ("resting", ["cat", "wall"], [("cat", "in front of", "wall")]),
    "rocket": ("launching", ["rocket", "tower", "smoke"],
               [("rocket", "next to", "tower"), ("smoke", "below", "rocket")]),
    "stereo_motorcycle": ("parking", ["motorcycle", "wall", "box"],
                          [("motorcycle", "next to", "box")]),
    "immunohistochemistry": ("staining", ["cell", "tissue"], [("cell", "in", "tissue")]),
}

_REPLY = """```json
{
"action": "%s"
"objects": [%s],
"relations": [
%s
]
"dense caption": "The image shows %s."
}
```"""


def scripted_reply(action: str, objects, relations, caption: str) -> str:
    """A VLM reply as the prompt's example lays it out (no commas after "action" and after the
    relations list), inside a ```json fence."""
    objs = ", ".join(f'"{o}"' for o in objects)
    rels = ",\n".join("[" + ", ".join(f'"{t}"' for t in r) + "]" for r in relations)
    return _REPLY % (action, objs, rels, caption)


def photograph(name: str) -> np.ndarray:
    """uint8 [H, W, 3] of a scikit-image sample (the left view of stereo pairs, grey as RGB)."""
    from skimage import data as skdata
    pixels = getattr(skdata, name)()
    pixels = pixels[0] if isinstance(pixels, tuple) else pixels
    return np.repeat(pixels[..., None], 3, -1) if pixels.ndim == 2 else pixels[..., :3]


# A long-tailed count law for tests and benchmarks of the packed crop layout
# (sclaro_jax.data.packing): objects 1-10 and relations 0-16 per image, most images with few
# (P(n) falls by 0.8 per extra object and 0.85 per extra relation: about half the images have
# at most 3 of each).
LONG_TAIL_OBJECTS = np.r_[0.0, 0.8 ** np.arange(10)] / np.sum(0.8 ** np.arange(10))
LONG_TAIL_RELATIONS = 0.85 ** np.arange(17) / np.sum(0.85 ** np.arange(17))
_NAMES = ("person", "dog", "cat", "car", "tree", "ball", "chair", "table", "cup", "bag")
_PREDICATES = ("on", "near", "holding", "behind", "under")


def long_tail_counts(n: int, seed: int = 0) -> np.ndarray:
    """[n, 2] (objects, relations) per image drawn from the long-tailed law."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(len(LONG_TAIL_OBJECTS), n, p=LONG_TAIL_OBJECTS),
                     rng.choice(len(LONG_TAIL_RELATIONS), n, p=LONG_TAIL_RELATIONS)], 1)


def write_long_tail_dataset(out_dir: str, records: int = 200, *, seed: int = 0,
                            view_size: int = 32, width: int = 48, height: int = 40) -> dict:
    """A train split of `records` synthetic samples (noise photographs, random boxes and
    triplets) whose object / relation counts follow the long-tailed law; returns the manifest.
    The relation regions are noise images standing in for focused regions."""
    import io

    from PIL import Image

    from data_prep import shards
    from sclaro_jax.data import schema

    rng = np.random.default_rng(seed)

    def image() -> bytes:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
            buf, "JPEG", quality=90)
        return buf.getvalue()

    with shards.ShardWriter(out_dir, view_size=view_size, records_per_shard=100) as writer:
        for i, (n_obj, n_rel) in enumerate(long_tail_counts(records, seed)):
            objects = []
            for _ in range(n_obj):
                x0, y0 = rng.integers(0, width - 8), rng.integers(0, height - 8)
                x1, y1 = rng.integers(x0 + 4, width + 1), rng.integers(y0 + 4, height + 1)
                objects.append(schema.Object(str(rng.choice(_NAMES)),
                                             (float(x0), float(y0), float(x1), float(y1))))
            relations = []
            for _ in range(n_rel):
                s, o = (int(k) for k in rng.integers(0, n_obj, 2))
                p = str(rng.choice(_PREDICATES))
                relations.append(schema.Relation(
                    s, p, o, schema.triplet_text(objects[s].name, p, objects[o].name), image()))
            writer.add(schema.Sample(
                id=f"long-tail-{i:05d}", source="synthetic", split="train", image=image(),
                width=width, height=height, action=str(rng.choice(("playing", "sitting"))),
                caption="", objects=tuple(objects), relations=tuple(relations),
                mask_kind="box"))
    return writer.manifest


def write_json(path, doc) -> None:
    """`doc` as a json file at `path`, its folder made."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_replacing(path, lambda f: json.dump(doc, f), text=True)


def rgb_encode(ids):
    """COCO panoptic's encoding of segment ids: id = R + 256 G + 256^2 B (the PNG's pixels)."""
    return np.stack([ids % 256, ids // 256 % 256, ids // 65536], -1).astype(np.uint8)
