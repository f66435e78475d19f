"""MINER scoring kernels on in-memory score matrices (docs/design.md, section 4).

Pure `jax.numpy`, static shapes; integer arguments (k, m, block sizes, pooling) are static.
Inputs may be float16/bfloat16/float32 and are upcast: all arithmetic is float32. Score matrices
are `[Q, G]`: one row per text query, one column per gallery image, higher is better.

MINER's two equations are written once here, as pure functions every path calls (the in-memory
kernels below, `stream`'s chunk step and through it `sharded`): `fuse` (region fusion) and
`csls_combine` (2S - r_q - r_i).

The public functions are jitted on first use, most with `sclaro_jax.compile`'s options: on CPU,
XLA's default (YNNPACK) fusions reduce over the first axis of a large matrix much more slowly
(see bench/README.md). The last-axis top-k is the exception (faster with XLA's defaults), so
CSLS is three compiled calls: row top-k means, column top-k means, 2S - r_q - r_i. Inside a
caller's `jax.jit` they are traced into the caller's computation like any jitted function.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sclaro_jax import compile

# Block lengths of the exact blocked top-k, chosen by measurement on the 8,231 x 32,768 CSLS
# matrix (bench/README.md, "MINER kernels on CPU").
ROW_BLOCK = 64  # top-k along the last axis (each query's best images)
COLUMN_BLOCK = 16  # top-k along the first axis (each image's best queries)


def _jitted(*static: str, options: bool = True) -> Callable[[Callable], Callable]:
    """`compile.jit(fn, static_argnames=static)` (or plain `jax.jit` when `options` is False),
    built on the first call, not at import. Called on tracers (inside a caller's `jax.jit`,
    where XLA refuses nested compiler options) `fn` is traced into the caller's computation."""

    def wrap(fn: Callable) -> Callable:
        compiled: list[Callable] = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
                return fn(*args, **kwargs)
            if not compiled:
                jit = compile.jit if options else jax.jit
                compiled.append(jit(fn, static_argnames=static))
            return compiled[0](*args, **kwargs)

        return call

    return wrap


def _f32(x) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _on_device(x):
    """A numpy array as a jax array, once, for a function that passes it to several compiled
    calls (each would copy it again). `jax.device_put` aliases a C-contiguous array whose data
    is 64-byte aligned on the CPU backend (no copy at all) and copies it once otherwise;
    `jnp.asarray` always copies. Anything else (jax arrays, tracers) is returned as it is."""
    return jax.device_put(x) if isinstance(x, np.ndarray) else x


def _check_k(k: int, n: int, what: str) -> None:
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be between 1 and the number of {what} ({n})")


def _topk_last(x: jax.Array, k: int, block: int = ROW_BLOCK) -> tuple[jax.Array, jax.Array]:
    """Exact `lax.top_k(x, k)` along the last axis (same values, same indices, ties to the lower
    index) through block maxima.

    The last axis is cut into blocks of `block` (the tail padded with -inf); the k largest block
    maxima name k candidate blocks, which hold every element of the top k (an element outside
    them is below k distinct block maxima; among equal values the chosen blocks hold the
    lower-index ones). The candidate blocks are gathered in ascending index order, so a final
    `top_k` over the k * block candidates breaks ties by the original index.
    """
    n = x.shape[-1]
    if k * block >= n:
        return jax.lax.top_k(x, k)
    lead = x.shape[:-1]
    nblocks = -(-n // block)
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, nblocks * block - n)],
                     constant_values=-jnp.inf)
    block_max = padded.reshape(lead + (nblocks, block)).max(-1)
    chosen = jnp.sort(jax.lax.top_k(block_max, k)[1], axis=-1)
    pos = (chosen[..., None] * block + jnp.arange(block)).reshape(lead + (k * block,))
    candidates = jnp.take_along_axis(x, jnp.minimum(pos, n - 1), axis=-1)
    candidates = jnp.where(pos < n, candidates, -jnp.inf)
    values, where = jax.lax.top_k(candidates, k)
    return values, jnp.take_along_axis(pos, where, axis=-1)


