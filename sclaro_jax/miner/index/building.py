"""The build of a MINER ANN index (`sclaro_jax.miner.index`): its steps over one small state
object (`Build`), each resumable from `manifest.json`:

    plan       every argument checked, meta.json's settings (`_plan`), before anything is written
    store      each chunk's views into views.npy, its r_i and the calibration queries' exact top
               within the chunk into parts/ (one streamed pass over the bank's fused scores)
    train      the FAISS indexes on a strided sample of the stored vectors
    add        each chunk into a copy of the trained indexes (merge-safe factories)
    assemble   the parts merged in gallery order into global.faiss / crops.faiss, r_i.npy,
               calibration.npz; the sizes of every file into meta.json
    calibrate  the cheapest search settings reaching the recall asked (`calibration`), into
               meta.json's "calibration"

The method and the files are in the package docstring.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from sclaro_jax.files import own_folder, remove_own_folder, replacing
from sclaro_jax.miner.index import calibration
from sclaro_jax.miner.index.files import (Shard, _index_folder, _read_index, _read_json,
                                          _views_to_write, _write_index, _write_json,
                                          _write_npy, kept)
from sclaro_jax.miner.index.forms import (_add, _faiss_refusal, _mergeable, _trained,
                                          final_index, new_index)
from sclaro_jax.miner.index.gallery import Gallery
from sclaro_jax.miner.index.settings import (DEFAULT_FACTORY, DEFAULT_RECALL, SETTINGS, VERSION,
                                             IndexFileError, _compare, _is_ivf, bank_hash,
                                             check_ranges, faiss, resolve_factory, shard_rows)
from sclaro_jax.miner.index.vectors import per_image

# A hook run after each chunk of a build step is recorded: (step, chunk) -> None. Tests replace
# it to kill a build at a known point.
_after_chunk = None


def _plan(gallery: Gallery, bank: np.ndarray, *, alpha, k, pool, factory, chunk,
          shard, queries: np.ndarray, source: str) -> tuple[dict, list]:
    """(meta.json of the build, [(kind, factory, dim)] of its indexes), every argument checked
    first (`RANGES`, the bank's shape, the shard, each factory made once), so that a refused
    build writes nothing."""
    check_ranges(alpha=alpha, k=k, chunk=chunk)
    if pool not in ("max", "mean"):
        raise ValueError(f"pool must be 'max' or 'mean', not {pool!r}")
    for name, arr in (("bank", bank), ("calibration queries", queries)):
        if arr.ndim != 2 or arr.shape[1] != gallery.dim or not len(arr):
            raise ValueError(f"the {name} must be [Q, {gallery.dim}] (the gallery's dim), "
                             f"not shape {arr.shape}")
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
            "chunk": int(chunk), "calibration_hash": bank_hash(queries),
            "calibration_queries": {"count": len(queries), "source": source}}
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
        fields = [f for f in SETTINGS if (man["trained"] or f != "factory") and not (
            f == "calibration_hash" and man["complete"] and f not in old)]  # built before it
        _compare({f: meta[f] for f in fields}, old, str(meta_path), fields)
        _compare({f: meta[f] for f in ("version", "n_crops", "images")}, old, str(meta_path),
                 ("version", "n_crops", "images"))
        for kept_field in ("files", "calibration"):
            if kept_field in old:
                meta[kept_field] = old[kept_field]
        if old["factory"] != meta["factory"]:
            _write_json(meta_path, meta)
    else:
        _write_json(meta_path, meta)
    if man["stored"] and not man["complete"]:
        print(f"index {out}: resuming the build, reusing what it kept ({kept(meta, man)}"
              f"{', trained' if man['trained'] else ''})", file=sys.stderr)
    return man


@dataclasses.dataclass
class Build:
    """What every step of one build reads: its folder, gallery, bank, calibration queries,
    settings and manifest, and the views file it writes."""

    out: Path
    gallery: Gallery
    bank: np.ndarray
    queries: np.ndarray       # the calibration queries [Qc, D]
    meta: dict
    kinds: list               # [(kind, factory, dim)]
    man: dict
    chunk: int
    train_size: Optional[int]
    progress: bool
    views: Optional[np.memmap] = None

    @property
    def parts(self) -> Path:
        return self.out / "parts"

    @property
    def chunks(self) -> list[tuple[int, int]]:
        n = self.meta["images"]
        return [(a, min(a + self.chunk, n)) for a in range(0, n, self.chunk)]

    def record(self, step: str, c: int) -> None:
        self.man[step] = sorted(set(self.man[step]) | {c})
        _write_json(self.out / "manifest.json", self.man)
        if _after_chunk is not None:
            _after_chunk(step, c)

    def r_i(self, c: int) -> np.ndarray:
        return np.load(self.parts / f"ri-{c:05d}.npy")

    def r_i_rows(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty(len(rows), np.float32)
        for c, (a, b) in enumerate(self.chunks):
            sel = (rows >= a) & (rows < b)
            if sel.any():
                out[sel] = self.r_i(c)[rows[sel] - a]
        return out

    def bar(self, items, what: str, disable: bool = False):
        from tqdm.auto import tqdm
        return tqdm(items, desc=f"index {self.out.name}: {what}", unit="chunk",
                    disable=disable or not self.progress)


def _open_views(st: Build) -> None:
    views_path = st.out / "views.npy"
    shape = (st.meta["images"], 1 + st.meta["n_crops"], st.gallery.dim)
    if not os.path.lexists(views_path):
        with replacing(views_path) as tmp:
            np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=shape).flush()
    st.views = _views_to_write(views_path)
    if st.views.shape != shape:
        raise IndexFileError(f"{views_path}: shape {st.views.shape}, expected {shape}")


def _store(st: Build) -> None:
    """1. Each chunk's views, its r_i and the calibration queries' exact top within it: one
    streamed pass (`stream.search` with the bank; r_i needs only the bank)."""
    from sclaro_jax.miner import stream

    m, lo = st.meta, st.meta["offset"]
    todo = [c for c in range(len(st.chunks)) if c not in st.man["stored"]]
    for c in st.bar(todo, "store + r_i"):
        a, b = st.chunks[c]
        v = st.gallery.views(lo + a, lo + b)
        st.views[a:b] = v
        st.views.flush()
        res = stream.search(st.queries, v[:, 0], v[:, 1:] if m["n_crops"] else None,
                            alpha=m["alpha"], pool=m["pool"], k=m["k"], rescore="csls",
                            bank=st.bank, top=min(calibration.K, b - a),
                            chunk=min(st.chunk, m["images"]))
        calibration.save_chunk(st.parts / f"cal-{c:05d}.npz", res, a)
        _write_npy(st.parts / f"ri-{c:05d}.npy", res.r_i.astype(np.float32))
        st.record("stored", c)


def _train(st: Build) -> None:
    """2. The FAISS indexes, trained on a strided sample of the stored vectors."""
    if st.man["trained"]:
        return
    m = st.meta
    p_img = per_image(m["n_crops"], m["pool"])
    for kind, fac, d in st.kinds:
        total = m["images"] * (p_img if kind == "crops" else 1)
        index = _trained(kind, fac, d, st.views, st.r_i_rows, total, p_img, m["alpha"],
                         m["pool"], st.train_size, m["factory"])
        _write_index(st.out / f"trained-{kind}.faiss", index)
    st.man["trained"] = True
    _write_json(st.out / "manifest.json", st.man)


def _add_chunks(st: Build, trained: dict) -> None:
    """3. Each chunk added to a copy of the trained indexes (merge-safe factories only)."""
    m = st.meta
    if not all(_mergeable(fac) for _, fac, _ in st.kinds):
        return
    todo = [c for c in range(len(st.chunks)) if c not in st.man["added"]]
    for c in st.bar(todo, "add"):
        a, b = st.chunks[c]
        v = np.asarray(st.views[a:b])
        for kind, _, d in st.kinds:
            index = faiss().clone_index(trained[kind])
            _add(index, kind, v, st.r_i(c), d, m["alpha"], m["pool"])
            _write_index(st.parts / f"{kind}-{c:05d}.faiss", index)
        st.record("added", c)


def _assemble(st: Build, trained: dict) -> dict:
    """4. The parts merged in gallery order (fast-scan: the chunks added in order), r_i.npy and
    calibration.npz; returns the final indexes {kind: index}."""
    m = st.meta
    mergeable = all(_mergeable(fac) for _, fac, _ in st.kinds)
    p_img = per_image(m["n_crops"], m["pool"])
    final = {}
    for kind, fac, d in st.kinds:
        index = faiss().clone_index(trained[kind])
        per = 1 if kind == "global" else p_img
        for c, (a, b) in enumerate(st.bar(st.chunks, kind, disable=mergeable)):
            if mergeable:
                part = _read_index(st.parts / f"{kind}-{c:05d}.faiss")
                # IVF lists store ids (shifted by the chunk's first row); flat ids: positions
                index.merge_from(part, a * per if _is_ivf(fac) else 0)
            else:
                _add(index, kind, np.asarray(st.views[a:b]), st.r_i(c), d, m["alpha"],
                     m["pool"])
        final[kind] = final_index(index, fac)
        _write_index(st.out / f"{kind}.faiss", final[kind])
    _write_npy(st.out / "r_i.npy", np.concatenate([st.r_i(c) for c in range(len(st.chunks))]))
    calibration.save_exact(st.out / "calibration.npz", st.queries,
                           [st.parts / f"cal-{c:05d}.npz" for c in range(len(st.chunks))])
    return final


def _tidy(out: Path, kinds) -> None:
    """Remove a finished build's working files (its parts folder, which it made and marked; the
    trained indexes: a link goes, never its target)."""
    remove_own_folder(out / "parts")
    for kind, _, _ in kinds:
        (out / f"trained-{kind}.faiss").unlink(missing_ok=True)


def build(gallery: Gallery, bank: np.ndarray, out, *, alpha: float = 0.4, k: int = 10,
          pool: str = "max", factory: str = DEFAULT_FACTORY, chunk: int = 32768,
          shard: tuple[int, int] = (0, 1), train_size: Optional[int] = None,
          recall: float = DEFAULT_RECALL, calibration_queries: Optional[np.ndarray] = None,
          progress: bool = True) -> Path:
    """Build (or resume building) the index of one shard of `gallery` in folder `out`; returns
    `out`. `bank` [Qb, D] L2-normalised float32 query bank for r_i. `recall`: the recall@10
    against the exact MINER + CSLS order its stored search settings are calibrated to, on
    `calibration_queries` [Qc, D] (default: rows of the bank, `calibration.bank_rows`). A
    finished index built again with another `recall` is only calibrated again. See the package
    docstring. Every argument is checked before anything is written (a ValueError naming it)."""
    faiss()  # fail before any work without it
    check_ranges(recall=recall)
    out = Path(out)
    bank = np.ascontiguousarray(bank, np.float32)
    source = "bank" if calibration_queries is None else "given"
    queries = np.ascontiguousarray(bank[calibration.bank_rows(len(bank))]
                                   if calibration_queries is None else calibration_queries,
                                   np.float32)
    meta, kinds = _plan(gallery, bank, alpha=alpha, k=k, pool=pool, factory=factory,
                        chunk=chunk, shard=shard, queries=queries, source=source)
    _index_folder(out)
    man = _resume(out, meta)
    st = Build(out, gallery, bank, queries, meta, kinds, man, chunk, train_size, progress)
    if not man["complete"]:
        own_folder(st.parts, flag="the index build's parts folder")
        _open_views(st)
        _store(st)
        _train(st)
        trained = {kind: _read_index(out / f"trained-{kind}.faiss") for kind, _, _ in kinds}
        _add_chunks(st, trained)
        final = _assemble(st, trained)
        st.views = None
        names = ["views.npy", "r_i.npy", "calibration.npz"] + [f"{kd}.faiss" for kd, _, _ in kinds]
        meta["files"] = {f: (out / f).stat().st_size for f in names}
        shard_ = Shard(out, meta, np.load(out / "views.npy", mmap_mode="r"),
                       np.load(out / "r_i.npy"), final["global"], final.get("crops"))
        meta["calibration"] = calibration.calibrate(shard_, recall)
        _write_json(out / "meta.json", meta)
        man["complete"] = True
        _write_json(out / "manifest.json", man)
    elif meta.get("calibration", {}).get("asked") != recall:
        calibration.recalibrate(out, recall)
    _tidy(out, kinds)  # also what an interrupt right after the last record left
    return out
