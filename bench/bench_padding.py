"""Padding and dropped crops of the two static-shape crop layouts, on the object / relation
counts of a dataset's records and of the long-tailed law the tests use.

- "caps" (`PipelineConfig(layout="caps")`): every image gets max_objects / max_relations slots;
  crops past them are dropped.
- "packed" (`sclaro_jax.data.packing`, the trainer's default): each batch at the smallest of the
  planned sizes that holds its crops (`packing.plan`: at most three, the largest B x the
  largest per-image counts), so nothing is dropped.

For random batches (images drawn with replacement from the counts) it reports per layout the
slots per batch, the fraction of slots that hold padding, the crops dropped, and for packed how
often each size is used and the plan's own expectation (`packing.expected_use`). The encoder
work of a step is about proportional to 1 + slots / B per image (the global view plus the
crops), so "crop work vs caps" is the step's crop-encoder work relative to the caps layout.

"useful crops/s" times it: a jitted CLIP image tower of `--preset` (random weights, fp32,
forward only) encodes each layout's slots of each size (best of 3 after a warm-up); a layout's
time per batch is its sizes' times weighted by how often each is used, and its useful crops/s
the real crops it encodes per batch (caps: those within the caps) over that time. `--preset ""`
skips the timing.

    python -m data_prep demo --out /tmp/demo_shards
    python bench/bench_padding.py --data /tmp/demo_shards --batch 128
    python bench/bench_padding.py --long-tail --batch 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sclaro_jax.data import packing  # noqa: E402
from sclaro_jax.data.dataset import open_dataset  # noqa: E402


def dataset_counts(data: str, split: str) -> np.ndarray:
    """[n, 2] (objects, relations) of every record of the split."""
    from array_record.python.array_record_module import ArrayRecordReader

    from sclaro_jax.data import schema
    out = []
    for path in open_dataset(data).paths(split):
        reader = ArrayRecordReader(path)
        out += [(len(s.objects), len(s.relations)) for s in map(schema.decode, reader.read_all())]
        reader.close()
    return np.array(out)


def long_tail_counts(n: int = 100_000) -> np.ndarray:
    from data_prep.testing import long_tail_counts as draw
    return draw(n, seed=0)


class EncoderTimer:
    """Seconds for a jitted CLIP image tower of `preset` to encode n crops (forward only)."""

    def __init__(self, preset: str):
        import jax

        from sclaro_jax.models import clip
        self.model = clip.create(preset, seed=0)
        self.size = self.model.config.vision.image_size
        self.encode = jax.jit(lambda m, x: m.encode_image(x))
        self.cache: dict[int, float] = {}

    def __call__(self, n: int) -> float:
        import time

        import jax
        if n not in self.cache:
            x = jax.numpy.asarray(np.random.default_rng(n).standard_normal(
                (n, self.size, self.size, 3), dtype=np.float32))
            jax.block_until_ready(self.encode(self.model, x))  # compiles
            best = np.inf
            for _ in range(3):
                t0 = time.perf_counter()
                jax.block_until_ready(self.encode(self.model, x))
                best = min(best, time.perf_counter() - t0)
            self.cache[n] = best
        return self.cache[n]


def rows(per_image: np.ndarray, batch: int, caps: tuple[int, int], draws: int, seed: int = 0,
         timer=None):
    """The table's rows: (layout, slots obj / rel, padding obj / rel / all, dropped obj / rel,
    size use, mean slots, useful crops/s or nan)."""
    rng = np.random.default_rng(seed)
    totals_full = np.zeros((draws, 2))
    totals_caps = np.zeros((draws, 2))
    for i in range(draws):
        images = per_image[rng.integers(0, len(per_image), batch)]
        totals_full[i] = images.sum(0)
        totals_caps[i] = np.minimum(images, caps).sum(0)
    out = []
    slots = np.array(caps) * batch
    pad = 1 - totals_caps.mean(0) / slots
    rate = np.nan if timer is None else totals_caps.sum(1).mean() / (
        timer(int(slots[0])) + timer(int(slots[1])))
    out.append(("caps", f"{slots[0]} / {slots[1]}", pad, 1 - totals_caps.sum() / (
        draws * slots.sum()), 1 - totals_caps.sum(0) / totals_full.sum(0), "one size",
        slots.sum(), rate))
    hists = [packing.histogram(per_image[:, k]) for k in range(2)]
    for max_sizes in (1, 2, 3):
        sizes = packing.plan(*hists, batch, max_sizes=max_sizes)
        tiers = np.array([sizes.tier(*t) for t in totals_full.astype(int)])
        used = np.stack([np.array(sizes.objects)[tiers], np.array(sizes.relations)[tiers]], 1)
        pad = 1 - totals_full.mean(0) / used.mean(0)
        share = np.bincount(tiers, minlength=sizes.tiers) / draws
        expect = packing.expected_use(sizes, *hists)["padding_all"]
        rate = np.nan if timer is None else totals_full.sum(1).mean() / sum(
            share[t] * (timer(sizes.objects[t]) + timer(sizes.relations[t]))
            for t in range(sizes.tiers))
        out.append((f"packed, {sizes.tiers} size{'s' * (sizes.tiers > 1)}",
                    " / ".join(f"{o}, {r}" for o, r in zip(sizes.objects, sizes.relations)),
                    pad, 1 - totals_full.sum() / used.sum(), np.zeros(2),
                    " / ".join(f"{s:.1%}" for s in share) + f" (plan: {expect:.1%} padding)",
                    used.sum(1).mean(), rate))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="", help="a dataset folder (python -m data_prep)")
    parser.add_argument("--long-tail", action="store_true",
                        help="the long-tailed law of the tests (data_prep.testing): objects "
                             "1-10, relations 0-16, most images with few")
    parser.add_argument("--split", default="train")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--max-objects", type=int, default=10)
    parser.add_argument("--max-relations", type=int, default=8)
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--preset", default="tiny",
                        help="the CLIP image tower that times useful crops/s ('' skips it)")
    args = parser.parse_args()
    if bool(args.data) == args.long_tail:
        parser.error("give one of --data DIR and --long-tail")
    per_image = long_tail_counts() if args.long_tail else dataset_counts(args.data, args.split)
    what = "the long-tailed law (100,000 images)" if args.long_tail else \
        f"{len(per_image)} records of {args.data} ({args.split})"
    mean = per_image.mean(0)
    print(f"{what}; per image: objects mean {mean[0]:.2f} (max {per_image[:, 0].max()}), "
          f"relations mean {mean[1]:.2f} (max {per_image[:, 1].max()}); batch {args.batch}, "
          f"{args.draws} random batches; caps {args.max_objects} / {args.max_relations}")
    print("| layout | slots per size (obj, rel) | padding obj / rel | padding, all slots | "
          "crops dropped obj / rel | batches per size | crop work vs caps | "
          f"useful crops/s ({args.preset or 'not timed'}) |")
    print("|---|---|---|---|---|---|---|---|")
    timer = EncoderTimer(args.preset) if args.preset else None
    table = rows(per_image, args.batch, (args.max_objects, args.max_relations), args.draws,
                 timer=timer)
    caps_work = 1 + table[0][6] / args.batch
    for name, slots, pad, pad_all, dropped, use, mean_slots, rate in table:
        print(f"| {name} | {slots} | {pad[0]:.1%} / {pad[1]:.1%} | {pad_all:.1%} | "
              f"{dropped[0]:.2%} / {dropped[1]:.2%} | {use} | "
              f"{(1 + mean_slots / args.batch) / caps_work:.2f} | "
              + ("-" if np.isnan(rate) else f"{rate:,.0f} ({rate / table[0][7]:.2f}x)") + " |")


if __name__ == "__main__":
    main()
