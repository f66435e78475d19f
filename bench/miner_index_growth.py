"""The growth line of the MINER ANN index (`sclaro_jax.miner.index`): build time, search speed
and memory at growing gallery sizes of `miner_gallery.py`'s topics gallery, with the images
generated while the index is built (so a size needs the index's own float16 copy on disk, 9.2 GB
a million images x 6 views x 768, not a second copy of the gallery), beside the exact scan
(`stream.search` without a bank: the fused scores' top 10, the cost of an exact search once r_i
is known) over that copy on the first --scan-queries queries.

    python bench/miner_index_growth.py --sizes 2000000,4000000 --queries-from GALLERY_1M_DIR \
        --dir /tmp/ann_growth

The queries, ground truth and bank are `miner_gallery.make`'s, which are the same for every size
of at least 1M images: --queries-from names a made gallery folder of that family (its
queries.npy, gt.npy, bank.npy, gallery.json). The generation time is measured apart and taken
out of the build time. One JSON line per size and setting, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import miner_gallery  # noqa: E402
from sclaro_jax.miner import index, stream  # noqa: E402


class Generated(index.Gallery):
    """The topics gallery of `params` (gallery.json's), its rows made on demand (one 65,536-image
    generator chunk cached), with the seconds spent making them."""

    def __init__(self, n: int, params: dict):
        super().__init__(n=n, dim=params["dim"], n_crops=params["crops"], encoder="synthetic")
        self.p = params
        self.centres = miner_gallery._centres(params["topics"], params["dim"], params["seed"])
        self.cached = (-1, None)
        self.seconds = 0.0

    def _chunk(self, i: int) -> np.ndarray:
        if self.cached[0] != i:
            t0 = time.perf_counter()
            a, b = i * miner_gallery.CHUNK, min(self.n, (i + 1) * miner_gallery.CHUNK)
            g, c = miner_gallery.image_rows(a, b, crops=self.p["crops"], centres=self.centres,
                                            beta=self.p["beta"], delta=self.p["delta"],
                                            seed=self.p["seed"])
            self.cached = (i, np.concatenate([g[:, None], c], axis=1).astype(np.float16))
            self.seconds += time.perf_counter() - t0
        return self.cached[1]

    def views(self, a: int, b: int) -> np.ndarray:
        out, size = [], miner_gallery.CHUNK
        for i in range(a // size, (b - 1) // size + 1):
            lo = i * size
            out.append(self._chunk(i)[max(a, lo) - lo:min(b, lo + size) - lo])
        return np.concatenate(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2000000,4000000", help="comma list of gallery sizes")
    p.add_argument("--queries-from", required=True,
                   help="a miner_gallery.py folder of >= 1M images (queries, gt, bank)")
    p.add_argument("--dir", default="/tmp/ann_growth", help="index folders")
    p.add_argument("--shortlist", type=int, default=index.DEFAULT_SHORTLIST)
    p.add_argument("--nprobes", default=f"{index.DEFAULT_NPROBE}/{index.DEFAULT_NPROBE_GLOBAL}",
                   help="comma list of CROPS/GLOBAL lists visited")
    p.add_argument("--scan-queries", type=int, default=200,
                   help="queries for the exact scan beside the index (0: none)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--keep", action="store_true", help="keep the indexes")
    p.add_argument("--reuse", action="store_true",
                   help="search a finished index already in --dir (kept with --keep) instead "
                        "of building it; no build figures")
    args = p.parse_args()
    src = Path(args.queries_from)
    params = json.loads((src / "gallery.json").read_text())
    q, gt, bank = (np.load(src / f"{n}.npy") for n in ("queries", "gt", "bank"))
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        gallery = Generated(n, params)
        out = Path(args.dir) / f"growth_{n}"
        build_s = None
        if not (args.reuse and (out / "meta.json").is_file()):
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            index.build(gallery, bank, out, progress=False)
            build_s = round(time.perf_counter() - t0 - gallery.seconds, 1)
        shard = index.open_index(out)
        emb = n * (1 + params["crops"]) * params["dim"] * 2
        mem = shard.memory_bytes()
        scan = None
        if args.scan_queries:
            qe = q[:args.scan_queries]
            t0 = time.perf_counter()
            views = np.load(out / "views.npy", mmap_mode="r")  # read in order, not advised random
            stream.search(qe, views[:, 0], views[:, 1:], rescore="none", top=10)
            scan = len(qe) / (time.perf_counter() - t0)
        for probes in args.nprobes.split(","):
            crops_, _, glob_ = probes.partition("/")
            kw = dict(shortlist=args.shortlist, nprobe=int(crops_),
                      nprobe_global=int(glob_ or crops_), batch=args.batch)
            index.search(q[:args.batch], [shard], **kw)  # compiles
            t0 = time.perf_counter()
            res = index.search(q, [shard], **kw)
            qps = len(q) / (time.perf_counter() - t0)
            ranks = index.gt_ranks(res.indices, gt)
            row = dict(images=n, nprobe=probes, build_s=build_s,
                       generate_s=round(gallery.seconds, 1) if build_s else None,
                       q_per_s=round(qps, 1),
                       R1=round(100 * float(np.mean(ranks < 1)), 2),
                       R10=round(100 * float(np.mean(ranks < 10)), 2),
                       index_mb=round(mem / 1e6, 1), mem_ratio=round(mem / emb, 3))
            if scan:
                row.update(scan_q_per_s=round(scan, 2), x_scan=round(qps / scan, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del shard
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    keys = list(rows[0]) if rows else []
    print("| " + " | ".join(keys) + " |\n|" + "---:|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main()
