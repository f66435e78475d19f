"""The training core on the tiny preset: groups, schedule, EMA rule, moving scales, one compile."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from sclaro_jax.data import batch as fields
from sclaro_jax.data.batch import batch_shapes
from sclaro_jax.data.pipeline import PipelineConfig
from sclaro_jax.models import layers, scenarioclip
from sclaro_jax.train import core

B, N = 4, 3


def _batch(seed=0, batch_size=B, augment=False):
    """A random uint8 batch. Its photometric fields are the identity, or with `augment` a
    drawn mix (jitter on for some samples, blur for some) from a separate stream."""
    cfg = PipelineConfig(image_size=32, max_objects=N, max_relations=N, text_length=8)
    rng = np.random.default_rng(seed)
    out = {}
    for k, shape in batch_shapes(batch_size, cfg).items():
        if k in fields.IDENTITY_PHOTOMETRIC:
            out[k] = np.broadcast_to(fields.IDENTITY_PHOTOMETRIC[k], shape).copy()
        elif k in [f.pixels for f in fields.LEVEL_FIELDS.values()]:
            out[k] = rng.integers(0, 256, shape, dtype=np.uint8)
        elif k.endswith("tokens"):
            ids = rng.integers(1, 400, shape).astype(np.int32)
            ids[..., 0], ids[..., 4:] = 49406, 0
            ids[..., 3] = 49407
            out[k] = ids
        elif k.endswith("mask"):
            out[k] = rng.uniform(size=shape) < 0.7
        elif k.endswith("labels"):
            out[k] = rng.integers(0, 5, shape).astype(np.int32)
        elif k in ("valid", "has_action"):
            out[k] = np.ones(shape, bool)
        else:
            out[k] = np.zeros(shape, np.int32)
    if augment:
        draw = np.random.default_rng(1000 + seed)
        out[fields.JITTER] = draw.uniform(size=batch_size) < 0.5
        out[fields.JITTER_ORDER] = np.stack([draw.permutation(4) for _ in range(batch_size)]
                                            ).astype(np.int32)
        out[fields.JITTER_FACTORS] = np.concatenate(
            [draw.uniform(0.8, 1.2, (batch_size, 3)), draw.uniform(-0.05, 0.05, (batch_size, 1))],
            axis=1).astype(np.float32)
        out[fields.BLUR_SIGMA] = np.where(draw.uniform(size=batch_size) < 0.5,
                                          draw.uniform(0.1, 1.5, batch_size), 0).astype(np.float32)
        out[fields.CROP_JITTER] = draw.uniform(size=batch_size) < 0.5
        out[fields.CROP_JITTER_ORDER] = np.stack([draw.permutation(4) for _ in range(batch_size)]
                                                 ).astype(np.int32)
        units = draw.uniform(size=(batch_size, 4))
        for name, s, h in ((fields.OBJECT_JITTER_FACTORS, 0.15, 0.03),
                           (fields.RELATION_JITTER_FACTORS, 0.10, 0.02)):
            out[name] = np.concatenate([1 - s + 2 * s * units[:, :3], h * (2 * units[:, 3:] - 1)],
                                       axis=1).astype(np.float32)
    return out


CFG = core.TrainConfig(total_steps=20, lr=1e-3, ema_warmup_steps=3, frozen_vision_layers=1,
                       frozen_text_layers=1)


@pytest.fixture(scope="module")
def run():
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=16, seed=0)
    graphdef, state, tx = core.init_state(model, CFG)
    labels = core.param_labels(state.params, CFG)
    opt_state = state.opt_state
    step = jax.jit(core.make_train_step(graphdef, tx, CFG), donate_argnums=0)
    flat = lambda tree: {core.param_name(k): np.asarray(v)
                         for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    history = [(flat(state.params), flat(state.teacher), None)]
    initial = jax.tree.map(np.array, state.params)
    for i in range(6):  # other photometric parameters every step
        state, metrics = step(state, _batch(i, augment=True))
        history.append((flat(state.params), flat(state.teacher),
                        {k: float(v) for k, v in metrics.items()}))
        if i == 0:
            first_opt_state = flat(state.opt_state)
    names = {core.param_name(k): v for k, v in jax.tree_util.tree_flatten_with_path(labels)[0]}
    return dict(step=step, labels=names, history=history, opt_state=opt_state, params=initial,
                first_opt_state=first_opt_state)


@pytest.mark.slow
def test_one_compilation_for_every_step(run):
    """Six steps, each batch with other photometric parameters (applied in the step): one
    compilation."""
    assert run["step"]._cache_size() == 1
    draws = [_batch(i, augment=True) for i in range(2)]
    assert any(not np.array_equal(draws[0][k], draws[1][k]) for k in fields.IDENTITY_PHOTOMETRIC)


def test_level_inputs_augment_uint8_pixels_then_normalise():
    from sclaro_jax import ops
    from sclaro_jax.data import photometric
    batch = _batch(0, augment=True)
    batch[fields.JITTER][:2] = [True, False]
    batch[fields.CROP_JITTER][:2] = [True, False]
    batch[fields.BLUR_SIGMA][:2] = [0.0, 0.0]
    inputs = jax.jit(core.level_inputs)(batch)
    augmented = photometric.augment_batch(batch)
    for level, f in fields.LEVEL_FIELDS.items():
        np.testing.assert_allclose(inputs[level][0], ops.normalize(augmented[f.pixels]),
                                   atol=1e-6)  # XLA divides by 255 as a multiplication
        # sample 0 is jittered, sample 1 keeps its pixels
        assert not np.array_equal(augmented[f.pixels][0], batch[f.pixels][0])
        np.testing.assert_array_equal(augmented[f.pixels][1], batch[f.pixels][1])
    # float32 pixels were normalised on the host: no augmentation, no second normalisation
    host = dict(batch, **{f.pixels: ops.normalize(batch[f.pixels])
                          for f in fields.LEVEL_FIELDS.values()})
    for level, f in fields.LEVEL_FIELDS.items():
        np.testing.assert_array_equal(core.level_inputs(host)[level][0], host[f.pixels])


def test_parameter_groups(run):
    labels = run["labels"]
    params = run["history"][0][0]
    assert {v for v in labels.values()} == {"frozen", "kd", "decay", "no_decay"}
    for k, lab in labels.items():
        if lab == "decay":
            assert params[k].ndim >= 2
        if "bias" in k or "norm" in k or "logit_scale" in k:
            assert lab in ("no_decay", "frozen"), k
    assert [k for k, v in labels.items() if v == "kd"] == ["kd_log_scale"]
    for k, lab in labels.items():  # frozen by name: embeddings and block 0 of each tower
        parts = k.split("/")
        tower = next((t for t in ("vision_model", "text_model") if t in parts), None)
        rest = parts[parts.index(tower) + 1:] if tower else []
        want = rest[:1] == ["embeddings"] or rest[:3] == ["encoder", "layers", "0"]
        assert (lab == "frozen") == want, k
    assert not any("pre_layrnorm" in k and v == "frozen" for k, v in labels.items())


def test_frozen_patterns_follow_the_counts_and_pre_layernorm():
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=16, seed=0)
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
    cfg = dataclasses.replace(CFG, frozen_vision_layers=2, frozen_text_layers=0,
                              freeze_pre_layernorm=True)
    frozen = {core.param_name(k) for k, v in
              jax.tree_util.tree_flatten_with_path(core.param_labels(params, cfg))[0]
              if v == "frozen"}
    assert any("vision_model/encoder/layers/1/" in k for k in frozen)
    assert any("vision_model/pre_layrnorm/" in k for k in frozen)
    assert not any("text_model/encoder/" in k for k in frozen)
    assert any("text_model/embeddings/" in k for k in frozen)


def test_optimiser_state_is_keyed_by_the_trainable_names(run):
    """Adam's moments mirror the parameters' dicts with the frozen leaves pruned, in the order
    the trainable leaves have among all parameters (so global norms sum in that order)."""
    mu = run["opt_state"][1].inner_states["decay"].inner_state[0].mu
    names = [core.param_name(k) for k, _ in jax.tree_util.tree_flatten_with_path(
        mu, is_leaf=lambda x: x is None or type(x).__name__ == "MaskedNode")[0]]
    trainable = [k for k, v in run["labels"].items() if v != "frozen"]
    assert names == trainable


def test_frozen_stay_trainable_move_and_scales_learn(run):
    first, last = run["history"][0][0], run["history"][-1][0]
    for k, lab in run["labels"].items():
        moved = not np.array_equal(first[k], last[k])
        assert moved == (lab != "frozen"), (k, lab)
    metrics = [m for _, _, m in run["history"][1:]]
    assert metrics[-1]["kd_temperature"] != pytest.approx(0.07, abs=1e-7)
    for level in ("global", "object", "relation"):
        assert metrics[-1][f"logit_scale_{level}"] != metrics[0][f"logit_scale_{level}"]


def test_ema_teacher_copies_during_warmup_then_lags(run):
    h = run["history"]
    for step in range(1, 4):  # ema_warmup_steps = 3
        params, teacher, _ = h[step]
        for k in params:
            np.testing.assert_array_equal(teacher[k], params[k])
    for step in range(4, len(h)):
        params, teacher, _ = h[step]
        prev_teacher = h[step - 1][1]
        lagging = 0
        for k in params:
            want = CFG.ema_decay * prev_teacher[k] + (1 - CFG.ema_decay) * params[k]
            np.testing.assert_allclose(teacher[k], want, rtol=1e-6, atol=1e-7)
            lagging += not np.array_equal(teacher[k], params[k])
        assert lagging > 0


def test_learning_rate_schedule():
    lr = core.learning_rate(core.TrainConfig(total_steps=1000, lr=2e-5))
    assert float(lr(0)) == pytest.approx(2e-8)
    assert float(lr(100)) == pytest.approx(2e-5)
    assert float(lr(550)) == pytest.approx(1e-5, rel=1e-3)  # cosine half-way
    assert float(lr(1000)) == pytest.approx(0.0, abs=1e-12)


def test_loss_is_finite_and_kd_present(run):
    m = run["history"][1][2]
    assert np.isfinite(m["loss"]) and m["loss_kd"] > 0 and m["loss_ca"] > 0
    assert m["loss"] == pytest.approx(m["loss_ca"] + m["loss_kd"], rel=1e-6)


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_params_and_losses(run):
    import jax.numpy as jnp
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=16, dtype=jnp.bfloat16)
    graphdef, state, tx = core.init_state(model, CFG)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
    step = jax.jit(core.make_train_step(graphdef, tx, CFG))
    new, metrics = step(state, _batch(0, augment=True))
    assert metrics["loss"].dtype == jnp.float32 and np.isfinite(float(metrics["loss"]))
    assert {x.dtype for x in jax.tree.leaves(new.params)} == {jnp.dtype("float32")}
    # bf16 matmuls land near the fp32 loss of the same weights (seed 0) on the same batch:
    # the fp32 run's first step
    loss32 = run["history"][1][2]["loss"]
    assert abs(float(metrics["loss"]) - loss32) < 0.05 * loss32


@functools.partial(jax.jit, static_argnums=(0, 4), static_argnames="share")
def _metrics(graphdef, params, teacher, batch, cfg, share=False):
    """`core.compute_losses`' metrics of the student `params` and the `teacher` (pure dicts of
    `graphdef`'s parameters): one jitted function, so the tests below that compute the same
    losses (same shapes, `cfg` with the same loss fields) compile them once."""
    return core.compute_losses(nnx.merge(graphdef, params), nnx.merge(graphdef, teacher), batch,
                               cfg, share_frozen_text=share)[1]


@pytest.mark.slow
def test_images_without_action_sit_out_global_and_text_kd():
    """Appendix: images with no action are kept; their objects and relations still train. The
    global contrastive loss and the text KD terms (student: the action text) skip them."""
    from sclaro_jax import losses
    from sclaro_jax.ops import normalize
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=16, seed=0)
    teacher = model  # the EMA teacher during warm-up: the terms still differ (other inputs)
    cfg = core.TrainConfig(total_steps=20)
    batch = _batch(3)
    batch["object_mask"][:] = batch["relation_mask"][:] = True
    batch["has_action"][0] = False
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    loss = lambda b: _metrics(graphdef, params, params, b, cfg)  # noqa: E731
    m = {k: float(v) for k, v in loss(batch).items()}

    # Nothing about image 0's action reaches the loss.
    other = dict(batch, action_tokens=batch["action_tokens"].copy())
    other["action_tokens"][0, 1:3] = [777, 888]
    assert {k: float(v) for k, v in loss(other).items()} == m
    # ...while it does when image 0 has an action.
    with_action = dict(other, has_action=np.ones(B, bool))
    assert float(loss(with_action)["loss_global"]) != pytest.approx(m["loss_global"], abs=1e-6)

    @jax.jit
    def reference(b):
        # Global loss: the contrastive loss over images 1.. alone.
        g = model.pair("global")
        txt = g.encode_text(b["action_tokens"][1:])
        l_global = losses.clip_contrastive(g.encode_image(normalize(b["image"][1:])), txt,
                                           model.logit_scale("global"))
        # KD: vision terms over all four images, text terms over images 1.. only.
        log_scale = model.kd_log_scale[...]
        t_img = teacher.pair("global").encode_image(normalize(b["image"]))
        kd = 0.0
        for level in ("object", "relation"):
            f = fields.LEVEL_FIELDS[level]
            emb = model.pair(level).encode_image(normalize(b[f.pixels]))
            kd += losses.kd_one_teacher_many_students(t_img, emb, np.ones((B, N), bool),
                                                      log_scale)
            t_txt = teacher.pair(level).encode_text(b[f.tokens][1:])
            kd += losses.kd_many_teachers_one_student(t_txt, np.ones((B - 1, N), bool), txt,
                                                      log_scale)
        return l_global, kd

    l_global, kd = reference(batch)
    assert m["loss_global"] == pytest.approx(float(l_global), rel=1e-5)
    assert m["loss_kd"] == pytest.approx(float(kd), rel=1e-5)


@pytest.mark.slow
def test_teacher_continues_from_the_students_frozen_text_blocks(run):
    """share_frozen_text: the teacher's object / relation text targets start from the student's
    hidden state after the frozen blocks. With the same frozen weights every loss equals the
    unshared computation; the train step builds its teacher from the student's frozen leaves,
    so the teacher's stored ones cannot change its loss."""
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=16, seed=0)  # run's
    graphdef, state, _ = core.init_state(model, CFG)
    labels = jax.tree.leaves(core.param_labels(state.params, CFG))
    leaves, treedef = jax.tree.flatten(state.params)
    rng = np.random.default_rng(0)
    noise = [0.05 * rng.standard_normal(x.shape, np.float32) for x in leaves]
    # A teacher that differs from the student in every trainable leaf, not in the frozen ones.
    moved = [x if lab == "frozen" else x + d for x, d, lab in zip(leaves, noise, labels)]
    teacher = nnx.merge(graphdef, jax.tree.unflatten(treedef, moved))
    assert core.shared_text_layers(model, teacher, CFG) == 1
    assert core.shared_text_layers(model, None, CFG) == 0
    assert core.shared_text_layers(
        model, teacher, dataclasses.replace(CFG, kd_direction="vision")) == 0
    assert core.shared_text_layers(
        model, teacher, dataclasses.replace(CFG, frozen_text_layers=12)) == 1  # never the last
    batch = _batch(1)
    plain, shared = (_metrics(graphdef, state.params, jax.tree.unflatten(treedef, moved), batch,
                              CFG, share=share) for share in (False, True))
    assert float(plain["loss_kd"]) > 0
    for k in plain:
        np.testing.assert_allclose(shared[k], plain[k], rtol=1e-6, err_msg=k)

    # The step (compiled once by `run`) with this teacher, its frozen leaves scrambled too.
    scrambled = [x + d for x, d in zip(leaves, noise)]
    state = state.replace(teacher=jax.tree.unflatten(treedef, scrambled))
    _, metrics = run["step"](state, batch)
    np.testing.assert_allclose(metrics["loss"], plain["loss"], rtol=1e-6)
    assert run["step"]._cache_size() == 1


