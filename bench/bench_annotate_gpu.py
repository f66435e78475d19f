"""The annotation stages of `python -m data_prep annotate` at full size on one device, with random
weights (no weights reach the device): images/s per stage at the pipeline's batch size and
larger ones, the VLM's output tokens/s, peak device memory, each speed switch against the
default, and the whole pipeline's images/s as `annotate` runs it; one JSON.

    python bench/bench_annotate_gpu.py --json OUT.json              # full size, on cuda
    python bench/bench_annotate_gpu.py --tiny --json OUT.json       # tiny models on the CPU

Full size: GroundingDINO-base built from its transformers config (IDEA-Research/grounding-dino-
base: Swin-B 384 backbone, BERT-base text encoder, 900 queries, 6 + 6 layers, images resized to
800 / 1333 px), SAM ViT-H from segment-anything's registry (`sam_model_registry["vit_h"]`), and
Qwen2-VL-7B's architecture in bfloat16 as the stage-1 VLM (`data_prep.testing.random_qwen2_vl`,
created on the device). `--tiny`: the test suite's tiny models (`data_prep.demo_models`, a tiny
Qwen2-VL). Inputs: the demo's real photographs (`data_prep/demo`, cycled to `--images`) with
their hand-written replies and boxes.

Stages, each timed after a warm-up call:
  vlm      `TransformersVLM` at each `--batches` size, dynamic and static KV cache: images/s and
           output tokens/s for `--new-tokens` greedy tokens (a random model rarely ends early:
           every row makes them all; the pipeline allows 512)
  detect   `GroundingDetector` on blocks of each `--batches` size (it batches images of one
           processed size: the block's groups), default and each switch (--detector-text-once,
           --bf16) at the pipeline's size
  segment  `SamSegmenter` per image (as the pipeline runs it) with the demo's boxes, default and
           each switch (--sam-sdpa, --bf16; --sam-compile with --compile); and the image encoder
           alone at batches of 1, 2, 4 and 8 images (the pipeline encodes one at a time)
  pipeline `data_prep.annotate.annotate` (local engine: caches, records, shards) on `--images`
           photographs in blocks of the pipeline's size: the VLM generates its tokens, then its
           reply is the photograph's scripted one (a random VLM's text parses to nothing); the
           random detector keeps its top 3 boxes per object (bench_annotate.top_per_object).
           Also the bound with the stages overlapped (`--engine ray`, one actor each): the
           slowest stage's images/s; and device-hours per 100,000 images
Peak memory: torch.cuda.max_memory_allocated per row ("n/a on CPU"). A row that runs out of
device memory is kept with its "error" and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PIPELINE_BATCH = 8  # annotate's --batch-size default: one block, one VLM / detector batch
ENCODER_BATCHES = (1, 2, 4, 8)  # SAM's image encoder; the pipeline encodes one image a time


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1 separated by commas, "
                                         f"got {text!r}")
    return values


class Device:
    """Synchronise, reset and read the peak memory of the run's device."""

    def __init__(self, name: str):
        import torch
        self.torch, self.name = torch, name
        self.cuda = name.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gb(self):
        return round(self.torch.cuda.max_memory_allocated() / 2 ** 30, 2) if self.cuda \
            else "n/a on CPU"

    def timed(self, fields: dict, images: int, fn, *args) -> dict:
        """`fields` with the seconds, images/s and peak memory of fn(*args) after one warm-up
        call; with "error" instead when the device runs out of memory."""
        try:
            fn(*args)
            self.reset()
            self.sync()
            t0 = time.perf_counter()
            fn(*args)
            self.sync()
            seconds = time.perf_counter() - t0
        except self.torch.OutOfMemoryError as e:
            self.reset()
            print(f"{fields}: out of device memory", file=sys.stderr)
            return {**fields, "error": f"out of memory: {str(e).splitlines()[0]}"}
        row = {**fields, "seconds": seconds, "images_per_s": images / seconds,
               "peak_gb": self.peak_gb()}
        print(" ".join(f"{k}={v}" for k, v in fields.items()) + f": {images / seconds:.2f} "
              f"images/s")
        return row


