"""Jitted Flax `encode_image` against transformers' PyTorch CLIP on the same weights.

ViT-B/32 (random-initialised Hugging Face CLIPModel written with `save_pretrained`), batch 32,
224 px, fp32. The Flax forward is timed twice: jitted with `sclaro_jax.compile.jit` (our
per-backend XLA options) and with plain `jax.jit`. All run in this one process on the same
number of threads; each is warmed up, then timed over `--iters` rounds of one call each
(alternating the order); reported are each one's median and minimum seconds and the median over
rounds of the paired ratio Flax/PyTorch, the figure least moved by load drifting on a shared
machine. Prints a Markdown row for bench/README.md.

    python bench/bench_encode_image.py [--threads N] [--batch 32] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


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

    from timing import paired_timings

    from sclaro_jax import compile as sj_compile
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

    def encode(state, pixels):
        return nnx.merge(graphdef, state).encode_image(pixels)

    encode_ours = sj_compile.jit(encode)  # with sclaro_jax's CPU compile options
    encode_default = jax.jit(encode)  # XLA's defaults

    def run_torch():
        with torch.inference_mode():
            return hf.get_image_features(x_t).pooler_output.numpy()

    def run_jax():
        return np.asarray(encode_ours(state, x_j))

    def run_jax_default():
        return np.asarray(encode_default(state, x_j))

    diff = float(np.abs(run_torch() - run_jax()).max())
    times = paired_timings([run_torch, run_jax, run_jax_default], args.iters)
    med, low = np.median(times, axis=0), times.min(axis=0)
    ratio, ratio_default = (float(np.median(times[:, i] / times[:, 0])) for i in (1, 2))
    print(f"versions: jax {jax.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; threads {args.threads}; "
          f"backend {jax.default_backend()}; compile options {sj_compile.compiler_options()}; "
          f"max |diff| {diff:.2e}")
    print("| model | batch | dtype | rounds | Flax jit median (min) s | Flax jit, XLA defaults "
          "median (min) s | PyTorch median (min) s | ratio Flax/PyTorch | ratio with XLA defaults |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.preset} | {args.batch} | {args.dtype} | {args.iters} "
          f"| {med[1]:.3f} ({low[1]:.3f}) | {med[2]:.3f} ({low[2]:.3f}) "
          f"| {med[0]:.3f} ({low[0]:.3f}) | {ratio:.2f} | {ratio_default:.2f} |")
    return ratio


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
