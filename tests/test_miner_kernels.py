"""sclaro_jax.miner crops and kernels against a plain-numpy float64 reference of docs/design.md,
section 4 (written out below, np.partition / stable argsort).

Rankings are compared with `assert_same_ranking`: random Gaussian embeddings have no exact ties,
but float32 and float64 may order two scores closer than 1e-6 differently, so only the order
across gaps larger than 1e-6 is required to agree.
"""

import random

import jax
import numpy as np
import pytest

from sclaro_jax.miner import (crop_boxes, crop_images, csls, csls_combine, csls_shortlist,
                              dual_softmax, fuse, fused_scores, hubness, hubness_from_topk, qbnorm, ranks,
                              recall_at_k, recall_from_ranks, sinkhorn, topk_mean)
from sclaro_jax.miner.kernels import _topk_first_values, _topk_last

jax.config.update("jax_default_matmul_precision", "highest")

ATOL = 1e-5


# ---------------------------------------------------------------- numpy reference (float64)

def ref_topk_mean(x, k, axis):
    x = np.asarray(x, np.float64)
    return -np.partition(-x, k - 1, axis=axis).take(np.arange(k), axis=axis).mean(axis=axis)


def ref_fused(text, gallery, crops, alpha=0.4, pool="max"):
    t, g, c = (np.asarray(a, np.float64) for a in (text, gallery, crops))
    per_crop = np.einsum("qd,grd->qgr", t, c)
    pooled = per_crop.max(-1) if pool == "max" else per_crop.mean(-1)
    return (1 - alpha) * t @ g.T + alpha * pooled


def ref_csls(s, k=10, bank=None):
    """k capped by each side's length, as the MINER authors' csls does."""
    s = np.asarray(s, np.float64)
    columns = s if bank is None else np.asarray(bank, np.float64)
    r_q = ref_topk_mean(s, min(k, s.shape[1]), 1)
    r_i = ref_topk_mean(columns, min(k, columns.shape[0]), 0)
    return 2 * s - r_q[:, None] - r_i[None, :]


def ref_shortlist(global_s, fused, m=25, k=10, bank=None):
    g = np.asarray(global_s, np.float64)
    r_q = ref_topk_mean(g, k, 1)
    r_i = ref_topk_mean(g if bank is None else bank, k, 0)
    out = np.full(g.shape, -np.inf)
    for q in range(g.shape[0]):
        top = np.argsort(-g[q], kind="stable")[:m]
        out[q, top] = 2 * np.asarray(fused, np.float64)[q, top] - r_q[q] - r_i[top]
    return out


def ref_qbnorm(s, bank, beta=20.0, dynamic=True):
    """Bogolin et al.'s `qb_norm` (dynamic inverted softmax), in exp space."""
    s, bank = np.asarray(s, np.float64), np.asarray(bank, np.float64)
    out = s.copy()
    normalised = np.exp(beta * s) / np.exp(beta * bank).sum(0)
    rows = np.arange(s.shape[0])
    if dynamic:
        active = np.unique(np.argmax(bank, 1))
        rows = np.nonzero(np.isin(np.argmax(s, 1), active))[0]
    out[rows] = normalised[rows]
    return out, rows


def ref_logsumexp(x, axis):
    top = x.max(axis, keepdims=True)
    return top + np.log(np.exp(x - top).sum(axis, keepdims=True))


def ref_sinkhorn(s, tau=0.02, iters=1):
    log_plan = np.asarray(s, np.float64) / tau
    for _ in range(iters):
        log_plan = log_plan - ref_logsumexp(log_plan, 1)
        log_plan = log_plan - ref_logsumexp(log_plan, 0)
    return log_plan


def ref_dual_softmax(s, tau=0.01):
    s = np.asarray(s, np.float64)
    e = np.exp((s - s.max(0)) / tau)
    return s * e / e.sum(0)


def ref_ranks(s, gt):
    s = np.asarray(s)
    return np.array([int(np.nonzero(np.argsort(-s[q], kind="stable") == gt[q])[0][0])
                     for q in range(len(gt))])


