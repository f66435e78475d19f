"""`data_prep.curate_cluster` on 10,000 synthetic object names (adjective x noun): embedding
time with all-MiniLM-L6-v2 on CPU, and HDBSCAN time on the float64 cosine-distance matrix.

    python bench/bench_curate_cluster.py [--n 10000] [--batch-size 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ADJECTIVES = """red blue green yellow black white grey brown orange purple pink golden silver
wooden metal plastic glass stone leather paper small large tiny huge tall short long round
square broken old new dirty clean wet dry empty full open closed folded rusty shiny striped
dotted plaid floral torn parked moving hanging standing sitting lying stacked wrapped frozen
hot cold soft hard heavy light electric digital antique modern vintage tall narrow wide thick
thin curved flat pointed striped spotted fluffy furry woolen cotton denim rubber ceramic
marble brick concrete steel copper bronze painted carved printed framed potted sliced cooked
fresh ripe dried roasted grilled baked frosted""".split()
NOUNS = """car truck bus bicycle motorcycle train boat airplane dog cat horse cow sheep bird
duck chicken table chair sofa bed desk shelf cabinet lamp mirror clock door window curtain
carpet pillow blanket cup mug glass bottle plate bowl spoon fork knife pan pot kettle
toaster oven fridge sink faucet towel soap toothbrush shirt jacket coat dress skirt hat cap
scarf glove shoe boot sock bag backpack suitcase umbrella wallet phone laptop keyboard mouse
monitor television camera speaker guitar piano drum ball racket bat skateboard surfboard kite
tree flower bush rock fence bench sign pole lamp-post bridge building tower tent""".split()


def synthetic_names(n: int) -> list[str]:
    adjectives = list(dict.fromkeys(ADJECTIVES))
    names = [f"{a} {b}" for a in adjectives for b in dict.fromkeys(NOUNS)]
    if n > len(names):
        raise SystemExit(f"--n {n}: only {len(names)} adjective x noun names")
    rng = np.random.default_rng(0)
    return [names[i] for i in rng.choice(len(names), n, replace=False)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-cluster-size", type=int, default=None)
    parser.add_argument("--min-samples", type=int, default=None)
    args = parser.parse_args()

    import torch

    from data_prep.curate_cluster import (MIN_CLUSTER_SIZE, MIN_SAMPLES, TextEncoder,
                                          cluster_embeddings, cosine_distances,
                                          default_model_path)
    torch.set_num_threads(args.threads)
    names = synthetic_names(args.n)
    t0 = time.perf_counter()
    encoder = TextEncoder(default_model_path(), batch_size=args.batch_size)
    t_load = time.perf_counter() - t0
    encoder.encode(names[:args.batch_size], progress=False)        # warm up
    t0 = time.perf_counter()
    emb = encoder.encode(names, progress=False)
    t_embed = time.perf_counter() - t0

    t0 = time.perf_counter()
    cosine_distances(emb)
    t_dist = time.perf_counter() - t0
    mcs = args.min_cluster_size or MIN_CLUSTER_SIZE
    ms = args.min_samples or MIN_SAMPLES
    t0 = time.perf_counter()
    labels = cluster_embeddings(emb, min_cluster_size=mcs, min_samples=ms)
    t_cluster = time.perf_counter() - t0
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    print(f"{len(names)} names, e.g. {names[:3]}; torch threads {torch.get_num_threads()}, "
          f"batch {args.batch_size}; HDBSCAN min_cluster_size={mcs} min_samples={ms}")
    print(f"{labels.max() + 1} clusters, {int((labels < 0).sum())} noise names; "
          f"peak RSS {peak_gib:.1f} GiB")
    print("| names | load model (s) | embed (s) | names/s | cosine matrix (s) | "
          "cluster_embeddings (s) |")
    print("|---|---|---|---|---|---|")
    print(f"| {len(names)} | {t_load:.1f} | {t_embed:.1f} | {len(names) / t_embed:.0f} | "
          f"{t_dist:.1f} | {t_cluster:.1f} |")


if __name__ == "__main__":
    main()
