"""MINER streaming search with the gallery split across the devices of a mesh.

Same scores and result as `stream.search` (see its docstring for the formulas, and
docs/design.md, section 4): each device runs `stream`'s chunk step, so the fusion and the CSLS
combination are `kernels.fuse` and `kernels.csls_combine`.

Layout: the gallery (float16) is padded to `n_dev * n_local * chunk` rows and split into
contiguous row blocks along the mesh axis `axis` (device d holds global rows
[d * n_local * chunk, (d + 1) * n_local * chunk)). Each device scans its block in chunks with
`lax.scan` over the same per-chunk step as `stream` (shard_map). A column lives on exactly one
device, so each device's r_i is exact. At the end the per-query top-k of S (for r_q) and the
per-query top-`top` candidates of 2S - r_i are all-gathered and merged (device order = gallery
order, so ties still go to the lower global index); the ground-truth "ranked ahead" counts are
summed. Works on a one-device mesh too.

Memory rule per device: its gallery block (n_local * chunk * (1 + R) * D * 2 bytes) plus the
chunk working set of `stream` (about 5 * Q * chunk * 4 bytes, more with a bank or crops).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sclaro_jax.miner import stream
from sclaro_jax.miner.stream import Config, SearchResult, State

TRACE_COUNT = {"search": 0}


def gallery_mesh(devices=None, axis: str = "gallery") -> Mesh:
    """A one-axis mesh over `devices` (default: all)."""
    return Mesh(np.array(devices if devices is not None else jax.devices()), (axis,))


def shard_rows(arr: np.ndarray, n_rows: int, mesh: Mesh, axis: str) -> jax.Array:
    """arr padded with zero rows to `n_rows` and split by rows over `axis`; each device's block is
    read straight from arr (works for an np.memmap without loading the rest)."""
    shape = (n_rows,) + arr.shape[1:]

    def block(index):
        start, stop, _ = index[0].indices(n_rows)
        return stream.padded_rows(arr, start, stop, stop - start)

    return jax.make_array_from_callback(shape, NamedSharding(mesh, P(axis)), block)


def _gathered(x: jax.Array, axis: str) -> jax.Array:
    """Every device's per-query list x [Q, k], side by side in device order: [Q, n_dev * k]."""
    return jnp.moveaxis(jax.lax.all_gather(x, axis), 0, 1).reshape(x.shape[0], -1)


def _local_scan(gal, crops, queries, bank, gt_idx, gt_val, *, cfg: Config, axis: str,
                n_local: int, chunk: int, n_gallery: int):
    """Runs inside shard_map: scan this device's block chunk by chunk, then merge globally."""
    base = jax.lax.axis_index(axis) * (n_local * chunk)
    g = gal.reshape((n_local, chunk) + gal.shape[1:])
    c = None if crops is None else crops.reshape((n_local, chunk) + crops.shape[1:])

    def body(state, xs):
        i, gi, ci = xs
        start = (base + i * chunk).astype(jnp.int32)
        n_valid = jnp.clip(n_gallery - start, 0, chunk).astype(jnp.int32)
        return stream.step_body(state, queries, gi, ci, bank, start, n_valid, gt_idx, gt_val,
                                cfg)

    state, r_i = jax.lax.scan(body, stream.init_state(queries.shape[0], cfg),
                              (jnp.arange(n_local, dtype=jnp.int32), g, c))
    topq = jax.lax.top_k(_gathered(state.topq, axis), cfg.k_q)[0]
    cand_s, cand_i = stream.top_of(_gathered(state.cand_s, axis), _gathered(state.cand_i, axis),
                                   cfg.top)
    merged = State(topq=topq, cand_s=cand_s, cand_i=cand_i,
                   ahead=jax.lax.psum(state.ahead, axis),
                   gt_seen=jax.lax.pmax(state.gt_seen, axis))
    return merged, r_i.reshape(-1)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "axis", "n_local", "chunk",
                                             "n_gallery"))
def _sharded_scan(gal, crops, queries, bank, gt_idx, gt_val, *, cfg, mesh, axis, n_local,
                  chunk, n_gallery):
    TRACE_COUNT["search"] += 1
    fn = functools.partial(_local_scan, cfg=cfg, axis=axis, n_local=n_local, chunk=chunk,
                           n_gallery=n_gallery)
    rep = P()
    out_state = State(rep, rep, rep, rep, rep)
    return jax.shard_map(
        fn, mesh=mesh,
        in_specs=(P(axis), None if crops is None else P(axis), rep,
                  None if bank is None else rep, rep, rep),
        out_specs=(out_state, P(axis)), check_vma=False,
    )(gal, crops, queries, bank, gt_idx, gt_val)


def search(queries: np.ndarray, gallery: np.ndarray, crops: Optional[np.ndarray] = None, *,
           mesh: Optional[Mesh] = None, axis: str = "gallery", alpha: float = 0.4,
           pool: str = "max", k: int = 10, rescore: str = "csls",
           bank: Optional[np.ndarray] = None, top: int = 10, chunk: int = 65536,
           gt: Optional[np.ndarray] = None) -> SearchResult:
    """`stream.search` with the gallery split over `mesh` along `axis` (default: all devices).

    `chunk` is clipped to ceil(G / n_dev) so a small gallery is not padded to n_dev full chunks.
    The ground truth's score for `gt_rank` comes from `stream`'s one-device step (a short pre-pass
    over the ground-truth rows); results are global gallery indices.
    """
    mesh = mesh or gallery_mesh(axis=axis)
    n_dev = mesh.shape[axis]
    n_gallery = gallery.shape[0]
    chunk = max(1, min(chunk, math.ceil(n_gallery / n_dev)))
    n_local = math.ceil(n_gallery / (n_dev * chunk))
    n_rows = n_dev * n_local * chunk
    cfg, q, b, gt_idx, gt_val = stream.prepare(queries, gallery, crops, bank, gt, chunk,
                                               alpha=alpha, pool=pool, k=k, rescore=rescore,
                                               top=top)
    gal = shard_rows(gallery, n_rows, mesh, axis)
    crp = None if crops is None else shard_rows(crops, n_rows, mesh, axis)
    state, r_i = _sharded_scan(gal, crp, q, b, gt_idx, gt_val,
                               cfg=cfg, mesh=mesh, axis=axis, n_local=n_local, chunk=chunk,
                               n_gallery=n_gallery)
    return stream.finish(state, np.asarray(r_i)[:n_gallery], cfg, gt is not None)
