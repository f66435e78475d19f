"""Examples/sec and MFU of the ScenarioCLIP training step on one accelerator (synthetic batches,
so the input pipeline is out of the measurement; see bench_input.py for that side).

    python bench/bench_gpu_train.py --preset ViT-B/32 --batch 128 --objects 8 --relations 8 \
        --dtype bfloat16 --peak-tflops 989 [--breakdown]

FLOPs per step come from XLA's cost analysis of the step as written (the lowered HLO: every dot
at 2*M*N*K, backend-independent); MFU = FLOPs per step / step time / peak. The peak defaults to the dense bf16 figure of an H100/H200 SXM (989 TFLOP/s).

Crop counts (`--counts`): "full" fills every one of the --objects / --relations slots of every
image (the step's best case); "demo" draws each image's counts from the bundled demo's
photographs, as real data leaves slots empty. `--layout caps` pads every image to the slots;
`--layout packed` packs the batch's crops into the smallest planned size
(`sclaro_jax.data.packing`; every size compiled before timing, a few batches cycled). Useful
MFU counts only the FLOPs of real crops: the step's FLOPs are linear in the crop slots of each
level (three lowerings give the line), evaluated at the real crop counts.

    python bench/bench_gpu_train.py --counts demo --layout caps
    python bench/bench_gpu_train.py --counts demo --layout packed

The step's speed switches are a run's `config.perf` (`sclaro_jax.perf.PerfConfig`): --attention
einsum | xla | cudnn, --fused-qkv, --fused-update, --xla-options "name=value ...",
--packed-multiple N; the result names them, with the cuDNN fused-attention calls in the compiled
step. (bench/README.md's `--attention dpa` rows measured an earlier stand-in for "xla" that
passed the text tower's causal mask as a dense mask.)

    python bench/bench_gpu_train.py --counts demo --layout packed --attention cudnn --fused-qkv
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train_step import real_crops, resized  # noqa: E402


def _flops(cost) -> float:
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", float("nan")))


def lowered_flops(lowered) -> float:
    """XLA's FLOP count of a lowered (not compiled) computation. A backend reached through the
    PJRT C API (the CUDA plugin) has no pre-compilation cost analysis (`Lowered.cost_analysis`
    gives None there), so the same HLO module is then counted by the CPU client's analysis,
    which counts every dot and convolution at 2*M*N*K whatever the platform."""
    flops = _flops(lowered.cost_analysis())
    if flops == flops:
        return flops
    import jax
    from jax._src.lib import _jax  # no public form of the CPU client's HLO cost analysis
    module = lowered.compiler_ir("hlo").as_hlo_module()
    return _flops(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))


def _timed(fn, repeats: int, steps: int) -> list[float]:
    """Seconds per call of `fn` (which returns something to block on), `repeats` times."""
    import jax
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            result = fn()
        jax.block_until_ready(result)
        out.append((time.perf_counter() - t0) / steps)
    return out


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The paper config's step: preset, batch, crops per image, compute dtype."""
    parser.add_argument("--preset", default="ViT-B/32")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--relations", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layout", choices=("caps", "packed"), default="caps")
    parser.add_argument("--counts", choices=("full", "demo"), default="full",
                        help="crops per image: every slot, or drawn from the demo's photographs")


def step_batches(args, batches: int = 8, text_len: int = 32, align: int = 1):
    """(batches, packed sizes or None): `batches` synthetic batches of the step's config in its
    layout (one when every slot is full); packed sizes are multiples of `align`."""
    import numpy as np

    from bench_train_step import demo_counts, make_batch, pack_planned
    from sclaro_jax.data import packing
    caps = (args.objects, args.relations)
    if args.counts == "full":
        per_image = np.array([caps])
        batches = 1
    else:
        per_image = np.minimum(demo_counts(), caps)
    rng = np.random.default_rng(0)
    out = [make_batch(args.preset, args.batch, seed=i, n_obj=caps[0], n_rel=caps[1],
                      text_len=text_len, counts=per_image[rng.integers(0, len(per_image),
                                                                       args.batch)])
           for i in range(batches)]
    if args.layout == "caps":
        return out, None
    sizes = packing.plan(*(packing.histogram(per_image[:, k]) for k in range(2)), args.batch,
                         align=align)
    return [pack_planned(b, sizes) for b in out], sizes


