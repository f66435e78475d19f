"""A synthetic retrieval benchmark with small planted objects, and the encoder that reads it.

MINER's premise is that a global image embedding under-represents small objects. This module makes
that premise concrete and checkable, with nothing learned:

- `make_planted_split(out)` draws cluttered scenes: four of six muted "clutter" colours in large
  rectangles. Half the images carry one small two-coloured flag (each half about 0.6% of the
  image, in two of eight saturated colours; every colour pair is used once) and a caption naming
  its colours: one query each, with a unique ground truth. The other half carry one larger
  single-colour "decoy" patch (about 2%, one saturated colour) and no caption. Written as a COCO
  captions JSON + PNG images.
- `PlantedColourEncoder` is a transparent dual encoder: an image's embedding is, per palette
  colour, its detected presence `clip(area_fraction / 1.5%, 0, 1)` (a saturating detector, like
  a pooled feature that needs enough evidence), plus a constant channel; a caption's embedding
  is the sum of the colours it names plus the same constant. Both L2-normalised.

Globally a flag half covers ~0.6% -> presence ~0.4, while a decoy of one of the query's colours
is fully present: global retrieval prefers decoy images. In a 60% crop that contains the flag
each half covers ~1.7% -> presence 1: the crop view matches the caption better than any decoy
does, which is what MINER's max over crops recovers. `python -m sclaro_jax.eval.rocs --model
planted-colours --split DIR/captions.json` runs the whole evaluation on it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from sclaro_jax import cli
from sclaro_jax.eval.encoders import Encoder, l2_with_norm, register_encoder
from sclaro_jax.files import write_replacing
from sclaro_jax.miner import crop_boxes

CLUTTER = {"grey": (128, 128, 128), "olive": (128, 128, 0), "navy": (0, 0, 128),
           "teal": (0, 128, 128), "maroon": (128, 0, 0), "purple": (128, 0, 128)}
SALIENT = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255),
           "yellow": (255, 255, 0), "magenta": (255, 0, 255), "cyan": (0, 255, 255),
           "white": (255, 255, 255), "black": (0, 0, 0)}
PALETTE = {**CLUTTER, **SALIENT}
NAMES = list(PALETTE)
THRESHOLD = 0.015  # area fraction at which a colour counts as fully present
CONSTANT = 0.1  # the shared channel that keeps every embedding non-zero


@register_encoder("planted-colours")
class PlantedColourEncoder(Encoder):
    """The synthetic benchmark's encoder (see the module docstring)."""

    name = "planted-colours"
    fingerprint = "planted-colours-v1"
    image_size = 96
    batch_size = 64

    def __init__(self):
        palette = jnp.asarray(np.array(list(PALETTE.values()), np.float32))

        @jax.jit
        def image_fn(views):
            x = views.astype(jnp.float32).reshape(views.shape[0], -1, 1, 3)
            nearest = jnp.argmin(jnp.sum((x - palette) ** 2, -1), -1)  # [B, P]
            frac = jax.nn.one_hot(nearest, len(NAMES)).mean(1)
            present = jnp.clip(frac / THRESHOLD, 0.0, 1.0)
            return l2_with_norm(jnp.concatenate([present, jnp.full((len(frac), 1), CONSTANT)],
                                                -1))

        self._image_fn = image_fn
        self._text_fn = jax.jit(l2_with_norm)

    def view(self, image: np.ndarray) -> np.ndarray:
        img = Image.fromarray(image).resize((self.image_size, self.image_size), Image.NEAREST)
        return np.asarray(img)

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), len(NAMES) + 1), np.float32)
        out[:, -1] = CONSTANT
        for row, text in zip(out, texts):
            for word in re.findall(r"[a-z]+", text.lower()):
                if word in PALETTE:
                    row[NAMES.index(word)] = 1.0
        return out


