"""MINER kernels on CPU against the numpy way MINER's reference code scores
(docs/design.md, section 4).

(1) CSLS on a Q x G float32 score matrix (default 8,231 x 32,768): jitted `csls` vs `np.partition`
top-k means on both axes, then 2S - r_q - r_i. (2) Fused + CSLS scoring of the ROCS-COCO shape
(8,231 queries, 3,248 images, 5 crops, dim 1152, random L2-normalised embeddings): `fused_scores`
+ `csls` vs numpy fusion in 128-image chunks, then the same numpy CSLS. Each round times both
once, alternating the order; figures are medians over rounds after one compile call. Optionally
(--sweep-blocks) the top-k block lengths on the CSLS matrix, and (--host-input) `csls` given
the matrix as a numpy array (as numpy allocates it, and 64-byte aligned) against a device array.

    python bench/bench_miner.py                      # full size (memory: see bench/README.md)
    python bench/bench_miner.py --queries 800 --images 3000 --rocs-queries 500 --rocs-images 300
    python bench/bench_miner.py --skip-csls --skip-rocs --host-input --images 8192 --repeats 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def peak_rss_gib() -> float:
    """VmHWM of this process (peak resident set), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2 ** 20
    return float("nan")


def numpy_topk_mean(s: np.ndarray, k: int, axis: int) -> np.ndarray:
    return np.partition(s, -k, axis=axis).take(np.arange(-k, 0), axis=axis).mean(axis=axis)


def numpy_csls(s: np.ndarray, k: int) -> np.ndarray:
    r_q = numpy_topk_mean(s, k, 1)
    r_i = numpy_topk_mean(s, k, 0)
    return 2 * s - r_q[:, None] - r_i[None, :]


def numpy_fused(text: np.ndarray, gallery: np.ndarray, crops: np.ndarray, alpha: float,
                chunk: int = 128) -> np.ndarray:
    q, (g, r, d) = text.shape[0], crops.shape
    out = np.empty((q, g), np.float32)
    for i in range(0, g, chunk):
        c = crops[i:i + chunk]
        crop_best = (text @ c.reshape(-1, d).T).reshape(q, len(c), r).max(-1)
        out[:, i:i + chunk] = (1 - alpha) * (text @ gallery[i:i + chunk].T) + alpha * crop_best
    return out


def rounds(ref: Callable[[], np.ndarray], ours: Callable[..., object], repeats: int,
           prepare: Callable[[], object] | None = None
           ) -> tuple[float, float, np.ndarray, np.ndarray]:
    """Median seconds of `ref` and `ours` over `repeats` alternating rounds (ours compiled
    first), and the last outputs of each. With `prepare`, `ours(prepare())` is timed and
    `prepare()` (e.g. a fresh device copy to donate) is not."""
    if prepare is not None:
        timed = ours
        ours = None
    out_ours = timed(prepare()) if prepare is not None else ours()
    np.asarray(out_ours)
    times = np.zeros((repeats, 2))
    out_ref = None
    for r in range(repeats):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            if i == 0:
                out_ref = ref()
            else:
                if prepare is not None:
                    arg = prepare()
                    arg.block_until_ready()
                    t0 = time.perf_counter()
                    out_ours = timed(arg)
                else:
                    out_ours = ours()
                out_ours.block_until_ready()
            times[r, i] = time.perf_counter() - t0
    med = np.median(times, axis=0)
    return float(med[0]), float(med[1]), out_ref, np.asarray(out_ours)