def photographs(folder: str, n: int) -> tuple[list, list, dict]:
    """`n` demo photographs (cycled) with their object lists and scripted replies:
    (PIL images, object lists, {"folder/<name>": reply}); also written to `folder`."""
    from PIL import Image

    from data_prep.demo import image_path, load_annotations
    from data_prep.demo_models import demo_reply
    entries = load_annotations()
    os.makedirs(folder, exist_ok=True)
    images, objects, replies, boxes = [], [], {}, []
    for i in range(n):
        entry = entries[i % len(entries)]
        name = f"{i:04d}_{entry['id']}{os.path.splitext(entry['path'])[1]}"
        shutil.copyfile(image_path(entry), os.path.join(folder, name))
        images.append(Image.open(os.path.join(folder, name)).convert("RGB"))
        objects.append([o["name"] for o in entry["objects"]])
        boxes.append([o["box"] for o in entry["objects"]])
        replies[f"folder/{name}"] = demo_reply(entry)
    return images, objects, {"replies": replies, "boxes": boxes}


def grounding_dino_base():
    """GroundingDINO-base's architecture (config of IDEA-Research/grounding-dino-base)."""
    from transformers import BertConfig, GroundingDinoConfig, SwinConfig
    return GroundingDinoConfig(
        backbone_config=SwinConfig(image_size=384, patch_size=4, embed_dim=128,
                                   depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32],
                                   window_size=12, out_indices=[2, 3, 4]),
        text_config=BertConfig(), num_queries=900, encoder_layers=6, decoder_layers=6,
        d_model=256, max_text_len=256)


def build_models(args, tmp: str, dev: Device, stages: list) -> dict:
    """{"detector": (tiny folder, model or None), "sam": Sam, "vlm": (model, processor),
    "params": {stage: parameters}} on the device; the VLM only for the stages that use it."""
    import torch
    from segment_anything import sam_model_registry

    from data_prep import demo_models, segment
    from data_prep.testing import random_qwen2_vl
    demo = demo_models.layout(tmp)["detector"]
    from data_prep import detect
    detect.save_tiny_model(demo)  # the processor (local vocabulary) and the tiny model
    torch.manual_seed(0)
    with torch.device(dev.name):
        if args.tiny:
            detector, sam = None, segment.build_tiny_sam()
        else:
            from transformers import GroundingDinoForObjectDetection, GroundingDinoImageProcessor
            detector = GroundingDinoForObjectDetection(grounding_dino_base()).eval()
            sam = sam_model_registry["vit_h"](checkpoint=None).eval()
    if not args.tiny:  # the released processor's sizes: shortest edge 800, longest 1333
        GroundingDinoImageProcessor().save_pretrained(demo)
    vlm = random_qwen2_vl("tiny" if args.tiny else "7b", device=dev.name,
                          dtype="float32" if args.tiny else "bfloat16") \
        if {"vlm", "pipeline"} & set(stages) else None
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    params = {"sam": count(sam), **({"vlm": count(vlm[0])} if vlm else {})}
    if detector is not None:
        params["detector"] = count(detector)
    return {"detector": (demo, detector), "sam": sam, "vlm": vlm, "params": params}


def make_detector(models, dev, **switches):
    from data_prep.detect import GroundingDetector
    folder, model = models["detector"]
    return GroundingDetector(folder, device=dev.name, batch_size=10 ** 6, model=model,
                             **switches)


def bench_vlm(args, models, images, dev):
    from data_prep.vlm import TransformersVLM
    model, processor = models["vlm"]
    for batch in args.batches:
        for static in (False, True):
            vlm = TransformersVLM.of(model, processor, max_new_tokens=args.new_tokens,
                                     batch_size=batch, static_cache=static)
            chunk = images[:batch]
            row = dev.timed({"stage": "vlm", "batch": len(chunk), "static_cache": static,
                             "new_tokens": args.new_tokens}, len(chunk), vlm, chunk)
            if "seconds" in row:  # the warm-up and the timed call made the same tokens
                row["tokens_per_s"] = vlm.generated_tokens / 2 / row["seconds"]
            yield row


def bench_detect(args, models, images, objects, dev):
    runs = [(b, "default", {}) for b in args.batches] + [
        (args.pipeline_batch, name, {key: True})
        for name, key in (("detector_text_once", "text_once"), ("bf16", "bf16"))]
    for batch, name, switches in runs:
        det = make_detector(models, dev, **switches)
        yield dev.timed({"stage": "detect", "batch": batch, "switch": name}, batch, det,
                        images[:batch], objects[:batch])
        if switches.get("text_once"):  # the wrapper sits on the shared model: take it off
            det.model.model.text_backbone = det.model.model.text_backbone.encoder


