"""The step's speed switches (`config.perf`, `sclaro_jax.perf`): each computes the default step's
numbers and compiles once; the config reaches them and a resumed run may flip them.

float32 matmuls at the highest precision (conftest). The whole train step with every switch on
is held to the default step in tests/test_train_core.py, the packed sizes in test_packing.py."""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import ROOT
from sclaro_jax import compile, perf
from sclaro_jax.config import load_config
from sclaro_jax.models import clip, layers, scenarioclip
from sclaro_jax.train import core, fused_update

# ------------------------------------------------------------------------------ attention


def _inputs():
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((3, 32, 32, 3)).astype(np.float32)
    ids = rng.integers(1, 400, (3, 8)).astype(np.int32)
    ids[:, 0] = 49406
    for row, eot in zip(ids, (3, 7, 5)):
        row[eot] = 49407  # EOT at the start, the end and in between: three causal rows
    padding = np.ones((3, 8), np.int32)
    # keys past some EOTs stay visible to the padding mask: only the causal mask hides them
    padding[0, 6:] = padding[2, 7:] = 0
    return pixels, ids, padding


# The tiny preset's towers with one block each (half the compile time): the pooled outputs run
# it on the pooled query alone, the text tower's every state on every query.
ONE_BLOCK = clip.PRESETS["tiny"].replace(**{
    tower: dataclasses.replace(getattr(clip.PRESETS["tiny"], tower), num_hidden_layers=1)
    for tower in ("vision", "text")})


@functools.lru_cache(maxsize=None)
def _towers(options: layers.AttentionOptions, dtype=jnp.float32):
    """(outputs, gradients, jitted function, parameters) of a one-block CLIP (seed 0) whose
    attention computes as `options`: the vision tower's pooled class token, the text tower's
    every causal state, and its pooled EOT state with a padding mask; the gradients of their
    sum of squares with respect to every parameter."""
    model = clip.create(ONE_BLOCK, seed=0, dtype=dtype)
    layers.configure_attention(model, options)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, pixels, ids, padding):
        m = nnx.merge(graphdef, params)
        outs = (m.vision_pooled(pixels), m.text_model(ids)[0], m.text_pooled(ids, padding))
        return sum(jnp.sum(jnp.square(o.astype(jnp.float32))) for o in outs), outs

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, outs), grads = fn(params, *_inputs())
    outs = [np.asarray(o, np.float32) for o in outs]
    return outs, [np.asarray(g) for g in jax.tree.leaves(grads)], fn, params


SWITCHED = [layers.AttentionOptions("xla"), layers.AttentionOptions(fused_qkv=True)]


@pytest.mark.slow
@pytest.mark.parametrize("options", SWITCHED, ids=["xla", "fused_qkv"])
def test_attention_switches_give_the_einsum_numbers_in_float32_and_compile_once(options):
    """Outputs within 1e-6 of their largest value, every gradient within 1e-6 of the largest
    gradient (measured: 3e-7 and 2e-7); the k bias's gradient, zero in exact arithmetic
    (softmax ignores a shift shared by all keys), is rounding noise either way."""
    ref_out, ref_grads, _, _ = _towers(layers.AttentionOptions())
    outs, grads, fn, params = _towers(options)
    for a, b in zip(ref_out, outs, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * np.abs(a).max())
    scale = max(np.abs(g).max() for g in ref_grads)
    for a, b in zip(ref_grads, grads, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * scale)
    pixels, ids, padding = _inputs()
    fn(params, pixels + 1, ids[::-1].copy(), padding[::-1].copy())  # other values, same shapes
    assert fn._cache_size() == 1


@pytest.mark.slow
def test_attention_switches_are_as_accurate_in_bfloat16():
    """bfloat16 compute, both switches on: the outputs and gradients are as far from the
    float32 ones as the einsum path's bfloat16 numbers are (within 25%; measured 0.5-1% of
    their norms either way, ratios 0.99-1.01)."""
    ref_out, ref_grads, _, _ = _towers(layers.AttentionOptions())
    einsum_out, einsum_grads, _, _ = _towers(layers.AttentionOptions(), jnp.bfloat16)
    out, grads, _, _ = _towers(layers.AttentionOptions("xla", True), jnp.bfloat16)

    def distance(xs, ref):
        return (np.sqrt(sum(np.sum(np.square(x - r)) for x, r in zip(xs, ref, strict=True)))
                / np.sqrt(sum(np.sum(np.square(r)) for r in ref)))

    for ours, einsum, ref in ((out, einsum_out, ref_out), (grads, einsum_grads, ref_grads)):
        assert 0 < distance(ours, ref) <= 1.25 * distance(einsum, ref) < 0.02