def assert_same_ranking(ours, ref, gap=1e-6):
    """Each row ranks the same, except inside runs of reference scores closer than `gap`: at every
    cut where consecutive sorted reference scores differ by more than `gap`, the set of images
    above the cut must be the same in both."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    ref_order = np.argsort(-ref, axis=1, kind="stable")
    ours_rank = np.argsort(np.argsort(-ours, axis=1, kind="stable"), axis=1, kind="stable")
    prefix_max = np.maximum.accumulate(np.take_along_axis(ours_rank, ref_order, 1), axis=1)
    sorted_ref = np.take_along_axis(ref, ref_order, 1)
    with np.errstate(invalid="ignore"):
        cut = (sorted_ref[:, :-1] - sorted_ref[:, 1:]) > gap
    position = np.broadcast_to(np.arange(ref.shape[1] - 1), cut.shape)
    assert cut.sum() > 0.5 * np.isfinite(ref).sum(), "too few clean cuts to say anything"
    np.testing.assert_array_equal(prefix_max[:, :-1][cut], position[cut])


def embeddings(rng, *shape, dtype=np.float32):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)


# ---------------------------------------------------------------- crops

def test_fixed5_on_640x480_keeps_the_aspect_corners_then_centre():
    boxes = crop_boxes(640, 480)  # cw = 384, ch = 288: 36% of the image
    np.testing.assert_array_equal(boxes, [[0, 0, 384, 288], [256, 0, 640, 288],
                                          [0, 192, 384, 480], [256, 192, 640, 480],
                                          [128, 96, 512, 384]])
    assert boxes.dtype.kind == "i"
    np.testing.assert_array_equal(crop_boxes(640, 480, "grid3x3")[[0, 4, 8]],
                                  [[0, 0, 213, 160], [213, 160, 426, 320],
                                   [426, 320, 639, 480]])


def _authors_rule(w, h, kind, seed):
    """The boxes each generator must give, worked out from the rule as the MINER authors
    state it (int() truncation of the float products, Python's random for the random crops)."""
    if kind == "fixed5":
        cw, ch = max(1, int(0.6 * w)), max(1, int(0.6 * h))
        xs = {"left": 0, "right": w - cw, "mid": (w - cw) // 2}
        ys = {"top": 0, "bottom": h - ch, "mid": (h - ch) // 2}
        order = [("left", "top"), ("right", "top"), ("left", "bottom"), ("right", "bottom"),
                 ("mid", "mid")]
        return [[xs[a], ys[b], xs[a] + cw, ys[b] + ch] for a, b in order]
    if kind == "grid3x3":
        cw, ch = w // 3, h // 3
        return [[i * cw, j * ch, i * cw + cw, j * ch + ch] for j in range(3) for i in range(3)]
    draw = random.Random(seed)
    out = []
    for _ in range(5):
        r = draw.uniform(0.3, 0.7)
        cw, ch = max(1, int(w * r)), max(1, int(h * r))
        x = draw.randint(0, w - cw)
        y = draw.randint(0, h - ch)
        out.append([x, y, x + cw, y + ch])
    return out


@pytest.mark.parametrize("kind", ["fixed5", "grid3x3", "random"])
def test_crop_boxes_equal_the_authors_rule_for_500_image_sizes(kind):
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (2, 5), (3, 3), (4000, 3000), (1, 3000), (4000, 1)] + [
        (int(w), int(h)) for w, h in zip(rng.integers(1, 4001, 494), rng.integers(1, 3001, 494))]
    for i, (w, h) in enumerate(sizes):
        if kind == "grid3x3" and min(w, h) < 3:
            with pytest.raises(ValueError, match=f"at least 3 x 3 pixels, got {w} x {h}"):
                crop_boxes(w, h, kind)
            continue
        got = crop_boxes(w, h, kind, seed=i)
        np.testing.assert_array_equal(got, _authors_rule(w, h, kind, i), err_msg=f"{w} x {h}")
        assert got[:, :2].min() >= 0 and (got[:, 2] <= w).all() and (got[:, 3] <= h).all()
        assert (got[:, 2] > got[:, 0]).all() and (got[:, 3] > got[:, 1]).all()
    assert len(sizes) == 500


def test_fixed_crops_cover_ratio_squared_of_the_image_and_squares_do_not():
    for w, h in [(640, 480), (1920, 1080), (1000, 1000)]:
        area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) / (w * h)
        np.testing.assert_allclose(area(crop_boxes(w, h)), 0.36, atol=2e-3)
        square = crop_boxes(w, h, shape="square")
        np.testing.assert_allclose(area(square), 0.36 * min(w, h) / max(w, h), atol=2e-3)


def test_square_shape_keeps_the_earlier_rule():
    boxes = crop_boxes(640, 480, shape="square")  # s = 288, centre first
    np.testing.assert_array_equal(boxes, [[176, 96, 464, 384], [0, 0, 288, 288],
                                          [352, 0, 640, 288], [0, 192, 288, 480],
                                          [352, 192, 640, 480]])
    np.testing.assert_array_equal(crop_boxes(640, 480, "grid3x3", shape="square")[:, :2],
                                  [[x, y] for y in (0, 96, 192) for x in (0, 176, 352)])
    boxes = crop_boxes(101, 200, "grid3x3", ratio=0.5, shape="square")  # s = 50
    assert set(boxes[:, 2] - boxes[:, 0]) == {50} and sorted(set(boxes[:, 0])) == [0, 26, 51]
    np.testing.assert_array_equal(crop_boxes(300, 300, ratio=1.0, shape="square"),
                                  np.tile([0, 0, 300, 300], (5, 1)))
    boxes = crop_boxes(640, 480, "random", n=50, seed=3, shape="square")
    side = boxes[:, 2] - boxes[:, 0]
    np.testing.assert_array_equal(side, boxes[:, 3] - boxes[:, 1])
    assert side.min() >= int(0.3 * 480) and side.max() <= int(0.7 * 480)


def test_random_crops_are_deterministic_and_keep_the_aspect():
    boxes = crop_boxes(640, 480, "random", n=50, seed=3)
    np.testing.assert_array_equal(boxes, crop_boxes(640, 480, "random", n=50, seed=3))
    assert not np.array_equal(boxes, crop_boxes(640, 480, "random", n=50, seed=4))
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    np.testing.assert_allclose(w / 640, h / 480, atol=1 / 480)  # one ratio for both sides
    assert w.min() >= int(0.3 * 640) and w.max() <= int(0.7 * 640)
    assert len(crop_boxes(640, 480, "random")) == 5


@pytest.mark.parametrize("args, kwargs, match", [
    ((640, 480, "fixed4"), {}, "unknown crop kind"),
    ((640, 480), {"ratio": 0.0}, "ratio"),
    ((640, 480), {"ratio": 1.2}, "ratio"),
    ((0, 480), {}, "positive"),
    ((640, -1), {}, "positive"),
    ((640, 480, "random"), {"n": 0}, "positive integer"),
    ((640, 480, "fixed5"), {"n": 3}, "n applies"),
    ((640, 480), {"shape": "round"}, "unknown crop shape"),
    ((2, 480, "grid3x3"), {}, "at least 3 x 3 pixels"),
])
def test_crop_boxes_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        crop_boxes(*args, **kwargs)


def test_crop_images_slices():
    image = np.arange(480 * 640 * 3, dtype=np.uint32).reshape(480, 640, 3).astype(np.uint8)
    crops = crop_images(image, crop_boxes(640, 480))
    assert [c.shape for c in crops] == [(288, 384, 3)] * 5
    np.testing.assert_array_equal(crops[0], image[0:288, 0:384])
    np.testing.assert_array_equal(crops[4], image[96:384, 128:512])


# ---------------------------------------------------------------- top-k

@pytest.mark.parametrize("n, k, block", [(1000, 1, 8), (1001, 10, 8), (997, 70, 8),
                                         (333, 3, 64), (50, 7, 8)])
def test_blocked_topk_equals_stable_sort_with_ties(n, k, block):
    rng = np.random.default_rng(n + k)
    # Small integers: many exact ties, which the blocked method must break by the lower index.
    x = rng.integers(-40, 40, (37, n)).astype(np.float32)
    values, index = jax.jit(_topk_last, static_argnums=(1, 2))(x, k, block)
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(index, order)
    np.testing.assert_array_equal(values, np.take_along_axis(x, order, 1))
    column = jax.jit(_topk_first_values, static_argnums=(1, 2))(x.T.copy(), k, block)
    np.testing.assert_array_equal(column, np.take_along_axis(x, order, 1))


@pytest.mark.parametrize("k", [1, 10, 33])
def test_topk_mean_default_blocks(k):
    # 700 x 2200: with k = 10 or 33 the blocked path runs on both axes (k * block < size).
    x = np.random.default_rng(k).standard_normal((700, 2200)).astype(np.float32)
    for axis in (0, 1, -1):
        np.testing.assert_allclose(topk_mean(x, k, axis), ref_topk_mean(x, k, axis), atol=ATOL)
    np.testing.assert_allclose(topk_mean(x.astype(np.float16), k, 0),
                               ref_topk_mean(x.astype(np.float16), k, 0), atol=ATOL)


def test_topk_mean_errors():
    x = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="k=7"):
        topk_mean(x, 7, 1)
    with pytest.raises(ValueError, match="axis"):
        topk_mean(np.zeros((2, 3, 4), np.float32), 2, 1)


