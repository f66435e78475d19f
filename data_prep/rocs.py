"""Build a ROCS-style split from a detection-annotated image set (MINER section 3), end to end:
instances -> high-clutter subset -> rare objects -> mask-area rule (segment-anything masks) ->
class-aware captions -> a `save_to_disk` folder that `python -m sclaro_jax.eval.rocs` reads.

`build_rocs(images, image_dir, segment, ask, out)` runs the steps of `rocs_select` and
`rocs_caption` in order, with the models passed in: `segment(image uint8 [H, W, 3], boxes
[N, 4]) -> bool masks [N, H, W]` (`data_prep.segment.SamSegmenter`; the paper used SAM 3, this
uses segment-anything) and `ask(image, prompt) -> reply or None` (a VLM, or
`rocs_caption.CaptionReplies`, which is asked with (image id, instance id) instead of the
image). It writes OUT/rocs (the dataset), OUT/summary.json (images and objects kept and dropped
at each step, each drop with its reason) and OUT/stats.json (Figure 3's numbers per stage).

Still to come: the `python -m data_prep rocs` command with stage caches (a rerun skipping
finished work), and GroundingDINO boxes for image sets without instance annotations.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from data_prep import rocs_caption, rocs_select
from data_prep.rocs_select import AnnotatedImage


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def mask_step(segment: Callable, pixels: np.ndarray, image: AnnotatedImage,
              max_mask_area: float) -> tuple[list, list]:
    """(rare instances kept, [(instance, mask share)] dropped as visually dominant)."""
    rare = rocs_select.rare_instances(image)
    if not rare:
        return [], []
    masks = segment(pixels, np.array([i.box for i in rare], np.float32))
    kept, dropped = [], []
    for inst, mask in zip(rare, masks):
        share = rocs_select.mask_fraction(mask)
        if rocs_select.small_enough(share, max_mask_area):
            kept.append(inst)
        else:
            dropped.append((inst, share))
    return kept, dropped


def build_rocs(images: list[AnnotatedImage], image_dir: str | Path, segment: Callable,
               ask: Callable, out: str | Path, *, top_fraction: float = rocs_select.TOP_FRACTION,
               max_mask_area: float = rocs_select.MAX_MASK_AREA, ask_with_ids: bool = False,
               progress: bool = True) -> dict:
    """Run the construction (see the module docstring); returns the summary."""
    from tqdm.auto import tqdm

    out, image_dir = Path(out), Path(image_dir)
    out.mkdir(parents=True, exist_ok=True)
    clutter = rocs_select.high_clutter(images, top_fraction)
    dropped: dict[str, list] = {"no_rare_object": [], "mask_too_large": [],
                                rocs_caption.NO_REPLY: [], rocs_caption.MISSING_OBJECT: []}
    rows, kept_pairs, rare_pairs = [], [], []
    for image in tqdm(clutter, desc="rocs", unit="image", disable=not progress):
        path = image_dir / image.file_name
        if not path.exists():
            raise FileNotFoundError(f"image {image.id}: {path} not found (file_name "
                                    f"{image.file_name!r} under --images {image_dir})")
        rare_pairs += [(image, i) for i in rocs_select.rare_instances(image)]
        pixels = _pixels(path)
        if pixels.shape[:2] != (image.height, image.width):
            raise ValueError(f"image {image.id}: {path} is {pixels.shape[1]}x{pixels.shape[0]}, "
                             f"the instances file says {image.width}x{image.height}")
        kept, too_large = mask_step(segment, pixels, image, max_mask_area)
        dropped["mask_too_large"] += [{"image_id": image.id, "instance_id": i.id,
                                       "object": i.category, "mask_share": round(s, 6)}
                                      for i, s in too_large]
        if not kept:
            if not too_large:
                dropped["no_rare_object"].append({"image_id": image.id})
            continue
        for inst in kept:
            query = (image.id, inst.id) if ask_with_ids else Image.fromarray(pixels)
            got = rocs_caption.recaption(ask, query, inst.category)
            if got.caption is None:
                dropped[got.reason].append({"image_id": image.id, "instance_id": inst.id,
                                            "object": inst.category, "replies": got.replies})
                continue
            kept_pairs.append((image, inst))
            rows.append({"image": path, "image_id": image.id, "caption": got.caption,
                         "object": inst.category, "box": inst.box})
    kept_images = sorted({im.id for im, _ in kept_pairs})
    summary = {"images": len(images), "high_clutter": len(clutter),
               "kept_images": len(kept_images), "kept_captions": len(rows),
               "top_fraction": top_fraction, "max_mask_area": max_mask_area,
               "dropped": dropped}
    stats = {"all": rocs_select.figure_stats(images),
             "high_clutter": rocs_select.figure_stats(clutter, rare_pairs),
             "rocs": rocs_select.figure_stats([im for im in clutter if im.id in kept_images],
                                              kept_pairs)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    rocs_caption.write_rocs(out / "rocs", rows)
    return summary