def crop_flops_line(lower, packed_batch) -> tuple[float, float, float]:
    """(a, b, c): the step's FLOPs at k_o object and k_r relation slots are a + b k_o + c k_r
    (to the contrastive losses' k^2 terms, under a millionth), from three lowerings of a packed
    batch cut or grown to (k, k), (2k, k), (k, 2k). `lower(batch)` -> the lowered step."""
    k = max(8, min(real_crops(packed_batch)))

    def at(k_o, k_r):
        return lowered_flops(lower(resized(packed_batch, {"object": k_o, "relation": k_r})))
    base, more_o, more_r = at(k, k), at(2 * k, k), at(k, 2 * k)
    slope_o, slope_r = (more_o - base) / k, (more_r - base) / k
    return base - slope_o * k - slope_r * k, slope_o, slope_r


class StepFlops:
    """`(all, useful)` FLOPs of the step on a batch of either layout: XLA's count for the step
    lowered at the batch's shape (once per shape), and the crop line (`crop_flops_line`) at the
    batch's real crops. `lower(batch)` -> the lowered step; `first` is a batch of the run;
    `line` an earlier StepFlops' line of the same step function (not fitted again)."""

    def __init__(self, lower, first: dict, line: tuple[float, float, float] | None = None):
        from sclaro_jax.data import packing
        self.lower = lower
        self.line = line or crop_flops_line(lower, packing.pack(first))  # pack keeps packed
        self.lowered: dict = {}

    def __call__(self, batch: dict) -> tuple[float, float]:
        shape = (batch["object_mask"].shape, batch["relation_mask"].shape)
        if shape not in self.lowered:
            self.lowered[shape] = lowered_flops(self.lower(batch))
        return self.lowered[shape], self.useful(*real_crops(batch))

    def useful(self, k_o: int, k_r: int) -> float:
        """The step's FLOPs at k_o object and k_r relation crops (the crop line)."""
        return self.line[0] + self.line[1] * k_o + self.line[2] * k_r


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser)
    parser.add_argument("--text-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--flops-only", action="store_true",
                        help="print the step's FLOPs (no compilation, no timing) and exit")
    parser.add_argument("--attention", choices=("einsum", "xla", "cudnn"), default="einsum",
                        help="config.perf.attention: einsum (heads-major einsums), xla "
                             "(jax.nn.dot_product_attention on XLA) or cudnn (its cuDNN kernel)")
    parser.add_argument("--fused-qkv", action="store_true", help="config.perf.fused_qkv")
    parser.add_argument("--fused-update", action="store_true", help="config.perf.fused_update")
    parser.add_argument("--xla-options", default="",
                        help='config.perf.xla_options, e.g. "xla_gpu_enable_command_buffer="')
    parser.add_argument("--packed-multiple", type=int, default=1,
                        help="config.perf.packed_multiple")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the forward pass alone (student + teacher, no gradients)")
    args = parser.parse_args()

    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from sclaro_jax import compile as sc_compile
    from sclaro_jax.models import layers, scenarioclip
    from sclaro_jax.perf import PerfConfig
    from sclaro_jax.train import core

    perf = PerfConfig(fused_qkv=args.fused_qkv, attention=args.attention,
                      fused_update=args.fused_update, xla_options=args.xla_options,
                      packed_multiple=args.packed_multiple)
    host_batches, sizes = step_batches(args, text_len=args.text_length,
                                       align=perf.packed_align())
    batches = [jax.device_put(b) for b in host_batches]
    batch = batches[0]
    model = scenarioclip.build("scenarioclip", preset=args.preset, dtype=jnp.dtype(args.dtype),
                               attention=perf.attention_options())
    cfg = core.TrainConfig(total_steps=10_000)
    graphdef, state, tx = core.init_state(model, cfg)
    del model
    step = sc_compile.jit(core.make_train_step(graphdef, tx, cfg, fused_update=perf.fused_update),
                          options=perf.compiler_options(), donate_argnums=0)
    lowered = step.lower(state, batch)
    # FLOPs of the step as written (the HLO before backend passes: every dot and convolution at
    # 2*M*N*K). The compiled executable's own cost analysis is no use for MFU on GPU: GEMMs that
    # XLA hands to cuBLAS are custom calls, which it counts as zero FLOPs.
    step_flops = StepFlops(lambda b: step.lower(state, b), host_batches[0])
    flops, useful = (float(x) for x in np.mean([step_flops(b) for b in host_batches], axis=0))

    @jax.jit
    def forward(state, batch):
        model = nnx.merge(graphdef, state.params)
        teacher = nnx.merge(graphdef, state.teacher)  # its frozen leaves are the student's
        return core.compute_losses(model, teacher, batch, cfg, share_frozen_text=True)[0]

    if args.flops_only:
        print(json.dumps({"preset": args.preset, "batch": args.batch, "objects": args.objects,
                          "relations": args.relations, "dtype": args.dtype,
                          "layout": args.layout, "counts": args.counts,
                          "tflops_per_step": flops / 1e12, "useful_tflops_per_step": useful / 1e12,
                          "forward_tflops": lowered_flops(
                              forward.lower(state, batch)) / 1e12}))
        return
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    compiled_flops = _flops(compiled.cost_analysis())
    fused_attention_calls = layers.cudnn_attention_calls(compiled.as_text())
    holder = {"state": state}
    del state
    warm = batches
    if sizes is not None:  # every planned size compiled before timing
        from bench_train_step import every_size
        warm = batches + [jax.device_put(b) for b in every_size(sizes, host_batches[0])]
    cycle = {"i": 0}

    def one_step():
        b = batches[cycle["i"] % len(batches)]
        cycle["i"] += 1
        holder["state"], metrics = step(holder["state"], b)
        return metrics

    for b in warm:
        holder["state"], metrics = step(holder["state"], b)
    jax.block_until_ready(metrics)
    times = _timed(one_step, args.repeats, max(args.steps, len(batches)))
    dt = float(np.median(times))
    metrics = one_step()
    result = {
        "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
        "flax": flax.__version__, "preset": args.preset, "batch": args.batch,
        "objects": args.objects, "relations": args.relations, "dtype": args.dtype,
        "layout": args.layout, "counts": args.counts,
        "packed_sizes": None if sizes is None else sizes.describe(),
        "step_s": dt, "step_s_repeats": times, "examples_per_sec": args.batch / dt,
        "useful_crops_per_sec": float(np.mean([sum(real_crops(b)) for b in host_batches])) / dt,
        "tflops_per_step": flops / 1e12, "useful_tflops_per_step": useful / 1e12,
        "achieved_tflops": flops / dt / 1e12,
        "mfu": flops / dt / (args.peak_tflops * 1e12),
        "useful_mfu": useful / dt / (args.peak_tflops * 1e12),
        "compiled_cost_analysis_tflops": compiled_flops / 1e12, "compile_s": compile_s,
        "perf": {**dataclasses.asdict(perf), "xla_options": dict(perf.xla_options)},
        "cudnn_fused_attention_calls": fused_attention_calls,
        "loss": float(metrics["loss"]),
        "recompiles": step._cache_size() - (1 if sizes is None else sizes.tiers),
    }
    if args.breakdown:
        fwd_flops = lowered_flops(forward.lower(holder["state"], batch))
        jax.block_until_ready(forward(holder["state"], batch))
        fwd = float(np.median(_timed(lambda: forward(holder["state"], batch), args.repeats,
                                     args.steps)))
        result.update(forward_s=fwd, forward_tflops=fwd_flops / 1e12,
                      forward_mfu=fwd_flops / fwd / (args.peak_tflops * 1e12))
    result["peak_memory_gb"] = ((jax.devices()[0].memory_stats() or {}).get(
        "peak_bytes_in_use", 0) / 2 ** 30)
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