# ---------------------------------------------------------------- fusion and CSLS

@pytest.mark.parametrize("pool, chunk, dtype", [("max", None, np.float32), ("max", 64, np.float16),
                                                ("mean", 50, np.float32)])
def test_fused_scores(pool, chunk, dtype):
    rng = np.random.default_rng(1)
    text, gallery = embeddings(rng, 61, 48), embeddings(rng, 203, 48, dtype=dtype)
    crops = embeddings(rng, 203, 5, 48, dtype=dtype)
    ours = fused_scores(text, gallery, crops, alpha=0.4, pool=pool, chunk=chunk)
    ref = ref_fused(text, gallery, crops, 0.4, pool)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=ATOL)
    assert_same_ranking(ours, ref)


def test_fuse_and_csls_combine_are_the_two_equations():
    rng = np.random.default_rng(4)
    t, g, c = embeddings(rng, 7, 16), embeddings(rng, 9, 16), embeddings(rng, 9, 3, 16)
    np.testing.assert_allclose(fuse(t, g, None, 0.4), t.astype(np.float64) @ g.T, atol=ATOL)
    np.testing.assert_allclose(fuse(t, g, c, 0.25, "mean"), ref_fused(t, g, c, 0.25, "mean"),
                               atol=ATOL)
    s, r_q, r_i = rng.standard_normal((7, 9)), rng.standard_normal(7), rng.standard_normal(9)
    expected = 2 * s - r_q[:, None] - r_i[None, :]
    np.testing.assert_allclose(csls_combine(s, r_q, r_i), expected, atol=ATOL)
    np.testing.assert_allclose(csls_combine(s, None, r_i), expected + r_q[:, None], atol=ATOL)
    pick = rng.integers(0, 9, (7, 4))  # r_i gathered per entry, as for a shortlist
    np.testing.assert_allclose(csls_combine(np.take_along_axis(s, pick, 1), r_q, r_i[pick]),
                               np.take_along_axis(expected, pick, 1), atol=ATOL)


