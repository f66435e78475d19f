"""The packed crop layout (`sclaro_jax.data.packing`): planned sizes, batches from real records,
the caps layout's losses and gradients, every crop of a batch trained, few compilations."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax._src import monitoring  # no public listener API
import numpy as np
import pytest
from flax import nnx

from data_prep.testing import LONG_TAIL_OBJECTS, LONG_TAIL_RELATIONS, write_long_tail_dataset
from sclaro_jax.data import batch as fields
from sclaro_jax.data import packing
from sclaro_jax.data.batch import batch_shapes, batch_specs
from sclaro_jax.data.dataset import open_dataset
from sclaro_jax.data.pipeline import PipelineConfig, make_loader
from sclaro_jax.models import clip, scenarioclip
from sclaro_jax.run import sharding
from sclaro_jax.run.ahead import CompiledSteps
from sclaro_jax.train import core

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

SIZE = 32
CAPS = PipelineConfig(image_size=SIZE, max_objects=8, max_relations=6)  # the demo's counts fit
CFG = core.TrainConfig(total_steps=400, lr=1e-3, ema_warmup_steps=3, frozen_vision_layers=1,
                       frozen_text_layers=1)

TINY = clip.PRESETS["tiny"]
# The tiny preset's towers with one block each (the `models` below): the layouts compare crop
# by crop, at any depth; a block less is a quarter less compile time of the gradients.
ONE_BLOCK = TINY.replace(**{tower: dataclasses.replace(getattr(TINY, tower), num_hidden_layers=1)
                            for tower in ("vision", "text")})


def _read_counts(folder, split="train"):
    from array_record.python.array_record_module import ArrayRecordReader

    from sclaro_jax.data import schema
    out = []
    for path in open_dataset(folder).paths(split):
        reader = ArrayRecordReader(path)
        out += [(len(s.objects), len(s.relations))
                for s in map(schema.decode, reader.read_all())]
        reader.close()
    return np.array(out)


@pytest.fixture(scope="module")
def long_tail_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("long_tail") / "shards"
    write_long_tail_dataset(str(folder), records=200, seed=0, view_size=SIZE)
    return str(folder)


@pytest.fixture(scope="module")
def models():
    student = scenarioclip.build("scenarioclip", preset=ONE_BLOCK, embed_dim=16, seed=0)
    teacher = scenarioclip.build("scenarioclip", preset=ONE_BLOCK, embed_dim=16, seed=1)
    return student, teacher


def test_manifest_histograms_are_the_records_counts_and_are_recounted_without_them(demo_dir):
    ds = open_dataset(demo_dir)
    counts = _read_counts(demo_dir)
    want = (packing.histogram(counts[:, 0]), packing.histogram(counts[:, 1]))
    assert packing.split_histograms(ds, "train") == want
    old = dataclasses.replace(ds, manifest={**ds.manifest, "splits": {
        k: {kk: vv for kk, vv in v.items() if kk != packing.HISTOGRAMS}
        for k, v in ds.manifest["splits"].items()}})
    assert packing.split_histograms(old, "train", progress=False) == want


def test_sum_distribution_is_the_repeated_convolution():
    hist = [0, 3, 1, 0, 2]
    p = np.array(hist, float) / sum(hist)
    want = np.array([1.0])
    for _ in range(7):
        want = np.convolve(want, p)
    np.testing.assert_allclose(packing.sum_distribution(hist, 7), want, atol=1e-12)


def _draw_padding(sizes, per_image, draws, rng):
    """Padding and tier use of `draws` random batches (images drawn from `per_image` [n, 2]
    with replacement), each at the smallest tier that holds it."""
    totals = per_image[rng.integers(0, len(per_image), (draws, sizes.batch_size))].sum(1)
    tiers = np.array([sizes.tier(o, r) for o, r in totals])
    slots = np.array(sizes.objects)[tiers] + np.array(sizes.relations)[tiers]
    return 1 - totals.sum() / slots.sum(), np.bincount(tiers, minlength=sizes.tiers) / draws


@pytest.mark.parametrize("which", ["demo", "long_tail"])
def test_plan_at_batch_128_pads_at_most_12_percent_and_never_drops(which, demo_dir):
    rng = np.random.default_rng(0)
    if which == "demo":
        per_image = _read_counts(demo_dir)
    else:  # 20,000 images from the long-tailed law
        per_image = np.stack([rng.choice(11, 20000, p=LONG_TAIL_OBJECTS),
                              rng.choice(17, 20000, p=LONG_TAIL_RELATIONS)], 1)
    hists = [packing.histogram(per_image[:, k]) for k in range(2)]
    sizes = packing.plan(*hists, 128)
    assert 1 <= sizes.tiers <= packing.MAX_TIERS
    assert (sizes.objects[-1], sizes.relations[-1]) == tuple(128 * per_image.max(0))
    padding, share = _draw_padding(sizes, per_image, 4000, rng)
    assert padding <= 0.12, (which, sizes, padding)
    expected = packing.expected_use(sizes, *hists)
    assert abs(expected["padding_all"] - padding) < 0.01
    if which == "long_tail":  # drawn independently, as the plan assumes
        np.testing.assert_allclose(share, expected["tier_share"], atol=0.03)
    else:  # the demo's object and relation counts rise together: fewer overflows than planned
        assert share[0] >= expected["tier_share"][0]
    caps_padding = 1 - per_image.mean(0).sum() / per_image.max(0).sum()
    assert padding < caps_padding / 2  # caps at the largest counts: nothing dropped either


def test_sizes_refuse_what_cannot_hold_every_crop():
    with pytest.raises(ValueError, match="must hold batch_size x max_objects = 40"):
        packing.PackedSizes(4, (20, 30), (8, 12), 10, 3)
    with pytest.raises(ValueError, match="non-decreasing"):
        packing.PackedSizes(4, (40, 30), (8, 12), 10, 3)
    sizes = packing.PackedSizes(4, (20, 40), (8, 12), 10, 3)
    assert [sizes.tier(20, 8), sizes.tier(21, 8), sizes.tier(3, 9)] == [0, 1, 1]
    with pytest.raises(ValueError, match="layout 'flat'"):
        PipelineConfig(layout="flat")
    with pytest.raises(ValueError, match="make_loader plans them"):
        batch_shapes(4, PipelineConfig(layout="packed"))


def _loaders(folder, caps, batch_size, seed=3, train=True, n=1):
    """The same records as caps and packed batches (same seed: same augmentation draws)."""
    caps = dataclasses.replace(caps, train=train)
    sizes = packing.plan(*packing.split_histograms(open_dataset(folder), "train"), batch_size)
    packed = dataclasses.replace(caps, layout="packed", packed=sizes)
    out = []
    for cfg in (caps, packed):
        it = iter(make_loader(folder, "train", batch_size, config=cfg, seed=seed))
        out.append([next(it) for _ in range(n)])
    return out[0], out[1], packed


def test_packed_batches_hold_every_crop_in_order_decoded_in_place(demo_dir):
    caps_batches, packed_batches, cfg = _loaders(demo_dir, CAPS, 4, n=3)
    for a, b in zip(caps_batches, packed_batches):
        tier = cfg.packed.tier_of(b)
        # what the step is compiled for ahead of the first batch (batch_specs) is what comes
        assert {k: (v.shape, v.dtype) for k, v in b.items()} == batch_specs(4, cfg, tier)
        assert {k: (v.shape, v.dtype) for k, v in a.items()} == batch_specs(4, CAPS)
        for level in fields.CROP_LEVELS:
            f = fields.LEVEL_FIELDS[level]
            n = int(b[f.mask].sum())
            assert n == int(a[f.mask].sum()) and b[f.mask][:n].all() and not b[f.mask][n:].any()
            seg = b[f.segments]
            assert list(seg[:n]) == sorted(seg[:n]) and (seg[n:] == packing.PAD_SEGMENT).all()
            np.testing.assert_array_equal(np.bincount(seg[:n], minlength=4), a[f.mask].sum(1))
            assert not b[f.pixels][n:].any() and (b[f.labels][n:] == -1).all()
        back = packing.unpack(b, {"object": CAPS.max_objects, "relation": CAPS.max_relations})
        assert sorted(back) == sorted(a)
        for k in a:
            np.testing.assert_array_equal(back[k], a[k], err_msg=k)
        again = packing.pack(a, {level: b[fields.LEVEL_FIELDS[level].mask].size
                                 for level in fields.CROP_LEVELS})
        for k in b:
            np.testing.assert_array_equal(again[k], b[k], err_msg=k)


def test_a_bad_record_leaves_the_packed_buffer_with_its_crops(tmp_path):
    from test_pipeline import V1_SIZE, _write_with_bad_records
    n_good, n_bad = _write_with_bad_records(str(tmp_path))
    cfg = PipelineConfig(max_objects=2, max_relations=2, image_size=V1_SIZE)
    caps_batches, packed_batches, _ = _loaders(str(tmp_path), cfg, n_good + n_bad, train=False)
    a, b = caps_batches[0], packed_batches[0]
    np.testing.assert_array_equal(a[fields.BAD_RECORD], b[fields.BAD_RECORD])
    assert a[fields.BAD_RECORD].sum() == n_bad
    back = packing.unpack(b, {"object": 2, "relation": 2})
    for k in a:
        np.testing.assert_array_equal(back[k], a[k], err_msg=k)
    bad = np.nonzero(b[fields.BAD_RECORD])[0]
    for level in fields.CROP_LEVELS:
        f = fields.LEVEL_FIELDS[level]
        assert not np.isin(b[f.segments], bad).any()


@functools.lru_cache(maxsize=None)
def _jitted(models, grads=False):
    """(params, teacher params, batch) -> metrics (and gradients) of `core.compute_losses`
    (one jitted function per model pair, so tests share its compilations)."""
    graphdef, _ = nnx.split(models[0], nnx.Param)

    def loss(params, teacher, batch):
        return core.compute_losses(nnx.merge(graphdef, params), nnx.merge(graphdef, teacher),
                                   batch, CFG)
    return jax.jit(jax.value_and_grad(loss, has_aux=True) if grads else
                   lambda *a: loss(*a)[1])


def _params(models):
    return [nnx.split(m, nnx.Param)[1] for m in models]


@pytest.mark.slow
def test_packed_losses_gradients_and_augmentation_equal_the_caps_layout(demo_dir, models):
    """A training batch of the demo (photometric draws on) that the caps hold without drops:
    the augmented pixels are the same bytes, the losses and gradients the same numbers."""
    from sclaro_jax.data import photometric
    caps_batches, packed_batches, _ = _loaders(demo_dir, CAPS, 4, seed=8)
    for a, b in zip(caps_batches, packed_batches):
        # global jitter on some samples, the crop levels' on another
        assert a[fields.JITTER].any() and a[fields.CROP_JITTER].any()
        aug_a, aug_b = photometric.augment_batch(a), photometric.augment_batch(b)
        back = packing.unpack({**b, **{k: np.asarray(v) for k, v in aug_b.items()}},
                              {"object": CAPS.max_objects, "relation": CAPS.max_relations})
        for level, f in fields.LEVEL_FIELDS.items():
            keep = np.ones(len(a[fields.IMAGE]), bool) if f.mask is None else a[f.mask]
            np.testing.assert_array_equal(back[f.pixels][keep], np.asarray(aug_a[f.pixels])[keep])
        run = _jitted(models, grads=True)
        _assert_same_numbers(run(*_params(models), b), run(*_params(models), a))


def _assert_same_numbers(got, want):
    """Losses within 1e-6 relative; gradients within 1e-6 of the largest, elementwise and in
    norm (some exact zeros, the keys' biases, come out as rounding noise of either sign)."""
    (_, m_a), g_a = want
    (_, m_b), g_b = got
    for k in m_a:
        assert float(m_b[k]) == pytest.approx(float(m_a[k]), rel=1e-6, abs=1e-9), k
    flat_a, flat_b = jax.tree.leaves(g_a), jax.tree.leaves(g_b)
    scale = max(float(np.max(np.abs(x))) for x in flat_a)
    for x, y in zip(flat_a, flat_b, strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6 * scale)
    norm = lambda tree: np.sqrt(sum(float(np.sum(np.square(x))) for x in tree))  # noqa: E731
    assert norm([np.asarray(x) - np.asarray(y) for x, y in zip(flat_a, flat_b)]) <= \
        1e-6 * norm(flat_a)


@pytest.mark.slow
def test_packed_sizes_rounded_to_a_multiple_give_the_same_numbers(demo_dir, models):
    """`config.perf.packed_multiple` (64, with 2 devices' align): every planned size is a
    multiple of 64 and still holds every crop; a batch padded to its rounded size gives the
    planned size's losses and gradients (`_assert_same_numbers`)."""
    from conftest import demo_config
    from sclaro_jax.train import trainer

    config = demo_config(demo_dir)
    config.perf.packed_multiple = 64
    plain = trainer.pipeline_config(demo_config(demo_dir), host_batch=4, align=2).packed
    rounded = trainer.pipeline_config(config, host_batch=4, align=2).packed
    assert rounded.tiers <= plain.tiers
    assert all(k % 64 == 0 for k in rounded.objects + rounded.relations)
    assert (rounded.max_objects, rounded.max_relations) == (plain.max_objects,
                                                          plain.max_relations)
    _, packed_batches, _ = _loaders(demo_dir, CAPS, 4, seed=8, n=2)  # the caps test's first
    run = _jitted(models, grads=True)
    want = run(*_params(models), packed_batches[0])
    compiled = run._cache_size()
    grown = []
    for b in packed_batches:
        crops = [int(b[fields.LEVEL_FIELDS[level].mask].sum()) for level in fields.CROP_LEVELS]
        grown.append(packing.grow(b, rounded, rounded.tier(*crops)))
        assert grown[-1][fields.LEVEL_FIELDS["object"].mask].size % 64 == 0
    _assert_same_numbers(run(*_params(models), grown[0]), want)
    run(*_params(models), grown[1])
    assert rounded.tiers == 1 and run._cache_size() == compiled + 1  # one rounded size


def _np_contrastive(img, txt, log_scale):
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
    logits = min(np.exp(log_scale), 100.0) * unit(img) @ unit(txt).T
    lse = lambda x, axis: np.log(np.sum(np.exp(x - x.max(axis, keepdims=True)), axis)) + \
        x.max(axis)
    diag = np.diag(logits)
    return float(np.mean(0.5 * ((lse(logits, 1) - diag) + (lse(logits, 0) - diag))))


def _np_kd(teacher, student, log_scale):
    """Appendix Eq. 8 for one pair of 1-D embeddings, as the reference computes it (the
    teacher's probabilities clamped at 1e-8)."""
    t_s = 1.0 / np.clip(np.exp(log_scale), 1.0, 100.0)
    log_softmax = lambda x: x - x.max() - np.log(np.sum(np.exp(x - x.max())))
    p_t = np.maximum(np.exp(log_softmax(teacher / 0.07)), 1e-8)
    log_p_s = log_softmax(student / t_s)
    return float(t_s ** 2 * np.sum(p_t * (np.log(p_t) - log_p_s)) / len(teacher))


@pytest.mark.slow
def test_a_batch_past_the_caps_trains_every_crop_as_the_reference_flattens_them(
        long_tail_dir, models):
    """Long-tailed records, 8 images: the caps layout at 3 objects / 3 relations drops crops;
    the packed batch keeps them all, and its losses are a plain numpy computation over every
    crop (each level's crops flattened over the batch, the KD terms looped per image) from the
    towers' embeddings of each crop."""
    small = PipelineConfig(image_size=SIZE, max_objects=3, max_relations=3)
    caps_batches, packed_batches, _ = _loaders(long_tail_dir, small, 8, train=False)
    a, b = caps_batches[0], packed_batches[0]
    assert a[fields.DROPPED_OBJECTS].sum() > 0 and a[fields.DROPPED_RELATIONS].sum() > 0
    assert not b[fields.DROPPED_OBJECTS].any() and not b[fields.DROPPED_RELATIONS].any()
    model, teacher = models
    got = _jitted(models)(*_params(models), b)

    # the reference's way: every crop of each image, flattened; KD looped per image
    per_image = packing.unpack(b)  # [B, N] with N the batch's largest count: nothing left out
    graphdef, _ = nnx.split(model, nnx.Param)

    @jax.jit
    def embed(params, teacher_params, batch):
        student, teacher = nnx.merge(graphdef, params), nnx.merge(graphdef, teacher_params)
        inputs = core.level_inputs(batch)
        emb = {level: (student.pair(level).encode_image(x.pixels),
                       student.pair(level).encode_text(x.tokens)) for level, x in inputs.items()}
        return (emb, teacher.pair("global").encode_image(inputs["global"].pixels),
                {level: teacher.pair(level).encode_text(inputs[level].tokens)
                 for level in fields.CROP_LEVELS}, {k: x.mask for k, x in inputs.items()})
    emb, t_img, t_txt, masks = jax.tree.map(np.asarray, embed(*_params(models), per_image))
    emb = {k: [x.astype(np.float64) for x in v] for k, v in emb.items()}
    t_img = t_img.astype(np.float64)
    t_txt = {k: v.astype(np.float64) for k, v in t_txt.items()}
    kd_scale = float(model.kd_log_scale[...])
    total_ca, total_kd = 0.0, 0.0
    for level in fields.LEVEL_FIELDS:
        img, txt = emb[level]
        mask = masks[level]
        total_ca += _np_contrastive(img[mask], txt[mask], float(model.logit_scale(level)))
    for level in fields.CROP_LEVELS:
        img = emb[level][0]
        mask = masks[level]
        vision, text = [], []
        for i in range(len(mask)):
            crops = np.nonzero(mask[i])[0]
            if len(crops):
                vision.append(np.mean([_np_kd(t_img[i], img[i, j], kd_scale) for j in crops]))
                text.append(np.mean([_np_kd(t_txt[level][i, j], emb["global"][1][i], kd_scale)
                                     for j in crops]))
        total_kd += np.mean(vision) + np.mean(text)
    assert float(got["loss_ca"]) == pytest.approx(total_ca, rel=1e-5)
    assert float(got["loss_kd"]) == pytest.approx(total_kd, rel=1e-5)
    assert float(got["loss"]) == pytest.approx(total_ca + total_kd, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["demo", "long_tail"])
def test_64_batches_train_with_nothing_dropped_at_each_of_3_compiled_sizes_at_most(
        which, demo_dir, long_tail_dir):
    """64 training batches of 8 images (the demo's 10 training records 51 times over, the long
    tail's 200 more than twice) through the train step as the trainer runs it, every packed size
    compiled before the first batch (`run.ahead.CompiledSteps`): no crop dropped, every crop of
    every batch in the step, every compiled size used, no compilation once training has
    started. (With seed 0 each dataset's largest size first comes at batch 16 and 5.)"""
    folder = demo_dir if which == "demo" else long_tail_dir
    # one vision block; the text towers keep two, the first shared by student and teacher
    # (`core.shared_text_layers`: never the last block) as in the trainer's step
    model = scenarioclip.build("scenarioclip", embed_dim=16, seed=0, preset=TINY.replace(
        vision=dataclasses.replace(TINY.vision, num_hidden_layers=1)))
    # the towers' blocks frozen (the heads, scales and KD temperature train): half the
    # compile time of the full step, which the tests above cover
    cfg = dataclasses.replace(CFG, frozen_vision_layers=2, frozen_text_layers=2,
                              freeze_pre_layernorm=True)
    assert core.shared_text_layers(model, model, cfg) == 1
    graphdef, state, tx = core.init_state(model, cfg)
    jitted, state = sharding.jit_step(core.make_train_step(graphdef, tx, cfg), state, None,
                                      "none")
    ds = open_dataset(folder)
    cfg = dataclasses.replace(CAPS, layout="packed", packed=packing.plan(
        *packing.split_histograms(ds, "train"), 8))
    step = CompiledSteps(jitted, state, [batch_specs(8, cfg, t) for t in range(cfg.packed.tiers)])
    it = iter(make_loader(folder, "train", 8, config=cfg, seed=0))
    compiles, stepping = [], [False]

    def listen(event, seconds, **_):  # compilations inside the step's calls only
        if event == BACKEND_COMPILE and stepping[0]:
            compiles.append(seconds)

    monitoring.register_event_duration_secs_listener(listen)
    sizes = set()
    totals = np.zeros(4)
    for _ in range(64):
        batch = next(it)
        want = [int(batch[fields.LEVEL_FIELDS[level].mask].sum()) for level in fields.CROP_LEVELS]
        sizes.add(batch[fields.LEVEL_FIELDS["object"].mask].shape + batch[
            fields.LEVEL_FIELDS["relation"].mask].shape)
        stepping[0] = True
        state, metrics = step(state, batch)
        stepping[0] = False
        totals += [metrics["dropped_objects"], metrics["dropped_relations"],
                   metrics["crops_objects"] - want[0], metrics["crops_relations"] - want[1]]
    assert np.isfinite(float(metrics["loss"]))
    assert list(totals) == [0, 0, 0, 0]
    monitoring.unregister_event_duration_listener(listen)
    assert compiles == [] and jitted._cache_size() == 0 and not step.late
    assert len(step.executables) == cfg.packed.tiers <= packing.MAX_TIERS
    assert len(sizes) == cfg.packed.tiers  # every compiled size was needed and used
