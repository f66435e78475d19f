"""The switches of `config.perf` against the default step, one at a time, on the paper recipe's
step as the trainer builds it (`trainer` over the config), on real records' batches already on
the device: step seconds, examples/s, speed-up, MFU / useful MFU, compile seconds, and the loss
after the same steps from the same start (every switch computes the default's numbers to
rounding). The switches are tried in the order of the profile's shares of the work each
targets (`--profile`: bench/gpu_profile.py's profile.json), so a budget cut keeps the likeliest
winners; all are compiled first (`--threads` at a time), then timed one by one.

    python bench/bench_step_variants.py --data DIR --profile P/profile.json --json V.json
    python bench/bench_step_variants.py --config configs/scenarioclip.py:demo --data DIR \\
        --variants default,fused_qkv --json V.json                        # a CPU
    python bench/bench_step_variants.py --overrides-of V.json   # the winners, one flag a line

Winners: the fastest of each group of exclusive switches (attention, packed multiple, XLA
options), and any other switch, when at least --min-gain faster than the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe import add_recipe_arguments  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    perf: dict  # config.perf overrides
    kind: str | None = None  # the profile row it targets (its share orders the tries)
    group: str | None = None  # variants of one group exclude each other


VARIANTS = [
    Variant("default", {}),
    Variant("fused_qkv", {"fused_qkv": True}, "gemm"),
    Variant("attention_xla", {"attention": "xla"}, "attention", "attention"),
    Variant("attention_cudnn", {"attention": "cudnn"}, "attention", "attention"),
    Variant("fused_update", {"fused_update": True}, "optimizer"),
    Variant("graph_min_1", {"xla_options": "xla_gpu_graph_min_graph_size=1"}, "gaps", "xla"),
    Variant("command_buffer_off", {"xla_options": "xla_gpu_enable_command_buffer="}, "gaps",
            "xla"),
    Variant("triton_gemm_off", {"xla_options": "xla_gpu_enable_triton_gemm=false"}, "gemm",
            "xla"),
    Variant("packed_64", {"packed_multiple": 64}, "gemm", "packed"),
]
BY_NAME = {v.name: v for v in VARIANTS}


def ordered(names: list[str], profile: dict | None) -> list[Variant]:
    """The default first, then by the profile's share of each variant's kind (largest first;
    the list's order without a profile)."""
    share = {row["kind"]: row["share"] for row in (profile or {}).get("rows", [])}
    chosen = [BY_NAME[n] for n in names]
    rest = sorted((v for v in chosen if v.name != "default"),
                  key=lambda v: -share.get(v.kind, 0.0))
    return [BY_NAME["default"]] + rest


def variant_config(base, variant: Variant):
    config = base.copy_and_resolve_references()
    with config.unlocked():
        for key, value in variant.perf.items():
            config.perf[key] = value
    return config


def build(config, steps: int) -> dict:
    """The trainer's step of `config` (one packed size) compiled ahead as a run compiles it,
    its state and `steps` batches on the device."""
    import jax

    from recipe import trainer_step
    from sclaro_jax.models.layers import cudnn_attention_calls
    from sclaro_jax.run import sharding
    from sclaro_jax.run.ahead import CompiledSteps

    built = trainer_step(config, steps)
    step = CompiledSteps(built["jitted"], built["state"], built["specs"], threads=1)
    state = built["state"]
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
    (executable,) = step.executables.values()
    return {"step": step, "state": state, "host": built["host"],
            "batches": [sharding.put_batch(b, built["mesh"]) for b in built["host"]],
            "compile_s": step.seconds, "lower": lambda b: built["jitted"].lower(shapes, b),
            "cudnn_attention_calls": cudnn_attention_calls(executable.as_text())}


def measure(built: dict, repeats: int, peak: float, useful_flops) -> dict:
    import jax

    from bench_gpu_train import lowered_flops
    from bench_train_step import real_crops

    step, state, batches = built.pop("step"), built.pop("state"), built["batches"]
    losses = []
    for b in batches:  # the same steps from the same start for every variant
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in batches:
            state, metrics = step(state, b)
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - t0) / len(batches))
    step_s = float(np.median(times))
    flops = float(np.mean([lowered_flops(built["lower"](b)) for b in built["host"][:1]]))
    useful = float(np.mean([useful_flops(*real_crops(b)) for b in built["host"]]))
    batch = len(built["host"][0]["valid"])
    del state
    return {"step_s": step_s, "step_s_repeats": times, "examples_per_sec": batch / step_s,
            "mfu": flops / step_s / peak, "useful_mfu": useful / step_s / peak,
            "losses": losses, "compile_s": built["compile_s"],
            "cudnn_attention_calls": built["cudnn_attention_calls"]}


