"""`data_prep.curate.cluster` on 10,000 synthetic object names (adjective x noun): embedding
time with all-MiniLM-L6-v2 on CPU; HDBSCAN on the float64 cosine-distance matrix with the
`hdbscan` library (what curation uses) and with scikit-learn's (what it used before), same
labels; and `hdbscan.approximate_predict` for 1,000 new names (adjective x adjective x noun)
through the clusterer refit from the saved float32 embeddings, as `curate --extend` does (the
refit is one more `fit_clusterer`: the same cost).

    python bench/bench_curate_cluster.py [--n 10000] [--new 1000] [--batch-size 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
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


def new_names(n: int, seen: set[str]) -> list[str]:
    adjectives, nouns = list(dict.fromkeys(ADJECTIVES)), list(dict.fromkeys(NOUNS))
    rng = np.random.default_rng(1)
    out: dict[str, None] = {}
    while len(out) < n:
        a, b = rng.choice(len(adjectives), 2, replace=False)
        name = f"{adjectives[a]} {adjectives[b]} {nouns[rng.integers(len(nouns))]}"
        if name not in seen:
            out[name] = None
    return list(out)


def timed(fn, *args, **kw):
    """(result, seconds, peak traced MiB above the start)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    seconds = time.perf_counter() - t0
    peak = (tracemalloc.get_traced_memory()[1] - base) / 2**20
    tracemalloc.stop()
    return out, seconds, peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--new", type=int, default=1_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-cluster-size", type=int, default=None)
    parser.add_argument("--min-samples", type=int, default=None,
                        help="hdbscan's convention (scikit-learn gets one more)")
    args = parser.parse_args()

    import hdbscan
    import torch
    from sklearn.cluster import HDBSCAN as SklearnHDBSCAN

    from data_prep.curate.cluster import (MIN_CLUSTER_SIZE, MIN_SAMPLES, TextEncoder,
                                          _unit_rows, cosine_distances, default_model_path,
                                          fit_clusterer)
    torch.set_num_threads(args.threads)
    names = synthetic_names(args.n)
    extra = new_names(args.new, set(names))
    t0 = time.perf_counter()
    encoder = TextEncoder(default_model_path(), batch_size=args.batch_size)
    t_load = time.perf_counter() - t0
    encoder.encode(names[:args.batch_size], progress=False)        # warm up
    t0 = time.perf_counter()
    emb = encoder.encode(names, progress=False)
    t_embed = time.perf_counter() - t0
    extra_emb = encoder.encode(extra, progress=False)

    mcs = args.min_cluster_size or MIN_CLUSTER_SIZE
    ms = args.min_samples or MIN_SAMPLES
    dist, t_dist, _ = timed(cosine_distances, emb)
    hdb, t_hdb, m_hdb = timed(lambda d: hdbscan.HDBSCAN(
        min_cluster_size=mcs, min_samples=ms, metric="precomputed").fit(d), dist)
    skl, t_skl, m_skl = timed(lambda d: SklearnHDBSCAN(
        min_cluster_size=mcs, min_samples=ms + 1, metric="precomputed", copy=True).fit(d), dist)
    same = np.array_equal(hdb.labels_, skl.labels_)
    del dist, hdb, skl
    saved = _unit_rows(emb).astype(np.float32)  # as save_curation keeps them
    clusterer, t_fit, m_fit = timed(fit_clusterer, saved, min_cluster_size=mcs, min_samples=ms)
    refit, t_refit, _ = timed(fit_clusterer, saved, min_cluster_size=mcs, min_samples=ms)
    refit_same = np.array_equal(refit.labels_, clusterer.labels_)
    clusterer = refit
    (predicted, strength), t_pred, _ = timed(hdbscan.approximate_predict, clusterer, extra_emb)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    labels = clusterer.labels_

    print(f"{len(names)} names, e.g. {names[:3]}; torch threads {torch.get_num_threads()}, "
          f"batch {args.batch_size}; HDBSCAN min_cluster_size={mcs} min_samples={ms} "
          f"(scikit-learn {ms + 1})")
    print(f"{labels.max() + 1} clusters, {int((labels < 0).sum())} noise names; hdbscan and "
          f"scikit-learn labels {'identical' if same else 'DIFFER'}; peak RSS {peak_gib:.1f} GiB")
    print(f"load model {t_load:.1f} s; embed {t_embed:.1f} s ({len(names) / t_embed:.0f} "
          f"names/s); cosine matrix {t_dist:.1f} s")
    print("| names | hdbscan fit (s) | its peak (MiB) | scikit-learn fit (s) | its peak (MiB) | "
          "fit_clusterer (s) | its peak (MiB) | refit (s) | "
          f"approximate_predict {len(extra)} (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(names)} | {t_hdb:.1f} | {m_hdb:.0f} | {t_skl:.1f} | {m_skl:.0f} | "
          f"{t_fit:.1f} | {m_fit:.0f} | {t_refit:.1f} | {t_pred:.2f} |")
    print("the refit's labels " + ("equal the fit's" if refit_same else "DIFFER"))
    print(f"{len(extra)} new names, e.g. {extra[:2]}: {int((predicted >= 0).sum())} placed in "
          f"a cluster, median strength {np.median(strength[predicted >= 0]):.2f}")


if __name__ == "__main__":
    main()