def test_attention_options_are_set_on_every_layer_and_cudnn_is_refused_off_gpu():
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=16, warn_random=False,
                               attention=layers.AttentionOptions("xla", fused_qkv=True))
    found = [m for _, m in nnx.iter_modules(model) if isinstance(m, layers.Attention)]
    assert len(found) == 3 * 4  # three pairs of two 2-block towers
    assert {m.options for m in found} == {layers.AttentionOptions("xla", True)}
    assert sum(m.causal for m in found) == 3 * 2  # the text towers' blocks
    with pytest.raises(ValueError, match="'einsum', 'xla', 'cudnn'"):
        layers.AttentionOptions("flash")
    with pytest.raises(ValueError, match=r"'cudnn' \(config.perf.attention\) takes bfloat16"):
        layers.configure_attention(model, layers.AttentionOptions("cudnn"))
    if jax.default_backend() != "gpu":
        bf16 = clip.create("tiny", dtype=jnp.bfloat16)
        with pytest.raises(ValueError, match="needs a CUDA GPU.*backend is 'cpu'"):
            layers.configure_attention(bf16, layers.AttentionOptions("cudnn"))
    assert {m.options.implementation for _, m in nnx.iter_modules(model)
            if isinstance(m, layers.Attention)} == {"xla"}  # a refusal changes nothing


def test_cudnn_attention_calls_are_counted_from_the_compiled_hlo():
    q = jnp.ones((2, 8, 4, 16), jnp.float32)
    xla = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="xla"))
    assert layers.cudnn_attention_calls(xla.lower(q).compile().as_text()) == 0
    gpu_hlo = ('%fmha = (bf16[4,50,12,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), '
               'custom_call_target="__cudnn$fmhaSoftmax", backend_config={}\n'
               '%bwd = custom-call(%q, %k), custom_call_target="__cudnn$fmhaSoftmaxBackward"\n'
               '%gemm = custom-call(%a, %b), custom_call_target="__cublas$gemm"\n')
    assert layers.cudnn_attention_calls(gpu_hlo) == 2


# ------------------------------------------------------------------------------ fused update

CFG = core.TrainConfig(total_steps=40, lr=1e-3, ema_warmup_steps=3, ema_decay=0.9,
                       frozen_vision_layers=1, frozen_text_layers=1)  # warm-up: 4 steps


def _parameters(kd: bool = True) -> dict:
    """Parameters with a leaf in every optimiser group (by name: `core.param_labels`), float32
    and bfloat16 ones (a buffer each), a frozen embedding and frozen block 0; without `kd` the
    kd group is empty (PyramidCLIP)."""
    rng = np.random.default_rng(1)

    def leaf(shape, dtype=jnp.float32):
        return jnp.asarray(0.5 * rng.standard_normal(shape), dtype)

    def block():
        return {"mlp": {"fc1": {"kernel": leaf((8, 6)), "bias": leaf((6,))}}}

    out = {"global_pair": {
        "vision_model": {"embeddings": {"class_embedding": leaf((8,))},
                         "encoder": {"layers": {"0": block(), "1": block()}}},
        "text_head": {"linear": {"kernel": leaf((6, 4), jnp.bfloat16),
                                 "bias": leaf((4,), jnp.bfloat16)}}},
        "global_logit_scale": leaf(()), "object_logit_scale": leaf(())}
    if kd:
        out["kd_log_scale"] = leaf(())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kd,decay_scales", [(True, True), (True, False), (False, True)])
