"""`sclaro_jax.miner.index` (ANN shortlist + exact MINER + CSLS re-rank) against the exact
streamed search (`miner.stream.search`, same query bank) on a structured synthetic gallery.

Two structured galleries (clustered on the sphere, not uniform noise), generated once under --dir
and reused:
- `--gallery topics` (default): `bench/miner_gallery.py`'s: 4,096 topic centres, each crop
  drawn around one, the global view the sum of its crops plus noise, queries planted on one
  crop each at noise --gamma (3: a query's own crop at cos ~0.32, the crops of its topic at
  ~0.16, as a caption sits far from its photograph in CLIP space), a bank planted the same way
  on other images; `--crops 0` makes it global-only (the growth line).
- `--gallery scenes`: 2 sqrt(n) scene centres and n / 4 object prototypes; image i has a scene
  s_i and R objects o_ir;
      crop   c_ir = norm(0.55 O[o_ir] + 0.35 S[s_i] + 0.45 u_ir)         u: unit noise per crop
      global g_i  = norm(0.60 S[s_i] + 0.30 mean_r O[o_ir] + 0.50 v_i)
      query       = norm(0.45 O[o_ir] + 0.45 u_ir + 0.20 S[s_i] + --noise w)  planted on (i, r)
  a query shares its crop's own detail u_ir and its object has about 20 crops in the gallery:
  an easier gallery (exact R@1 99.5 at 1M, noise 1.4).

Per run: the exact search (stream.search with the bank: top-10, exact ground-truth ranks),
the index build (timed, per step), then the index searched at each --shortlist / --nprobe:
recall@10 of its top 10 against the exact top 10, R@1 / R@10 against the ground truth, queries/s
(whole batch, after one warm-up batch) beside stream.search's, the in-memory index (FAISS
indexes + r_i) against the float16 embeddings it indexes.

    python bench/bench_miner_index.py --n 1000000 --crops 5 --dim 768 --dir /tmp/ann_bench
    python bench/bench_miner_index.py --n 20000 --factories "IVF{nlist},PQ{m}x4fs;..."
    python bench/bench_miner_index.py --cache OUT/cache     # an eval.rocs cache (planted-colours)

`--against scann` (global-only, `--crops 0`): ScaNN (pip `scann`, a bench-only install, never a
dependency of the package) on the same vectors and queries, one run. Global-only MINER + CSLS
is exactly a maximum inner product search: 2 S - r_i - r_q orders the gallery as
[t, 1] . [g_i, -r_i / 2] does (r_q is the query's own constant), so ScaNN indexes [g_i, -r_i / 2]
(float32, r_i from the same bank) and is asked for [t, 1]; both engines are scored against the
one exact top 10. ScaNN's searcher (tree of `--scann-leaves` leaves, SOAR spilling with
`--scann-soar`, anisotropic 4-bit codes, an exact re-order) is searched at each
`--scann-search` leaves x `--scann-reorder` depth; its queries/s are search_batched_parallel's
on the whole batch after a warm-up, as ours are `index.search`'s. The summary is the best
queries/s of each engine at recall@10 >= `--target` and their ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _rand_unit(rng, *shape) -> np.ndarray:
    return _unit(rng.standard_normal(shape, dtype=np.float32))


def generate_scenes(folder: Path, n: int, r: int, dim: int, n_queries: int, n_bank: int,
                    noise: float, block: int = 20_000, seed: int = 0) -> dict:
    """The "scenes" gallery (module docstring): images.npy [n, dim], crops.npy [n, r, dim]
    (float16), queries.npy, bank.npy, gt.npy under folder (skipped when done.json says they are
    there); returns the arrays (memory-mapped)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "done.json"
    want = dict(n=n, r=r, dim=dim, queries=n_queries, bank=n_bank, seed=seed, v=2, noise=noise)
    if not done.exists() or json.loads(done.read_text()) != want:
        t0 = time.perf_counter()
        rng = np.random.default_rng(seed)
        k_scenes, n_protos = max(16, int(np.sqrt(n) * 2)), max(64, n // 4)
        scenes, protos = _rand_unit(rng, k_scenes, dim), _rand_unit(rng, n_protos, dim)
        scene = rng.integers(0, k_scenes, n)
        objects = rng.integers(0, n_protos, (n, r))
        images = np.lib.format.open_memmap(folder / "images.npy", "w+", np.float16, (n, dim))
        crops = np.lib.format.open_memmap(folder / "crops.npy", "w+", np.float16, (n, r, dim))
        # queries and bank rows: (image, crop) pairs; their crop noise u is kept when generated
        picks = rng.choice(n, n_queries + n_bank, replace=False)
        pick_r = rng.integers(0, r, len(picks))
        order = np.argsort(picks)
        planted = np.zeros((len(picks), dim), np.float32)
        for a in range(0, n, block):
            b = min(a + block, n)
            u = _rand_unit(rng, b - a, r, dim)
            obj = protos[objects[a:b]]
            c = _unit(0.55 * obj + 0.35 * scenes[scene[a:b]][:, None] + 0.45 * u)
            g = _unit(0.60 * scenes[scene[a:b]] + 0.30 * obj.mean(1)
                      + 0.50 * _rand_unit(rng, b - a, dim))
            images[a:b], crops[a:b] = g.astype(np.float16), c.astype(np.float16)
            lo, hi = np.searchsorted(picks[order], [a, b])
            for j in order[lo:hi]:
                i, rr = picks[j], pick_r[j]
                planted[j] = (0.45 * protos[objects[i, rr]] + 0.45 * u[i - a, rr]
                              + 0.20 * scenes[scene[i]])
        images.flush(), crops.flush()
        del images, crops
        planted = _unit(planted + noise * _rand_unit(rng, len(picks), dim))
        np.save(folder / "queries.npy", planted[:n_queries])
        np.save(folder / "gt.npy", picks[:n_queries])
        np.save(folder / "bank.npy", planted[n_queries:])
        done.write_text(json.dumps(want))
        print(f"generated {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
    return {name: np.load(folder / f"{name}.npy", mmap_mode="r")
            for name in ("images", "crops", "queries", "gt", "bank")}


def generate(folder: Path, n: int, r: int, dim: int, n_queries: int, n_bank: int,
             gamma: float) -> dict:
    """The "topics" gallery: `miner_gallery.make` into folder (reused when made with the same parameters); the arrays
    memory-mapped: images [n, dim], crops [n, r, dim] (None for r = 0), queries, gt, bank."""
    import miner_gallery
    t0 = time.perf_counter()
    miner_gallery.make(str(folder), n, crops=r, dim=dim, queries=n_queries, bank=n_bank,
                       gamma=gamma, progress=False)
    print(f"gallery {folder} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    load = {name: np.load(folder / f"{name}.npy", mmap_mode="r")
            for name in ("global", "queries", "gt", "bank")}
    load["images"] = load.pop("global")
    load["crops"] = np.load(folder / "crops.npy", mmap_mode="r") if r else None
    return load


def from_cache(args) -> None:
    """recall@10 of the index against the exact ranking on an eval.rocs embedding cache (e.g. the
    planted-colours benchmark's): queries and bank are the split's queries (queries.npy)."""
    from sclaro_jax.miner import index, stream

    gallery = index.Gallery.from_cache(args.cache)
    views = gallery.views(0, gallery.n)
    q = np.load(Path(gallery.parts[0][2]).parent / "queries.npy").astype(np.float32)
    ref = stream.search(q, views[:, 0], views[:, 1:], bank=q, top=10)
    for factory in args.factories.split(";"):
        out = Path(args.dir) / "index_cache"
        shutil.rmtree(out, ignore_errors=True)
        index.build(gallery, q, out, factory=factory, progress=False)
        shard = index.open_index(out)
        for m in [int(x) for x in args.shortlists.split(",")]:
            for nprobe in [int(x) for x in args.nprobes.split(",")]:
                res = index.search(q, [shard], shortlist=m, nprobe=nprobe,
                                   nprobe_global=index.DEFAULT_NPROBE_GLOBAL)
                rec = recall10(res.indices, ref.indices)
                top1 = np.mean(res.indices[:, 0] == ref.indices[:, 0])
                print(f"| {gallery.n} x {1 + gallery.n_crops} | {len(q)} | "
                      f"{shard.meta['factory_global']} / {shard.meta['factory_crops']} | {m} | "
                      f"{nprobe} | {rec:.3f} | {top1:.3f} |", flush=True)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="gallery images")
    p.add_argument("--crops", type=int, default=5, help="crops per image (0: global only)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--bank", type=int, default=1000, help="query bank rows (r_i)")
    p.add_argument("--gallery", choices=("topics", "scenes"), default="topics",
                   help="which synthetic gallery (module docstring)")
    p.add_argument("--gamma", type=float, default=3.0,
                   help="topics: query noise of the planted queries (miner_gallery.py)")
    p.add_argument("--noise", type=float, default=1.4, help="scenes: query noise")
    p.add_argument("--dir", default="/tmp/ann_bench", help="data and index folder")
    p.add_argument("--factories", default="IVF{nlist},PQ{m/2}x4fs",
                   help="';'-separated FAISS factory templates to build and search")
    p.add_argument("--shortlists", default="50,100,200",
                   help="comma list of shortlist M, or M:MG (the global index's MG)")
    p.add_argument("--calibrated", action="store_true",
                   help="also search with the settings each build calibrated (with "
                        "--shortlists '': only those)")
    p.add_argument("--json", help="write the rows (and the exact search's queries/s) here")
    p.add_argument("--nprobes", default="16,32,64",
                   help="comma list of nprobe (CROPS/GLOBAL for different ones)")
    p.add_argument("--chunk", type=int, default=32768, help="build chunk")
    p.add_argument("--stream-chunk", type=int, default=32768, help="stream.search chunk")
    p.add_argument("--batch", type=int, default=64, help="re-rank batch")
    p.add_argument("--keep", action="store_true", help="keep the built indexes")
    p.add_argument("--reuse", action="store_true",
                   help="search an index kept by an earlier --keep run (its build time)")
    p.add_argument("--no-exact", action="store_true", help="reuse exact.npz from an earlier run")
    p.add_argument("--cache", help="instead: recall on this eval.rocs embedding cache folder")
    p.add_argument("--against", choices=("scann",), help="the same search by another engine "
                   "(global-only; module docstring)")
    p.add_argument("--scann-leaves", type=int, default=0,
                   help="ScaNN tree leaves (0: 2 sqrt(n), at least 16)")
    p.add_argument("--scann-search", default="8,16,32,64,128,256",
                   help="comma list of ScaNN leaves searched")
    p.add_argument("--scann-reorder", default="20,40,80,160", help="comma list of re-order depths")
    p.add_argument("--scann-soar", type=float, default=1.5,
                   help="SOAR spilling lambda (0: none; each vector in 2 leaves otherwise)")
    p.add_argument("--target", type=float, default=0.95, help="recall@10 of the summary")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed searches per setting (both engines): the fastest is reported")
    args = p.parse_args()
    if args.against and args.crops:
        p.error("--against scann compares the global-only search: pass --crops 0")
    if args.cache:
        from_cache(args)
        return

    import jax

    from sclaro_jax.miner import index, stream

    data_dir = Path(args.dir) / f"gallery_{args.n}x{args.crops}x{args.dim}"
    if args.gallery == "scenes":
        data_dir = Path(args.dir) / f"scenes_{args.n}x{args.crops}x{args.dim}"
        d = generate_scenes(data_dir, args.n, max(args.crops, 1), args.dim, args.queries,
                            args.bank, args.noise)
        d["crops"] = d["crops"] if args.crops else None
    else:
        d = generate(data_dir, args.n, args.crops, args.dim, args.queries, args.bank,
                     args.gamma)
    crops = d["crops"]
    q, gt, bank = np.asarray(d["queries"]), np.asarray(d["gt"]), np.asarray(d["bank"])
    emb_bytes = args.n * (1 + args.crops) * args.dim * 2
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs; gallery "
          f"{args.n} x (1 + {args.crops}) x {args.dim} float16 = {emb_bytes / 1e9:.2f} GB; "
          f"{len(q)} queries, bank {len(bank)}", flush=True)

    exact_path = data_dir / "exact.npz"
    if args.no_exact and exact_path.exists():
        e = np.load(exact_path)
        exact_ids, exact_rank, exact_s = e["indices"], e["gt_rank"], float(e["seconds"])
        r_i = e["r_i"] if "r_i" in e.files else None
    else:
        t0 = time.perf_counter()
        ref = stream.search(q, d["images"], crops, bank=bank, top=10, k=10,
                            chunk=args.stream_chunk, gt=gt)
        exact_s = time.perf_counter() - t0
        exact_ids, exact_rank, r_i = ref.indices, ref.gt_rank, ref.r_i
        np.savez(exact_path, indices=exact_ids, gt_rank=exact_rank, seconds=exact_s, r_i=r_i)
    t0 = time.perf_counter()  # the scan alone: no bank (plain top-10 of S), same queries
    stream.search(q, d["images"], crops, rescore="none", top=10, chunk=args.stream_chunk)
    scan_s = time.perf_counter() - t0
    print(json.dumps({"exact_stream_s": round(exact_s, 1), "scan_no_bank_s": round(scan_s, 1),
                      "scan_q_per_s": round(len(q) / scan_s, 2),
                      "exact_q_per_s": round(len(q) / exact_s, 2),
                      "exact_R@1": round(100 * np.mean(exact_rank < 1), 2),
                      "exact_R@10": round(100 * np.mean(exact_rank < 10), 2)}), flush=True)

    theirs = []
    if args.against == "scann":
        if r_i is None:
            raise SystemExit(f"{exact_path} has no r_i (written by an older run): run without "
                             f"--no-exact")
        theirs = against_scann(args, np.asarray(d["images"]), r_i, q, exact_ids)

    rows = []
    gallery = index.Gallery.from_arrays(d["images"], crops, encoder="synthetic")
    for factory in args.factories.split(";"):
        tag = hashlib.md5(factory.encode()).hexdigest()[:8]
        out = Path(args.dir) / f"index_{args.n}x{args.crops}_{tag}"
        if not args.reuse:
            shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        index.build(gallery, bank, out, factory=factory, chunk=args.chunk, progress=False)
        build_s = time.perf_counter() - t0
        if args.reuse and (out / "build_s.txt").exists():
            build_s = float((out / "build_s.txt").read_text())
        (out / "build_s.txt").write_text(str(build_s))
        shard = index.open_index(out)
        mem = shard.memory_bytes()
        grid = [(sl, probes) for sl in args.shortlists.split(",") if sl
                for probes in args.nprobes.split(",")]
        if args.calibrated:  # the settings the build chose (`--recall` of the build: 0.95)
            grid.insert(0, (None, None))
        for sl, probes in grid:
            if sl is None:
                kw, _ = index.search_settings([shard])
            else:  # "M" or "M:Mg" (crop index M, global index Mg); "NPROBE[/NPROBE_GLOBAL]"
                m, _, mg = sl.partition(":")
                nprobe, _, nprobe_global = probes.partition("/")
                kw = dict(shortlist=int(m), shortlist_global=int(mg) if mg else None,
                          nprobe=int(nprobe), nprobe_global=int(nprobe_global or nprobe))
            index.search(q[:args.batch], [shard], batch=args.batch, **kw)  # compiles
            res, s = fastest(lambda: index.search(q, [shard], batch=args.batch, **kw),
                             args.repeats)
            ranks = index.gt_ranks(res.indices, gt)
            m = kw["shortlist"] if kw["shortlist_global"] is None else \
                f"{kw['shortlist']}:{kw['shortlist_global']}"
            row = dict(calibrated=sl is None, backend=jax.default_backend(),
                       device=str(jax.devices()[0].device_kind), images=args.n,
                       crops=args.crops, dim=args.dim, queries=len(q),
                       factory=shard.meta["factory_global"] + " / "
                       + str(shard.meta["factory_crops"]),
                       shortlist=m if sl is not None else f"{m} (calibrated)",
                       nprobe=f"{kw['nprobe']} / {kw['nprobe_global']}",
                       recall10=recall10(res.indices, exact_ids),
                       R1=100 * float(np.mean(ranks < 1)),
                       R10=100 * float(np.mean(ranks < 10)),
                       q_per_s=len(q) / s, speedup=exact_s / s, speedup_scan=scan_s / s,
                       build_s=build_s,
                       index_mb=mem / 1e6, mem_ratio=mem / emb_bytes)
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
        del shard
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"\npeak VmHWM {rss() / 1e9:.2f} GB\n")
    print(f"stream.search without a bank (the scan alone): {len(q) / scan_s:.2f} queries/s")
    print(f"exact stream.search: {len(q) / exact_s:.2f} queries/s, R@1 "
          f"{100 * np.mean(exact_rank < 1):.2f}, R@10 {100 * np.mean(exact_rank < 10):.2f}")
    print("| factory (global / crops) | M | nprobe | recall@10 vs exact | R@1 | R@10 | "
          "queries/s | x stream (bank) | x scan | build (s) | index MB | index / f16 emb |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['factory']} | {r['shortlist']} | {r['nprobe']} | {r['recall10']:.3f} | "
              f"{r['R1']:.2f} | {r['R10']:.2f} | {r['q_per_s']:.1f} | {r['speedup']:.1f} | "
              f"{r['speedup_scan']:.1f} | "
              f"{r['build_s']:.0f} | {r['index_mb']:.1f} | {r['mem_ratio']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"exact_q_per_s": len(q) / exact_s,
                                               "rows": rows}, indent=1))
    if theirs:
        summary(rows, theirs, args.target, args)


