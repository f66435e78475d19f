"""Input pipeline throughput: sclaro_jax's Grain pipeline vs the reference's PyTorch DataLoader.

Both read the same ArrayRecord shards (samples with 8 objects and 8 relations, 640x480 JPEG
photographs and focused-region images, 224 px outputs), each in one process on one core
(`worker_count=0` / `num_workers=0`, torch.set_num_threads(1)), so samples/s is per worker.

- ours: `sclaro_jax.data.pipeline.make_loader` (decode once, one parameter draw per sample,
  one-resample Resize+CenterCrop, reduced-scale JPEG decode of relation regions, memoised
  tokens), uint8 output (normalised on the accelerator) and, separately, float32 output
  normalised on the host as the reference does.
- reference: a torch `Dataset` doing what the reference code does per sample: PIL decode of the
  image and of every relation region, `image.crop(box)` per object, torchvision
  RandomResizedCrop/ColorJitter/GaussianBlur (global) and Resize/CenterCrop/ColorJitter
  (objects, relations), ToTensor + Normalize, and a collate that tokenises the 17 texts with
  transformers' CLIPTokenizer (max_length 77).

Rounds alternate the order of the pipelines; each times one batch of each.

    python bench/bench_input.py --rounds 12
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAMES = ["person", "dog", "ball", "chair", "table", "cup", "tree", "car"]


def build_shards(out: str, n_samples: int, n_obj: int = 8, n_rel: int = 8) -> None:
    """Samples with n_obj objects / n_rel relations on 640x480 JPEGs of the demo photographs."""
    from data_prep import demo, focus
    from data_prep.shards import ShardWriter
    from sclaro_jax.data import schema

    rng = np.random.default_rng(0)
    photos = []
    for entry in demo.load_annotations():
        img = Image.open(demo.image_path(entry)).convert("RGB")
        img = img.resize((640, 480), Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        boxes = []
        for _ in range(n_obj):
            w, h = rng.integers(60, 400), rng.integers(60, 320)
            x0, y0 = rng.integers(0, 640 - w), rng.integers(0, 480 - h)
            boxes.append((float(x0), float(y0), float(x0 + w), float(y0 + h)))
        rgb = np.asarray(img)
        regions = []
        for k in range(n_rel):
            a, b = k % n_obj, (k + 1) % n_obj
            region = focus.focused_region(rgb, demo.box_mask(boxes[a], 640, 480),
                                          demo.box_mask(boxes[b], 640, 480))
            regions.append((a, b, demo.encode_jpeg(region, 90)))
        photos.append((buf.getvalue(), boxes, regions))
    with ShardWriter(out, records_per_shard=64) as w:
        for i in range(n_samples):
            data, boxes, regions = photos[i % len(photos)]
            objects = tuple(schema.Object(NAMES[(i + k) % len(NAMES)], box)
                            for k, box in enumerate(boxes))
            relations = tuple(
                schema.Relation(a, "next to", b, schema.triplet_text(
                    objects[a].name, "next to", objects[b].name), region)
                for a, b, region in regions)
            w.add(schema.Sample(id=f"bench{i:05d}", source="bench", split="train", image=data,
                                width=640, height=480, action=["playing", "sitting"][i % 2],
                                caption="", objects=objects, relations=relations,
                                mask_kind="box"))


class ReferenceDataset:
    """The reference code's per-sample work, on the same records (torch + torchvision + PIL)."""

    def __init__(self, paths):
        import grain.python as grain
        import torchvision.transforms as T

        self.source = grain.ArrayRecordDataSource(paths)
        norm = T.Normalize((0.48145466, 0.4578275, 0.40821073),
                           (0.26862954, 0.26130258, 0.27577711))
        jitter = T.RandomApply([T.ColorJitter(0.2, 0.2, 0.2, 0.05)], p=0.2)
        bicubic = T.InterpolationMode.BICUBIC
        self.global_tf = T.Compose([
            T.RandomResizedCrop(224, scale=(0.8, 1.0), interpolation=bicubic), jitter,
            T.RandomApply([T.GaussianBlur(9, (0.1, 1.5))], p=0.1), T.ToTensor(), norm])
        self.region_tf = T.Compose([T.Resize(224, interpolation=bicubic), T.CenterCrop(224),
                                    jitter, T.ToTensor(), norm])

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        import torch

        from sclaro_jax.data import schema

        s = schema.decode(self.source[i])
        image = Image.open(io.BytesIO(s.image)).convert("RGB")
        objects = torch.stack([self.region_tf(image.crop(o.box)) for o in s.objects])
        relations = torch.stack([
            self.region_tf(Image.open(io.BytesIO(r.region)).convert("RGB"))
            for r in s.relations])
        return (self.global_tf(image), objects, relations, s.action,
                [o.name for o in s.objects], [r.text for r in s.relations])


