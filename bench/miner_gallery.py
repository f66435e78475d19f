"""A structured synthetic MINER gallery on disk: G images x (1 global + R crops) of dimension D,
float16, clustered on the unit sphere, with queries planted on crops and a query bank; made in
fixed chunks so that any size fits in bounded memory and the first G rows of a larger gallery
are the rows of a smaller one (a growth line reads prefixes of one set).

    python bench/miner_gallery.py --out /tmp/gallery_1m --images 1000000 --crops 5 --dim 768

The model (norm() L2-normalises; u, v, w independent random vectors of about unit length,
standard normal / sqrt(D)):
    topic centres   m_1 .. m_T                           T = --topics, uniform on the sphere
    crop r of j     c_jr = norm(m_t(j,r) + beta * u_jr)  t(j, r) uniform over the topics
    global of j     g_j  = norm(sum_r c_jr + delta * w_j)    (with R = 0: norm(m_t(j) + beta u))
    query q         t_q  = norm(c_{j(q) r(q)} + gamma * v_q)  planted on one crop of image j(q)
                    (R = 0: on the global)
so a query's own crop lies at cos 1/sqrt(1 + gamma^2) in expectation, the crops of its topic
near cos 1/((1 + beta^2) sqrt(1 + gamma^2)), and the rest near 0: a gallery with real
neighbourhood structure (hundreds of images a topic) rather than uniform noise. The bank is
made like the queries, on other images (its r_i is CSLS's inductive gallery term).

Files: global.npy [G, D] f16, crops.npy [G, R, D] f16 (absent for R = 0), queries.npy [Q, D]
f32, gt.npy [Q] int64 (the image each query was planted on), bank.npy [Qb, D] f32,
gallery.json (the parameters). Rows are made per chunk of 65,536 images from a seed derived
from (seed, chunk), so the files are the same whatever the machine, and reruns skip finished
files.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

CHUNK = 65536


def _norm(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _centres(topics: int, dim: int, seed: int) -> np.ndarray:
    return _norm(np.random.default_rng([seed, 0]).standard_normal((topics, dim),
                                                                     dtype=np.float32))


def image_rows(a: int, b: int, *, crops: int, centres: np.ndarray, beta: float, delta: float,
               seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(global [b - a, D], crops [b - a, R, D]) float32 of images a..b-1; a is a multiple of
    CHUNK (each chunk has its own generator)."""
    assert a % CHUNK == 0 and b - a <= CHUNK
    rng = np.random.default_rng([seed, 1, a // CHUNK])
    n, dim = b - a, centres.shape[1]
    views = max(crops, 1)
    topic = rng.integers(0, centres.shape[0], size=(CHUNK, views))[:n]
    scale = 1 / np.sqrt(dim, dtype=np.float32)
    noise = rng.standard_normal((n, views, dim), dtype=np.float32) * scale
    c = _norm(centres[topic] + beta * noise)
    if crops == 0:
        return c[:, 0], c[:, :0]
    w = rng.standard_normal((n, dim), dtype=np.float32) * scale
    return _norm(c.sum(axis=1) + delta * w), c


def make(out: str, images: int, *, crops: int = 5, dim: int = 768, queries: int = 1000,
         bank: int = 1000, topics: int = 4096, beta: float = 1.0, delta: float = 1.0,
         gamma: float = 3.0, seed: int = 0, progress: bool = True) -> dict:
    """Write the gallery of the module docstring into `out`; returns its parameters."""
    os.makedirs(out, exist_ok=True)
    params = dict(images=images, crops=crops, dim=dim, queries=queries, bank=bank,
                  topics=topics, beta=beta, delta=delta, gamma=gamma, seed=seed, chunk=CHUNK)
    meta = os.path.join(out, "gallery.json")
    if os.path.exists(meta):
        with open(meta) as f:
            if json.load(f) == params:
                return params
    centres = _centres(topics, dim, seed)
    g = np.lib.format.open_memmap(os.path.join(out, "global.npy.tmp"), "w+", np.float16,
                                  (images, dim))
    c = (np.lib.format.open_memmap(os.path.join(out, "crops.npy.tmp"), "w+", np.float16,
                                   (images, crops, dim)) if crops else None)
    t0 = time.perf_counter()
    for a in range(0, images, CHUNK):
        b = min(images, a + CHUNK)
        gl, cr = image_rows(a, b, crops=crops, centres=centres, beta=beta, delta=delta,
                            seed=seed)
        g[a:b] = gl
        if c is not None:
            c[a:b] = cr
        if progress:
            print(f"\r{b:,} / {images:,} images ({time.perf_counter() - t0:.0f} s)", end="",
                  flush=True)
    if progress:
        print()
    for arr, name in ((g, "global"), (c, "crops")):
        if arr is not None:
            arr.flush()
            del arr
            os.replace(os.path.join(out, f"{name}.npy.tmp"), os.path.join(out, f"{name}.npy"))
    rng = np.random.default_rng([seed, 2])
    # from the first million images at most: every size of a growth line has the same queries
    picked = rng.choice(min(images, 1_000_000), size=queries + bank, replace=False)
    for name, rows in (("queries", picked[:queries]), ("bank", picked[queries:])):
        gl = np.load(os.path.join(out, "global.npy"), mmap_mode="r")
        if crops:
            cr = np.load(os.path.join(out, "crops.npy"), mmap_mode="r")
            which = rng.integers(0, crops, size=len(rows))
            target = np.asarray(cr[rows, which], np.float32)
        else:
            target = np.asarray(gl[rows], np.float32)
        v = rng.standard_normal(target.shape, dtype=np.float32) / np.sqrt(dim)
        np.save(os.path.join(out, f"{name}.npy"), _norm(target + gamma * v))
        if name == "queries":
            np.save(os.path.join(out, "gt.npy"), rows.astype(np.int64))
    with open(meta, "w") as f:
        json.dump(params, f, indent=1)
    return params


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--images", type=int, default=1_000_000)
    p.add_argument("--crops", type=int, default=5)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--bank", type=int, default=1000)
    p.add_argument("--topics", type=int, default=4096)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    t0 = time.perf_counter()
    params = make(a.out, a.images, crops=a.crops, dim=a.dim, queries=a.queries, bank=a.bank,
                  topics=a.topics, beta=a.beta, delta=a.delta, gamma=a.gamma, seed=a.seed)
    print(json.dumps(params), f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