def test_fused_scores_rejects_bad_pool():
    with pytest.raises(ValueError, match="pool"):
        fused_scores(np.ones((2, 3)), np.ones((4, 3)), np.ones((4, 5, 3)), pool="sum")


@pytest.fixture(scope="module")
def scores():
    """Fused scores of random embeddings: 700 queries (non-multiple of both block sizes), 1,300
    images, 5 crops; plus a 400-query bank and the global-only matrices."""
    rng = np.random.default_rng(7)
    text, bank_text = embeddings(rng, 700, 64), embeddings(rng, 400, 64)
    gallery, crops = embeddings(rng, 1300, 64), embeddings(rng, 1300, 5, 64)
    return dict(fused=ref_fused(text, gallery, crops).astype(np.float32),
                bank=ref_fused(bank_text, gallery, crops).astype(np.float32),
                global_=(text @ gallery.T).astype(np.float32),
                global_bank=(bank_text @ gallery.T).astype(np.float32))


@pytest.fixture(params=["cpu-kernel", "jnp"])
def csls_form(request, monkeypatch):
    """Both forms of `csls` on this CPU: the numba kernels (the default here) and the jnp form
    that GPUs and a caller's `jax.jit` run."""
    from sclaro_jax.miner import kernels

    monkeypatch.setattr(kernels, "CPU_KERNEL", request.param == "cpu-kernel")
    return request.param


