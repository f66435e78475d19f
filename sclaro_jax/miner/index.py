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
Fast-scan PQ (`...x4fs`, the default for large galleries) cannot be merged (`_mergeable`): step 3 is skipped and
step 4 adds the stored chunks in order, one step (a kill there redoes the adding only).
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
measurement (bench/README.md, "MINER ANN index on CPU"). HNSW is not supported: it has no `merge_from` and no IVF lists.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

VERSION = 1
# "auto": exact ("Flat") for an index of fewer than FLAT_BELOW vectors, where a scan is cheap and
# a quantizer trained on so few vectors loses recall (the planted-colours benchmark's 2,000
# images: PQ recall@10 0.875, Flat 1.000); LARGE_FACTORY above (measured at 1M images).
DEFAULT_FACTORY = "auto"
LARGE_FACTORY = "IVF{nlist},PQ{m/2}x4fs"
FLAT_BELOW = 20_000
DEFAULT_NPROBE = 896  # crop index; measured at 1M images (bench/README.md)
DEFAULT_NPROBE_GLOBAL = 256  # global index
DEFAULT_SHORTLIST = 100
INSTALL = 'pip install "sclaro-jax[ann]"'

# A hook run after each chunk of a build step is recorded: (step, chunk) -> None. Tests replace
# it to kill a build at a known point.
_after_chunk = None


class IndexFileError(ValueError):
    """An index folder that cannot be used: missing or truncated files, an unfinished build."""


class IndexMismatchError(ValueError):
    """An index built with other settings (encoder, crop rule, dim, ...) than asked for."""


class FaissMissing(ImportError):
    pass


def faiss():
    """The faiss module, imported on first use; a one-line error naming the extra without it."""
    try:
        import faiss as f
    except ImportError as e:
        raise FaissMissing(f"the ANN index needs faiss ({e}); install it with {INSTALL}") from None
    return f


