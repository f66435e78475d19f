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

    python bench/bench_gpu_real_data.py --counts demo --layout caps --layout packed

`--counts demo` gives each record its demo photograph's own object / relation counts (real
data leaves caps slots empty; "full" fills them). Each `--layout` (repeatable) is measured in
turn: caps at --objects / --relations per image, packed at the sizes planned from the written
split. Every executable of every layout is compiled first (`--compile-threads` at a time),
then each layout timed. Per layout: examples/s, data_wait_fraction, useful crops/s,
MFU and useful MFU (FLOPs of real crops only, `bench_gpu_train.crop_flops_line`).
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

from bench_gpu_train import StepFlops, add_step_arguments  # noqa: E402
from bench_train_step import real_crops  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     conflict_handler="resolve")
    add_step_arguments(parser)
    parser.add_argument("--layout", action="append", choices=("caps", "packed"),
                        help="crop layout, repeatable: each measured in turn (default caps)")
    parser.add_argument("--samples", type=int, default=1024, help="records to write")
    parser.add_argument("--data", default="", help="shard folder (written if empty)")
    parser.add_argument("--workers", type=int, action="append",
                        help="Grain worker processes (repeatable; default: cores - 1)")
    parser.add_argument("--buffer", type=int, default=2, help="per-worker buffer (batches)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed real-data steps")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--compile-threads", type=int, default=1,
                        help="executables compiled at once before any timing (all layouts)")
    parser.add_argument("--flops-of", default="", metavar="LOG",
                        help="the output of an earlier run (same arguments): count the FLOPs of "
                             "its batches here, without compiling or timing, and print its "
                             "results with MFU and useful MFU from its step times")
    args = parser.parse_args()
    layouts = args.layout or ["caps"]
    workers = args.workers or [max(1, (os.cpu_count() or 2) - 1)]

    size, data = write_shards(args)
    if args.flops_of:
        print(json.dumps(recount(args, size, read_results(args.flops_of)), indent=2))
        return
    runs = [prepare(args, data, size, layout) for layout in layouts]
    compile_s = compile_all(runs, args.compile_threads)
    line = None
    results = []
    for run in runs:
        run["flops"] = StepFlops(run["lower"], run["first"], line=line)
        line = run["flops"].line  # the same step function: one line for every layout
        results.append(measure(args, run, workers, compile_s))
    print(json.dumps(results, indent=2), flush=True)


def write_shards(args) -> tuple[int, str]:
    """(image size of --preset, shard folder): --data, or a new temporary folder, with
    --samples records written to it if it holds none (their crop counts by --counts)."""
    from bench_input import build_shards
    from sclaro_jax.models import clip

    size = clip.config_from_preset(args.preset).vision.image_size
    data = args.data = args.data or os.path.join(tempfile.mkdtemp(), "shards")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        t0 = time.perf_counter()
        build_shards(data, args.samples, n_obj=args.objects, n_rel=args.relations,
                     view_size=size, demo_counts=args.counts == "demo")
        print(f"wrote {args.samples} records to {data} in {time.perf_counter() - t0:.1f} s",
              flush=True)
    return size, data


def prepare(args, data: str, size: int, layout: str, data_only: bool = False,
            max_sizes: int | None = None) -> dict:
    """One layout's step, train state, loader config and the batches of every shape it runs
    (the caps' one shape; each planned packed size, at most `max_sizes` of them, by default
    `packing.plan`'s); `data_only`: the loader config alone."""
    import jax
    import jax.numpy as jnp

    from bench_train_step import every_size
    from sclaro_jax.data import packing
    from sclaro_jax.data.dataset import open_dataset
    from sclaro_jax.data.pipeline import PipelineConfig, make_loader
    from sclaro_jax.models import scenarioclip
    from sclaro_jax.train import core

    sizes = None
    if layout == "packed":
        sizes = packing.plan(*packing.split_histograms(open_dataset(data), "train"), args.batch,
                             max_sizes=max_sizes or packing.MAX_TIERS)
    pcfg = PipelineConfig(image_size=size, max_objects=args.objects,
                          max_relations=args.relations, text_length=32, layout=layout,
                          packed=sizes)
    if data_only:
        return {"pcfg": pcfg}
    model = scenarioclip.build("scenarioclip", preset=args.preset, dtype=jnp.dtype(args.dtype))
    cfg = core.TrainConfig(total_steps=10_000)
    graphdef, state, tx = core.init_state(model, cfg)
    del model
    step = jax.jit(core.make_train_step(graphdef, tx, cfg), donate_argnums=0)
    first = next(iter(make_loader(data, "train", args.batch, config=pcfg, seed=0)))
    run = {"layout": layout, "sizes": sizes, "pcfg": pcfg, "step": step, "state": state,
           "first": first, "shapes": every_size(sizes, first) if sizes else [first]}
    # FLOPs from lowerings at the state's shapes (the state itself is donated once it trains)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    run["lower"] = lambda b: step.lower(shapes, b)
    return run


