"""Time to the first training step with and without JAX's persistent compilation cache, each in
a fresh process (what a resumed run pays before it trains again).

    python bench/bench_compile_cache.py [--preset tiny] [--batch 8]

Three child processes share one fresh cache folder: cold (empty cache: compile and write),
warm (the same step read back), and one with the cache off. Each builds the model and the
train state, then times its first step call (trace, lower, compile or cache read, run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    import jax
    if args.cache:
        from jax.experimental.compilation_cache import compilation_cache
        compilation_cache.set_cache_dir(args.cache)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_train_step as bts

    from sclaro_jax.models import scenarioclip
    from sclaro_jax.run import sharding
    from sclaro_jax.train import core
    batch = bts.make_batch(args.preset, args.batch)
    model = scenarioclip.build("scenarioclip", preset=args.preset,
                               embed_dim=64 if args.preset == "tiny" else 512)
    layers = model.global_pair.config.vision.num_hidden_layers
    cfg = core.TrainConfig(total_steps=1000, **{**bts.TRAIN, **bts._frozen(layers)})
    graphdef, state, tx = core.init_state(model, cfg)
    step, state = sharding.jit_step(
        core.make_train_step(graphdef, tx, cfg), state,
        None, "none")
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    loss = float(metrics["loss"])
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    float(metrics["loss"])
    print(json.dumps({"first_step_s": first, "second_step_s": time.perf_counter() - t0,
                      "loss": loss}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name, cache in (("cold cache", tmp), ("warm cache", tmp), ("cache off", "")):
            out = subprocess.run([sys.executable, __file__, "--child", "--preset", args.preset,
                                  "--batch", str(args.batch), "--cache", cache],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((name, r))
        size = sum(f.stat().st_size for f in Path(tmp).iterdir()) / 2**20
    print(f"preset {args.preset}, batch {args.batch}; cache folder {size:.1f} MiB")
    print("| run | first step s (incl. compile or cache read) | second step s | loss |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['first_step_s']:.2f} | {r['second_step_s']:.3f} | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