# --------------------------------------------------------------------------------------------
# Galleries to index
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Gallery:
    """Gallery views to read in row ranges: `images` [G, D] and `crops` [G, R, D] (numpy or
    np.memmap), or the parts of an `eval.rocs` embedding cache (`from_cache`)."""

    n: int
    dim: int
    n_crops: int
    images: Optional[np.ndarray] = None
    crops: Optional[np.ndarray] = None
    parts: Optional[list] = None  # [(start, stop, path)] of [n, 1 + R, D] cache parts
    encoder: Optional[str] = None
    crop_rule: Optional[str] = None
    crop_spec: Optional[dict] = None
    queries: Optional[Path] = None  # a cache's queries.npy (the default bank)

    def views(self, a: int, b: int) -> np.ndarray:
        """Rows a:b as float16 [b - a, 1 + R, D], global view first."""
        from sclaro_jax.miner.stream import read_rows

        if self.parts is not None:
            out = []
            for lo, hi, path in self.parts:
                if hi > a and lo < b:
                    arr = np.load(path, mmap_mode="r")
                    out.append(np.asarray(arr[max(a, lo) - lo:min(b, hi) - lo]))
            return np.concatenate(out).astype(np.float16)
        g = read_rows(self.images, a, b).astype(np.float16)[:, None]
        if self.crops is None:
            return g
        return np.concatenate([g, read_rows(self.crops, a, b).astype(np.float16)], axis=1)

    @classmethod
    def from_arrays(cls, images, crops=None, **info) -> "Gallery":
        images = np.asarray(images) if not isinstance(images, np.ndarray) else images
        if images.ndim != 2:
            raise ValueError(f"images must be [G, D], not shape {images.shape}")
        if crops is not None and (crops.ndim != 3 or crops.shape[0] != images.shape[0]
                                  or crops.shape[2] != images.shape[1]):
            raise ValueError(f"crops must be [{images.shape[0]}, R, {images.shape[1]}], not "
                             f"shape {crops.shape}")
        return cls(n=images.shape[0], dim=images.shape[1],
                   n_crops=0 if crops is None else crops.shape[1], images=images, crops=crops,
                   **info)

    @classmethod
    def from_npy(cls, images: str, crops: Optional[str] = None, **info) -> "Gallery":
        return cls.from_arrays(_load(images), None if crops is None else _load(crops), **info)

    @classmethod
    def from_cache(cls, folder) -> "Gallery":
        """An `eval.rocs` embedding cache folder (`OUT/cache/<key>`: meta.json, gallery parts
        `gallery-PPPPP-of-NNNNN.npy` [n, 1 + R, D] float16, queries.npy), or the cache folder
        `OUT/cache` itself when it holds one split's."""
        folder = Path(folder)
        keys = sorted(p.parent for p in folder.glob("*/meta.json"))
        if not (folder / "meta.json").exists() and len(keys) == 1:
            folder = keys[0]
        elif not (folder / "meta.json").exists() and keys:
            raise ValueError(f"{folder} holds the caches of {len(keys)} splits; name one: "
                             + ", ".join(str(k) for k in keys))
        meta_path = folder / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(2, "No such file or directory (not an eval.rocs embedding "
                                       "cache folder)", str(meta_path))
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError as e:
            raise ValueError(f"{meta_path} is not JSON ({e})") from None
        files = sorted(folder.glob("gallery-*-of-*.npy"))
        total = int(files[0].name.split("-of-")[1][:5]) if files else 0
        if not files or len(files) != total:
            raise IndexFileError(f"{folder}: {len(files)} of {total or '?'} gallery parts; run "
                                 f"eval.rocs to finish the cache")
        parts, start, shape = [], 0, None
        for path in files:
            try:
                arr = np.load(path, mmap_mode="r")
            except (ValueError, OSError) as e:
                raise IndexFileError(f"{path}: unreadable ({e})") from None
            parts.append((start, start + arr.shape[0], path))
            start += arr.shape[0]
            shape = arr.shape
        if start != meta.get("images", start):
            raise IndexFileError(f"{folder}: {start} gallery rows, meta.json says "
                                 f"{meta['images']}")
        queries = folder / "queries.npy"
        return cls(n=start, dim=shape[2], n_crops=shape[1] - 1, parts=parts,
                   encoder=meta.get("encoder"), crop_rule=meta.get("crop_rule"),
                   crop_spec=meta.get("crops"), queries=queries if queries.is_file() else None)


def _load(path: str) -> np.ndarray:
    """A .npy file as a read-only memory map (a missing one is an OSError naming it)."""
    if not Path(path).is_file():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    try:
        return np.load(path, mmap_mode="r")
    except ValueError as e:
        raise ValueError(f"{path}: not a .npy array ({e})") from None