@pytest.mark.slow
def test_the_step_switches_give_the_default_steps_numbers_and_compile_once(run):
    """The run's six steps with every switch the step reads on (`config.perf`: q/k/v from one
    matmul, attention by `jax.nn.dot_product_attention` on XLA, the optimiser and EMA in one
    pass), from the same weights: one compilation; each step's loss within 1e-6 relative of
    the default step's (measured 1.2e-7); the Adam first moments after step 1 (0.1 x the
    clipped gradients) within 2e-5 of each leaf's largest value (measured 3e-6); after six
    steps every parameter and teacher value within 1e-3 of the summed learning rates
    (measured 1.1e-4: Adam divides gradient differences by their size). The k biases are left
    out of the last two: their gradient is zero in exact arithmetic (softmax ignores a shift
    shared by every key), so it is rounding noise either way, which Adam's normalisation turns
    into steps of any sign; that it is noise is checked."""
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=16, seed=0,
                               warn_random=False,
                               attention=layers.AttentionOptions("xla", fused_qkv=True))
    graphdef, state, tx = core.init_state(model, CFG)
    step = jax.jit(core.make_train_step(graphdef, tx, CFG, fused_update=True), donate_argnums=0)
    flat = lambda tree: {core.param_name(k): np.asarray(v)  # noqa: E731
                         for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    for i in range(6):
        state, metrics = step(state, _batch(i, augment=True))
        assert float(metrics["loss"]) == pytest.approx(run["history"][i + 1][2]["loss"],
                                                       rel=1e-6)
        if i == 0:
            moments = {k: (v, flat(state.opt_state)[k])
                       for k, v in run["first_opt_state"].items() if ".mu/" in k}
    assert step._cache_size() == 1
    scale = max(np.abs(a).max() for a, _ in moments.values())
    for name, (a, b) in moments.items():
        if name.endswith("k_proj/bias"):
            assert max(np.abs(a).max(), np.abs(b).max()) < 1e-6 * scale, name
        else:
            np.testing.assert_allclose(b, a, rtol=0, atol=2e-5 * np.abs(a).max(), err_msg=name)
    steps = 1e-3 * sum(float(core.learning_rate(CFG)(i)) for i in range(6))
    want_params, want_teacher, _ = run["history"][-1]
    for want, got in ((want_params, flat(state.params)), (want_teacher, flat(state.teacher))):
        for name in want:
            if not name.endswith("k_proj/bias"):
                np.testing.assert_allclose(got[name], want[name], rtol=0, atol=steps,
                                           err_msg=name)


def _one_update(params, cfg, grads=None):
    """Parameters (name -> numpy) after one optimiser update of `make_optimizer` from a fresh
    state, with zero gradients by default."""
    labels = core.param_labels(params, cfg)
    trainable = core.trainable_part(params, labels)
    tx = core.make_optimizer(cfg, core.trainable_part(labels, labels))
    grads = jax.tree.map(np.zeros_like, trainable) if grads is None else grads
    new = jax.jit(lambda g, p: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))(
        grads, trainable)
    return {core.param_name(k): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(new)[0]}