def recall10(got: np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each exact top 10 found in the returned top 10."""
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)]))


def fastest(search, repeats: int):
    """(the last result, the fewest seconds) of `repeats` timed calls of `search()`."""
    best = np.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = search()
        best = min(best, time.perf_counter() - t0)
    return out, best


def against_scann(args, images: np.ndarray, r_i: np.ndarray, q: np.ndarray,
                  exact_ids: np.ndarray) -> list[dict]:
    """ScaNN on [g_i, -r_i / 2] queried with [t, 1] (module docstring): one row per leaves
    searched x re-order depth, recall@10 against the exact top 10 and queries/s."""
    try:
        import scann
    except ImportError:
        raise SystemExit("--against scann needs ScaNN, a bench-only install: pip install "
                         "--target /tmp/scann_site scann --no-deps; PYTHONPATH=/tmp/scann_site")
    from sclaro_jax.miner.index.vectors import global_vectors, query_vectors

    n, d = images.shape[0], images.shape[1] + 1  # the index's own forms, unpadded
    db = global_vectors(np.asarray(images)[:, None], r_i, d)
    qx = query_vectors(q, d)
    leaves = args.scann_leaves or max(16, int(2 * np.sqrt(n)))
    reorders = [int(x) for x in args.scann_reorder.split(",")]
    t0 = time.perf_counter()
    tree = dict(num_leaves=leaves, num_leaves_to_search=min(leaves, 32),
                training_sample_size=min(n, 250_000))
    if args.scann_soar:
        tree.update(soar_lambda=args.scann_soar, overretrieve_factor=2.0)
    searcher = (scann.scann_ops_pybind.builder(db, 10, "dot_product").tree(**tree)
                .score_ah(2, anisotropic_quantization_threshold=0.2)
                .reorder(max(reorders)).build())
    build_s = time.perf_counter() - t0
    print(json.dumps({"scann_build_s": round(build_s, 1), "leaves": leaves,
                      "soar_lambda": args.scann_soar, "dim": db.shape[1]}), flush=True)
    rows = []
    for searched in [int(x) for x in args.scann_search.split(",") if int(x) <= leaves]:
        for reorder in reorders:
            kw = dict(final_num_neighbors=10, leaves_to_search=searched,
                      pre_reorder_num_neighbors=reorder)
            searcher.search_batched_parallel(qx[:args.batch], **kw)  # warm-up
            (ids, _), s = fastest(lambda: searcher.search_batched_parallel(qx, **kw),
                                  args.repeats)
            row = dict(engine="scann", leaves=searched, reorder=reorder,
                       recall10=recall10(np.asarray(ids), exact_ids), q_per_s=len(q) / s,
                       build_s=build_s)
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    return rows


def best_at(rows: list[dict], target: float) -> dict | None:
    """The fastest row whose recall@10 reaches `target` (None: none does)."""
    ok = [r for r in rows if r["recall10"] >= target]
    return max(ok, key=lambda r: r["q_per_s"]) if ok else None


def summary(ours: list[dict], theirs: list[dict], target: float, args) -> None:
    """Both engines' curves (recall@10 -> best queries/s at or above it) and the ratio at
    `target`."""
    print(f"\n{args.n} x {args.dim} global-only, {args.queries} queries, {os.cpu_count()} CPUs: "
          f"best queries/s at recall@10 >= each level")
    print("| recall@10 >= | ours q/s (M, nprobe) | ScaNN q/s (leaves, re-order) | ours / ScaNN |")
    print("|---:|---:|---:|---:|")
    for level in (0.90, 0.95, 0.97, 0.99):
        a, b = best_at(ours, level), best_at(theirs, level)
        fa = f"{a['q_per_s']:.0f} ({a['shortlist']}, {a['nprobe']})" if a else "not reached"
        fb = f"{b['q_per_s']:.0f} ({b['leaves']}, {b['reorder']})" if b else "not reached"
        ratio = f"{a['q_per_s'] / b['q_per_s']:.2f}x" if a and b else "-"
        print(f"| {level:.2f} | {fa} | {fb} | {ratio} |")
    a, b = best_at(ours, target), best_at(theirs, target)
    if a and b:
        print(f"at recall@10 >= {target}: ours {a['q_per_s']:.0f} q/s, ScaNN "
              f"{b['q_per_s']:.0f} q/s: {a['q_per_s'] / b['q_per_s']:.2f}x")


if __name__ == "__main__":
    main()