def bank_hash(bank: np.ndarray) -> str:
    """sha256 of the bank as float32 (shape and bytes), 16 hex digits."""
    b = np.ascontiguousarray(bank, np.float32)
    return hashlib.sha256(repr(b.shape).encode() + b.tobytes()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Factories
# --------------------------------------------------------------------------------------------

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


def _pad(x: np.ndarray, d: int) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    if x.shape[1] == d:
        return x
    out = np.zeros((x.shape[0], d), np.float32)
    out[:, :x.shape[1]] = x
    return out


def global_vectors(views: np.ndarray, r_i: np.ndarray, d: int) -> np.ndarray:
    """[g, -r_i / 2, 0...] per image, float32 [n, d]."""
    g = views[:, 0].astype(np.float32)
    return _pad(np.concatenate([g, -0.5 * r_i.astype(np.float32)[:, None]], axis=1), d)


def crop_vectors(views: np.ndarray, r_i: np.ndarray, d: int, alpha: float, pool: str
                 ) -> np.ndarray:
    """The fused crop vectors, float32 [n * P, d] (P = R for pool max, 1 for mean), image i's
    at rows i * P ... i * P + P - 1:

        max:  x_ir = [(1 - alpha) g_i + alpha c_ir, -r_i / 2]      r = 0 .. R - 1
        mean: x_i  = [(1 - alpha) g_i + alpha mean_r c_ir, -r_i / 2]

    so that with the query [t, 1], max_r t.x_ir (or t.x_i) = S_i - r_i / 2 = (2 S_i - r_i) / 2:
    an exact inner product search over these vectors, keeping each image's best, gives the
    MINER + CSLS order; the ANN only approximates the inner products."""
    g = views[:, :1].astype(np.float32)
    c = views[:, 1:].astype(np.float32)
    if pool == "mean":
        c = c.mean(axis=1, keepdims=True)
    x = (1 - alpha) * g + alpha * c
    ri = np.broadcast_to(-0.5 * r_i.astype(np.float32)[:, None, None], x.shape[:2] + (1,))
    x = np.concatenate([x, ri], axis=2)
    return _pad(x.reshape(-1, x.shape[2]), d)


def per_image(n_crops: int, pool: str) -> int:
    """Crop-index vectors per image (`crop_vectors`)."""
    return n_crops if pool == "max" else 1


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------

SETTINGS = ("encoder", "crop_rule", "crops", "dim", "alpha", "k", "pool", "bank_hash",
            "factory", "shard", "total", "chunk")


def _write_json(path: Path, obj) -> None:
    from sclaro_jax.files import write_replacing
    write_replacing(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True)),
                    text=True, fsync=True)


def _write_npy(path: Path, arr) -> None:
    from sclaro_jax.files import write_replacing
    write_replacing(path, lambda f: np.save(f, arr), fsync=True)


def _write_index(path: Path, index) -> None:
    from sclaro_jax.files import write_replacing
    data = faiss().serialize_index(index)
    write_replacing(path, lambda f: f.write(data.tobytes()), fsync=True)


def _read_index(path: Path):
    if not path.is_file():
        raise IndexFileError(f"{path}: missing")
    try:
        return faiss().deserialize_index(np.fromfile(path, dtype=np.uint8))
    except RuntimeError as e:
        raise IndexFileError(f"{path}: unreadable FAISS index "
                             f"({str(e).strip().splitlines()[-1][:200]})") from None


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


