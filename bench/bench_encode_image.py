"""Jitted Flax `encode_image` against transformers' PyTorch CLIP on the same weights.

ViT-B/32 (random-initialised Hugging Face CLIPModel written with `save_pretrained`), batch 32,
224 px, fp32. Both run in this one process on the same number of threads; each is warmed up, then
timed over `--iters` rounds of one call each (alternating which goes first); reported are each
one's median and minimum seconds and the median over rounds of the paired ratio Flax/PyTorch,
the figure least moved by load drifting on a shared machine. Prints a Markdown row for bench/README.md.

    python bench/bench_encode_image.py [--threads N] [--batch 32] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="PyTorch intra-op threads (default: all cores, which XLA:CPU uses too)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--preset", default="ViT-B/32", help="sclaro_jax.models.clip preset")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype of the Flax path (PyTorch stays fp32)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import torch
    import transformers
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sclaro_jax.models import clip

    torch.set_num_threads(args.threads)
    cfg = clip.config_from_preset(args.preset)
    hf_cfg = transformers.CLIPConfig(**{k: v for k, v in clip._config_to_hf(cfg).items()
                                        if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    hf = transformers.CLIPModel(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = clip.from_hf(d, dtype=jnp.dtype(args.dtype))

    size = cfg.vision.image_size
    x = np.random.default_rng(0).standard_normal((args.batch, size, size, 3), np.float32)
    x_t = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
    x_j = jnp.asarray(x)

    graphdef, state = nnx.split(model)

    @jax.jit
    def encode(state, pixels):
        return nnx.merge(graphdef, state).encode_image(pixels)

    def run_torch():
        with torch.inference_mode():
            return hf.get_image_features(x_t).pooler_output.numpy()

    def run_jax():
        return np.asarray(encode(state, x_j))

    def paired_timings(fns, pause=0.25):
        """Per-round seconds of each function. Calls alternate within a round (the order flips
        every round) so drift in machine load hits both alike; the pause lets the other
        framework's spinning worker threads go idle first."""
        for fn in fns:
            fn(), fn()  # compile / warm up
        times = np.zeros((args.iters, len(fns)))
        for r in range(args.iters):
            order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
            for i in order:
                time.sleep(pause)
                t0 = time.perf_counter()
                fns[i]()
                times[r, i] = time.perf_counter() - t0
        return times

    diff = float(np.abs(run_torch() - run_jax()).max())
    times = paired_timings([run_torch, run_jax])
    t_torch, t_jax = np.median(times, axis=0)
    min_torch, min_jax = times.min(axis=0)
    ratio = float(np.median(times[:, 1] / times[:, 0]))  # median of the paired ratios
    print(f"versions: jax {jax.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; threads {args.threads}; "
          f"backend {jax.default_backend()}; max |diff| {diff:.2e}")
    print("| model | batch | dtype | threads | rounds | Flax jit median (min) s "
          "| PyTorch median (min) s | ratio Flax/PyTorch (median of paired rounds) |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.preset} | {args.batch} | {args.dtype} | {args.threads} | {args.iters} "
          f"| {t_jax:.3f} ({min_jax:.3f}) | {t_torch:.3f} ({min_torch:.3f}) | {ratio:.2f} |")
    return ratio


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