def winners(results: list[dict], min_gain: float) -> dict:
    """The config.perf overrides to train with: the best of each group, other switches alone,
    each when at least `min_gain` faster than the default."""
    base = next(r for r in results if r["name"] == "default" and "step_s" in r)["step_s"]
    best: dict = {}
    for r in results:
        if "step_s" not in r or r["name"] == "default" or base / r["step_s"] < 1 + min_gain:
            continue
        key = BY_NAME[r["name"]].group or r["name"]
        if key not in best or r["step_s"] < best[key]["step_s"]:
            best[key] = r
    out: dict = {}
    for r in best.values():
        for key, value in BY_NAME[r["name"]].perf.items():
            if key == "xla_options" and out.get(key):
                value = f"{out[key]} {value}"
            out[key] = value
    return out


def overrides(path: str) -> list[str]:
    """The winners of a results file as `--config.perf.KEY=VALUE` flags."""
    found = json.loads(Path(path).read_text()).get("winners", {})
    return [f"--config.perf.{k}={v}" for k, v in found.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_arguments(parser)
    parser.add_argument("--variants", default=",".join(v.name for v in VARIANTS),
                        help=f"comma-separated, of {[v.name for v in VARIANTS]}")
    parser.add_argument("--profile", default="", help="profile.json: order the variants by it")
    parser.add_argument("--steps", type=int, default=10, help="batches per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="variants compiled at once (0: one per four cores)")
    parser.add_argument("--min-gain", type=float, default=0.02)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--json", default="", help="write the results here (after each one)")
    parser.add_argument("--overrides-of", default="", metavar="JSON",
                        help="print the winners of an earlier --json as config flags and exit")
    args = parser.parse_args(argv)
    if args.overrides_of:
        flags = overrides(args.overrides_of)
        if flags:  # none: no line at all (an empty line would be an empty argument)
            print("\n".join(flags))
        return
    unknown = [n for n in args.variants.split(",") if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(BY_NAME)}")

    from bench_run_start import step_flops
    from recipe import recipe
    from sclaro_jax.run.ahead import default_threads

    # one executable per variant; batches made in this process
    base = recipe(args, **{"data.max_packed_sizes": 1, "data.workers": 0})
    profile = None
    if args.profile and Path(args.profile).is_file():
        profile = json.loads(Path(args.profile).read_text())
    elif args.profile:
        print(f"{args.profile} not found: the variants in their listed order", flush=True)
    variants = ordered(args.variants.split(","), profile)
    useful_flops = step_flops(base)[1]
    peak = args.peak_tflops * 1e12
    results = [{"name": v.name, "perf": v.perf} for v in variants]

    def compile_one(i):
        try:
            return build(variant_config(base, variants[i]), args.steps)
        except Exception as err:  # noqa: BLE001 (a switch this machine refuses: reported)
            return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}

    threads = args.threads or default_threads(len(variants))
    with ThreadPoolExecutor(threads) as pool:
        built = list(pool.map(compile_one, range(len(variants))))
    for result, made in zip(results, built):
        if "error" in made:
            result.update(made)
        else:
            result.update(measure(made, args.repeats, peak, useful_flops))
        write(args.json, results, args.min_gain, useful_flops)
    print(render(results))
    print(json.dumps({"winners": winners(results, args.min_gain)}))


def write(path: str, results: list[dict], min_gain: float, useful_flops=None) -> None:
    """The JSON: the variants measured so far, the winners once the default is measured, and
    the default step's useful-FLOPs line (`bench_run_start.UsefulLine`: the run stage takes it,
    `--useful-flops-from`)."""
    if not path:
        return
    done = [r for r in results if "step_s" in r or "error" in r]
    payload = {"results": done}
    if any(r["name"] == "default" and "step_s" in r for r in done):
        payload["winners"] = winners(done, min_gain)
    if useful_flops is not None:
        payload["useful_flops"] = dataclasses.asdict(useful_flops)
    Path(path).write_text(json.dumps(payload, indent=2))


def render(results: list[dict]) -> str:
    base = next((r for r in results if r["name"] == "default" and "step_s" in r), None)
    lines = ["| variant | step ms | examples/s | speed-up | MFU | useful MFU | compile s "
             "| loss diff | cuDNN attention |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} | | | | | | | |")
            continue
        diff = max(abs(a - b) / max(abs(b), 1e-12)
                   for a, b in zip(r["losses"], base["losses"])) if base else float("nan")
        lines.append(f"| {r['name']} | {1e3 * r['step_s']:.1f} | {r['examples_per_sec']:,.0f} "
                     f"| {base['step_s'] / r['step_s']:.3f}x | {r['mfu']:.1%} "
                     f"| {r['useful_mfu']:.1%} | {r['compile_s']:.0f} | {diff:.1e} "
                     f"| {r['cudnn_attention_calls']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