@pytest.fixture(scope="module")
def tiny_params(run):
    return jax.tree.map(lambda x: x + 0.5, run["params"])  # no zero biases: decay would show


@pytest.mark.slow
def test_logit_scales_decay_by_default_as_the_reference_and_not_with_the_option_off(
        tiny_params):
    """Zero gradients: Adam's step is 0, so a decayed parameter moves by exactly
    -lr(0) * weight_decay * value (AdamW's decoupled decay) and an exempt one stays."""
    cfg = dataclasses.replace(CFG, weight_decay=0.2)
    lr0 = np.float32(cfg.lr * cfg.warmup_init_factor)  # the schedule at step 0
    before = {core.param_name(k): np.asarray(v)
              for k, v in jax.tree_util.tree_flatten_with_path(tiny_params)[0]}
    labels = {core.param_name(k): v for k, v in
              jax.tree_util.tree_flatten_with_path(core.param_labels(tiny_params, cfg))[0]}
    scales = [f"{level}_logit_scale" for level in ("global", "object", "relation")]
    for decay_scales in (True, False):
        after = _one_update(tiny_params, dataclasses.replace(cfg, decay_logit_scales=decay_scales))
        for name in scales:
            want = before[name] - lr0 * np.float32(0.2) * before[name] if decay_scales \
                else before[name]
            np.testing.assert_allclose(after[name], want, rtol=1e-6, err_msg=name)
            assert (after[name] != before[name]) == decay_scales, name
        # the KD temperature, biases and norm parameters never decay; matrices always do
        np.testing.assert_array_equal(after["kd_log_scale"], before["kd_log_scale"])
        for name, label in labels.items():
            if label == "no_decay" and name not in scales:
                np.testing.assert_array_equal(after[name], before[name], err_msg=name)
            if label == "decay":
                np.testing.assert_allclose(after[name], before[name] * (1 - lr0 * 0.2),
                                           rtol=1e-6, err_msg=name)


