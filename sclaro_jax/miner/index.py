"""An approximate-nearest-neighbour index for MINER galleries, re-ranked by the exact MINER score.

    python -m sclaro_jax.miner.index build --cache CACHE_DIR --out IDX       # eval.rocs's cache
    python -m sclaro_jax.miner.index build --images G.npy --crops C.npy --bank B.npy --out IDX
    python -m sclaro_jax.miner.index search --index IDX --queries Q.npy --out DIR  # hits.npz

Scores (docs/design.md, section 4; `stream`'s docstring), all embeddings L2-normalised:

    S    = (1 - alpha) * t.g_i + alpha * pool_r t.c_ir               (`kernels.fuse`)
    CSLS = 2 S - r_q - r_i                                           (`kernels.csls_combine`)
    r_i  = mean of image i's k highest S over a query bank B (inductive: `stream.search(bank=)`,
           computed exactly at build time over the FUSED scores of the bank)
    r_q  = mean of query q's k highest S over its shortlist (k = min(k, shortlist size))

For one query r_q is a constant, so the order is that of 2S - r_i. Without crops that is a
maximum inner product search: 2 (t.g_i - r_i / 2) = 2 [t, 1] . [g_i, -r_i / 2]. So the global
index holds x_i = [g_i, -r_i / 2] (zero-padded to the factory's sub-quantizer multiple) and is
searched with [t, 1, 0...]. With crops the same holds per crop: since (1 - alpha) t.g_i does not
depend on r, S_i = max_r t.((1 - alpha) g_i + alpha c_ir) for max pooling (and
t.((1 - alpha) g_i + alpha mean_r c_ir) for mean), so the crop index holds the fused crop
vectors [(1 - alpha) g_i + alpha c_ir, -r_i / 2] (row i * R + r, image i; one per image for
mean pooling), and an exact inner product search over them, keeping each image's best vector,
IS the MINER + CSLS order (`crop_vectors`). The ANN approximates those inner products. A search
takes, per query, the top `shortlist` images of the global index and the first `shortlist`
distinct images of the top `shortlist * R` fused crop vectors, their union (at most
2 * shortlist images per shard), and computes the EXACT fused score S and CSLS there from the
stored float16 embeddings (jax: on the GPU when there is one), with `stream.search`'s tie rule
(the lower gallery index first).
r_q over the shortlist equals stream's r_q (over the whole gallery) whenever the shortlist holds
the query's k best images by S; with a flat index and a shortlist the size of the gallery the
result is `stream.search(queries, images, crops, bank=B)` (tests/test_miner_index.py).

Build (one shard: rows [i * G // N, (i + 1) * G // N) of the gallery, `--shard i/N`), in chunks
of `chunk` images, bounded memory (one chunk of views plus the bank's [Qb, chunk] scores):
    1. store: the chunk's views as float16 into `views.npy` [n, 1 + R, D] (global first, then
       the crops), its r_i into `parts/ri-CCCCC.npy`;
    2. train: the FAISS indexes on a strided sample of the stored vectors (`trained-*.faiss`);
    3. add: each chunk's vectors into a copy of the trained index, `parts/{global,crops}-*.faiss`;
    4. assemble: the parts merged in order into `global.faiss` / `crops.faiss`, `r_i.npy`, the
       sizes of every file into `meta.json`; the parts are removed.
Fast-scan PQ (`...x4fs`, the default for large galleries) cannot be merged, so it is built as
its plain 4-bit twin (`...x4`, the same codes) and made fast-scan when it is written in step 4
(`build_form`, `final_index`).
The crop index's IVF lists are chosen by the crops, not by the fused vectors they store
(`route_vectors`): k-means on the crop vectors [c_ir, 0...], each fused vector added to the list
of its crop's nearest centre. A fused vector mixes the image's global view into every crop, so
lists of fused vectors group images rather than what their crops show, and a query about one
crop probes the wrong lists; the stored vectors, and so the scores, are unchanged.
`manifest.json` records each finished step and chunk (every file is written whole, then
renamed, then recorded), so a build killed at any point and run again redoes only the
unrecorded work and ends with the same files as an uninterrupted build (the trained index is
read back, not trained again). `meta.json` holds the settings (encoder, crop rule, crops, dim,
alpha, k, pool, bank hash, factory, shard); an index, or a resumed build, with other settings is
refused naming both values.

FAISS factories: `{nlist}` becomes 2^round(log2(sqrt(n))) for the n vectors of that index (at
most n / 39, at least 1), `{m}` becomes ceil(d / 8) (8 dimensions per sub-quantizer) and
`{m/N}` ceil(d / N); vectors are zero-padded to a multiple of the PQ size (`PQm`). The default,
"auto", is "Flat" (exact) for an index of fewer than `FLAT_BELOW` (20,000) vectors and
`LARGE_FACTORY` ("IVF{nlist},PQ{m/2}x4fs") above; it and the nprobe defaults were chosen by
measurement (bench/README.md, "MINER ANN index on CPU"). HNSW is not supported: it has no
`merge_from` and no IVF lists.

Every number a build or a search takes has a declared range (`RANGES`: `--alpha` in [0, 1], the
counts from 1 to 2^31 - 1), checked before anything is read or written; a build refused for
any argument leaves nothing behind, and one refused while training (a factory FAISS cannot
train on so few vectors) reruns with another factory.

Ctrl-C (SIGINT) in `index build` is one line saying what is kept and that the same command
resumes (exit 130, as `data_prep import`); the rerun says what it reuses.

This module builds and runs the command; `index_files` holds the settings, the gallery reader and
the index files, `index_faiss` the FAISS indexes a build makes, `index_search` the search (their
names are importable from here).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from sclaro_jax.files import own_folder, remove_own_folder, replacing, write_replacing
from sclaro_jax.miner.gallery import Gallery, _load  # noqa: F401
from sclaro_jax.miner.index_faiss import (  # noqa: F401  (the index's names, in one place)
    _add, _faiss_refusal, _mergeable, _trained, add_routed, build_form, final_index, new_index,
    route_vectors, routed, train_routed)
from sclaro_jax.miner.index_files import (  # noqa: F401
    DEFAULT_FACTORY, DEFAULT_NPROBE, DEFAULT_NPROBE_GLOBAL, DEFAULT_SHORTLIST, FLAT_BELOW,
    LARGE_FACTORY, RANGES, SETTINGS, VERSION, FaissMissing, IndexFileError,
    IndexMismatchError, Shard, _compare, _index_folder, _is_ivf, _nlist_of, _pad,
    _read_index, _read_json, _views_to_write, _write_index, _write_json, _write_npy, bank_hash,
    check_ranges, crop_vectors, faiss, global_vectors, kept, open_index, open_shards,
    parse_shard, per_image, ranged, resolve_factory, shard_rows)
from sclaro_jax.miner.index_search import candidates, gt_ranks, search  # noqa: F401


# Building
# --------------------------------------------------------------------------------------------
# A hook run after each chunk of a build step is recorded: (step, chunk) -> None. Tests replace
# it to kill a build at a known point.
_after_chunk = None


def _plan(gallery: Gallery, bank: np.ndarray, *, alpha, k, pool, factory, chunk,
          shard) -> tuple[dict, list]:
    """(meta.json of the build, [(kind, factory, dim)] of its indexes), every argument checked
    first (`RANGES`, the bank's shape, the shard, each factory made once), so that a refused
    build writes nothing."""
    check_ranges(alpha=alpha, k=k, chunk=chunk)
    if pool not in ("max", "mean"):
        raise ValueError(f"pool must be 'max' or 'mean', not {pool!r}")
    if bank.ndim != 2 or bank.shape[1] != gallery.dim:
        raise ValueError(f"the bank must be [Qb, {gallery.dim}] (the gallery's dim), not "
                         f"shape {bank.shape}")
    lo, hi = shard_rows(gallery.n, shard)
    n, r = hi - lo, gallery.n_crops
    if n < 1:
        raise ValueError(f"shard {shard[0]}/{shard[1]} of {gallery.n} images is empty")
    d_glob_f, d_glob = resolve_factory(factory, n, gallery.dim + 1)
    d_crop_f, d_crop = resolve_factory(factory, max(1, n * per_image(r, pool)), gallery.dim + 1)
    kinds = [("global", d_glob_f, d_glob)] + ([("crops", d_crop_f, d_crop)] if r else [])
    for _, fac, d in kinds:
        try:
            new_index(fac, d)
        except RuntimeError as e:
            raise _faiss_refusal(factory, f"make {fac!r}", e) from None
    meta = {"version": VERSION, "encoder": gallery.encoder, "crop_rule": gallery.crop_rule,
            "crops": gallery.crop_spec, "n_crops": r, "dim": gallery.dim, "alpha": float(alpha),
            "k": int(k), "pool": pool, "bank_hash": bank_hash(bank), "bank_rows": len(bank),
            "factory": factory, "factory_global": d_glob_f, "dim_global": d_glob,
            "factory_crops": d_crop_f if r else None, "dim_crops": d_crop if r else None,
            "shard": list(shard), "offset": lo, "images": n, "total": gallery.n,
            "chunk": int(chunk)}
    return meta, kinds


def _resume(out: Path, meta: dict) -> dict:
    """The manifest of the build in `out` (a new one where none began), its meta.json written
    or checked: a build with other settings is refused naming both values. The factory counts
    once the indexes are trained (a build refused in training reruns with another one). A
    resumed build says what it reuses."""
    meta_path, man_path = out / "meta.json", out / "manifest.json"
    man = _read_json(man_path) if man_path.exists() else {
        "stored": [], "trained": False, "added": [], "complete": False}
    if meta_path.exists():
        old = _read_json(meta_path)
        fields = [f for f in SETTINGS if man["trained"] or f != "factory"]
        _compare({f: meta[f] for f in fields}, old, str(meta_path), fields)
        _compare({f: meta[f] for f in ("version", "n_crops", "images")}, old, str(meta_path),
                 ("version", "n_crops", "images"))
        if "files" in old:
            meta["files"] = old["files"]
        if old["factory"] != meta["factory"]:
            _write_json(meta_path, meta)
    else:
        _write_json(meta_path, meta)
    if man["stored"] and not man["complete"]:
        print(f"index {out}: resuming the build, reusing what it kept ({kept(meta, man)}"
              f"{', trained' if man['trained'] else ''})", file=sys.stderr)
    return man


def _tidy(out: Path, kinds) -> None:
    """Remove a finished build's working files (its parts folder, which it made and marked; the
    trained indexes: a link goes, never its target)."""
    remove_own_folder(out / "parts")
    for kind, _, _ in kinds:
        (out / f"trained-{kind}.faiss").unlink(missing_ok=True)

def build(gallery: Gallery, bank: np.ndarray, out, *, alpha: float = 0.4, k: int = 10,
          pool: str = "max", factory: str = DEFAULT_FACTORY, chunk: int = 32768,
          shard: tuple[int, int] = (0, 1), train_size: Optional[int] = None,
          progress: bool = True) -> Path:
    """Build (or resume building) the index of one shard of `gallery` in folder `out`; returns
    `out`. `bank` [Qb, D] L2-normalised float32 query bank for r_i. See the module docstring.
    Every argument is checked before anything is written (a ValueError naming it: `RANGES`)."""
    from tqdm.auto import tqdm

    from sclaro_jax.miner import stream

    faiss()  # fail before any work without it
    out = Path(out)
    bank = np.ascontiguousarray(bank, np.float32)
    meta, kinds = _plan(gallery, bank, alpha=alpha, k=k, pool=pool, factory=factory,
                        chunk=chunk, shard=shard)
    lo, n, r = meta["offset"], meta["images"], meta["n_crops"]
    p_img = per_image(r, pool)
    _index_folder(out)
    man_path = out / "manifest.json"
    man = _resume(out, meta)
    if man["complete"]:
        _tidy(out, kinds)  # what an interrupt right after the last record left
        return out
    chunks = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    parts = out / "parts"
    own_folder(parts, flag="the index build's parts folder")
    views_path = out / "views.npy"
    shape = (n, 1 + r, gallery.dim)
    if not os.path.lexists(views_path):
        with replacing(views_path) as tmp:
            np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=shape).flush()
    views = _views_to_write(views_path)
    if views.shape != shape:
        raise IndexFileError(f"{views_path}: shape {views.shape}, expected {shape}")

    def record(step: str, c: int) -> None:
        man[step] = sorted(set(man[step]) | {c})
        _write_json(man_path, man)
        if _after_chunk is not None:
            _after_chunk(step, c)

    # 1. store the views and r_i
    todo = [c for c in range(len(chunks)) if c not in man["stored"]]
    for c in tqdm(todo, desc=f"index {out.name}: store + r_i", unit="chunk", disable=not progress):
        a, b = chunks[c]
        v = gallery.views(lo + a, lo + b)
        views[a:b] = v
        views.flush()
        res = stream.search(bank[:1], v[:, 0], v[:, 1:] if r else None, alpha=alpha, pool=pool,
                            k=k, rescore="csls", bank=bank, top=1, chunk=min(chunk, n))
        _write_npy(parts / f"ri-{c:05d}.npy", res.r_i.astype(np.float32))
        record("stored", c)

    def r_i_rows(rows: np.ndarray) -> np.ndarray:
        out_ = np.empty(len(rows), np.float32)
        for c, (a, b) in enumerate(chunks):
            sel = (rows >= a) & (rows < b)
            if sel.any():
                out_[sel] = np.load(parts / f"ri-{c:05d}.npy")[rows[sel] - a]
        return out_

    # 2. train on a strided sample of the stored vectors
    if not man["trained"]:
        for kind, fac, d in kinds:
            total = n * (p_img if kind == "crops" else 1)
            index = _trained(kind, fac, d, views, r_i_rows, total, p_img, alpha, pool,
                             train_size, factory)
            _write_index(out / f"trained-{kind}.faiss", index)
        man["trained"] = True
        _write_json(man_path, man)

    # 3. add each chunk to a copy of the trained indexes (merge-safe factories)
    trained = {kind: _read_index(out / f"trained-{kind}.faiss") for kind, _, _ in kinds}
    mergeable = all(_mergeable(fac) for _, fac, _ in kinds)
    todo = [c for c in range(len(chunks)) if c not in man["added"]] if mergeable else []
    for c in tqdm(todo, desc=f"index {out.name}: add", unit="chunk", disable=not progress):
        a, b = chunks[c]
        v = np.asarray(views[a:b])
        ri = np.load(parts / f"ri-{c:05d}.npy")
        for kind, _, d in kinds:
            index = faiss().clone_index(trained[kind])
            _add(index, kind, v, ri, d, alpha, pool)
            _write_index(parts / f"{kind}-{c:05d}.faiss", index)
        record("added", c)

    # 4. assemble: merge the parts in gallery order, or (fast-scan) add the chunks in order
    for kind, fac, d in kinds:
        index = faiss().clone_index(trained[kind])
        per = 1 if kind == "global" else p_img
        for c, (a, b) in enumerate(tqdm(chunks, desc=f"index {out.name}: {kind}", unit="chunk",
                                        disable=not progress or mergeable)):
            if mergeable:
                part = _read_index(parts / f"{kind}-{c:05d}.faiss")
                # IVF lists store ids (shifted by the chunk's first row); flat ids: positions
                index.merge_from(part, a * per if _is_ivf(fac) else 0)
            else:
                _add(index, kind, np.asarray(views[a:b]), np.load(parts / f"ri-{c:05d}.npy"),
                     d, alpha, pool)
        _write_index(out / f"{kind}.faiss", final_index(index, fac))
    _write_npy(out / "r_i.npy", np.concatenate([np.load(parts / f"ri-{c:05d}.npy")
                                                for c in range(len(chunks))]))
    del views
    names = ["views.npy", "r_i.npy"] + [f"{kind}.faiss" for kind, _, _ in kinds]
    meta["files"] = {f: (out / f).stat().st_size for f in names}
    _write_json(out / "meta.json", meta)
    man["complete"] = True
    _write_json(man_path, man)
    _tidy(out, kinds)
    return out


# The command
# --------------------------------------------------------------------------------------------

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (128 + SIGINT)


def _parser() -> argparse.ArgumentParser:
    from sclaro_jax import cli

    p = cli.parser("python -m sclaro_jax.miner.index",
                   "An ANN index (FAISS) for a MINER gallery, searched with the exact MINER "
                   "fused score and CSLS on a shortlist (docs/miner.md).")
    sub = p.add_subparsers(dest="command", required=True, metavar="{build,search}")
    b = sub.add_parser("build", help="build (or resume building) an index",
                       description="Build, or resume after a kill or Ctrl-C, the index of a "
                                   "gallery (or of one shard of it).",
                       formatter_class=cli.DefaultsOnce)
    src = b.add_argument_group("gallery (one of --cache, --images)")
    src.add_argument("--cache", help="an eval.rocs embedding cache folder (OUT/cache/KEY): its "
                                     "encoder, crop rule and gallery")
    src.add_argument("--images", help="global embeddings, a [G, D] .npy")
    src.add_argument("--crops", help="crop embeddings, a [G, R, D] .npy (with --images)")
    src.add_argument("--bank", help="query bank [Qb, D] .npy for r_i (default with --cache: the "
                                    "split's own queries, queries.npy)")
    src.add_argument("--encoder", help="encoder name to record (with --images)")
    src.add_argument("--crop-rule", help="crop rule to record (with --images)")
    b.add_argument("--out", required=True, type=cli.writable, help="index folder")
    b.add_argument("--factory", default=DEFAULT_FACTORY,
                   help="FAISS index factory string ({nlist}, {m}: see docs/miner.md); auto "
                        "(default): Flat below 20,000 vectors, else IVF{nlist},PQ{m/2}x4fs")
    b.add_argument("--alpha", type=ranged("alpha"), default=0.4,
                   help="weight of the crop score, 0 to 1")
    b.add_argument("--k", type=ranged("k"), default=10, help="CSLS neighbourhood size")
    b.add_argument("--pool", choices=("max", "mean"), default="max", help="pooling over crops")
    b.add_argument("--chunk", type=ranged("chunk"), default=32768,
                   help="images per build chunk")
    b.add_argument("--shard", default="0/1", help="build shard i of N (i/N)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    s = sub.add_parser("search", help="search an index",
                       description="Top-k images per query: ANN shortlist, then the exact MINER "
                                   "+ CSLS score.", formatter_class=cli.DefaultsOnce)
    s.add_argument("--index", action="append", required=True,
                   help="index folder (repeat for each shard of a sharded index)")
    s.add_argument("--queries", required=True, help="query embeddings [Q, D] .npy")
    s.add_argument("--gt", help="ground-truth gallery row per query [Q] .npy: prints R@1/5/10")
    s.add_argument("--top", type=ranged("top"), default=10, help="results per query")
    s.add_argument("--shortlist", type=ranged("shortlist"), default=DEFAULT_SHORTLIST,
                   help="candidates per index (global, crops) and shard")
    s.add_argument("--nprobe", type=ranged("nprobe"), default=DEFAULT_NPROBE,
                   help="IVF lists visited in the crop index")
    s.add_argument("--nprobe-global", type=ranged("nprobe_global"),
                   default=DEFAULT_NPROBE_GLOBAL, help="IVF lists visited in the global index")
    s.add_argument("--batch", type=ranged("batch"), default=64, help="queries per re-rank batch")
    s.add_argument("--out", required=True, type=cli.writable,
                   help="folder for hits.npz (scores, indices, r_q)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def interrupted(out) -> str:
    """The line a build stopped by Ctrl-C prints: what `out` keeps, and how to resume."""
    out = Path(out)
    try:
        meta = _read_json(out / "meta.json")
        man = _read_json(out / "manifest.json") if (out / "manifest.json").is_file() else {}
    except IndexFileError:
        return (f"index build: interrupted before anything was kept in {out}: rerun the same "
                f"command to start it")
    trained = ", trained" if man.get("trained") else ""
    return (f"index build: interrupted; {kept(meta, man)}{trained} are kept in {out}: rerun "
            f"the same command to resume")


def _build(args) -> int:
    if bool(args.cache) == bool(args.images):
        raise ValueError("give one of --cache (an eval.rocs cache folder) or --images")
    if args.cache:
        gallery = Gallery.from_cache(args.cache)
        bank_path = args.bank or gallery.queries
        if bank_path is None:
            raise FileNotFoundError(2, "No such file or directory (no --bank given)",
                                    str(Path(args.cache) / "queries.npy"))
    else:
        gallery = Gallery.from_npy(args.images, args.crops, encoder=args.encoder,
                                   crop_rule=args.crop_rule)
        if not args.bank:
            raise ValueError("--images needs --bank (a [Qb, D] .npy query bank)")
        bank_path = args.bank
    bank = np.asarray(_load(str(bank_path)), np.float32)
    out = build(gallery, bank, args.out, alpha=args.alpha, k=args.k, pool=args.pool,
                factory=args.factory, chunk=args.chunk, shard=parse_shard(args.shard),
                progress=not args.no_progress)
    meta = _read_json(out / "meta.json")
    size = sum(meta["files"].values())
    print(f"index {out}: {meta['images']} images x {1 + meta['n_crops']} views, "
          f"{meta['factory_global']} / {meta['factory_crops']}, {size / 1e6:.1f} MB")
    return 0


def _search(args) -> int:
    queries = np.asarray(_load(args.queries), np.float32)
    gt = None if args.gt is None else np.asarray(_load(args.gt))
    shards = open_shards(args.index)
    res = search(queries, shards, top=args.top, shortlist=args.shortlist,
                 nprobe=args.nprobe, nprobe_global=args.nprobe_global, batch=args.batch,
                 progress=not args.no_progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_replacing(out / "hits.npz", lambda f: np.savez(f, scores=res.scores,
                                                         indices=res.indices, r_q=res.r_q))
    line = f"{len(queries)} queries -> {out / 'hits.npz'}"
    if gt is not None:
        ranks = gt_ranks(res.indices, gt)
        line += "; " + ", ".join(f"R@{k} {100 * np.mean(ranks < k):.2f}"
                                 for k in (1, 5, 10) if k <= res.indices.shape[1])
    print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from sclaro_jax import cli

    args = _parser().parse_args(argv)
    try:
        return _build(args) if args.command == "build" else _search(args)
    except cli.USER_ERRORS as e:
        return cli.fail(e)
    except KeyboardInterrupt:
        print(interrupted(args.out) if args.command == "build"
              else "index search: interrupted; nothing was written", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