def reference_collate(tokenizer):
    def collate(items):
        import torch
        images, objects, relations, actions, names, texts = zip(*items)

        def tok(t):
            return tokenizer(list(t), padding="max_length", max_length=77, truncation=True,
                             return_tensors="pt")["input_ids"]
        return (torch.stack(images), torch.stack(objects), torch.stack(relations), tok(actions),
                tok([n for ns in names for n in ns]), tok([t for ts in texts for t in ts]))
    return collate


def forever(make_iter):
    while True:
        yield from make_iter()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=96, help="distinct records written")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--workers", type=int, default=0,
                        help="also time our pipeline alone with this many worker processes")
    args = parser.parse_args()

    import torch
    import transformers

    from sclaro_jax.data.dataset import open_dataset
    from sclaro_jax.data.pipeline import PipelineConfig, make_loader
    from sclaro_jax.data.tokenizer import ClipTokenizer
    from timing import paired_timings

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench_input_")
    out = os.path.join(tmp, "shards")
    t0 = time.perf_counter()
    build_shards(out, args.samples)
    print(f"wrote {args.samples} records in {time.perf_counter() - t0:.1f} s")
    ds = open_dataset(out)
    ClipTokenizer().save_pretrained(os.path.join(tmp, "tok"))
    hf_tok = transformers.CLIPTokenizer.from_pretrained(os.path.join(tmp, "tok"))

    def ours(pixels):
        cfg = PipelineConfig(max_objects=8, max_relations=8, pixels=pixels)
        return iter(make_loader(ds, "train", args.batch, config=cfg, seed=0))

    ours_u8, ours_f32 = ours("uint8"), ours("float32")
    ref = forever(lambda: iter(torch.utils.data.DataLoader(
        ReferenceDataset(ds.paths("train")), batch_size=args.batch, shuffle=True,
        num_workers=0, collate_fn=reference_collate(hf_tok), drop_last=True)))
    b = next(ours_u8)
    r = next(ref)
    print("ours:", {k: v.shape for k, v in b.items() if k in ("image", "objects", "relations")})
    print("reference:", [tuple(x.shape) for x in r[:3]])
    fns = [lambda: next(ours_u8), lambda: next(ours_f32), lambda: next(ref)]
    times = paired_timings(fns, args.rounds, pause=0.1)
    med = np.median(times, axis=0)
    rate = args.batch / med
    ratio = np.median(times[:, 2:3] / times[:, :2], axis=0)
    print(f"{args.rounds} rounds of one batch of {args.batch}, 8 objects + 8 relations, 224 px")
    print("| pipeline | s per batch, median (min) | samples/s per worker | vs PyTorch |")
    print("|---|---|---|---|")
    labels = ["sclaro_jax Grain, uint8 out", "sclaro_jax Grain, float32 normalised",
              "reference PyTorch DataLoader"]
    for i, label in enumerate(labels):
        vs = f"{ratio[i]:.2f}x" if i < 2 else "1.00x"
        print(f"| {label} | {med[i]:.3f} ({times[:, i].min():.3f}) | {rate[i]:.1f} | {vs} |")
    if args.workers:
        cfg = PipelineConfig(max_objects=8, max_relations=8)
        it = iter(make_loader(ds, "train", args.batch, config=cfg, seed=0,
                              worker_count=args.workers))
        for _ in range(2 * args.workers):
            next(it)
        t0 = time.perf_counter()
        n = 4 * args.rounds
        for _ in range(n):
            next(it)
        dt = time.perf_counter() - t0
        print(f"ours, uint8, {args.workers} worker processes: {n * args.batch / dt:.1f} "
              f"samples/s over {n} batches ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