def build(gallery: Gallery, bank: np.ndarray, out, *, alpha: float = 0.4, k: int = 10,
          pool: str = "max", factory: str = DEFAULT_FACTORY, chunk: int = 32768,
          shard: tuple[int, int] = (0, 1), train_size: Optional[int] = None,
          progress: bool = True) -> Path:
    """Build (or resume building) the index of one shard of `gallery` in folder `out`; returns
    `out`. `bank` [Qb, D] L2-normalised float32 query bank for r_i. See the module docstring."""
    from tqdm.auto import tqdm

    from sclaro_jax.miner import stream

    faiss()  # fail before any work without it
    out = Path(out)
    bank = np.ascontiguousarray(bank, np.float32)
    if bank.ndim != 2 or bank.shape[1] != gallery.dim:
        raise ValueError(f"the bank must be [Qb, {gallery.dim}] (the gallery's dim), not "
                         f"shape {bank.shape}")
    lo, hi = shard_rows(gallery.n, shard)
    n, r = hi - lo, gallery.n_crops
    if n < 1:
        raise ValueError(f"shard {shard[0]}/{shard[1]} of {gallery.n} images is empty")
    d_glob_f, d_glob = resolve_factory(factory, n, gallery.dim + 1)
    p_img = per_image(r, pool)
    d_crop_f, d_crop = resolve_factory(factory, max(1, n * p_img), gallery.dim + 1)
    meta = {"version": VERSION, "encoder": gallery.encoder, "crop_rule": gallery.crop_rule,
            "crops": gallery.crop_spec, "n_crops": r, "dim": gallery.dim, "alpha": float(alpha),
            "k": int(k), "pool": pool, "bank_hash": bank_hash(bank), "bank_rows": len(bank),
            "factory": factory, "factory_global": d_glob_f, "dim_global": d_glob,
            "factory_crops": d_crop_f if r else None, "dim_crops": d_crop if r else None,
            "shard": list(shard), "offset": lo, "images": n, "total": gallery.n,
            "chunk": int(chunk)}
    out.mkdir(parents=True, exist_ok=True)
    meta_path, man_path = out / "meta.json", out / "manifest.json"
    if meta_path.exists():
        old = _read_json(meta_path)
        _compare({f: meta[f] for f in SETTINGS}, old, str(meta_path), SETTINGS)
        _compare({f: meta[f] for f in ("n_crops", "images")}, old, str(meta_path),
                 ("n_crops", "images"))
        if "files" in old:
            meta["files"] = old["files"]
    else:
        _write_json(meta_path, meta)
    man = _read_json(man_path) if man_path.exists() else {
        "stored": [], "trained": False, "added": [], "complete": False}
    if man["complete"]:
        return out
    chunks = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    parts = out / "parts"
    parts.mkdir(exist_ok=True)
    views_path = out / "views.npy"
    shape = (n, 1 + r, gallery.dim)
    if views_path.exists():
        views = np.load(views_path, mmap_mode="r+")
        if views.shape != shape:
            raise IndexFileError(f"{views_path}: shape {views.shape}, expected {shape}")
    else:
        tmp = out / "views.npy.tmp"
        views = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=shape)
        views.flush()
        os.replace(tmp, views_path)
        views = np.load(views_path, mmap_mode="r+")

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
                            k=k, rescore="csls", bank=bank, top=1, chunk=chunk)
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
    kinds = [("global", d_glob_f, d_glob)] + ([("crops", d_crop_f, d_crop)] if r else [])
    if not man["trained"]:
        for kind, fac, d in kinds:
            total = n if kind == "global" else n * p_img
            size = min(total, train_size or max(40 * _nlist_of(fac), 10_000))
            rows = np.unique(np.linspace(0, total - 1, size).astype(np.int64))
            if kind == "global":
                x = global_vectors(np.asarray(views[rows]), r_i_rows(rows), d)
            else:
                img = np.unique(rows // p_img)
                x = crop_vectors(np.asarray(views[img]), r_i_rows(img), d, alpha, pool)
            index = faiss().index_factory(d, fac, faiss().METRIC_INNER_PRODUCT)
            if not index.is_trained:
                index.train(x)
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
            x = global_vectors(v, ri, d) if kind == "global" else \
                crop_vectors(v, ri, d, alpha, pool)
            index.add(x)
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
                v = np.asarray(views[a:b])
                ri = np.load(parts / f"ri-{c:05d}.npy")
                index.add(global_vectors(v, ri, d) if kind == "global" else
                          crop_vectors(v, ri, d, alpha, pool))
        _write_index(out / f"{kind}.faiss", index)
    _write_npy(out / "r_i.npy", np.concatenate([np.load(parts / f"ri-{c:05d}.npy")
                                                for c in range(len(chunks))]))
    del views
    names = ["views.npy", "r_i.npy"] + [f"{kind}.faiss" for kind, _, _ in kinds]
    meta["files"] = {f: (out / f).stat().st_size for f in names}
    _write_json(meta_path, meta)
    man["complete"] = True
    _write_json(man_path, man)
    shutil.rmtree(parts)
    for kind, _, _ in kinds:
        (out / f"trained-{kind}.faiss").unlink()
    return out


def _mergeable(factory: str) -> bool:
    """Whether chunk indexes of this factory can be merged: not fast-scan PQ ("x4fs"), whose
    `merge_from` corrupts memory in faiss-cpu 1.15.1 (a crash after a few merges)."""
    return "fs" not in factory


def _is_ivf(factory: str) -> bool:
    """Whether a factory string makes an IVF index (by its text: faiss's
    `try_extract_index_ivf` returns a wrapper that frees the index it points into)."""
    return "IVF" in factory


def _nlist_of(factory: str) -> int:
    m = re.search(r"IVF(\d+)", factory)
    return int(m.group(1)) if m else 1


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise IndexFileError(f"{path}: missing (not a MINER index folder, or its build never "
                             f"started)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise IndexFileError(f"{path}: not JSON ({e}); the file is damaged") from None


# --------------------------------------------------------------------------------------------
# Open and search
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Shard:
    """One opened index folder."""

    path: Path
    meta: dict
    views: np.ndarray        # float16 [n, 1 + R, D], memory-mapped
    r_i: np.ndarray          # float32 [n]
    glob: object             # faiss index over [g, -r_i / 2]
    crops: object            # faiss index over the crops, or None

    @property
    def offset(self) -> int:
        return self.meta["offset"]

    @property
    def n(self) -> int:
        return self.meta["images"]

    def memory_bytes(self) -> int:
        """Bytes of the in-memory part: the FAISS indexes (serialised) and r_i."""
        f = faiss()
        size = len(f.serialize_index(self.glob)) + self.r_i.nbytes
        return size + (len(f.serialize_index(self.crops)) if self.crops is not None else 0)


def open_index(path) -> Shard:
    """Open one finished index folder; an unfinished build, a missing or truncated file is an
    `IndexFileError` naming the file."""
    path = Path(path)
    meta = _read_json(path / "meta.json")
    man = _read_json(path / "manifest.json")
    if not man.get("complete") or "files" not in meta:
        chunks = -(-meta.get("images", 0) // max(1, meta.get("chunk", 1)))
        raise IndexFileError(f"{path}: the build is not finished ({len(man.get('stored', []))} "
                             f"of {chunks} chunks stored, {len(man.get('added', []))} added); "
                             f"run the same build command again to resume it")
    if meta.get("version") != VERSION:
        raise IndexFileError(f"{path / 'meta.json'}: index version {meta.get('version')}, this "
                             f"code reads {VERSION}; rebuild the index")
    for name, size in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise IndexFileError(f"{f}: missing; rebuild the index")
        if f.stat().st_size != size:
            raise IndexFileError(f"{f}: {f.stat().st_size} bytes, the build wrote {size} "
                                 f"(truncated or replaced); rebuild the index")
    views = np.load(path / "views.npy", mmap_mode="r")
    r_i = np.load(path / "r_i.npy")
    glob = _read_index(path / "global.faiss")
    crops = _read_index(path / "crops.faiss") if meta["n_crops"] else None
    return Shard(path, meta, views, r_i, glob, crops)


def open_shards(paths: Sequence, expect: Optional[dict] = None,
                opened: Optional[list] = None) -> list[Shard]:
    """Open the index folders of one gallery (one folder, or every shard i/N of a sharded
    build, in any order) and check they agree with each other and with `expect` (e.g.
    {"encoder": ..., "crop_rule": ..., "dim": ...}): a difference is refused naming both.
    `opened`: shards already opened, checked again (against another `expect`)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not opened and not paths:
        raise ValueError("no index folder given")
    shards = sorted(opened or (open_index(p) for p in paths), key=lambda s: s.meta["shard"][0])
    first = shards[0]
    for s in shards[1:]:
        _compare({f: first.meta[f] for f in SETTINGS if f not in ("shard",)}, s.meta,
                 f"{s.path / 'meta.json'} (beside {first.path})",
                 [f for f in SETTINGS if f != "shard"])
    count = first.meta["shard"][1]
    have = [s.meta["shard"][0] for s in shards]
    if have != list(range(count)):
        raise IndexFileError(f"{', '.join(str(s.path) for s in shards)}: shards {have} of "
                             f"{count}; a search needs each shard 0..{count - 1} once")
    if expect:
        _compare(expect, first.meta, str(first.path / "meta.json"), list(expect))
    return shards


@functools.partial(jax.jit, static_argnames=("alpha", "pool", "k", "top"))
def _rerank(t, views, valid, ids, r_i, *, alpha: float, pool: str, k: int, top: int):
    """Exact MINER + CSLS on each query's candidates.

    t [B, D] f32; views [B, W, V, D] (global, then crops); valid [B, W]; ids [B, W] int32 gallery
    rows, ascending among the valid ones; r_i [B, W]. S [B, W] by `kernels.fuse`; r_q = mean of
    the min(k, valid) highest S; CSLS by `kernels.csls_combine`; the top `top` by a stable
    descending order (ties: the lower position, so the lower gallery row). Invalid: -inf, -1.
    """
    from sclaro_jax.miner.kernels import csls_combine, fuse

    def one(tq, v):
        crops = v[:, 1:] if v.shape[1] > 1 else None
        return fuse(tq[None], v[:, 0], crops, alpha, pool, precision=jax.lax.Precision.HIGHEST)[0]

    s = jnp.where(valid, jax.vmap(one)(t, views), -jnp.inf)
    kk = min(k, s.shape[1])
    best = jax.lax.top_k(s, kk)[0]
    count = jnp.minimum(valid.sum(axis=1), kk)
    finite = jnp.arange(kk)[None, :] < count[:, None]
    r_q = jnp.where(finite, best, 0.0).sum(axis=1) / jnp.maximum(count, 1)
    resc = jnp.where(valid, csls_combine(s, r_q, r_i), -jnp.inf)
    vals, pos = jax.lax.top_k(resc, top)
    idx = jnp.where(jnp.isfinite(vals), jnp.take_along_axis(ids, pos, axis=1), -1)
    return vals, idx, r_q


def candidates(shards: Sequence[Shard], t: np.ndarray, shortlist: int, nprobe: int,
               nprobe_global: Optional[int] = None) -> np.ndarray:
    """[B, W] gallery rows per query: the union over shards of the top `shortlist` images of
    the global index and the first `shortlist` distinct images of the top `shortlist * P` fused
    crop vectors (P per image), ascending, padded with -1 (W = 2 * shortlist * shards, less
    where a shard is smaller). nprobe / nprobe_global: IVF lists visited in the crop / global
    index (None: nprobe in both)."""
    f = faiss()
    found = []
    b = t.shape[0]
    for s in shards:
        params = f.ParameterSpace()
        for index, fac, probes in ((s.glob, s.meta["factory_global"], nprobe_global or nprobe),
                                   (s.crops, s.meta["factory_crops"], nprobe)):
            if index is not None and _is_ivf(fac):
                params.set_index_parameter(index, "nprobe", probes)
        qg = np.zeros((b, max(s.glob.d, s.crops.d if s.crops is not None else 0)), np.float32)
        qg[:, :t.shape[1]] = t
        qg[:, t.shape[1]] = 1.0
        _, ig = s.glob.search(np.ascontiguousarray(qg[:, :s.glob.d]), min(shortlist, s.n))
        found.append(np.where(ig >= 0, ig + s.offset, -1))
        if s.crops is not None:
            per = per_image(s.meta["n_crops"], s.meta["pool"])
            _, ic = s.crops.search(np.ascontiguousarray(qg[:, :s.crops.d]),
                                   min(shortlist * per, s.crops.ntotal))
            found.append(_first_distinct(np.where(ic >= 0, ic // per + s.offset, -1),
                                         min(shortlist, s.n)))
    ids = np.concatenate(found, axis=1)
    big = np.iinfo(np.int64).max
    ids = np.sort(np.where(ids < 0, big, ids), axis=1)
    dup = np.zeros_like(ids, bool)
    dup[:, 1:] = ids[:, 1:] == ids[:, :-1]
    ids = np.sort(np.where(dup, big, ids), axis=1)
    return np.where(ids == big, -1, ids)


def _first_distinct(ids: np.ndarray, m: int) -> np.ndarray:
    """Per row, the first m distinct non-negative ids in row order, padded with -1."""
    out = np.full((ids.shape[0], m), -1, np.int64)
    for row, found in zip(out, ids):
        found = found[found >= 0]
        _, first = np.unique(found, return_index=True)
        keep = found[np.sort(first)][:m]
        row[:len(keep)] = keep
    return out


def _gather(shards: Sequence[Shard], ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 views [B, W, V, D] and r_i [B, W] of gallery rows ids (-1: zeros)."""
    first = shards[0]
    v = first.views.shape[1:]
    out = np.zeros(ids.shape + v, np.float16)
    r_i = np.zeros(ids.shape, np.float32)
    flat = ids.reshape(-1)
    ov, orr = out.reshape((-1,) + v), r_i.reshape(-1)
    for s in shards:
        sel = np.nonzero((flat >= s.offset) & (flat < s.offset + s.n))[0]
        if len(sel):
            rows = flat[sel] - s.offset
            order = np.argsort(rows, kind="stable")
            ov[sel[order]] = s.views[rows[order]]
            orr[sel] = s.r_i[rows]
    return out, r_i


def search(queries: np.ndarray, shards, *, top: int = 10, shortlist: int = DEFAULT_SHORTLIST,
           nprobe: int = DEFAULT_NPROBE, nprobe_global: Optional[int] = DEFAULT_NPROBE_GLOBAL,
           batch: int = 64, progress: bool = False):
    """Top `top` gallery images per query under the exact MINER + CSLS score on the ANN
    shortlist (module docstring). queries [Q, D] L2-normalised; shards: from `open_shards` (or
    folders). Returns `stream.SearchResult` (scores [Q, top] 2S - r_q - r_i, indices [Q, top]
    global gallery rows, -1 past the candidates; r_q [Q] over the shortlist; r_i [G] the
    bank's)."""
    from tqdm.auto import tqdm

    from sclaro_jax.miner.stream import SearchResult

    if not shards or isinstance(shards, (str, os.PathLike)) or not isinstance(shards[0], Shard):
        shards = open_shards(shards)
    meta = shards[0].meta
    queries = np.ascontiguousarray(queries, np.float32)
    if queries.ndim != 2 or queries.shape[1] != meta["dim"]:
        raise IndexMismatchError(f"{shards[0].path / 'meta.json'}: the index was built with "
                                 f"dim {meta['dim']}, not {queries.shape[-1]} (queries of "
                                 f"shape {queries.shape})")
    total = meta["total"]
    top = min(top, total)
    scores = np.empty((len(queries), top), np.float32)
    indices = np.empty((len(queries), top), np.int64)
    r_q = np.empty((len(queries),), np.float32)
    for a in tqdm(range(0, len(queries), batch), desc="search", unit="batch",
                  disable=not progress):
        t = queries[a:a + batch]
        ids = candidates(shards, t, shortlist, nprobe, nprobe_global)
        b = len(t)
        if b < batch and len(queries) > batch:  # one compiled shape for every batch
            t = np.concatenate([t, np.zeros((batch - b, t.shape[1]), np.float32)])
            ids = np.concatenate([ids, np.full((batch - b, ids.shape[1]), -1)])
        views, r_i = _gather(shards, ids)
        vals, idx, rq = _rerank(jnp.asarray(t), jnp.asarray(views), jnp.asarray(ids >= 0),
                                jnp.asarray(ids.astype(np.int32)), jnp.asarray(r_i),
                                alpha=meta["alpha"], pool=meta["pool"], k=meta["k"],
                                top=min(top, ids.shape[1]))
        vals, idx = np.asarray(vals)[:b], np.asarray(idx)[:b]
        pad = top - vals.shape[1]
        scores[a:a + b] = np.pad(vals, ((0, 0), (0, pad)), constant_values=-np.inf)
        indices[a:a + b] = np.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
        r_q[a:a + b] = np.asarray(rq)[:b]
    return SearchResult(scores=scores, indices=indices, r_q=r_q,
                        r_i=np.concatenate([s.r_i for s in shards]))


def gt_ranks(indices: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """Position of each query's ground truth in its result list, or the list's length when it
    is not there (so recall@k = mean(rank < k) for k up to the list's length)."""
    hit = indices == np.asarray(gt)[:, None]
    return np.where(hit.any(axis=1), hit.argmax(axis=1), indices.shape[1]).astype(np.int64)


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    from sclaro_jax import cli

    p = cli.parser("python -m sclaro_jax.miner.index",
                   "An ANN index (FAISS) for a MINER gallery, searched with the exact MINER "
                   "fused score and CSLS on a shortlist (docs/miner.md).")
    sub = p.add_subparsers(dest="command", required=True, metavar="{build,search}")
    b = sub.add_parser("build", help="build (or resume building) an index",
                       description="Build, or resume after a kill, the index of a gallery (or "
                                   "of one shard of it).", formatter_class=cli.DefaultsOnce)
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
    b.add_argument("--alpha", type=float, default=0.4, help="weight of the crop score")
    b.add_argument("--k", type=int, default=10, help="CSLS neighbourhood size")
    b.add_argument("--pool", choices=("max", "mean"), default="max", help="pooling over crops")
    b.add_argument("--chunk", type=int, default=32768, help="images per build chunk")
    b.add_argument("--shard", default="0/1", help="build shard i of N (i/N)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    s = sub.add_parser("search", help="search an index",
                       description="Top-k images per query: ANN shortlist, then the exact MINER "
                                   "+ CSLS score.", formatter_class=cli.DefaultsOnce)
    s.add_argument("--index", action="append", required=True,
                   help="index folder (repeat for each shard of a sharded index)")
    s.add_argument("--queries", required=True, help="query embeddings [Q, D] .npy")
    s.add_argument("--gt", help="ground-truth gallery row per query [Q] .npy: prints R@1/5/10")
    s.add_argument("--top", type=int, default=10, help="results per query")
    s.add_argument("--shortlist", type=int, default=DEFAULT_SHORTLIST,
                   help="candidates per index (global, crops) and shard")
    s.add_argument("--nprobe", type=int, default=DEFAULT_NPROBE,
                   help="IVF lists visited in the crop index")
    s.add_argument("--nprobe-global", type=int, default=DEFAULT_NPROBE_GLOBAL,
                   help="IVF lists visited in the global index")
    s.add_argument("--batch", type=int, default=64, help="queries per re-rank batch")
    s.add_argument("--out", required=True, type=cli.writable,
                   help="folder for hits.npz (scores, indices, r_q)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from sclaro_jax import cli

    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
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
        queries = np.asarray(_load(args.queries), np.float32)
        gt = None if args.gt is None else np.asarray(_load(args.gt))
        shards = open_shards(args.index)
        res = search(queries, shards, top=args.top, shortlist=args.shortlist,
                     nprobe=args.nprobe, nprobe_global=args.nprobe_global, batch=args.batch,
                     progress=not args.no_progress)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        np.savez(out / "hits.npz", scores=res.scores, indices=res.indices, r_q=res.r_q)
        line = f"{len(queries)} queries -> {out / 'hits.npz'}"
        if gt is not None:
            ranks = gt_ranks(res.indices, gt)
            line += "; " + ", ".join(f"R@{k} {100 * np.mean(ranks < k):.2f}"
                                     for k in (1, 5, 10) if k <= res.indices.shape[1])
        print(line)
        return 0
    except (*cli.USER_ERRORS, FaissMissing) as e:
        return cli.fail(e)


if __name__ == "__main__":
    sys.exit(main())