def _topk_first_values(x: jax.Array, k: int, block: int = COLUMN_BLOCK) -> jax.Array:
    """The k largest values of each column of `x [N, G]`, as `[G, k]`, without transposing `x`.

    Same blocked argument as `_topk_last`, along the first axis: rows are grouped into blocks
    ([N/B, B, G] view), block maxima `[N/B, G]` are small enough to transpose, and only the
    k * B candidates of each column are gathered, straight into a `[G, k * B]` matrix.
    """
    n, g = x.shape
    if k * block >= n:
        return jax.lax.top_k(x.T, k)[0]
    nblocks = -(-n // block)
    padded = jnp.pad(x, [(0, nblocks * block - n), (0, 0)], constant_values=-jnp.inf)
    block_max = padded.reshape(nblocks, block, g).max(1)
    chosen = jax.lax.top_k(block_max.T, k)[1]  # [G, k]
    pos = (chosen[..., None] * block + jnp.arange(block)).reshape(g, k * block)
    candidates = x[jnp.minimum(pos, n - 1), jnp.arange(g)[:, None]]  # [G, kB], no transpose
    candidates = jnp.where(pos < n, candidates, -jnp.inf)
    return jax.lax.top_k(candidates, k)[0]


# Compiled separately because XLA:CPU's best options differ by axis (bench/README.md): the
# first-axis reduction is faster with `sclaro_jax.compile`'s options, the last-axis path with
# XLA's defaults.
_row_topk_mean = _jitted("k", options=False)(lambda x, k: _topk_last(_f32(x), k)[0].mean(-1))
_column_topk_mean = _jitted("k")(lambda x, k: _topk_first_values(_f32(x), k).mean(-1))


def topk_mean(scores: jax.Array, k: int, axis: int = -1) -> jax.Array:
    """Exact mean of the k largest entries along `axis` (the last axis, or axis 0 of a matrix).

    mean_{j in top-k along axis} S_j, float32. Blocked (`_topk_last`, `_topk_first_values`),
    which is faster than `lax.top_k` on CPU (see bench/README.md).
    """
    shape = jnp.shape(scores)
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"axis {axis} out of range for shape {shape}")
    _check_k(k, shape[axis], "entries along the axis")
    if axis in (-1, len(shape) - 1):
        return _row_topk_mean(scores, k=k)
    if len(shape) == 2:
        return _column_topk_mean(scores, k=k)
    raise ValueError(f"axis must be 0 or -1 of a matrix, or the last axis; got {axis}")


def fuse(text: jax.Array, global_emb: jax.Array, crop_emb: jax.Array | None, alpha: float,
         pool: str = "max", precision: jax.lax.Precision | None = None) -> jax.Array:
    """MINER's region fusion (MINER paper, section 4.2; docs/design.md, section 4), `[Q, G]`:

        S = (1 - alpha) * T G^T + alpha * pool_r T C_r^T,   pool in {"max", "mean"} over crops
        S = T G^T                                            when `crop_emb` is None

    `text [Q, D]`, `global_emb [G, D]`, `crop_emb [G, R, D]` (or None), L2-normalised; each is
    upcast to float32 where it is multiplied. The crops are scored one `[Q, G]` matmul at a time
    and folded into a running max / sum (left to right, then / R for "mean"), so the
    `[Q, G, R]` tensor never exists. `precision`: of every matmul (None: JAX's default).
    A pure function: the caller jits it, or traces it into its own step.
    """
    if pool not in ("max", "mean"):
        raise ValueError(f"pool must be 'max' or 'mean', got {pool!r}")
    t = _f32(text)
    s = jnp.dot(t, _f32(global_emb).T, precision=precision)
    if crop_emb is None:
        return s
    pooled = None
    for r in range(crop_emb.shape[1]):
        s_r = jnp.dot(t, _f32(crop_emb[:, r]).T, precision=precision)
        if pooled is None:
            pooled = s_r
        else:
            pooled = jnp.maximum(pooled, s_r) if pool == "max" else pooled + s_r
    if pool == "mean":
        pooled = pooled / crop_emb.shape[1]
    return (1 - alpha) * s + alpha * pooled


