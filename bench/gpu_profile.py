"""Where the training step's time goes on one accelerator: a `jax.profiler` trace of a few steps
of the paper recipe from real records, as a table by kind of work (GEMMs, attention's core,
elementwise fusions, reductions, optimiser + EMA, photometric augmentation, copies, other, host
gaps): time and share of the step, FLOPs and bytes per step, achieved rates against ceilings
measured in the same process. The analysis is `gpu_profile_analysis.py`.

    python bench/gpu_profile.py --override model.dtype=bfloat16 --out /tmp/profile  # the H200
    python bench/gpu_profile.py --config configs/scenarioclip.py:demo --samples 16 \\
        --warmup 1 --steps 2 --workers 0 --out /tmp/profile                      # a CPU
    python bench/gpu_profile.py --from-trace /tmp/profile            # the table again, no run

The step is the trainer's for --config (`bench/recipe.py`: the paper recipe by default, every
`config.perf` switch as the config says) at one packed size (`data.max_packed_sizes=1`), so
one executable compiles, as a run compiles it (`run.ahead.CompiledSteps`). Records: version-2
shards of the demo photographs, each with its own object and relation counts, written into
--data unless it holds some. The batches are drawn from the trainer's loader and put on the
device first; the step runs --warmup times, then --steps times under the profiler.

Ceilings, measured after the trace: a matmul in the step's own dtypes at each of its most
time-consuming matmul shapes (taken from the HLO), jitted; and y = x + 1 over a float32 array
(2 GiB on an accelerator, 64 MiB on the CPU), bytes read + written.

Output (--out): profile.md and profile.json (the table, the step's figures and the run's),
trace/ (the profiler's folder) and hlo/<module>.txt (the optimized HLO that ran), which is what
--from-trace reads to build the same table again on any machine, running nothing.

On a GPU, XLA runs most kernels inside command buffers (CUDA graphs), whose cuBLAS / cuDNN
kernels do not say which instruction they ran: they get their kind from the kernel name and
count as unmapped (the table says how much time that is). With
XLA_FLAGS=--xla_gpu_enable_command_buffer= every kernel maps, at the price of one launch each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_train import _timed, lowered_flops  # noqa: E402
from recipe import add_recipe_arguments  # noqa: E402
from gpu_profile_analysis import (  # noqa: E402
    Module, attribute, hlo_costs, load_trace, report, table)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_recipe_arguments(parser)
    parser.add_argument("--warmup", type=int, default=3, help="steps run before the trace")
    parser.add_argument("--steps", type=int, default=5, help="steps traced")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="Grain worker processes drawing the batches (0: this process)")
    parser.add_argument("--out", default="", help="output folder (default: a new one in /tmp)")
    parser.add_argument("--from-trace", default="", metavar="DIR",
                        help="an earlier run's --out: its table again from its trace and HLO "
                             "(written to --out too if given)")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    return args


def prepare_profile(args):
    """(the trainer's compiled step with the state donated, train state, host batches, the
    run's description) for `profile`: --config's recipe at one packed size (one executable),
    from --data's records (written first if it holds none)."""
    from recipe import recipe, trainer_step
    from sclaro_jax.run.ahead import CompiledSteps

    config = recipe(args, **{"data.max_packed_sizes": 1, "data.workers": args.workers})
    built = trainer_step(config, args.warmup + args.steps)
    step = CompiledSteps(built["jitted"], built["state"], built["specs"])
    run = {"config": args.config, "overrides": args.override,
           "preset": config.model.preset, "batch": config.data.batch_size,
           "dtype": config.model.dtype, "layout": config.data.layout, "counts": "demo",
           "data": config.data.dir, "perf": dict(config.perf),
           "packed_sizes": built["packed"].describe() if built["packed"] else None}
    return step, built["state"], built["host"], run


def measure_ceilings(shapes: list[dict], stream_bytes: int) -> dict:
    """Best-of-5 rates (10 calls each): a jitted batched matmul at each of `shapes` ({"shape":
    [B, M, N, K], "dtypes": [lhs, rhs, out] as HLO names them}) on random data, and y = x + 1
    over `stream_bytes` of float32 (in place, the input donated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    names = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
             "s8": "int8", "u8": "uint8", "s32": "int32", "f8e4m3fn": "float8_e4m3fn",
             "f8e5m2": "float8_e5m2"}
    rng = np.random.default_rng(0)
    matmuls = []
    for m in shapes:
        (b, rows, cols, k), (lhs, rhs, out) = m["shape"], [names.get(t, t) for t in m["dtypes"]]
        x = jax.device_put(rng.standard_normal((b, rows, k), np.float32).astype(jnp.dtype(lhs)))
        y = jax.device_put(rng.standard_normal((b, k, cols), np.float32).astype(jnp.dtype(rhs)))
        dot = jax.jit(lambda x, y, out=out: jax.lax.dot_general(
            x, y, (((2,), (1,)), ((0,), (0,))), preferred_element_type=out))
        jax.block_until_ready(dot(x, y))
        seconds = min(_timed(lambda: dot(x, y), 5, 10))
        matmuls.append({**m, "tflops": 2 * b * rows * cols * k / seconds / 1e12})
        del x, y
    add = jax.jit(lambda x: x + 1, donate_argnums=0)
    held = [jnp.zeros((stream_bytes // 4,), jnp.float32)]

    def stream():
        held[0] = add(held[0])
        return held[0]

    jax.block_until_ready(stream())
    seconds = min(_timed(stream, 5, 10))
    return {"matmul": matmuls, "stream_bytes": 2 * held[0].nbytes,
            "stream_gbs": 2 * held[0].nbytes / seconds / 1e9}


def profile(step, state, batches: list, out, steps: int = 5, warmup: int = 3,
            run: dict | None = None) -> dict:
    """Trace `steps` calls of `step` (a `run.ahead.CompiledSteps` of one executable: `(state,
    batch) -> (state, metrics)`, state donated) after `warmup` untimed ones, the batches used
    in turn, all put on the device first; write the report, trace and HLO to `out`; return
    the report (`table(report)` is its Markdown). `run`: what to record of the run (preset,
    dtype, ...)."""
    import jax

    from sclaro_jax.data import batch as fields

    out = Path(out)
    (out / "hlo").mkdir(parents=True, exist_ok=True)
    batch_size = len(batches[0][fields.IMAGE])
    lowered = step.jitted.lower(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state), batches[0])
    batches = [jax.device_put(b) for b in batches]
    # The calls below go to this executable itself: one compilation, and its text is the
    # module that runs.
    (compiled,) = step.executables.values()
    compile_s = step.seconds
    hlo = compiled.as_text()
    module = hlo.split(None, 2)[1].rstrip(",")
    (out / "hlo" / f"{module}.txt").write_text(hlo)
    print(f"lowered and compiled {module} in {compile_s:.1f} s", flush=True)
    for i in range(warmup):
        state, metrics = compiled(state, batches[i % len(batches)])
    jax.block_until_ready(metrics)
    with jax.profiler.trace(str(out / "trace"), create_perfetto_trace=True):
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            state, metrics = compiled(state, batches[i % len(batches)])
        jax.block_until_ready(metrics)
        wall = time.perf_counter() - t0
    del state, metrics, batches
    found = [*(out / "trace").glob("plugins/profile/*/perfetto_trace.json.gz"),
             *(out / "trace").glob("plugins/profile/*/*.trace.json.gz")]
    trace = max(found, key=lambda p: (p.parent.name, p.name.startswith("perfetto")))
    print(f"traced {steps} steps ({wall / steps * 1e3:.1f} ms each); reading the trace",
          flush=True)
    device = jax.devices()[0]
    name = device.device_kind
    run = {**(run or {}), "device": name if name == device.platform else
           f"{name} ({device.platform})",
           "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "batch": batch_size, "steps": steps, "warmup": warmup, "compile_s": compile_s,
           "wall_ms": wall / steps * 1e3, "trace": str(trace.relative_to(out)),
           "hlo": [f"hlo/{module}.txt"]}
    # What --from-trace needs, saved before anything below can fail.
    write({"run": run}, out, markdown=False)
    attr, shapes = None, {}
    try:
        modules = [Module(hlo)]
        shapes = hlo_costs(modules)[1]  # by FLOPs alone, should the trace's analysis fail
        attr = attribute(load_trace(trace), modules, steps)
        shapes = attr["matmul_shapes"]
    except Exception:  # keep the session's data: the ceilings below, then --from-trace
        traceback.print_exc()
    try:
        run["lowered_tflop"] = lowered_flops(lowered) / 1e12
    except Exception as err:  # only a cross-check of the table's count
        print(f"no XLA FLOP count of the lowered step: {err!r}", flush=True)
    keys = {json.dumps([m["shape"], m["dtypes"]]) for found in shapes.values() for m in found}
    run["ceilings"] = measure_ceilings(
        [dict(zip(("shape", "dtypes"), json.loads(k))) for k in sorted(keys)],
        2 ** 26 if device.platform == "cpu" else 2 ** 31)
    write({"run": run}, out, markdown=False)
    if attr is None:
        raise SystemExit(f"the analysis failed; trace, HLO and the run's figures are in {out}: "
                         "python bench/gpu_profile.py --from-trace " + str(out))
    rep = report(attr, run)
    write(rep, out)
    return rep


def write(rep: dict, out, markdown: bool = True) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(rep, indent=2) + "\n")
    if markdown:
        (out / "profile.md").write_text(table(rep) + "\n")


def from_trace(folder) -> dict:
    """The report of an earlier `profile` into `folder`, computed again from its trace, its HLO
    and the run's recorded figures (step count, batch, ceilings)."""
    folder = Path(folder)
    run = json.loads((folder / "profile.json").read_text())["run"]
    attr = attribute(load_trace(folder / run["trace"]),
                     [Module((folder / path).read_text()) for path in run["hlo"]], run["steps"])
    return report(attr, run)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.from_trace:
        rep = from_trace(args.from_trace)
        if args.out:
            write(rep, args.out)
    else:
        import tempfile

        args.out = args.out or tempfile.mkdtemp(prefix="gpu_profile_")
        step, state, batches, run = prepare_profile(args)
        rep = profile(step, state, batches, args.out, args.steps, args.warmup, run)
        print(f"trace, HLO and report in {args.out}", flush=True)
    print(table(rep))


if __name__ == "__main__":
    main()
