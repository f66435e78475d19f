"""Photometric augmentation on the device (`sclaro_jax.data.photometric.augment_batch`): its
time on the paper's batch layout, and what it adds to a train step.

    python bench/bench_photometric.py                      # B=16, 10 objects, 8 relations, 224 px
    python bench/bench_photometric.py --rounds 10 --batch 32

(1) `augment_batch` alone, jitted, on B images of S px with their object and relation views
(every sample jittered and its global view blurred; the traced work does not depend on the
flags, so this is also the cost of a batch with the recipe's p=0.2 / p=0.1). (2) The tiny
preset's jitted train step (its own 32 px views, the same caps) on a batch with and without the
photometric fields: the difference is the augmentation's cost inside the step. Medians (min)
over paired rounds (`timing.paired_timings`), after two warm-up calls; compile times separate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def photometric_fields(batch: int, seed: int = 0) -> dict:
    """Drawn parameters, every sample's jitter on at every level (the reference's strengths per
    level) and its global view blurred (sigma 0.1-1.5)."""
    from sclaro_jax.data import augment, batch as fields
    drawn = [augment.photometric_fields(augment.sample_params(
        np.random.default_rng([seed, i]), 640, 480, train=True, jitter_p=1.0, blur_p=1.0))
        for i in range(batch)]
    return {name: np.stack([d[name] for d in drawn]) for name, _, _ in fields.PHOTOMETRIC}


def pixels_batch(batch: int, n_obj: int, n_rel: int, size: int, seed: int = 0) -> dict:
    from sclaro_jax.data import batch as fields
    rng = np.random.default_rng(seed)
    out = {fields.IMAGE: rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8)}
    for level, n in (("object", n_obj), ("relation", n_rel)):
        out[fields.LEVEL_FIELDS[level].pixels] = rng.integers(0, 256, (batch, n, size, size, 3),
                                                        dtype=np.uint8)
    return out | photometric_fields(batch, seed)


def summary(times: np.ndarray) -> str:
    return f"{np.median(times):.4f} s ({times.min():.4f})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--objects", type=int, default=10)
    parser.add_argument("--relations", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-step", action="store_true",
                        help="time augment_batch only, not the tiny train step")
    args = parser.parse_args(argv)

    import jax

    from bench_train_step import make_batch
    from sclaro_jax.data import photometric
    from sclaro_jax.models import scenarioclip
    from sclaro_jax.train import core
    from timing import paired_timings

    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s); "
          f"B={args.batch}, {args.objects} objects, {args.relations} relations")
    views = args.batch * (1 + args.objects + args.relations)
    batch = jax.device_put(pixels_batch(args.batch, args.objects, args.relations, args.size))
    augment = jax.jit(photometric.augment_batch)
    t0 = time.perf_counter()
    augment.lower(batch).compile()
    compile_s = time.perf_counter() - t0
    times = paired_timings([lambda: jax.block_until_ready(augment(batch))], args.rounds)[:, 0]
    print(f"augment_batch, {args.size} px, {views} views: compile {compile_s:.1f} s; "
          f"{summary(times)} per batch, {1e3 * np.median(times) / views:.2f} ms per view")
    if args.skip_step:
        return

    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=32, seed=0)
    cfg = core.TrainConfig(total_steps=1000, frozen_vision_layers=1, frozen_text_layers=1)
    graphdef, state, tx = core.init_state(model, cfg)
    plain = make_batch("tiny", args.batch, n_obj=args.objects, n_rel=args.relations)
    with_fields = plain | photometric_fields(args.batch)
    steps, compile_s = {}, {}
    for name, b in (("without", plain), ("with", with_fields)):
        step = jax.jit(core.make_train_step(graphdef, tx, cfg))
        t0 = time.perf_counter()
        step.lower(state, b).compile()
        compile_s[name] = time.perf_counter() - t0
        steps[name] = (lambda step=step, b=b: jax.block_until_ready(step(state, b)[1]))
    times = paired_timings([steps["without"], steps["with"]], args.rounds)
    extra = np.median(times[:, 1] - times[:, 0])
    print(f"tiny train step, 32 px, {views} views: without photometric fields "
          f"{summary(times[:, 0])} (compile {compile_s['without']:.1f} s); with "
          f"{summary(times[:, 1])} (compile {compile_s['with']:.1f} s); the augmentation adds "
          f"{extra:.4f} s median per step ({100 * extra / np.median(times[:, 0]):.0f}%)")


if __name__ == "__main__":
    main()
