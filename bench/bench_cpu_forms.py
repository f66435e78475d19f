"""What the training step's two CPU-side savings are worth, paired in one process: the same
jitted ScenarioCLIP step (weights, batch and numbers as bench_train_step.py) with the model built
with `gradient_forms="cpu"` and `"plain"` (`sclaro_jax.models.cpu_gradients`: cotangent barriers
+ column sums as matmuls) and with and without the teacher continuing from the student's frozen
text blocks (`share_frozen_text`).

    python bench/bench_cpu_forms.py --preset ViT-B/32 --batch 8 --rounds 3
    python bench/bench_cpu_forms.py --preset tiny --batch 32 --rounds 10

Timing is `timing.paired_timings` (two warm-up steps each, then every round one step of every
variant, alternating the order, after a 0.1 s pause); a ratio is the median over rounds of a
variant's time / the first variant's in the same round.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {  # name: (gradient_forms, share_frozen_text)
    "both on (default)": ("cpu", True),
    "gradient forms off": ("plain", True),
    "text sharing off": ("cpu", False),
    "both off": ("plain", False),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS))
    args = parser.parse_args()
    import jax

    import bench_train_step as bts
    from timing import paired_timings

    names = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    folder = bts.hf_folder(args.preset, tempfile.mkdtemp(prefix="bench_forms_"))
    batch = jax.device_put(bts.make_batch(args.preset, args.batch))
    runs, first = [], []
    for name in names:
        forms, share = VARIANTS[name]
        run, _ = bts.jax_side(folder, args.preset, bts.EMBED, share_frozen_text=share,
                              gradient_forms=forms)
        first.append(run(batch))
        runs.append(run)
    times = paired_timings([lambda run=run: run(batch) for run in runs], args.rounds, pause=0.1)
    print(f"{args.preset}, batch {args.batch}, {args.rounds} paired rounds, {os.cpu_count()} "
          f"cores; first-step losses {', '.join(f'{x:.6f}' for x in first)}")
    print("| variant | s/step median (min) | time / first variant's (median of rounds) |")
    print("|---|---|---|")
    for i, name in enumerate(names):
        print(f"| {name} | {np.median(times[:, i]):.3f} ({times[:, i].min():.3f}) | "
              f"{np.median(times[:, i] / times[:, 0]):.3f} |")


if __name__ == "__main__":
    main()
