"""Searching a MINER ANN index whose views.npy is read from disk: queries/s of the same index
with the page cache emptied first, under the read advice of `index.files` (a views file bigger
than half the memory mapped MADV_RANDOM, each batch's rows prefetched with
posix_fadvise(WILLNEED)) and with parts of it switched off, to show what each part gives.

    sudo python bench/miner_index_cold.py --index /tmp/ann_growth/growth_4000000 \\
        --queries-from /tmp/ann_q --modes now,random-only,none --drop-caches

Per mode: a warm-up search of one batch, then the timed search of the next --queries queries
(cold: right after `sync; echo 1 > /proc/sys/vm/drop_caches` with --drop-caches, which needs
root), then the same search again. One JSON line per mode.
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

from sclaro_jax.miner import index  # noqa: E402
from sclaro_jax.miner.index import files as index_files, searching as index_search  # noqa: E402

MODES = ("now", "random-only", "none")


def run(mode: str, args, q: np.ndarray, gt: np.ndarray) -> dict:
    cold, prefetch = index_files.cold, index_search.prefetch
    if mode != "now":
        index_search.prefetch = lambda views, rows: None
    if mode == "none":
        index_files.cold = lambda views: False  # no random advice at open either
    try:
        if args.drop_caches:
            subprocess.run(["sync"], check=True)
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
        shard = index.open_index(args.index)
        kw = dict(shortlist=args.shortlist, nprobe=args.nprobe, nprobe_global=args.nprobe_global,
                  batch=args.batch)
        index.search(q[:args.batch], [shard], **kw)  # compiles
        timed, again = q[args.batch:args.batch + args.queries], None
        t0 = time.perf_counter()
        res = index.search(timed, [shard], **kw)
        first = len(timed) / (time.perf_counter() - t0)
        if args.again:
            t0 = time.perf_counter()
            index.search(timed, [shard], **kw)
            again = round(len(timed) / (time.perf_counter() - t0), 1)
        ranks = index.gt_ranks(res.indices, gt[args.batch:args.batch + args.queries])
        return dict(mode=mode, queries=len(timed), q_per_s=round(first, 2), again=again,
                    R1=round(100 * float(np.mean(ranks < 1)), 2),
                    views_gb=round(shard.views.nbytes / 1e9, 1),
                    cold=bool(cold(shard.views)))
    finally:
        index_files.cold, index_search.prefetch = cold, prefetch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", required=True, help="a finished index folder")
    p.add_argument("--queries-from", required=True,
                   help="a miner_gallery.py folder (queries.npy, gt.npy) of the indexed gallery")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument("--queries", type=int, default=936, help="timed queries (after the warm-up)")
    p.add_argument("--shortlist", type=int, default=index.DEFAULT_SHORTLIST)
    p.add_argument("--nprobe", type=int, default=index.DEFAULT_NPROBE)
    p.add_argument("--nprobe-global", type=int, default=index.DEFAULT_NPROBE_GLOBAL)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--no-again", dest="again", action="store_false",
                   help="do not time the search a second time")
    p.add_argument("--drop-caches", action="store_true",
                   help="empty the page cache before each mode (root)")
    args = p.parse_args()
    src = Path(args.queries_from)
    q, gt = np.load(src / "queries.npy"), np.load(src / "gt.npy")
    if args.drop_caches and os.geteuid() != 0:
        p.error("--drop-caches needs root (it writes /proc/sys/vm/drop_caches)")
    for mode in args.modes.split(","):
        if mode not in MODES:
            p.error(f"--modes: {mode!r} is not one of {MODES}")
        print(json.dumps(run(mode, args, q, gt)), flush=True)


if __name__ == "__main__":
    main()