def bench_segment(args, models, images, extra, dev):
    import copy

    import numpy as np
    import torch

    from data_prep.segment import SamSegmenter
    arrays = [np.asarray(im) for im in images[:args.pipeline_batch]]
    boxes = [np.asarray(b, float) for b in extra["boxes"][:args.pipeline_batch]]
    switches = [("default", {}), ("sam_sdpa", {"sdpa": True}), ("bf16", {"bf16": True})]
    if args.compile:
        switches.append(("sam_compile", {"compile": True}))
    for name, kw in switches:
        # the switches change the model in place: each its own copy on the device
        seg = SamSegmenter(copy.deepcopy(models["sam"]) if kw else models["sam"],
                           device=dev.name, **kw)
        row = dev.timed({"stage": "segment", "what": "segmenter", "batch": 1, "switch": name},
                        len(arrays), lambda: [seg(a, b) for a, b in zip(arrays, boxes)])
        row["boxes_per_image"] = float(np.mean([len(b) for b in boxes]))
        yield row
    sam = models["sam"]
    size = sam.image_encoder.img_size
    # ViT-H's global attention holds [batch x 16 heads, 4096, 4096] floats: 1 GiB an image
    for batch in (1, 2) if args.tiny else ENCODER_BATCHES:
        x = torch.randn(batch, 3, size, size, device=dev.name)
        with torch.inference_mode():
            yield dev.timed({"stage": "segment", "what": "image_encoder", "batch": batch,
                             "switch": "default"}, batch, sam.image_encoder, x)
        del x


class GeneratingVLM:
    """Stage 1 that costs what the VLM costs and answers what the pipeline can use: the real
    `TransformersVLM` generates for the block's images, then each image gets its scripted
    reply (a random model's text parses to nothing, which would exclude every image)."""
    wants_items = True

    def __init__(self, vlm, replies: dict):
        self.vlm, self.replies = vlm, replies

    def __call__(self, items):
        from data_prep import sources
        self.vlm([sources.read_image(it)[1] for it in items])
        return [self.replies.get(it.id) for it in items]