def csls_combine(scores: jax.Array, r_q: jax.Array | None, r_i: jax.Array) -> jax.Array:
    """MINER's CSLS rescoring (MINER paper, section 4.3; docs/design.md, section 4):

        CSLS_qi = 2 S_qi - r_q - r_i

    `scores [Q, G]` (upcast to float32), `r_q [Q]` the queries' neighbourhood means, `r_i` the
    images' means, `[G]` or already gathered per entry (`[Q, G]`, e.g. a shortlist's
    `r_i[shortlist]`). `r_q` None leaves it out (2S - r_i): a streamed search does not know
    r_q until the whole gallery is seen, and since r_q is constant along a row it is
    subtracted from the kept candidates at the end. A pure function, traceable and jittable.
    """
    out = 2 * _f32(scores)
    if r_q is not None:
        out = out - r_q[:, None]
    return out - r_i


@_jitted("pool", "chunk")
def fused_scores(text: jax.Array, global_emb: jax.Array, crop_emb: jax.Array,
                 alpha: float = 0.4, pool: str = "max", chunk: int | None = None) -> jax.Array:
    """`fuse` of a whole gallery, jitted, `[Q, G]` (MINER paper, section 4.2):

        S = (1 - alpha) * T G^T + alpha * pool_r T C_r^T,   pool in {"max", "mean"} over crops

    `text [Q, D]`, `global_emb [G, D]`, `crop_emb [G, R, D]`, all already L2-normalised.
    `chunk`: score the gallery in static slices of this many images (bounds the temporaries to
    `[Q, chunk]`); None scores it whole. Either way only `[Q, G]`-sized buffers exist.
    """
    if crop_emb.ndim != 3 or crop_emb.shape[0] != global_emb.shape[0]:
        raise ValueError(f"crop_emb must be [G, R, D] with G={global_emb.shape[0]}, "
                         f"got {crop_emb.shape}")
    n = global_emb.shape[0]
    size = n if chunk is None else chunk
    parts = [fuse(text, global_emb[i:i + size], crop_emb[i:i + size], alpha, pool)
             for i in range(0, n, size)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


_csls_combine = _jitted()(csls_combine)
_DONATING_COMBINE: list[Callable] = []


def _donating_combine() -> Callable:
    """`csls_combine` compiled to write over its `scores` argument (donated)."""
    if not _DONATING_COMBINE:
        _DONATING_COMBINE.append(compile.jit(csls_combine, donate_argnums=0))
    return _DONATING_COMBINE[0]

# `csls` on a numpy array or a single-device CPU jax array runs the numba kernels of
# `_cpu_csls` (one read of the matrix for both neighbourhood means, one pass for the
# combination); False sends everything through the jnp form below (as on GPU and under a
# caller's `jax.jit`), e.g. to compare the two.
CPU_KERNEL = True


def _cpu_input(x) -> bool:
    """A numpy array, or a concrete jax array that lives whole on one CPU device."""
    if isinstance(x, np.ndarray):
        return True
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    devices = x.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _csls_cpu(scores, k: int, bank_scores, donate: bool):
    """`csls` through `_cpu_csls`: numpy in, numpy out; a jax array in, a jax array out (its own
    buffer when donated, else a fresh aligned buffer that `jax.device_put` aliases)."""
    from sclaro_jax.miner import _cpu_csls

    if donate and isinstance(scores, jax.Array) and scores.dtype == jnp.float32:
        # the means from a view that is gone before XLA's in-place combination on the donated
        # buffer (faster than numba's in place)
        r_q, r_i = _csls_means(scores, k, bank_scores)
        return _donating_combine()(scores, r_q, r_i)
    s = _cpu_csls.host_matrix(scores, "scores")
    r_q, r_i = _csls_means(s, k, bank_scores)
    if not isinstance(scores, jax.Array):
        out = np.empty(s.shape, np.float32, order="F" if not s.flags.c_contiguous else "C")
        return _cpu_csls.combine(s, r_q, r_i, out)
    out = _cpu_csls.aligned_empty(s.shape)
    return jax.device_put(_cpu_csls.combine(s, r_q, r_i, out))


def _csls_means(scores, k: int, bank_scores) -> tuple[np.ndarray, np.ndarray]:
    """(r_q, r_i) by `_cpu_csls.topk_means`: one read of `scores`, one of the bank if any."""
    from sclaro_jax.miner import _cpu_csls

    s = _cpu_csls.host_matrix(scores, "scores")
    if bank_scores is None:
        return _cpu_csls.topk_means(s, k)
    bank = _cpu_csls.host_matrix(bank_scores, "bank_scores")
    if bank.shape[1] != s.shape[1]:
        raise ValueError(f"bank_scores must be [Qb, {s.shape[1]}] (one column per gallery "
                         f"image, as scores), got {bank.shape}")
    return _cpu_csls.topk_means(s, k, cols=False)[0], _cpu_csls.topk_means(bank, k, rows=False)[1]


def csls(scores: jax.Array, k: int = 10, bank_scores: jax.Array | None = None, *,
         donate: bool = False) -> jax.Array:
    """Two-sided CSLS (MINER paper, section 4.3), `[Q, G]`, by `csls_combine`:

        CSLS_qi = 2 S_qi - r_q - r_i
        r_q = mean of query q's min(k, G) largest scores over the gallery (row top-k of S)
        r_i = mean of image i's min(k, Q) largest scores over queries (column top-k)

    Transductive (`bank_scores` None): r_i from `scores` itself. Inductive: r_i from the query
    bank's scores `bank_scores [Qb, G]` against the same gallery (min(k, Qb) of them). As in the
    MINER authors' code, k is capped by each side's length. Traceable inside `jax.jit`.

    On the CPU (a numpy array, or a jax array on one CPU device) the numba kernels of
    `sclaro_jax.miner._cpu_csls` run: one read of the matrix for both means, one pass for the
    combination. A numpy matrix is read where it lies (no copy unless it is not float32 or not
    contiguous) and a numpy array is returned; a jax array gives a jax array. Elsewhere (GPU,
    a caller's `jax.jit`, `CPU_KERNEL = False`) the jnp form: blocked top-k means
    (`topk_mean`), then `csls_combine`.

    `donate=True` hands the `scores` buffer (a float32 jax array the caller no longer needs) to
    the output, so no fresh [Q, G] buffer is allocated: on a CPU, faulting in a new large
    output can cost more than the arithmetic (see bench/README.md). `scores` is deleted
    afterwards. A numpy `scores` is never overwritten.
    """
    if k < 1:
        raise ValueError(f"k={k} must be at least 1")
    if CPU_KERNEL and _cpu_input(scores) and (bank_scores is None or _cpu_input(bank_scores)):
        return _csls_cpu(scores, k, bank_scores, donate)
    donate = donate and isinstance(scores, jax.Array)  # not a caller's numpy buffer
    scores = _on_device(scores)
    r_q = topk_mean(scores, min(k, jnp.shape(scores)[1]), 1)
    bank = scores if bank_scores is None else bank_scores
    r_i = topk_mean(bank, min(k, jnp.shape(bank)[0]), 0)
    tracing = isinstance(scores, jax.core.Tracer)
    if donate and not tracing and scores.dtype == jnp.float32:
        return _donating_combine()(scores, r_q, r_i)
    return _csls_combine(scores, r_q, r_i)


@_jitted("k", options=False)
def _top_indices(scores: jax.Array, k: int) -> jax.Array:
    """int `[Q, k]`: each row's k best columns, best first, ties to the lower index."""
    return _topk_last(_f32(scores), k)[1]


@_jitted("num_images")
def _place_shortlist(fused_pairs, shortlist, r_q, r_i, num_images: int):
    rescored = csls_combine(fused_pairs, r_q, r_i[shortlist])
    rows = jnp.arange(shortlist.shape[0])[:, None]
    out = jnp.full((shortlist.shape[0], num_images), -jnp.inf, jnp.float32)
    return out.at[rows, shortlist].set(rescored)


def csls_shortlist(global_scores: jax.Array,
                   fused: jax.Array | Callable[[jax.Array], jax.Array],
                   m: int = 25, k: int = 10, bank_scores: jax.Array | None = None) -> jax.Array:
    """Shortlist MINER (MINER paper, section 5.4 / appendix F.1), `[Q, G]`.

    Each query's M best images by the global score S^g (ties to the lower index) are rescored

        out_qi = 2 F_qi - r_q - r_i                    for i in shortlist(q)
        out_qi = -inf                                  otherwise (ranked after the shortlist)

    with F the fused score and r_q, r_i the CSLS neighbourhood means of the *global* matrix:
    r_q = mean of the k largest S^g_q., r_i = mean of the k largest S^g_.i over the queries
    (transductive) or over `bank_scores [Qb, G]`, a query bank's *global* scores (inductive).
    So no crop embedding is needed outside the shortlist. r_q is constant along a row and does
    not change a query's ranking; it is kept so that the values are CSLS values.

    `fused` is either the precomputed fused matrix `[Q, G]` or a function that takes the
    shortlist indices `int [Q, M]` and returns the fused scores of those pairs `[Q, M]`.
    """
    s = _on_device(global_scores)
    _check_k(m, s.shape[1], "gallery images")
    shortlist = _top_indices(s, k=m)
    r_q = topk_mean(s, k, 1)
    r_i = topk_mean(s if bank_scores is None else bank_scores, k, 0)
    pairs = fused(shortlist) if callable(fused) else jnp.take_along_axis(
        _on_device(fused), shortlist, axis=1)
    return _place_shortlist(pairs, shortlist, r_q, r_i, num_images=s.shape[1])


@_jitted("dynamic")
def qbnorm(scores: jax.Array, bank_scores: jax.Array, beta: float = 20.0,
           dynamic: bool = True) -> jax.Array:
    """Querybank normalisation with the (dynamic) inverted softmax (Bogolin et al., CVPR 2022).

    Inverted softmax: IS_qi = exp(beta S_qi) / sum_b exp(beta B_bi) over the bank `[Qb, G]`;
    returned as its logarithm, beta S_qi - logsumexp_b(beta B_bi) (same ranking, no overflow).
    Dynamic (their `qb_norm` code): the activation set A = images that are the top-1 of some bank
    query; a query whose own top-1 image (by S) is in A gets the normalised row, every other
    query keeps its raw row S_q. (`dynamic=False` normalises every row.) Rows are ranked on
    their own, so mixing the two scales across rows is what the reference does too.
    """
    s, b = _f32(scores), _f32(bank_scores)
    normalised = beta * s - jax.nn.logsumexp(beta * b, axis=0)[None, :]
    if not dynamic:
        return normalised
    active = jnp.zeros(s.shape[1], bool).at[jnp.argmax(b, axis=1)].set(True)
    return jnp.where(active[jnp.argmax(s, axis=1)][:, None], normalised, s)


@_jitted("iters")
def sinkhorn(scores: jax.Array, tau: float = 0.02, iters: int = 1) -> jax.Array:
    """Log-domain Sinkhorn on exp(S / tau), `[Q, G]`.

    L = S / tau; `iters` times: L <- L - logsumexp_i L_qi (rows: each query's distribution over
    images sums to 1), then L <- L - logsumexp_q L_qi (columns sum to 1). Returns L, the log of
    the normalised plan; the last step is over queries, so it changes each query's ranking.
    """
    log_plan = _f32(scores) / tau
    for _ in range(iters):
        log_plan = log_plan - jax.nn.logsumexp(log_plan, axis=1, keepdims=True)
        log_plan = log_plan - jax.nn.logsumexp(log_plan, axis=0, keepdims=True)
    return log_plan


@_jitted()
def dual_softmax(scores: jax.Array, tau: float = 0.01) -> jax.Array:
    """Dual softmax (CAMoE / DSL, text-to-image): out_qi = S_qi * softmax_q(S_.i / tau)_q, the
    prior is a softmax over the query axis (each image's column), computed in float32."""
    s = _f32(scores)
    return s * jax.nn.softmax(s / tau, axis=0)


@_jitted()
def ranks(scores: jax.Array, gt: jax.Array) -> jax.Array:
    """0-based rank of each query's ground-truth image, int32 `[Q]`:

        rank_q = #{j : S_qj > S_q,gt} + #{j < gt : S_qj == S_q,gt}

    i.e. its position in a stable descending argsort of the row.
    """
    s = _f32(scores)
    gt = jnp.asarray(gt, jnp.int32)
    target = jnp.take_along_axis(s, gt[:, None], axis=1)
    before = jnp.arange(s.shape[1])[None, :] < gt[:, None]
    return ((s > target) | ((s == target) & before)).sum(1).astype(jnp.int32)


def recall_at_k(scores: jax.Array, gt: jax.Array, ks: tuple[int, ...] = (1, 5, 10)
                ) -> dict[int, float]:
    """Text-to-image R@k in percent: 100 * mean_q [rank_q < k], ranks as in `ranks`."""
    return recall_from_ranks(ranks(scores, gt), ks)


def recall_from_ranks(gt_ranks: np.ndarray, ks: tuple[int, ...] = (1, 5, 10)
                      ) -> dict[int, float]:
    """R@k in percent from 0-based ground-truth ranks `[Q]` (`ranks`, or a streamed search's
    `gt_rank`): 100 * mean_q [rank_q < k]."""
    r = np.asarray(gt_ranks)
    return {int(k): float(100.0 * np.mean(r < k)) for k in ks}


def hubness(scores: jax.Array, k: int = 10) -> dict[str, float | int]:
    """Hubness statistics of a `[Q, G]` matrix (MINER paper, section 5.3, appendix E.4).

    N_k(i) = number of queries with image i in their top k (ties to the lower index);
    skewness = E[(N - mu)^3] / sigma^3 over all G images, zeros included (population moments;
    0.0 when every image occurs equally often); never_retrieved = fraction of images with
    N_k = 0; worst_hub = argmax_i N_k(i) (lowest index on ties), worst_hub_count its N_k.
    """
    num_images = jnp.shape(scores)[1]
    _check_k(k, num_images, "gallery images")
    return hubness_from_topk(_top_indices(scores, k=k), num_images)


def hubness_from_topk(indices: np.ndarray, num_images: int) -> dict[str, float | int]:
    """`hubness` from each query's top-k gallery indices `[Q, k]` (e.g. a streamed search's
    `indices[:, :k]`) over a gallery of `num_images`: N_k(i) = occurrences of i in `indices`,
    then the same statistics."""
    counts = np.bincount(np.asarray(indices).ravel(), minlength=num_images).astype(np.float64)
    centred = counts - counts.mean()
    sigma = np.sqrt(np.mean(centred ** 2))
    skewness = float(np.mean(centred ** 3) / sigma ** 3) if sigma > 0 else 0.0
    worst = int(np.argmax(counts))
    return {"skewness": skewness, "never_retrieved": float(np.mean(counts == 0)),
            "worst_hub": worst, "worst_hub_count": int(counts[worst])}