def compile_all(runs: list[dict], threads: int) -> float:
    """Compile every executable of every layout up front, `threads` at a time (XLA releases
    the GIL while it compiles; the jitted steps then find them in JAX's compilation cache).
    Returns the wall seconds."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(run, b) for run in runs for b in run["shapes"]]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(lambda job: job[0]["step"].lower(job[0]["state"], job[1]).compile(),
                      jobs))
    wall = time.perf_counter() - t0
    print(f"compiled {len(jobs)} executables, {threads} at a time, in {wall:.1f} s", flush=True)
    return wall


def read_results(path: str) -> list[dict]:
    """The results list a run prints last (its JSON from a line "[" to a line "]")."""
    lines = Path(path).read_text().splitlines()
    try:
        start = max(i for i, line in enumerate(lines) if line == "[")
        end = next(i for i in range(start, len(lines)) if lines[i] == "]")
    except (ValueError, StopIteration):
        raise SystemExit(f"{path}: no results list (a line '[' ... a line ']') in it") from None
    return json.loads("\n".join(lines[start:end + 1]))


def timed_batches(args, pcfg, workers: int, warmup: int, steps: int):
    """The batches a measurement times, one by one: the loader of seed 1 after `warmup`
    batches, `steps` of them (the same ones for the same records, batch and worker count:
    each Grain worker batches its own share of the records)."""
    from sclaro_jax.data.pipeline import make_loader

    it = iter(make_loader(args.data, "train", args.batch, config=pcfg, seed=1,
                          worker_count=workers, worker_buffer_size=args.buffer))
    for _ in range(warmup):
        next(it)
    for _ in range(steps):
        yield next(it)


def recount(args, size: int, results: list[dict]) -> list[dict]:
    """MFU and useful MFU of an earlier run's results: its batches drawn again (first, before
    any model exists, keeping one batch per shape and every batch's real crops), then their
    FLOPs counted here at each batch's shape and real crops, over its step times. Warm-up and
    timed steps are the run's own where it recorded them, else --warmup / --steps."""
    peak, line = args.peak_tflops * 1e12, None
    for result in results:
        warmup, steps = result.get("warmup", args.warmup), result.get("steps", args.steps)
        pcfg = prepare(args, args.data, size, result["layout"], data_only=True)["pcfg"]
        drawn = []
        for row in result["real_data"]:
            one, crops = {}, []
            for b in timed_batches(args, pcfg, row["workers"], warmup, steps):
                key = (b["object_mask"].shape, b["relation_mask"].shape)
                one.setdefault(key, b)
                crops.append((key, real_crops(b)))
            drawn.append((one, crops))
        run = prepare(args, args.data, size, result["layout"])
        flops = StepFlops(run["lower"], run["first"], line=line)
        line = flops.line
        f_all, f_real = flops(run["first"])
        device = result["device_batch"]
        device.update(mfu=f_all / device["step_s"] / peak,
                      useful_mfu=f_real / device["step_s"] / peak)
        for row, (one, crops) in zip(result["real_data"], drawn):
            f_all = sum(flops(one[key])[0] for key, _ in crops)
            f_real = sum(flops.useful(*real) for _, real in crops)
            wall = row["step_s"] * steps
            row.update(mfu=f_all / wall / peak, useful_mfu=f_real / wall / peak,
                       tflops_per_step=f_all / steps / 1e12,
                       useful_tflops_per_step=f_real / steps / 1e12)
        del run, drawn
    return results


def measure(args, run: dict, workers: list[int], compile_s: float) -> dict:
    """One layout: the step on a fixed device batch, then fed by Grain with each worker
    count."""
    import jax
    import numpy as np

    from sclaro_jax.data.pipeline import make_loader

    layout, sizes, pcfg, step = run["layout"], run["sizes"], run["pcfg"], run["step"]
    state, first, flops, data = run.pop("state"), run["first"], run["flops"], args.data
    device_batch = jax.device_put(first)
    t0 = time.perf_counter()
    state, metrics = step(state, device_batch)
    jax.block_until_ready(metrics)
    first_call_s = time.perf_counter() - t0
    for b in run["shapes"]:
        flops(b)
        state, metrics = step(state, jax.device_put(b))  # no compilation: compile_all did it
    for _ in range(3):
        state, metrics = step(state, device_batch)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, device_batch)
    jax.block_until_ready(metrics)
    device_s = (time.perf_counter() - t0) / args.steps
    peak = args.peak_tflops * 1e12
    f_all, f_real = flops(first)
    result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "cores": os.cpu_count(), "batch": args.batch, "objects": args.objects,
              "relations": args.relations, "dtype": args.dtype, "compile_s_all_layouts": compile_s,
              "first_call_s": first_call_s, "warmup": args.warmup, "steps": args.steps,
              "layout": layout, "counts": args.counts,
              "packed_sizes": sizes.describe() if sizes else None,
              "device_batch": {"step_s": device_s, "examples_per_sec": args.batch / device_s,
                               "mfu": f_all / device_s / peak,
                               "useful_mfu": f_real / device_s / peak},
              "real_data": []}
    print(json.dumps(result), flush=True)
    for count in workers:
        loader = make_loader(data, "train", args.batch, config=pcfg, seed=1,
                             worker_count=count, worker_buffer_size=args.buffer)
        it = iter(loader)
        for _ in range(args.warmup):
            state, metrics = step(state, jax.device_put(next(it)))
        jax.block_until_ready(metrics)
        wait, done, crops = 0.0, [], 0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            w0 = time.perf_counter()
            batch = next(it)
            wait += time.perf_counter() - w0
            done.append(flops(batch))
            crops += sum(real_crops(batch))
            state, metrics = step(state, jax.device_put(batch))
        jax.block_until_ready(metrics)
        wall = time.perf_counter() - t0
        f_all, f_real = np.sum(done, axis=0)
        row = {"workers": count, "buffer": args.buffer, "step_s": wall / args.steps,
               "examples_per_sec": args.batch * args.steps / wall,
               "useful_crops_per_sec": crops / wall,
               "data_wait_fraction": wait / wall,
               "of_device_batch_rate": device_s * args.steps / wall,
               "mfu": f_all / wall / peak, "useful_mfu": f_real / wall / peak,
               "loss": float(metrics["loss"]),
               "recompiles": step._cache_size() - (sizes.tiers if sizes else 1)}
        result["real_data"].append(row)
        print(json.dumps(row), flush=True)
        del it, loader
    return result

if __name__ == "__main__":
    main()