@pytest.mark.parametrize("k, inductive", [(10, False), (10, True), (1, False), (40, True),
                                          (500, False), (2000, True)])
def test_csls(scores, k, inductive, csls_form):
    """Against numpy, including k above the bank's 400 rows, the 700 queries and the 1,300
    images (capped per side)."""
    bank = scores["bank"] if inductive else None
    ours = csls(scores["fused"], k=k, bank_scores=bank)
    ref = ref_csls(scores["fused"], k, bank)
    np.testing.assert_allclose(ours, ref, atol=ATOL)
    assert_same_ranking(ours, ref)


@pytest.mark.parametrize("layout", ["fortran", "strided", "transposed-view", "float16"])
def test_csls_on_non_contiguous_and_other_dtypes(scores, layout, csls_form):
    s = scores["fused"]
    x = {"fortran": np.asfortranarray(s), "strided": np.repeat(s, 2, axis=1)[:, ::2],
         "transposed-view": np.ascontiguousarray(s.T).T, "float16": s.astype(np.float16)}[layout]
    np.testing.assert_allclose(np.asarray(csls(x, k=10)), ref_csls(x, 10), atol=ATOL)
    np.testing.assert_allclose(np.asarray(csls(x, k=10, bank_scores=x[:300])),
                               ref_csls(x, 10, x[:300]), atol=ATOL)


def test_csls_cpu_kernel_tiny_and_tied_matrices():
    """Shapes below one block, a single row or column, ties and -inf (no scores lost)."""
    rng = np.random.default_rng(3)
    for shape in [(1, 1), (1, 7), (7, 1), (3, 5), (65, 63), (2, 300)]:
        x = rng.standard_normal(shape).astype(np.float32)
        for k in (1, 3, 10):
            np.testing.assert_allclose(csls(x, k=k), ref_csls(x, k), atol=ATOL)
    tied = np.round(rng.standard_normal((130, 500)), 1).astype(np.float32)
    tied[5] = 0.5
    tied[:20, :40] = -np.inf  # every row and column keeps more than k finite scores
    finite = np.isfinite(tied)
    ours, ref = csls(tied, k=10), ref_csls(tied, 10)
    np.testing.assert_allclose(ours[finite], ref[finite], atol=ATOL)
    assert np.isneginf(ours[~finite]).all()


@pytest.mark.parametrize("k", [1, 2, 5])
def test_csls_cpu_kernel_across_its_first_rows_phase(k):
    """Past the first BLOCK x k rows the columns' lists leave the compare-exchange phase for
    thresholds: rows before, at and after that row (ties included) give numpy's means; a block
    whose every score beats its threshold, and one where only the last bit of the mask does."""
    from sclaro_jax.miner import _cpu_csls

    rng = np.random.default_rng(k)
    cold = _cpu_csls.BLOCK * k
    x = np.round(rng.standard_normal((cold + 70, 300)), 1).astype(np.float32)
    x[cold] = 9.0  # the first row after the phase beats every column's list
    x[cold + 1, [63, 127]] = 10.0  # bit 63 of two blocks' masks, nothing else in them
    r_q, r_i = _cpu_csls.topk_means(x, k)
    np.testing.assert_allclose(r_q, np.sort(x, 1)[:, -k:].mean(1), atol=1e-6)
    np.testing.assert_allclose(r_i, np.sort(x, 0)[-k:].mean(0), atol=1e-6)
    np.testing.assert_allclose(csls(x, k=k), ref_csls(x, k), atol=ATOL)


