"""Annotation pipeline throughput on CPU: images per second per stage and the share of each
stage's time spent outside the models (target: under 10%).

    python bench/bench_annotate.py --models small --images 6
    python bench/bench_annotate.py --models tiny --images 6

`small`: the smallest real variants, random-initialised: GroundingDINO with transformers'
default config (the grounding-dino-tiny architecture: Swin-T, BERT-base text encoder, 900
queries, 6+6 layers, images resized to 800/1333) and SAM ViT-B (segment-anything's `vit_b`,
1024 px). `tiny`: the test suite's toy models (detections and masks mean nothing; shows the
fixed costs). Stage 1 replays scripted VLM replies (`--vlm-replies`), so its time is parsing
and bookkeeping only. The run goes through `data_prep.annotate.Annotator`, i.e. with the real
caches, record encoding, validation and shard writing; "model" is the time inside the model
calls (`timings["model"]` of the detector and the segmenter), "outside" everything else the
stage does (image decoding, the processors' resizing and normalisation, post-processing, NMS,
focused regions, JPEG encoding, record validation, cache writes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def make_inputs(tmp: str, n: int, px: int = 0) -> tuple[str, str]:
    """`n` photographs cycling through the scenes of `data_prep.testing` (shrunk to at most `px`
    a side when given) and their scripted replies: (image folder, replies file)."""
    from PIL import Image

    from data_prep.testing import SCENES, photograph, scripted_reply
    tag = f"_{n}_{px}" if px else ""
    root = os.path.join(tmp, "images" + tag)
    os.makedirs(root, exist_ok=True)
    replies = {}
    names = list(SCENES)
    for i in range(n):
        name = names[i % len(names)]
        fname = f"{i:03d}_{name}.jpg"
        img = Image.fromarray(photograph(name))
        if px:
            img.thumbnail((px, px))
        img.save(os.path.join(root, fname), quality=90)
        replies[f"folder/{fname}"] = scripted_reply(*SCENES[name], f"a photograph of {name}")
    path = os.path.join(tmp, f"replies{tag}.json")
    with open(path, "w") as f:
        json.dump(replies, f)
    return root, path


def make_models(kind: str, tmp: str) -> tuple[str, str, str]:
    import torch
    from transformers import GroundingDinoConfig, GroundingDinoForObjectDetection

    from data_prep import detect, segment
    det = os.path.join(tmp, f"gdino_{kind}")
    sam = os.path.join(tmp, f"sam_{kind}.pth")
    if not os.path.exists(os.path.join(det, "config.json")):
        detect.save_tiny_model(det)  # processor (local vocabulary) and, for tiny, the model
        if kind == "small":
            from transformers import GroundingDinoImageProcessor
            GroundingDinoImageProcessor().save_pretrained(det)  # 800 / 1333, the default
            torch.manual_seed(0)
            GroundingDinoForObjectDetection(GroundingDinoConfig()).eval().save_pretrained(det)
    if not os.path.exists(sam):
        if kind == "small":
            from segment_anything import sam_model_registry
            torch.manual_seed(0)
            torch.save(sam_model_registry["vit_b"](checkpoint=None).state_dict(), sam)
        else:
            segment.save_tiny_sam(sam)
    return det, sam, "vit_b" if kind == "small" else "tiny"


def top_per_object(detector, per_object: int, counts: list | None = None):
    """`detector` keeping the top `per_object` detections of each label: a random detector
    finds nearly all of its queries (~870 boxes an image for the 900-query model) where a
    trained one returns a handful per object, so stage 3 sees a realistic load this way.
    `counts` gets (found, kept) per image."""
    def detect_top(images, objects):
        out = []
        for dets in detector(images, objects):
            kept, seen = [], {}
            for d in dets:  # sorted by score
                if seen.get(d.label, 0) < per_object:
                    seen[d.label] = seen.get(d.label, 0) + 1
                    kept.append(d)
            if counts is not None:
                counts.append((len(dets), len(kept)))
            out.append(kept)
        return out
    return detect_top


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", choices=("small", "tiny"), default="small")
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--per-object", type=int, default=3,
                        help="detections kept per stage-1 object (see detect_top)")
    parser.add_argument("--tmp", default="", help="folder to keep the models and images in")
    args = parser.parse_args()
    import torch

    from data_prep import annotate, detect, segment, vlm
    torch.set_num_threads(os.cpu_count())
    tmp = args.tmp or tempfile.mkdtemp(prefix="bench_annotate_")
    root, replies = make_inputs(tmp, args.images)
    det_path, sam_path, sam_type = make_models(args.models, tmp)
    run = os.path.join(tmp, f"run_{time.time_ns()}")
    cfg = annotate.AnnotateConfig(
        source="folder", root=root, out=os.path.join(run, "out"), work=os.path.join(run, "work"),
        vlm_replies=replies, detector=det_path, sam=sam_path, sam_type=sam_type, device="cpu",
        batch_size=args.batch_size, progress=False)
    detector = detect.GroundingDetector(det_path, device="cpu", batch_size=args.batch_size)
    counts = []
    detect_top = top_per_object(detector, args.per_object, counts)
    segmenter = segment.SamSegmenter(segment.load_sam(sam_path, sam_type), device="cpu")
    models = annotate.Models(vlm=vlm.RepliesFile(replies), detector=detect_top,
                             segmenter=segmenter)
    # warm-up on one image so first-call costs (lazy init, allocator) are not in the figures
    from PIL import Image
    first = sorted(os.listdir(root))[0]
    img = Image.open(os.path.join(root, first)).convert("RGB")
    import numpy as np
    found = detect_top([img], [["woman", "flag"]])[0]
    segmenter(np.asarray(img), np.asarray([d.box for d in found[:2]] or [[0, 0, 10, 10]]))
    counts.clear()
    for t in (detector.timings, segmenter.timings):
        for k in t:
            t[k] = 0.0
    t0 = time.perf_counter()
    summary = annotate.annotate(cfg, models=models)
    total = time.perf_counter() - t0
    stage_s = summary["stage_seconds_this_run"]
    n = summary["stage_images_this_run"]
    model_s = {"vlm": 0.0, "detect": detector.timings["model"],
               "segment": segmenter.timings["model"]}
    print(f"{args.models} models, {args.images} images ({summary['kept']} kept), batch "
          f"{args.batch_size}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"whole run {total:.1f} s")
    print("| stage | images | stage s | images/s | model s | outside the model s | outside share |")
    print("|---|---|---|---|---|---|---|")
    for stage in ("vlm", "detect", "segment"):
        s, m = stage_s.get(stage, 0.0), model_s[stage]
        label = {"vlm": "1: VLM (scripted replies: parsing only)", "detect": "2: GroundingDINO",
                 "segment": "3: SAM + focused regions + records"}[stage]
        share = f"{(s - m) / s:.1%}" if stage != "vlm" and s else "n/a"
        print(f"| {label} | {n.get(stage, 0)} | {s:.3f} | {n.get(stage, 0) / max(s, 1e-9):.2f} "
              f"| {m:.3f} | {s - m:.3f} | {share} |")
    print(f"detections per image: {np.mean([c[0] for c in counts]):.0f} from the detector, "
          f"{np.mean([c[1] for c in counts]):.1f} kept (top {args.per_object} per object)")
    print("detector timings:", {k: round(v, 3) for k, v in detector.timings.items()})
    print("segmenter timings:", {k: round(v, 3) for k, v in segmenter.timings.items()})


if __name__ == "__main__":
    main()
