"""The FAISS index forms of a MINER index build (`sclaro_jax.miner.index`): fast-scan twins,
crop-routed IVF lists, adding a chunk, training on a sample, and faiss's errors in one line. The
method is in `sclaro_jax.miner.index`'s docstring."""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from sclaro_jax.miner.index.settings import _is_ivf, _nlist_of, faiss
from sclaro_jax.miner.index.vectors import crop_vectors, global_vectors, route_vectors

_FAST_SCAN = re.compile(r"((?:IVF\d+,)?PQ\d+x4)fs(r?)")


def build_form(factory: str) -> str:
    """The factory a build trains, adds and merges with. Fast-scan PQ ("[IVF{n},]PQ{m}x4fs[r]")
    indexes cannot be merged (`merge_from` corrupts memory in faiss-cpu 1.15.1), so they are
    built as their plain 4-bit twin ("...PQ{m}x4", same codes) and made fast-scan when the build
    ends (`final_index`); any other factory is built as it is."""
    m = _FAST_SCAN.fullmatch(factory)
    return m.group(1) if m else factory


def new_index(factory: str, d: int):
    """An untrained index of `factory`'s build form (`build_form`), inner-product metric."""
    f = faiss()
    form = build_form(factory)
    index = f.index_factory(d, form, f.METRIC_INNER_PRODUCT)
    if form != factory and _is_ivf(factory):
        index.by_residual = factory.endswith("r")  # as faiss makes "x4fs" / "x4fsr"
    return index


def final_index(index, factory: str):
    """The index as `factory` makes it: a twin built by `build_form` made fast-scan."""
    if build_form(factory) == factory:
        return index
    f = faiss()
    return f.IndexIVFPQFastScan(index) if _is_ivf(factory) else f.IndexPQFastScan(index)


def _mergeable(factory: str) -> bool:
    """Whether chunk indexes of this factory's build form can be merged (`build_form`)."""
    return "fs" not in build_form(factory)


def routed(index) -> bool:
    """Whether the crop index's lists are chosen by the crops (`route_vectors`): an IVF index
    with nothing before it (no OPQ / PCA transform)."""
    return isinstance(index, faiss().IndexIVF)


def _assign(index, routes: np.ndarray) -> np.ndarray:
    _, lists = index.quantizer.search(routes, 1)
    return np.ascontiguousarray(lists[:, 0], np.int64)


def train_routed(index, x: np.ndarray, routes: np.ndarray) -> None:
    """Train an IVF index whose lists are chosen by `routes` (k-means on them, faiss's own
    `train_q1`) and whose codes encode `x` (the residual from the route's list centre where
    the index encodes residuals)."""
    f = faiss()
    routes = np.ascontiguousarray(routes, np.float32)
    index.train_q1(len(routes), f.swig_ptr(routes), False, index.metric_type)
    lists = _assign(index, routes)
    x = np.ascontiguousarray(x, np.float32)
    if index.by_residual:
        x = np.ascontiguousarray(x - index.quantizer.reconstruct_n(0, index.nlist)[lists])
    index.train_encoder(len(x), f.swig_ptr(x), f.swig_ptr(lists))  # x, lists alive here
    index.is_trained = True


def add_routed(index, x: np.ndarray, routes: np.ndarray) -> None:
    """Add `x` to the lists that `routes` choose (ids continue from `index.ntotal`): faiss's
    `contrib.ivf_tools.add_preassigned` (`add_core` with the lists given)."""
    from faiss.contrib.ivf_tools import add_preassigned

    add_preassigned(index, np.ascontiguousarray(x, np.float32),
                    _assign(index, np.ascontiguousarray(routes, np.float32)))


def _add(index, kind: str, views: np.ndarray, r_i: np.ndarray, d: int, alpha: float,
         pool: str) -> None:
    """Add one chunk's vectors of index `kind` (crop vectors into the lists their crops choose
    where the index is `routed`)."""
    if kind == "global":
        index.add(global_vectors(views, r_i, d))
    elif routed(index):
        add_routed(index, crop_vectors(views, r_i, d, alpha, pool), route_vectors(views, d, pool))
    else:
        index.add(crop_vectors(views, r_i, d, alpha, pool))


def _faiss_refusal(factory: str, what: str, e: RuntimeError) -> ValueError:
    """faiss's RuntimeError (a C++ exception, many lines) as one ValueError naming `factory`:
    its last line, without the C++ function and source file."""
    said = str(e).strip().splitlines()[-1]
    said = re.sub(r"^Error in .*? at \S+:\d+: (Error: )?", "", said)
    return ValueError(f"factory {factory!r}: FAISS cannot {what} ({said[:300]})")


def _trained(kind: str, fac: str, d: int, views, r_i_rows, total: int, p_img: int,
             alpha: float, pool: str, train_size: Optional[int], factory: str):
    """Index `kind` of factory `fac` trained on a strided sample of the `total` stored vectors;
    a sample FAISS cannot train on (too few vectors for the factory) is a ValueError."""
    size = min(total, train_size or max(40 * _nlist_of(fac), 10_000))
    rows = np.unique(np.linspace(0, total - 1, size).astype(np.int64))
    if kind == "global":
        x = global_vectors(np.asarray(views[rows]), r_i_rows(rows), d)
    else:
        img = np.unique(rows // p_img)
        sample = np.asarray(views[img])
        x = crop_vectors(sample, r_i_rows(img), d, alpha, pool)
    index = new_index(fac, d)
    try:
        if kind == "crops" and routed(index):
            train_routed(index, x, route_vectors(sample, d, pool))
        elif not index.is_trained:
            index.train(x)
    except RuntimeError as e:
        raise _faiss_refusal(factory, f"train {fac!r} on {len(x)} {kind} vectors", e) from None
    return index
