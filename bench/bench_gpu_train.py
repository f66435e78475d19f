"""Examples/sec and MFU of the ScenarioCLIP training step on one accelerator (synthetic batches,
so the input pipeline is out of the measurement; see bench_input.py for that side).

    python bench/bench_gpu_train.py --preset ViT-B/32 --batch 128 --objects 8 --relations 8 \
        --dtype bfloat16 --peak-tflops 989

FLOPs per step come from XLA's own cost analysis of the compiled step; MFU = FLOPs per step /
step time / peak. The peak defaults to the dense bf16 figure of an H100/H200 SXM (989 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ViT-B/32")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--relations", type=int, default=8)
    parser.add_argument("--text-length", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from bench_train_step import make_batch
    from sclaro_jax.models import scenarioclip
    from sclaro_jax.train import core

    batch = make_batch(args.preset, args.batch, n_obj=args.objects, n_rel=args.relations,
                       text_len=args.text_length)
    batch = jax.device_put(batch)
    model = scenarioclip.build("scenarioclip", preset=args.preset, dtype=jnp.dtype(args.dtype))
    cfg = core.TrainConfig(total_steps=10_000)
    graphdef, state, tx = core.init_state(model, cfg)
    del model
    step = jax.jit(core.make_train_step(graphdef, tx, cfg, core.param_labels(state.params, cfg)),
                   donate_argnums=0)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", float("nan")))
    for _ in range(3):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    dt = (time.perf_counter() - t0) / args.steps
    result = {
        "device": str(jax.devices()[0].device_kind), "preset": args.preset, "batch": args.batch,
        "objects": args.objects, "relations": args.relations, "dtype": args.dtype, "step_s": dt,
        "examples_per_sec": args.batch / dt, "tflops_per_step": flops / 1e12,
        "achieved_tflops": flops / dt / 1e12, "mfu": flops / dt / (args.peak_tflops * 1e12),
        "compile_s": compile_s, "loss": float(metrics["loss"]),
        "recompiles": step._cache_size() - 1,
        "peak_memory_gb": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
        / 2 ** 30,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