def test_fused_update_equals_the_optax_chain_and_ema_and_keeps_its_state(kd, decay_scales):
    """Seven optimiser steps (the learning rate's warm-up ends at step 4, the EMA's copying at
    step 3; odd steps' gradients are clipped, even ones' not): parameters, teacher and every
    optimiser-state leaf equal `make_optimizer` + `ema_update`'s, float32 ones within 1e-6
    relative to each element or to the leaf's largest value (measured: 9e-8 elementwise on the
    tiny model; 5e-6 on one element a subtraction brings near zero), bfloat16 ones within one
    bfloat16 step (2^-8), in the same pytree. Each step also starts from the chain's state, as
    after a resume that turns the switch on. (The tiny model's whole step with the switch on:
    tests/test_train_core.py.)"""
    cfg = dataclasses.replace(CFG, decay_logit_scales=decay_scales)
    everything = _parameters(kd)
    labels = core.param_labels(everything, cfg)
    params, trainable_labels = (core.trainable_part(t, labels) for t in (everything, labels))
    assert len(jax.tree.leaves(params)) == 6 + kd  # block 1, the head, two scales
    tx = core.make_optimizer(cfg, trainable_labels)
    chain = jax.jit(lambda *a: core.optimizer_update(tx, cfg)(*a, trainable_labels))
    fused = jax.jit(lambda *a: core.optimizer_update(tx, cfg, fused=True)(*a, trainable_labels))
    rng = np.random.default_rng(0)
    teacher = jax.tree.map(lambda x: x + 0.01, params)
    ours = chain_state = (params, teacher, tx.init(params))
    clipped = []
    for step in range(1, 8):
        size = 10.0 if step % 2 else 1e-3
        grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * size, x.dtype),
                             params)
        clipped.append(float(optax.global_norm(grads)) > cfg.grad_clip)
        want = chain(grads, chain_state[2], *chain_state[:2], jnp.int32(step))
        for start in (chain_state, ours):  # from the chain's state, and from its own
            got = fused(grads, start[2], *start[:2], jnp.int32(step))
            assert jax.tree.structure(got) == jax.tree.structure(want)
            for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
                assert a.dtype == b.dtype
                tol = 2.0 ** -8 if a.dtype == jnp.bfloat16 else 1e-6
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                np.testing.assert_allclose(b, a, rtol=tol, atol=tol * np.abs(a).max())
        ours, chain_state = got, want
    assert clipped == [True, False] * 3 + [True]
    assert fused._cache_size() == 1


def test_fused_update_equations():
    """The elementwise equations against numbers worked by hand."""
    g, p, m, v = (jnp.float32(x) for x in (0.5, 2.0, 0.1, 0.04))
    new_p, new_m, new_v = fused_update.adamw(g, p, m, v, lr=-0.1, bc1=0.19, bc2=0.002,
                                             weight_decay=0.2, b1=0.9, b2=0.999, eps=1e-8)
    assert float(new_m) == pytest.approx(0.9 * 0.1 + 0.1 * 0.5)
    assert float(new_v) == pytest.approx(0.999 * 0.04 + 0.001 * 0.25)
    step = (0.14 / 0.19) / (np.sqrt(0.040210 / 0.002) + 1e-8) + 0.2 * 2.0
    assert float(new_p) == pytest.approx(2.0 - 0.1 * step, rel=1e-6)
    assert float(fused_update.clipped(jnp.float32(3.0), jnp.float32(6.0), 1.0)) == 0.5
    assert float(fused_update.clipped(jnp.float32(3.0), jnp.float32(0.5), 1.0)) == 3.0
    assert float(fused_update.ema(jnp.float32(1.0), jnp.float32(3.0), False, 0.75)) == 1.5
    assert float(fused_update.ema(jnp.float32(1.0), jnp.float32(3.0), True, 0.75)) == 3.0


# ------------------------------------------------------------------------------ XLA options


def test_xla_options_are_checked_by_xla_and_another_backends_are_left_out(caplog):
    """jaxlib 0.10's XLA:CPU knows the GPU options (and compiles the same module with them);
    here they are left out with a log line, after XLA has checked names and values."""
    backend = jax.default_backend()
    other = "gpu" if backend == "cpu" else "cpu"
    mine = {"cpu": {"xla_cpu_enable_fast_math": False},
            "gpu": {"xla_gpu_enable_triton_gemm": False}}
    theirs = {"cpu": {"xla_cpu_enable_fast_math": False},
              "gpu": {"xla_gpu_enable_command_buffer": "", "xla_gpu_graph_min_graph_size": "8",
                      "xla_gpu_enable_triton_gemm": False}}[other]
    with caplog.at_level(logging.WARNING):
        got = compile.checked_options({**mine[backend], **theirs,
                                       "xla_llvm_disable_expensive_passes": True})
    assert got == {**mine[backend], "xla_llvm_disable_expensive_passes": True}
    assert all(name in caplog.text for name in theirs)
    assert compile.option_backend("xla_gpu_autotune_level") == "gpu"
    assert compile.option_backend("xla_backend_optimization_level") is None
    with pytest.raises(ValueError, match="No such compile option: 'xla_gpu_enable_comand_buffer'"):
        compile.checked_options({"xla_gpu_enable_comand_buffer": ""})
    with pytest.raises(ValueError, match="'sometimes' is not a valid bool"):
        compile.checked_options({"xla_gpu_enable_triton_gemm": "sometimes"})
    assert compile.checked_options({}) == {}