def bench_pipeline(args, models, folder, extra, tmp, dev) -> dict:
    from bench_annotate import top_per_object

    from data_prep import annotate, segment
    from data_prep.vlm import TransformersVLM
    replies_file = os.path.join(tmp, "replies.json")
    with open(replies_file, "w") as f:
        json.dump(extra["replies"], f)
    sam_key = os.path.join(tmp, "sam.txt")  # the caches key stage 3 by this file's content
    with open(sam_key, "w") as f:
        f.write(f"random {'tiny' if args.tiny else 'vit_h'} SAM, seed 0\n")
    vlm = TransformersVLM.of(*models["vlm"], max_new_tokens=args.new_tokens,
                             batch_size=args.pipeline_batch)
    detector = make_detector(models, dev)
    segmenter = segment.SamSegmenter(models["sam"], device=dev.name)
    run = os.path.join(tmp, f"run_{time.time_ns()}")
    cfg = annotate.AnnotateConfig(
        source="folder", root=folder, out=os.path.join(run, "out"),
        work=os.path.join(run, "work"), vlm_replies=replies_file, detector=models["detector"][0],
        sam=sam_key, device=dev.name, batch_size=args.pipeline_batch, progress=False)
    model_set = annotate.Models(vlm=GeneratingVLM(vlm, extra["replies"]),
                                detector=top_per_object(detector, 3), segmenter=segmenter)
    dev.reset()
    t0 = time.perf_counter()
    summary = annotate.annotate(cfg, models=model_set)
    dev.sync()
    seconds = time.perf_counter() - t0
    stage_s, stage_n = summary["stage_seconds_this_run"], summary["stage_images_this_run"]
    rates = {s: stage_n[s] / stage_s[s] for s in stage_s if stage_s[s] and stage_n.get(s)}
    images = summary["images"]
    bound = min(rates.values()) if rates else None
    out = {"images": images, "batch_size": args.pipeline_batch, "kept": summary["kept"],
           "new_tokens": args.new_tokens, "seconds": seconds,
           "images_per_s": images / seconds, "stage_images_per_s": rates,
           "overlapped_bound_images_per_s": bound,
           "device_hours_per_100k": 1e5 / (images / seconds) / 3600, "peak_gb": dev.peak_gb()}
    print(f"pipeline: {images} images in {seconds:.1f} s, {images / seconds:.2f} images/s "
          f"({summary['kept']} kept); stages overlapped: at most {bound or 0:.2f} images/s")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring for details.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="file to write the results to")
    parser.add_argument("--tiny", action="store_true",
                        help="the test suite's tiny models on the CPU (seconds)")
    parser.add_argument("--device", default="",
                        help="cuda or cpu (default: cuda when there is one, cpu for --tiny)")
    parser.add_argument("--batches", type=positive_ints, default=None,
                        help="batch sizes, the pipeline's first (default 8,16,32; --tiny 2,4)")
    parser.add_argument("--images", type=int, default=0,
                        help="photographs for the pipeline run (default 16; --tiny 4)")
    parser.add_argument("--new-tokens", type=int, default=0,
                        help="greedy tokens the VLM generates per image (default 64; --tiny 4)")
    parser.add_argument("--compile", action="store_true",
                        help="also time --sam-compile (compiling ViT-H takes minutes)")
    parser.add_argument("--only", default="vlm,detect,segment,pipeline",
                        help="stages to run, comma-separated (default all four)")
    args = parser.parse_args(argv)
    from data_prep.cli import quiet_model_bars
    quiet_model_bars()  # transformers' "Loading weights" bar at every detector built
    stages = args.only.split(",")
    unknown = sorted(set(stages) - {"vlm", "detect", "segment", "pipeline"})
    if unknown:
        fail(f"--only: unknown stage {unknown[0]!r}; choose from vlm, detect, segment, pipeline")
    args.batches = args.batches or ([2, 4] if args.tiny else [PIPELINE_BATCH, 16, 32])
    args.pipeline_batch = args.batches[0]
    args.images = args.images or (4 if args.tiny else 16)
    args.new_tokens = args.new_tokens or (4 if args.tiny else 64)
    if min(args.images, args.new_tokens) < 1:
        fail("--images and --new-tokens must be at least 1")
    try:
        import segment_anything  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        fail(f"the annotation stages need torch, transformers and segment-anything ({e}): "
             f"pip install -e '.[annotate]' or the wheels of bench/gpu_wheels.sh")
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {device}: torch sees no CUDA device here (pass --tiny for the CPU form)")
    if not args.tiny and not device.startswith("cuda"):
        print("warning: the full-size models on the CPU take many minutes", file=sys.stderr)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or torch.get_num_threads())
    dev = Device(device)
    tmp = tempfile.mkdtemp(prefix="bench_annotate_gpu_")
    report = {"form": "tiny" if args.tiny else "full", "device": device,
              "device_name": torch.cuda.get_device_name() if dev.cuda else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "batches": args.batches, "pipeline_batch": args.pipeline_batch}

    def save():
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    try:
        t0 = time.perf_counter()
        models = build_models(args, tmp, dev, stages)
        report["build_s"] = round(time.perf_counter() - t0, 2)
        report["params"] = models["params"]
        print(f"models built in {report['build_s']} s on {device}: {models['params']}")
        folder = os.path.join(tmp, "photos")
        images, objects, extra = photographs(folder, max(args.images, max(args.batches)))
        save()
        for stage, rows in (("vlm", lambda: bench_vlm(args, models, images, dev)),
                            ("detect", lambda: bench_detect(args, models, images, objects,
                                                            dev)),
                            ("segment", lambda: bench_segment(args, models, images, extra,
                                                              dev))):
            if stage in stages:
                report[stage] = []
                for row in rows():  # each row on disk as it lands: a stopped run keeps them
                    report[stage].append(row)
                    save()
        if "pipeline" in stages:
            pipeline_folder = os.path.join(tmp, "pipeline_photos")
            _, _, pipe_extra = photographs(pipeline_folder, args.images)
            report["pipeline"] = bench_pipeline(args, models, pipeline_folder, pipe_extra, tmp,
                                                dev)
            save()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