def _scene(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """Four clutter colours: a background and three large overlapping rectangles."""
    clutter = np.array(list(CLUTTER.values()), np.uint8)
    colours = rng.permutation(len(clutter))[:4]
    img = np.empty((height, width, 3), np.uint8)
    img[:] = clutter[colours[0]]
    for c in colours[1:]:
        w, h = rng.integers(width // 3, width // 2), rng.integers(height // 3, height // 2)
        x, y = rng.integers(0, width - w), rng.integers(0, height - h)
        img[y:y + h, x:x + w] = clutter[c]
    return img


def _place(rng, width, height, pw, ph, inside=None):
    x0, y0, x1, y1 = inside if inside is not None else (0, 0, width, height)
    return int(rng.integers(x0, x1 - pw + 1)), int(rng.integers(y0, y1 - ph + 1))


def make_planted_split(out: str | os.PathLike, *, num_images: int = 56, width: int = 320,
                       height: int = 240, seed: int = 0) -> Path:
    """Write `out/captions.json` (COCO captions) and `out/images/*.png`; return the JSON path.

    Half the images (at most 28, one per colour pair) carry a flag and one query each; the
    others are clutter with a decoy.
    """
    rng = np.random.default_rng(seed)
    salient = list(SALIENT)
    pairs = list(itertools.combinations(salient, 2))
    rng.shuffle(pairs)
    num_flags = min(num_images - num_images // 2, len(pairs))
    kinds = [("flag", tuple(p)) for p in pairs[:num_flags]]
    kinds += [("decoy", salient[i % len(salient)]) for i in range(num_images - num_flags)]
    order = rng.permutation(num_images)
    folder = Path(out)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    side = min(width, height)
    fw, fh = int(round(0.15 * side)), int(round(0.11 * side))  # the flag: ~1.2% of the image
    dw = dh = int(round(np.sqrt(0.02 * width * height)))  # the decoy: ~2% of the image
    boxes = crop_boxes(width, height, "fixed5")
    images, annotations = [], []
    for i in range(num_images):
        kind, what = kinds[order[i]]
        img = _scene(rng, width, height)
        if kind == "decoy":
            x, y = _place(rng, width, height, dw, dh)
            img[y:y + dh, x:x + dw] = SALIENT[what]
        else:
            x, y = _place(rng, width, height, fw, fh, inside=boxes[rng.integers(len(boxes))])
            img[y:y + fh, x:x + fw // 2] = SALIENT[what[0]]
            img[y:y + fh, x + fw // 2:x + fw] = SALIENT[what[1]]
            annotations.append({"id": len(annotations), "image_id": i,
                                "caption": f"a cluttered scene with a small {what[0]} and "
                                           f"{what[1]} flag"})
        name = f"images/planted_{i:04d}.png"
        write_replacing(folder / name, lambda f, img=img: Image.fromarray(img).save(f, "PNG"))
        images.append({"id": i, "file_name": name, "width": width, "height": height,
                       kind: list(what) if kind == "flag" else what})
    path = folder / "captions.json"
    doc = {"info": {"description": "sclaro-jax planted-colours benchmark", "seed": seed},
           "images": images, "annotations": annotations}
    write_replacing(path, lambda f: json.dump(doc, f, indent=1), text=True)
    return path


def _parser() -> cli.ArgumentParser:
    parser = cli.parser(
        "python -m sclaro_jax.eval.retrieval.synthetic",
        "Write the planted-colours retrieval benchmark (COCO captions JSON + PNGs).")
    parser.add_argument("--out", required=True, type=cli.writable, help="output folder")
    parser.add_argument("--num-images", type=int, default=56, help="images to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num_images < 2:
        parser.error(f"argument --num-images: {args.num_images} is fewer than 2 (one flag "
                     "image and one decoy)")
    try:
        path = make_planted_split(args.out, num_images=args.num_images, seed=args.seed)
    except cli.USER_ERRORS as e:
        return cli.fail(e)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from sclaro_jax.heap import freeze_for_process
    freeze_for_process()  # a command's process: its imports are not scanned again
    raise SystemExit(main())