def test_xla_options_reach_the_compiled_function_and_compile_once():
    """An option for every backend (no HLO pass at all: no fusion) changes the compiled module,
    not its numbers."""
    fn = lambda x: jnp.exp(x) * 2.0 + 1.0  # noqa: E731
    x = jnp.linspace(0.0, 1.0, 64)
    assert "fusion(" in compile.jit(fn).lower(x).compile().as_text()
    jitted = compile.jit(fn, options={"xla_disable_all_hlo_passes": True})
    assert "fusion(" not in jitted.lower(x).compile().as_text()
    np.testing.assert_allclose(jitted(x), fn(x), rtol=1e-6)
    jitted(x + 1)
    assert jitted._cache_size() == 1


# ------------------------------------------------------------------------------ the config


def _config(name="scenarioclip", variant="demo"):
    return load_config(str(ROOT / "configs" / f"{name}.py") + (f":{variant}" if variant else ""))


def test_perf_config_from_the_configs_and_its_checks():
    for name in ("scenarioclip", "scenarioclip_nokd", "pyramidclip"):
        for variant in ("", "demo"):
            assert perf.PerfConfig.from_config(_config(name, variant)) == perf.PerfConfig()
    config = _config()
    config.perf.xla_options = "--xla_gpu_enable_command_buffer= xla_gpu_enable_triton_gemm=False"
    config.perf.packed_multiple = 64
    switches = perf.PerfConfig.from_config(config)
    assert dict(switches.xla_options) == {"xla_gpu_enable_command_buffer": "",
                                          "xla_gpu_enable_triton_gemm": False}
    assert switches.packed_align(8) == 64 and switches.packed_align(3) == 192
    del config.perf
    assert perf.PerfConfig.from_config(config) == perf.PerfConfig()  # a run from before perf
    with pytest.raises(ValueError, match="unknown keys \\['fused_mlp'\\]"):
        perf.PerfConfig.from_config({"perf": {"fused_mlp": True}})
    with pytest.raises(ValueError, match="perf.attention: .*'flash'"):
        perf.PerfConfig(attention="flash")
    with pytest.raises(ValueError, match="perf.packed_multiple"):
        perf.PerfConfig(packed_multiple=0)
    with pytest.raises(ValueError, match="'xla_gpu_graph_min_graph_size' is not name=value"):
        perf.PerfConfig(xla_options="xla_gpu_graph_min_graph_size 8")
    with pytest.raises(ValueError, match="perf.xla_options: XLA does not accept"):
        perf.PerfConfig(xla_options={"xla_cpu_no_such_thing": 1}).compiler_options()


@pytest.mark.slow
def test_the_config_reaches_the_model_and_a_resumed_run_may_flip_the_switches(tmp_path):
    from sclaro_jax.checkpoint import build_model
    from sclaro_jax.run import folder

    config = _config()
    config.perf.fused_qkv, config.perf.attention = True, "xla"
    attention = {m.options for _, m in nnx.iter_modules(build_model(config, abstract=True))
                 if isinstance(m, layers.Attention)}
    assert attention == {layers.AttentionOptions("xla", fused_qkv=True)}
    plain = {m.options for _, m in nnx.iter_modules(build_model(config, abstract=True,
                                                                perf=False))
             if isinstance(m, layers.Attention)}
    assert plain == {layers.AttentionOptions()}  # what a checkpoint is evaluated with

    folder.write_config(str(tmp_path), _config(), step=0, unsafe={})
    config.perf.fused_update, config.perf.packed_multiple = True, 64
    config.perf.xla_options = "xla_gpu_enable_command_buffer="
    unsafe, safe = folder.config_changes(str(tmp_path), config)
    assert unsafe == {}
    assert sorted(safe) == ["perf.attention", "perf.fused_qkv", "perf.fused_update",
                            "perf.packed_multiple", "perf.xla_options"]
    config.train.lr = 1.0  # a recipe key still is a drift
    assert list(folder.config_changes(str(tmp_path), config)[0]) == ["train.lr"]
