"""Is the Flax ViT-B/32 forward bound by its matrix multiplies? Two paired measurements:

1. jitted `encode_image` against a jitted chain of only its GEMMs (same shapes, same count),
   both with `sclaro_jax.compile.jit`;
2. one [1600, 768] x [768, 3072] GEMM in XLA:CPU against the same GEMM in PyTorch (MKL).

    python bench/bench_gemm_bound.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    from timing import paired_timings

    from sclaro_jax import compile as sj_compile
    from sclaro_jax.models import clip

    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    cfg = clip.PRESETS["ViT-B/32"]
    v, b, p_ = cfg.vision, 32, cfg.vision.patch_size
    model = clip.create(cfg)
    graphdef, state = nnx.split(model)
    pixels = jnp.asarray(rng.standard_normal((b, v.image_size, v.image_size, 3), np.float32))
    encode = sj_compile.jit(lambda s, x: nnx.merge(graphdef, s).encode_image(x))

    d, ff, tokens = v.hidden_size, v.intermediate_size, b * (v.num_patches + 1)
    w = {k: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02) for k, shape in
         {"patch": (p_ * p_ * 3, d), "q": (d, d), "k": (d, d), "v": (d, d), "out": (d, d),
          "fc1": (d, ff), "fc2": (ff, d)}.items()}

    @sj_compile.jit
    def gemm_chain(x, w):
        h = x.reshape(b * v.num_patches, p_ * p_ * 3) @ w["patch"]
        h = jnp.concatenate([h, h[:b]])  # + class tokens: [tokens, d]
        for _ in range(v.num_hidden_layers):
            h = (h @ w["q"] + h @ w["k"] + h @ w["v"]) @ w["out"]
            h = (h @ w["fc1"]) @ w["fc2"]
        return h

    names = ["encode_image", "GEMMs only"]
    t = paired_timings([lambda: encode(state, pixels).block_until_ready(),
                        lambda: gemm_chain(pixels, w).block_until_ready()], args.rounds, 0.1)
    print("| jitted | median ms | min ms |\n|---|---|---|")
    for name, ts in zip(names, t.T):
        print(f"| {name} | {np.median(ts) * 1e3:.0f} | {ts.min() * 1e3:.0f} |")

    x = rng.standard_normal((tokens, d), np.float32)
    k = rng.standard_normal((d, ff), np.float32)
    xj, kj, xt, kt = jnp.asarray(x), jnp.asarray(k), torch.from_numpy(x), torch.from_numpy(k)
    mm = sj_compile.jit(jnp.matmul)
    t = paired_timings([lambda: mm(xj, kj).block_until_ready(), lambda: xt @ kt],
                       args.rounds * 3, 0.1)
    print(f"\n| GEMM {tokens}x{d}x{ff} | median ms | min ms |\n|---|---|---|")
    for name, ts in zip(["XLA", "MKL"], t.T):
        print(f"| {name} | {np.median(ts) * 1e3:.1f} | {ts.min() * 1e3:.1f} |")
    print(f"\npaired ratio XLA/MKL, median over rounds: {np.median(t[:, 0] / t[:, 1]):.2f}")


if __name__ == "__main__":
    main()
