"""The settings of a MINER ANN index (`sclaro_jax.miner.index`): the version, the factories and
search defaults, the ranges of every number, the settings an index records, the errors, the
faiss module, and the factory strings ("auto", `{nlist}`, `{m}`)."""

from __future__ import annotations

import hashlib
import math
import re
from typing import Sequence

import numpy as np

from sclaro_jax import cli


VERSION = 2  # 2: the crop index's IVF lists are chosen by the crops (`route_vectors`)
# "auto": exact ("Flat") for an index of fewer than FLAT_BELOW vectors, where a scan is cheap and
# a quantizer trained on so few vectors loses recall (the planted-colours benchmark's 2,000
# images: PQ recall@10 0.875, Flat 1.000); LARGE_FACTORY above (measured at 1M images).
DEFAULT_FACTORY = "auto"
LARGE_FACTORY = "IVF{nlist},PQ{m/2}x4fs"
FLAT_BELOW = 20_000
# Lists visited in the crop index (of 2048 at 1M images) and the global index (of 1024): the
# topics gallery at 1M images, M 100: recall@10 0.973 of the exact ranking, R@1 72.4 (exact
# 72.5), 21.8x the exact search in the same run (bench/README.md, "MINER ANN index on CPU").
DEFAULT_NPROBE = 256
DEFAULT_NPROBE_GLOBAL = 32
DEFAULT_SHORTLIST = 100
INSTALL = cli.install_command("ann")
# The range of every number a build or a search takes: the flags' `type=` (`cli.number_in`) and
# the Python API (`check_ranges`). Counts are C ints (faiss's nprobe; the re-rank's int32 rows).
RANGES = {"alpha": (0.0, 1.0), "k": (1, cli.INT_MAX), "chunk": (1, cli.INT_MAX),
          "top": (1, cli.INT_MAX), "shortlist": (1, cli.INT_MAX),
          "shortlist_global": (1, cli.INT_MAX), "nprobe": (1, cli.INT_MAX),
          "nprobe_global": (1, cli.INT_MAX), "batch": (1, cli.INT_MAX),
          "recall": (0.0, 1.0)}


class IndexFileError(ValueError):
    """An index folder that cannot be used: missing or truncated files, an unfinished build."""


class IndexMismatchError(ValueError):
    """An index built with other settings (encoder, crop rule, dim, ...) than asked for."""


class FaissMissing(cli.MissingExtra):
    pass


def faiss():
    """The faiss module, imported on first use; a one-line error naming the extra without it."""
    try:
        return cli.need("faiss", "ann", "the ANN index")
    except cli.MissingExtra as e:
        raise FaissMissing(str(e), name="faiss") from None


def ranged(name: str):
    """argparse `type=` of the flag of `RANGES[name]` (`cli.number_in`)."""
    return cli.number_in(*RANGES[name])


def check_ranges(**values) -> None:
    """A ValueError naming the first argument outside its `RANGES` (None: the default)."""
    for name, value in values.items():
        if value is not None:
            lo, hi = RANGES[name]
            cli.in_range(value, lo, hi, name)



SETTINGS = ("encoder", "crop_rule", "crops", "dim", "alpha", "k", "pool", "bank_hash",
            "factory", "shard", "total", "chunk", "calibration_hash")
# The search settings a calibrated build records (meta.json "calibration"), chosen for a recall
# asked at build time (`calibration`); a search without flags uses them (`search_settings`).
# shortlist_global: the global index's own shortlist where it differs from the crop index's
# (None: `shortlist` for both; a global-only index has only `shortlist`).
SEARCH_SETTINGS = ("shortlist", "shortlist_global", "nprobe", "nprobe_global")
DEFAULT_RECALL = 0.95


def bank_hash(bank: np.ndarray) -> str:
    """sha256 of the bank as float32 (shape and bytes), 16 hex digits."""
    b = np.ascontiguousarray(bank, np.float32)
    return hashlib.sha256(repr(b.shape).encode() + b.tobytes()).hexdigest()[:16]


def resolve_factory(template: str, n: int, d: int) -> tuple[str, int]:
    """(factory string, padded dimension) for n vectors of dimension d; see the module doc.
    "auto": "Flat" below FLAT_BELOW vectors, else LARGE_FACTORY."""
    if template == "auto":
        template = "Flat" if n < FLAT_BELOW else LARGE_FACTORY
    nlist = 2 ** round(math.log2(max(1.0, math.sqrt(n))))
    nlist = max(1, min(nlist, n // 39))
    text = template.replace("{nlist}", str(nlist)).replace("{m}", str(-(-d // 8)))
    text = re.sub(r"\{m/(\d+)\}", lambda g: str(-(-d // int(g.group(1)))), text)
    pq = re.search(r"(?<!O)PQ(\d+)", text)
    q = int(pq.group(1)) if pq else 1
    opq = re.match(r"OPQ(\d+)", text)
    if opq:
        q = math.lcm(q, int(opq.group(1)))
    return text, -(-d // q) * q


def shard_rows(n: int, shard: tuple[int, int]) -> tuple[int, int]:
    i, count = shard
    return i * n // count, (i + 1) * n // count


def parse_shard(text: str) -> tuple[int, int]:
    """'i/N' -> (i, N), 0 <= i < N."""
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"--shard must be i/N with 0 <= i < N, not {text!r}")
    return int(m.group(1)), int(m.group(2))


def _compare(what: dict, have: dict, where: str, fields: Sequence[str]) -> None:
    """Refuse the first field whose values differ, naming both."""
    for f in fields:
        if f in what and what[f] != have.get(f):
            raise IndexMismatchError(f"{where}: the index was built with {f} {have.get(f)!r}, "
                                     f"not {what[f]!r}")


def _is_ivf(factory: str) -> bool:
    """Whether a factory string makes an IVF index (by its text: faiss's
    `try_extract_index_ivf` returns a wrapper that frees the index it points into)."""
    return "IVF" in factory


def _nlist_of(factory: str) -> int:
    m = re.search(r"IVF(\d+)", factory)
    return int(m.group(1)) if m else 1
