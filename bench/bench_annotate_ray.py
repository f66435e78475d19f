"""`annotate --engine ray` on this machine: per-stage busy time and images/s with 1 and 2
GroundingDINO actors (target: 2 actors >= 1.6x the images/s of 1), and the same images through
`--engine local` for comparison.

    python bench/bench_annotate_ray.py --images 64

Inputs: real photographs (the six skimage scenes of `data_prep.testing`, shrunk to at most
`--image-px` 256 px a side: the detector resizes every image to 800 px anyway, while SAM's
focused regions and JPEG encoding cost per input pixel), scripted VLM replies, blocks of 2
images. Models, random-initialised: GroundingDINO
with a Swin-L backbone (embed 192, depths 2-2-18-2) at the real
processor sizes (800 / 1333 px), a small text encoder and 30 queries, so that detection is the
heavy stage (SAM is the test suite's tiny one). Each
Ray stage actor gets 0.4 logical CPUs and one torch thread (`--stage-cpus 0.4`); the local
engine runs torch on all cores.

Figures, from the block markers each run writes (`WORK/blocks/*.json`): busy s = the summed
time inside a stage over all blocks (over all actors of the stage); images/s (whole run) =
images / wall time of `annotate()` (Ray: actor start and model loading included); images/s
(pipeline) = images / the time from the first block entering stage 1 to the last block landing
(the markers' `started` and `landed`: start-up and model loading excluded, pipeline fill and
drain included); images/s (steady) = the images of the blocks that landed after the first one /
the time from the first block landing to the last (fill excluded too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def make_detector(path: str) -> str:
    """The tiny model's processor and vocabulary; a Swin-L backbone at 800 / 1333 px."""
    import torch
    from transformers import (BertConfig, GroundingDinoConfig, GroundingDinoForObjectDetection,
                              GroundingDinoImageProcessor, SwinConfig)

    from data_prep import detect
    if os.path.exists(os.path.join(path, "swin_l")):
        return path
    detect.save_tiny_model(path)
    GroundingDinoImageProcessor().save_pretrained(path)  # 800 / 1333, the default
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["text_config"]["vocab_size"]
    config = GroundingDinoConfig(
        backbone_config=SwinConfig(embed_dim=192, depths=[2, 2, 18, 2],
                                   num_heads=[6, 12, 24, 48], out_indices=[2, 3, 4]),
        text_config=BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64,
                               max_position_embeddings=64),
        d_model=64, num_queries=30, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=128,
        decoder_ffn_dim=128, encoder_attention_heads=2, decoder_attention_heads=2,
        max_text_len=64)
    torch.manual_seed(0)
    GroundingDinoForObjectDetection(config).eval().save_pretrained(path)
    open(os.path.join(path, "swin_l"), "w").close()
    return path


def block_figures(work: str) -> dict:
    folder = os.path.join(work, "blocks")
    markers = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                markers.append(json.load(f))
    busy = {s: sum(m["stage_seconds"].get(s, 0.0) for m in markers)
            for s in ("vlm", "detect", "segment")}
    span = max(m["landed"] for m in markers) - min(m["started"] for m in markers)
    images = sum(len(m["ids"]) for m in markers)
    landed = sorted((m["landed"], len(m["ids"])) for m in markers)
    steady = sum(n for _, n in landed[1:]) / (landed[-1][0] - landed[0][0])
    return {"busy": busy, "pipeline": images / span, "span": span, "steady": steady,
            "blocks": len(markers)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--image-px", type=int, default=256)
    parser.add_argument("--stage-cpus", type=float, default=0.4)
    parser.add_argument("--tmp", default="", help="folder to keep the models and images in")
    parser.add_argument("--runs", default="local,ray1,ray2",
                        help="which runs, in order (local, ray1, ray2)")
    args = parser.parse_args()
    import ray
    import torch

    from bench_annotate import make_inputs
    from data_prep import segment
    from data_prep.annotate import AnnotateConfig, annotate
    from data_prep.annotate.ray_start import start_ray
    tmp = args.tmp or tempfile.mkdtemp(prefix="bench_annotate_ray_")
    root, replies = make_inputs(tmp, args.images, args.image_px)
    det = make_detector(os.path.join(tmp, "gdino_swin_l"))
    sam = os.path.join(tmp, "sam_tiny.pth")
    if not os.path.exists(sam):
        segment.save_tiny_sam(sam)
    base = AnnotateConfig(source="folder", root=root, out="", vlm_replies=replies, detector=det,
                          sam=sam, sam_type="tiny", device="cpu", batch_size=args.batch_size,
                          progress=False, stage_cpus=args.stage_cpus)
    print(f"{args.images} images (<= {args.image_px} px), blocks of {args.batch_size}, "
          f"{os.cpu_count()} cores, torch "
          f"{torch.__version__}, ray {ray.__version__}; GroundingDINO Swin-L 800/1333 px, 30 "
          f"queries; SAM tiny")
    rows = []
    for name in args.runs.split(","):
        run = os.path.join(tmp, f"{name}_{time.time_ns()}")
        engine = "local" if name == "local" else "ray"
        detectors = 2 if name == "ray2" else 1
        cfg = dataclasses.replace(base, out=os.path.join(run, "out"),
                                  work=os.path.join(run, "work"), engine=engine,
                                  stage_concurrency=(("detect", detectors),))
        if engine == "ray" and not ray.is_initialized():
            start_ray(num_cpus=os.cpu_count())
        t0 = time.perf_counter()
        summary = annotate(cfg)
        wall = time.perf_counter() - t0
        fig = block_figures(cfg.work_dir)
        n = summary["stage_images_this_run"]
        rows.append((name, detectors, summary, wall, fig, n))
        print(f"{name}: {wall:.1f} s, {summary['kept']} kept; busy s "
              + ", ".join(f"{k} {v:.1f}" for k, v in fig["busy"].items())
              + f"; {args.images / wall:.3f} images/s whole run, {fig['pipeline']:.3f} "
              f"pipeline ({fig['span']:.1f} s), {fig['steady']:.3f} steady",
              flush=True)
    print()
    print("| engine | GroundingDINO actors | VLM busy s | GroundingDINO busy s (images) | SAM "
          "busy s (images) | wall s | images/s whole run | pipeline s | images/s pipeline | "
          "images/s steady |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, detectors, summary, wall, fig, n in rows:
        b = fig["busy"]
        print(f"| {'local' if name == 'local' else 'ray'} | {detectors if name != 'local' else '-'}"
              f" | {b['vlm']:.2f} | {b['detect']:.1f} ({n.get('detect', 0)}) | "
              f"{b['segment']:.1f} ({n.get('segment', 0)}) | {wall:.1f} | "
              f"{args.images / wall:.3f} | {fig['span']:.1f} | {fig['pipeline']:.3f} | "
              f"{fig['steady']:.3f} |")
    named = {r[0]: r for r in rows}
    if "ray1" in named and "ray2" in named:
        one, two = named["ray1"], named["ray2"]
        print(f"\n2 vs 1 GroundingDINO actors: {two[4]['pipeline'] / one[4]['pipeline']:.2f}x "
              f"images/s (pipeline), {two[4]['steady'] / one[4]['steady']:.2f}x (steady), "
              f"{one[3] / two[3]:.2f}x (whole run)")


if __name__ == "__main__":
    main()