def test_csls_cpu_kernel_reads_numpy_in_place_and_returns_numpy(scores):
    """numpy in, numpy out, nothing put on the device (the transfer guard refuses any
    host-to-device copy), the caller's matrix untouched; a CPU jax array gives a jax array."""
    s = scores["fused"]
    before = s.copy()
    with jax.transfer_guard_host_to_device("disallow"):
        ours = csls(s, k=10, donate=True)  # a numpy buffer is never donated
    assert isinstance(ours, np.ndarray) and ours.dtype == np.float32
    np.testing.assert_array_equal(s, before)
    fortran = csls(np.asfortranarray(s), k=10)
    assert fortran.flags.f_contiguous  # the caller's layout, no transposing copy
    resident = csls(jax.device_put(s), k=10)
    assert isinstance(resident, jax.Array)
    np.testing.assert_array_equal(np.asarray(resident), ours)


@pytest.mark.parametrize("inductive", [False, True])
def test_csls_donating_its_input_gives_the_same_values(scores, inductive, csls_form):
    bank = scores["bank"] if inductive else None
    x = jax.device_put(scores["fused"]) + 0  # a buffer XLA owns, as a computed matrix is
    pointer = x.unsafe_buffer_pointer()
    ours = csls(x, k=10, bank_scores=bank, donate=True)
    np.testing.assert_allclose(ours, ref_csls(scores["fused"], 10, bank), atol=ATOL)
    assert x.is_deleted()  # the buffer became the output
    assert ours.unsafe_buffer_pointer() == pointer
    kept = jax.device_put(scores["fused"]) + 0
    csls(kept, k=10)
    assert not kept.is_deleted()


def test_kernels_trace_inside_a_callers_jit(scores):
    s = scores["fused"]
    np.testing.assert_allclose(jax.jit(lambda x: csls(x, k=10))(s), csls(s, k=10), atol=1e-6)
    rng = np.random.default_rng(2)
    t, g, c = embeddings(rng, 9, 16), embeddings(rng, 11, 16), embeddings(rng, 11, 5, 16)
    traced = jax.jit(lambda *a: fused_scores(*a, pool="mean", chunk=4))(t, g, c)
    np.testing.assert_allclose(traced, ref_fused(t, g, c, pool="mean"), atol=ATOL)


@pytest.mark.parametrize("inductive", [False, True])
def test_csls_shortlist(scores, inductive):
    bank = scores["global_bank"] if inductive else None
    ref = ref_shortlist(scores["global_"], scores["fused"], m=25, k=10, bank=bank)
    ours = csls_shortlist(scores["global_"], scores["fused"], m=25, k=10, bank_scores=bank)
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    assert (np.isfinite(ref).sum(1) == 25).all()
    np.testing.assert_allclose(ours[np.isfinite(ref)], ref[np.isfinite(ref)], atol=ATOL)
    assert_same_ranking(ours, ref)
    fused = scores["fused"]
    by_pairs = csls_shortlist(scores["global_"], lambda idx: np.take_along_axis(
        fused, np.asarray(idx), 1), m=25, k=10, bank_scores=bank)
    np.testing.assert_array_equal(by_pairs, ours)


# ---------------------------------------------------------------- other hubness corrections

@pytest.mark.parametrize("dynamic", [True, False])
def test_qbnorm(scores, dynamic):
    s, bank = scores["fused"][:200], scores["bank"]
    ours = np.asarray(qbnorm(s, bank, beta=20.0, dynamic=dynamic))
    ref, normalised = ref_qbnorm(s, bank, 20.0, dynamic)
    assert 0 < len(normalised) <= 200 and (len(normalised) == 200) == (not dynamic)
    raw = np.setdiff1d(np.arange(200), normalised)
    np.testing.assert_allclose(ours[raw], ref[raw], atol=ATOL)
    # ours is log(ref) on normalised rows; values of beta * S are ~20, hence the relative bound.
    np.testing.assert_allclose(ours[normalised], np.log(ref[normalised]), rtol=1e-6, atol=1e-4)
    assert_same_ranking(ours, np.where(np.isin(np.arange(200), normalised)[:, None],
                                       np.log(np.maximum(ref, 1e-300)), ref))


