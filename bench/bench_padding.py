"""Padding waste of two static-shape layouts, measured on the object / relation counts of a
dataset's records: "caps" (the batches `sclaro_jax.data.pipeline` makes, `sclaro_jax.data.batch`)
and "packed" (a per-batch crop budget; not built by the library, sized here only).

For batches drawn at random from the split (bootstrap), "caps" pads every image to
max_objects / max_relations; "packed" gives the batch a budget of crops (a multiple of the mean
count times the batch size). Reported per layout: the fraction of encoder slots that hold
padding, the fraction of crops dropped because they did not fit, how often a batch dropped any,
and the encoder work relative to caps.

    python -m data_prep demo --out /tmp/demo_shards
    python bench/bench_padding.py --data /tmp/demo_shards --batch 128
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from sclaro_jax.data import schema
from sclaro_jax.data.dataset import open_dataset


def counts(data: str, split: str) -> np.ndarray:
    out = []
    for path in open_dataset(data).paths(split):
        reader = ArrayRecordReader(path)
        for record in reader.read_all():
            s = schema.decode(record)
            out.append((len(s.objects), len(s.relations)))
        reader.close()
    return np.array(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a dataset folder (python -m data_prep)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--max-objects", type=int, default=10)
    parser.add_argument("--max-relations", type=int, default=8)
    parser.add_argument("--draws", type=int, default=2000)
    args = parser.parse_args()

    c = counts(args.data, args.split)
    caps = np.array([args.max_objects, args.max_relations])
    c = np.minimum(c, caps)  # both layouts drop what exceeds the per-image caps
    rng = np.random.default_rng(0)
    batches = c[rng.integers(0, len(c), (args.draws, args.batch))].sum(1)  # [draws, 2]
    mean = c.mean(0)
    print(f"{len(c)} records of {args.data} ({args.split}); per image: objects mean "
          f"{mean[0]:.2f} (max {c[:, 0].max()}), relations mean {mean[1]:.2f} "
          f"(max {c[:, 1].max()}); batch {args.batch}, {args.draws} random batches")
    print("| layout | object slots | relation slots | padding (obj / rel) | crops dropped "
          "(obj / rel) | batches dropping any | encoder crops vs caps |")
    print("|---|---|---|---|---|---|---|")
    cap_slots = caps * args.batch
    rows = [("caps", cap_slots)]
    for f in (1.0, 1.1, 1.2, 1.3):
        rows.append((f"packed, budget {f:.1f} x mean",
                     np.array([math.ceil(f * m * args.batch) for m in mean])))
    for name, slots in rows:
        kept = np.minimum(batches, slots)
        pad = 1 - kept.mean(0) / slots
        drop = (batches - kept).sum(0) / batches.sum(0)
        any_drop = ((batches > slots).any(1)).mean()
        work = (1 + slots.sum() / args.batch) / (1 + cap_slots.sum() / args.batch)
        print(f"| {name} | {slots[0]} | {slots[1]} | {pad[0]:.1%} / {pad[1]:.1%} | "
              f"{drop[0]:.2%} / {drop[1]:.2%} | {any_drop:.1%} | {work:.2f} |")


if __name__ == "__main__":
    main()
