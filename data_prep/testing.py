"""Scripted stage-1 material for tests and benchmarks: scikit-image's sample photographs with
hand-written action / objects / relations, and a reply in the shape the appendix's prompt asks
for (its own example's missing commas and a code fence included)."""

from __future__ import annotations

import numpy as np

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
