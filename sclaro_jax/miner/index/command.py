"""The command `python -m sclaro_jax.miner.index build|search ...` (`main`): argument parsing,
the build from a gallery (.npy files or an `eval.rocs` cache), the search into hits.npz, and
Ctrl-C as one line. The method is in the package docstring."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from sclaro_jax.files import write_replacing
from sclaro_jax.miner.index.building import build
from sclaro_jax.miner.index.files import _read_json, kept, open_shards
from sclaro_jax.miner.index.gallery import Gallery, _load
from sclaro_jax.miner.index.searching import gt_ranks, search, search_settings
from sclaro_jax.miner.index.settings import (DEFAULT_FACTORY, DEFAULT_NPROBE,
                                             DEFAULT_NPROBE_GLOBAL, DEFAULT_RECALL,
                                             DEFAULT_SHORTLIST, IndexFileError, parse_shard,
                                             ranged)

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
    b.add_argument("--recall", type=ranged("recall"), default=DEFAULT_RECALL,
                   help="recall@10 against the exact MINER + CSLS order that the stored search "
                        "settings are calibrated to reach (docs/miner.md); a finished index "
                        "built again with another value is only calibrated again")
    b.add_argument("--calibration-queries",
                   help="queries [Qc, D] .npy to calibrate on (default: the bank's rows, "
                        "1,000 evenly spaced in a larger bank)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    s = sub.add_parser("search", help="search an index",
                       description="Top-k images per query: ANN shortlist, then the exact MINER "
                                   "+ CSLS score.", formatter_class=cli.DefaultsOnce)
    s.add_argument("--index", action="append", required=True,
                   help="index folder (repeat for each shard of a sharded index)")
    s.add_argument("--queries", required=True, help="query embeddings [Q, D] .npy")
    s.add_argument("--gt", help="ground-truth gallery row per query [Q] .npy: prints R@1/5/10")
    s.add_argument("--top", type=ranged("top"), default=10, help="results per query")
    s.add_argument("--shortlist", type=ranged("shortlist"),
                   help="candidates per index (global, crops) and shard (default: the "
                        f"index's calibrated value; {DEFAULT_SHORTLIST} for an uncalibrated one)")
    s.add_argument("--shortlist-global", type=ranged("shortlist_global"),
                   help="candidates of the global index per shard, where they differ from "
                        "--shortlist's (default: the index's calibrated value, else "
                        "--shortlist)")
    s.add_argument("--nprobe", type=ranged("nprobe"),
                   help="IVF lists visited in the crop index (default: the index's calibrated "
                        f"value; {DEFAULT_NPROBE} for an uncalibrated one)")
    s.add_argument("--nprobe-global", type=ranged("nprobe_global"),
                   help="IVF lists visited in the global index (default: the index's "
                        f"calibrated value; {DEFAULT_NPROBE_GLOBAL} for an uncalibrated one)")
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
    cal = (None if args.calibration_queries is None
           else np.asarray(_load(args.calibration_queries), np.float32))
    out = build(gallery, bank, args.out, alpha=args.alpha, k=args.k, pool=args.pool,
                factory=args.factory, chunk=args.chunk, shard=parse_shard(args.shard),
                recall=args.recall, calibration_queries=cal, progress=not args.no_progress)
    meta = _read_json(out / "meta.json")
    size = sum(meta["files"].values())
    print(f"index {out}: {meta['images']} images x {1 + meta['n_crops']} views, "
          f"{meta['factory_global']} / {meta['factory_crops']}, {size / 1e6:.1f} MB")
    c = meta.get("calibration")
    if c:
        how = "exhaustive (no cheaper setting measured reached it)" if c["exhaustive"] else \
            "the cheapest measured"
        probes = ", ".join(f"{k} {c[k]}" for k in ("nprobe", "nprobe_global")
                           if c[k] is not None)  # IVF indexes only
        own = c.get("shortlist_global")
        print(f"index {out}: calibrated for recall@{c['k']} {c['asked']:g}: {how}, shortlist "
              f"{c['shortlist']}{f' (global {own})' if own else ''}"
              f"{', ' + probes if probes else ''}: recall {c['recall']:.3f} "
              f"on {c['queries']} calibration queries")
    return 0


def _search(args) -> int:
    queries = np.asarray(_load(args.queries), np.float32)
    gt = None if args.gt is None else np.asarray(_load(args.gt))
    shards = open_shards(args.index)
    given = dict(shortlist=args.shortlist, shortlist_global=args.shortlist_global,
                 nprobe=args.nprobe, nprobe_global=args.nprobe_global)
    res = search(queries, shards, top=args.top, batch=args.batch,
                 progress=not args.no_progress, **given)
    print(f"index search: {search_settings(shards, **given)[1]}")
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
    except cli.INTERRUPTS as e:
        if not cli.ctrl_c(e):
            raise
        print(interrupted(args.out) if args.command == "build"
              else "index search: interrupted; nothing was written", file=sys.stderr)
        return INTERRUPTED
