"""`sclaro_jax.miner.stream.search` on a 1,000,000-image float16 gallery (dim 1152, 2.3 GB) on CPU.

The gallery (random unit vectors, float16) is written chunk-wise to a file on disk (default
/tmp/miner_gallery_<n>x<dim>.f16, kept for reuse; plain file writes, no memory map) and searched
as an np.memmap, which `stream` reads with file reads. Each measured search runs in a fresh
Python process: it imports jax, notes VmRSS (the baseline), compiles the chunk step on one
chunk, then times one full search of --queries random unit queries (CSLS transductive over those
queries, or plain top-k) and reports VmHWM from /proc/self/status.

    python bench/bench_miner_stream.py [--n 1000000] [--dim 1152] [--queries 1000]
        [--chunk 65536] [--top 10] [--modes csls,none] [--path FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def proc_status(field: str) -> int:
    """A memory field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def write_gallery(path: Path, n: int, dim: int, block: int = 50_000, seed: int = 0) -> float:
    """Random unit float16 rows written block by block to `path`; returns seconds."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".part")
    with open(tmp, "wb") as f:
        for a in range(0, n, block):
            x = rng.standard_normal((min(block, n - a), dim), dtype=np.float32)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            f.write(x.astype(np.float16).tobytes())
    tmp.rename(path)
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    """One measured search in this (fresh) process; prints one JSON line."""
    import jax

    from sclaro_jax.miner import stream

    jax.numpy.zeros(1).block_until_ready()
    base_rss = proc_status("VmRSS")
    gallery = np.memmap(args.path, dtype=np.float16, mode="r", shape=(args.n, args.dim))
    rng = np.random.default_rng(1)
    q = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    t0 = time.perf_counter()
    stream.search(q, gallery[:min(args.chunk, args.n)], rescore=args.mode, top=args.top,
                  chunk=args.chunk)                       # compiles the step (one chunk)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = stream.search(q, gallery, rescore=args.mode, top=args.top, chunk=args.chunk)
    wall = time.perf_counter() - t0
    assert res.indices.shape == (args.queries, args.top) and stream.step_cache_size() == 1
    gal_bytes = args.n * args.dim * 2
    print(json.dumps(dict(mode=args.mode, wall_s=wall, ms_per_query=1000 * wall / args.queries,
                          first_chunk_with_compile_s=compile_s, baseline_rss=base_rss,
                          peak=proc_status("VmHWM"), gallery_bytes=gal_bytes,
                          chunks=-(-args.n // args.chunk))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="gallery images")
    p.add_argument("--dim", type=int, default=1152)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--chunk", type=int, default=65536)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--modes", default="csls,none", help="comma list of csls / none")
    p.add_argument("--path", default=None, help="gallery file (default in /tmp, reused)")
    p.add_argument("--worker", dest="mode", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.path = args.path or f"/tmp/miner_gallery_{args.n}x{args.dim}.f16"
    if args.mode:
        worker(args)
        return
    path = Path(args.path)
    if not path.exists() or path.stat().st_size != args.n * args.dim * 2:
        print(f"writing {path} ({args.n * args.dim * 2 / 1e9:.2f} GB) ...", flush=True)
        print(f"  {write_gallery(path, args.n, args.dim):.1f} s", flush=True)
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--worker", mode, "--n", str(args.n), "--dim",
               str(args.dim), "--queries", str(args.queries), "--chunk", str(args.chunk),
               "--top", str(args.top), "--path", str(path)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env=dict(os.environ)).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    gb = 1e9
    print(f"\ngallery {args.n} x {args.dim} float16 = {args.n * args.dim * 2 / gb:.2f} GB, "
          f"{args.queries} queries, chunk {args.chunk}, top {args.top}")
    print("| rescore | total (s) | ms / query | peak VmHWM (GB) | peak / gallery | "
          "RSS after importing jax (GB) | first chunk incl. compile (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['wall_s']:.1f} | {r['ms_per_query']:.2f} | "
              f"{r['peak'] / gb:.2f} | {r['peak'] / r['gallery_bytes']:.2f} | "
              f"{r['baseline_rss'] / gb:.2f} | {r['first_chunk_with_compile_s']:.1f} |")


if __name__ == "__main__":
    main()