def normalised(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def aligned_copy(s: np.ndarray, alignment: int = 64) -> np.ndarray:
    """`s` copied into a buffer whose data starts on an `alignment`-byte boundary (numpy's own
    large allocations are 16-byte aligned)."""
    buf = np.empty(s.nbytes + alignment, np.uint8)
    start = (-buf.ctypes.data) % alignment
    out = buf[start:start + s.nbytes].view(s.dtype).reshape(s.shape)
    out[...] = s
    return out


def host_input(s: np.ndarray, k: int, repeats: int) -> None:
    """`csls` on the same matrix given as a numpy array (numpy's allocation, and a 64-byte
    aligned copy) and as a device array: median seconds over alternating rounds."""
    import jax

    from sclaro_jax.miner import csls

    inputs = {"numpy array": s, "numpy array, 64-byte aligned": aligned_copy(s),
              "jax array": jax.device_put(s)}
    for x in inputs.values():
        csls(x, k=k).block_until_ready()
    times = {name: [] for name in inputs}
    for r in range(repeats):
        for name in (list(inputs) if r % 2 == 0 else list(inputs)[::-1]):
            t0 = time.perf_counter()
            csls(inputs[name], k=k).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    print(f"\n| CSLS k={k}, {s.shape[0]} x {s.shape[1]}, input | median (s) | rounds (s) |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {np.median(ts):.3f} | {', '.join(f'{t:.2f}' for t in ts)} |",
              flush=True)


def sweep_blocks(s, k: int, repeats: int) -> None:
    import jax

    from sclaro_jax import compile
    from sclaro_jax.miner.kernels import _topk_first_values, _topk_last

    def best(fn) -> float:
        fn(s).block_until_ready()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(s).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    # Each axis compiled the way sclaro_jax.miner.kernels compiles it: rows with XLA's default
    # options, columns with sclaro_jax.compile's.
    print("\n| block | top-k mean, last axis, jax.jit (s) "
          "| top-k mean, first axis, compile.jit (s) |")
    print("|---|---|---|")
    last = best(jax.jit(lambda x: jax.lax.top_k(x, k)[0].mean(-1)))
    first = best(compile.jit(lambda x: jax.lax.top_k(x.T, k)[0].mean(-1)))
    print(f"| lax.top_k | {last:.3f} | {first:.3f} |", flush=True)
    for block in (16, 32, 64, 128, 256):
        last = best(jax.jit(lambda x: _topk_last(x, k, block)[0].mean(-1)))
        first = best(compile.jit(lambda x: _topk_first_values(x, k, block).mean(-1)))
        print(f"| {block} | {last:.3f} | {first:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=8231, help="CSLS matrix rows")
    parser.add_argument("--images", type=int, default=32768, help="CSLS matrix columns")
    parser.add_argument("--rocs-queries", type=int, default=8231)
    parser.add_argument("--rocs-images", type=int, default=3248)
    parser.add_argument("--crops", type=int, default=5)
    parser.add_argument("--dim", type=int, default=1152)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.4)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per measurement")
    parser.add_argument("--sweep-blocks", action="store_true",
                        help="also time the blocked top-k for several block lengths")
    parser.add_argument("--host-input", action="store_true",
                        help="also time csls on a numpy matrix (as is and 64-byte aligned) "
                             "against the same matrix on the device")
    parser.add_argument("--skip-csls", action="store_true")
    parser.add_argument("--skip-rocs", action="store_true")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from sclaro_jax.miner import csls, fused_scores

    rng = np.random.default_rng(0)
    print("| measurement | shape | numpy median (s) | ours median (s) | speed-up "
          "| max abs diff | peak RSS (GiB) |")
    print("|---|---|---|---|---|---|---|")
    s = None
    if not args.skip_csls:
        s = rng.standard_normal((args.queries, args.images), dtype=np.float32)
        s *= np.float32(0.1)
        s_dev = jax.device_put(s)
        ref_t, ours_t, ref, ours = rounds(lambda: numpy_csls(s, args.k),
                                          lambda: csls(s_dev, k=args.k), args.repeats)
        diff = float(np.abs(ref - ours).max())
        del ref, ours
        print(f"| CSLS k={args.k} | {args.queries} x {args.images} | {ref_t:.2f} | {ours_t:.3f} "
              f"| {ref_t / ours_t:.1f}x | {diff:.1e} | {peak_rss_gib():.2f} |", flush=True)
        # The same with the score buffer donated to the output (`csls(..., donate=True)`): the
        # input is a fresh device copy made outside the timing, as a caller's intermediate is.
        ref_t, ours_t, ref, ours = rounds(lambda: numpy_csls(s, args.k),
                                          lambda x: csls(x, k=args.k, donate=True),
                                          args.repeats, prepare=lambda: s_dev + 0)
        diff = float(np.abs(ref - ours).max())
        del ref, ours
        print(f"| CSLS k={args.k}, donate=True | {args.queries} x {args.images} | {ref_t:.2f} "
              f"| {ours_t:.3f} | {ref_t / ours_t:.1f}x | {diff:.1e} | {peak_rss_gib():.2f} |",
              flush=True)
    if not args.skip_rocs:
        text = normalised(rng, args.rocs_queries, args.dim)
        gallery = normalised(rng, args.rocs_images, args.dim)
        crops = normalised(rng, args.rocs_images, args.crops, args.dim)
        dev = [jax.device_put(a) for a in (text, gallery, crops)]

        def ours():
            # the fused matrix is an intermediate: its buffer becomes the output
            return csls(fused_scores(*dev, alpha=args.alpha), k=args.k, donate=True)

        ref_t, ours_t, ref, out = rounds(
            lambda: numpy_csls(numpy_fused(text, gallery, crops, args.alpha), args.k),
            ours, args.repeats)
        diff = float(np.abs(ref - out).max())
        del ref, out
        print(f"| fused (max of {args.crops} crops) + CSLS k={args.k} | {args.rocs_queries} x "
              f"{args.rocs_images}, dim {args.dim} | {ref_t:.2f} | {ours_t:.3f} "
              f"| {ref_t / ours_t:.1f}x | {diff:.1e} | {peak_rss_gib():.2f} |", flush=True)
    if args.host_input:
        if s is None:
            s = rng.standard_normal((args.queries, args.images), dtype=np.float32)
            s *= np.float32(0.1)
        host_input(s, args.k, args.repeats)
    if args.sweep_blocks:
        if s is None:
            s = rng.standard_normal((args.queries, args.images), dtype=np.float32)
        sweep_blocks(jax.device_put(s), args.k, args.repeats)


if __name__ == "__main__":
    main()