@pytest.mark.parametrize("tau, iters", [(0.02, 1), (0.05, 3)])
def test_sinkhorn(scores, tau, iters):
    s = scores["fused"][:300]
    ours, ref = sinkhorn(s, tau=tau, iters=iters), ref_sinkhorn(s, tau, iters)
    # log-domain values are ~S / tau (up to ~100): a float32 relative bound.
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-4)
    assert_same_ranking(ours, ref, gap=1e-4)


def test_dual_softmax(scores):
    s = scores["fused"][:300]
    ours, ref = dual_softmax(s, tau=0.01), ref_dual_softmax(s, 0.01)
    np.testing.assert_allclose(ours, ref, atol=ATOL)
    np.testing.assert_allclose(np.asarray(ours).sum(0), ref.sum(0), atol=1e-4)


# ---------------------------------------------------------------- metrics

def test_ranks_break_ties_like_a_stable_argsort():
    s = np.array([[0.5, 0.9, 0.5, 0.5, 0.1],
                  [0.5, 0.9, 0.5, 0.5, 0.1],
                  [0.5, 0.9, 0.5, 0.5, 0.1],
                  [0.3, 0.3, 0.3, 0.3, 0.3],
                  [0.3, 0.3, 0.3, 0.3, 0.3],
                  [0.0, 0.2, 0.1, 0.4, 0.4]], np.float32)
    gt = np.array([0, 3, 1, 0, 4, 4])
    expected = [1, 3, 0, 0, 4, 1]
    np.testing.assert_array_equal(ranks(s, gt), expected)
    np.testing.assert_array_equal(ref_ranks(s, gt), expected)
    assert recall_at_k(s, gt, ks=(1, 2, 4, 5)) == pytest.approx(
        {1: 100 * 2 / 6, 2: 100 * 4 / 6, 4: 100 * 5 / 6, 5: 100.0})


def test_ranks_and_recall_on_random_scores(scores):
    s = scores["fused"]
    gt = np.random.default_rng(0).integers(0, s.shape[1], s.shape[0])
    gt[:50] = np.argmax(s[:50], 1)  # some hits
    r = ref_ranks(s, gt)
    np.testing.assert_array_equal(ranks(s, gt), r)
    got = recall_at_k(s, gt)
    assert set(got) == {1, 5, 10} and isinstance(got[1], float)
    for k in (1, 5, 10):
        assert got[k] == pytest.approx(100 * np.mean(r < k))
    assert recall_from_ranks(r, ks=(1, 1300)) == {1: pytest.approx(got[1]), 1300: 100.0}
    assert got[1] >= 100 * 50 / 700


def test_hubness_hand_made():
    # top-2 of each query (ties to the lower index): {1,2}, {1,3}, {1,0}, {2,1}
    s = np.array([[0.0, 0.9, 0.8, 0.1, 0.2],
                  [0.1, 0.9, 0.0, 0.8, 0.2],
                  [0.5, 0.5, 0.5, 0.0, 0.0],
                  [0.0, 0.5, 0.7, 0.0, 0.5]], np.float32)
    counts = np.array([1, 4, 2, 1, 0], np.float64)
    c = counts - counts.mean()
    got = hubness(s, k=2)
    assert got["skewness"] == pytest.approx(np.mean(c ** 3) / np.mean(c ** 2) ** 1.5)
    assert got["never_retrieved"] == pytest.approx(0.2)
    assert (got["worst_hub"], got["worst_hub_count"]) == (1, 4)
    assert hubness_from_topk(np.array([[1, 2], [1, 3], [1, 0], [2, 1]]), 5) == got
    assert hubness_from_topk(np.array([[0], [1]]), 4)["never_retrieved"] == 0.5
    flat = hubness(np.eye(4, dtype=np.float32), k=1)
    assert flat["skewness"] == 0.0 and flat["never_retrieved"] == 0.0


def test_csls_lowers_hubness(scores):
    # The paper's effect (section 5.3): CSLS reduces k-occurrence skewness and unreached images.
    before, after = hubness(scores["fused"]), hubness(csls(scores["fused"]))
    assert after["skewness"] < before["skewness"]
    assert after["never_retrieved"] <= before["never_retrieved"]