@pytest.mark.slow
def test_optimiser_state_layout_does_not_depend_on_logit_scale_decay(tiny_params, tmp_path):
    """A checkpoint of the optimiser state as the code before `decay_logit_scales` wrote it
    (the no_decay group a plain `optax.adam`) restores into today's state with the decay on,
    leaf for leaf; the option changes no leaf either."""
    import orbax.checkpoint as ocp

    cfg = dataclasses.replace(CFG, decay_logit_scales=True)
    labels = core.param_labels(tiny_params, cfg)
    trainable, group = (core.trainable_part(t, labels) for t in (tiny_params, labels))
    lr = core.learning_rate(cfg)
    old_tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.multi_transform({
        "decay": optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay),
        "no_decay": optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        "kd": optax.adam(lambda s: cfg.kd_lr_factor * lr(s), b1=cfg.b1, b2=cfg.b2,
                         eps=cfg.eps)}, group))
    grads = jax.tree.map(lambda x: 0.01 * x, trainable)
    old_state = jax.jit(lambda g, p: old_tx.update(g, old_tx.init(p), p)[1])(grads, trainable)
    new_tx = core.make_optimizer(cfg, group)
    off_tx = core.make_optimizer(dataclasses.replace(cfg, decay_logit_scales=False), group)
    target = new_tx.init(trainable)
    assert jax.tree.structure(target) == jax.tree.structure(old_state)
    assert jax.tree.structure(off_tx.init(trainable)) == jax.tree.structure(target)
    path = tmp_path / "opt_state"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, old_state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(path, target)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(old_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jax.jit(new_tx.update)(grads, restored, trainable)  # and the restored state steps on
