"""The paper-config training step fed by the real Grain input pipeline, on one accelerator:
examples/s against the same step on a batch already on the device, and `data_wait_fraction`
(the share of the timed wall time the loop spends waiting for the next host batch).

    python bench/bench_gpu_real_data.py --workers 15 [--workers 8 ...]

Records: schema version 2 (stored training views at the preset's image size, 224 px for
ViT-B/32) of 640x480 JPEG photographs with 8 objects and 8 focused-region JPEGs each (the
shards `bench_input.py` measures, written to --data if it holds none), texts of 32 tokens;
the step applies the photometric augmentation the batches carry. One process compiles the step once, times it on a fixed device batch, then on
batches from `make_loader` for each --workers value (uint8 batches, normalised in the step).
Run it under `if __name__ == "__main__"` (Grain's workers start with spawn).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_train import add_step_arguments  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser)
    parser.add_argument("--samples", type=int, default=1024, help="records to write")
    parser.add_argument("--data", default="", help="shard folder (written if empty)")
    parser.add_argument("--workers", type=int, action="append",
                        help="Grain worker processes (repeatable; default: cores - 1)")
    parser.add_argument("--buffer", type=int, default=2, help="per-worker buffer (batches)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed real-data steps")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    args = parser.parse_args()
    workers = args.workers or [max(1, (os.cpu_count() or 2) - 1)]

    import jax
    import jax.numpy as jnp

    from bench_input import build_shards
    from sclaro_jax.data.pipeline import PipelineConfig, make_loader
    from sclaro_jax.models import clip, scenarioclip
    from sclaro_jax.train import core

    size = clip.config_from_preset(args.preset).vision.image_size
    data = args.data or os.path.join(tempfile.mkdtemp(), "shards")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        t0 = time.perf_counter()
        build_shards(data, args.samples, n_obj=args.objects, n_rel=args.relations,
                     view_size=size)
        print(f"wrote {args.samples} records to {data} in {time.perf_counter() - t0:.1f} s",
              flush=True)
    pcfg = PipelineConfig(image_size=size, max_objects=args.objects,
                          max_relations=args.relations, text_length=32)

    model = scenarioclip.build("scenarioclip", preset=args.preset, dtype=jnp.dtype(args.dtype))
    cfg = core.TrainConfig(total_steps=10_000)
    graphdef, state, tx = core.init_state(model, cfg)
    del model
    step = jax.jit(core.make_train_step(graphdef, tx, cfg),
                   donate_argnums=0)
    first = next(iter(make_loader(data, "train", args.batch, config=pcfg, seed=0)))
    device_batch = jax.device_put(first)
    t0 = time.perf_counter()
    state, metrics = step(state, device_batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        state, metrics = step(state, device_batch)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, device_batch)
    jax.block_until_ready(metrics)
    device_s = (time.perf_counter() - t0) / args.steps
    result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "cores": os.cpu_count(), "batch": args.batch, "objects": args.objects,
              "relations": args.relations, "dtype": args.dtype, "compile_s": compile_s,
              "device_batch": {"step_s": device_s, "examples_per_sec": args.batch / device_s},
              "real_data": []}
    print(json.dumps(result), flush=True)
    for count in workers:
        loader = make_loader(data, "train", args.batch, config=pcfg, seed=1,
                             worker_count=count, worker_buffer_size=args.buffer)
        it = iter(loader)
        for _ in range(args.warmup):
            state, metrics = step(state, jax.device_put(next(it)))
        jax.block_until_ready(metrics)
        wait = 0.0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            w0 = time.perf_counter()
            batch = next(it)
            wait += time.perf_counter() - w0
            state, metrics = step(state, jax.device_put(batch))
        jax.block_until_ready(metrics)
        wall = time.perf_counter() - t0
        row = {"workers": count, "buffer": args.buffer, "step_s": wall / args.steps,
               "examples_per_sec": args.batch * args.steps / wall,
               "data_wait_fraction": wait / wall,
               "of_device_batch_rate": device_s * args.steps / wall,
               "loss": float(metrics["loss"]), "recompiles": step._cache_size() - 1}
        result["real_data"].append(row)
        print(json.dumps(row), flush=True)
        del it, loader
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
