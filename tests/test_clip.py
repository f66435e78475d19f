"""Flax CLIP towers against transformers' PyTorch CLIPModel on the same random weights."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from conftest import TINY_HF, save_random_hf_clip
from sclaro_jax.models import clip

TOL = 1e-5


def _inputs(rng, batch, image_size, vocab=49408, length=77):
    pixels = rng.standard_normal((batch, image_size, image_size, 3), dtype=np.float32)
    ids = rng.integers(0, vocab - 2, (batch, length))
    ids[:, 0] = vocab - 2  # <|startoftext|>
    ends = np.linspace(1, length - 1, batch).astype(int)  # EOT at the start, middle and end
    for row, end in zip(ids, ends):
        row[end:] = vocab - 1  # <|endoftext|>, then padded with it as the tokenizer pads
    return pixels, ids


def _torch_features(hf, pixels, ids, attention_mask=None):
    px = torch.from_numpy(pixels).permute(0, 3, 1, 2)
    tid = torch.from_numpy(ids)
    am = None if attention_mask is None else torch.from_numpy(attention_mask)
    with torch.no_grad():
        vision, text = hf.vision_model(px), hf.text_model(tid, attention_mask=am)
        return {
            "image": hf.get_image_features(px).pooler_output.numpy(),
            "text": hf.get_text_features(tid, attention_mask=am).pooler_output.numpy(),
            "vision_pooled": vision.pooler_output.numpy(),
            "text_pooled": text.pooler_output.numpy(),
            "vision_hidden": vision.last_hidden_state.numpy(),
            "text_hidden": text.last_hidden_state.numpy(),
        }


@nnx.jit
def _jax_features(model, pixels, ids):
    vision_hidden, vision_pooled_full = model.vision_model(pixels)
    text_hidden, text_pooled_full = model.text_model(ids)
    pooled = {"vision_pooled": model.vision_pooled(pixels), "text_pooled": model.text_pooled(ids)}
    # The pooled-only path (last layer on the pooled token alone) equals the all-token path.
    for name, full in (("vision_pooled", vision_pooled_full), ("text_pooled", text_pooled_full)):
        assert pooled[name].shape == full.shape
        pooled[name + "_gap"] = jnp.abs(pooled[name] - full).max()
    return {
        "image": model.encode_image(pixels),
        "text": model.encode_text(ids),
        "vision_hidden": vision_hidden,
        "text_hidden": text_hidden,
        **pooled,
    }


def _assert_close(ours, ref, tol=TOL):
    for name in ("vision_pooled_gap", "text_pooled_gap"):
        assert ours[name] <= tol, f"pooled-only path differs from the full path: {ours[name]}"
    for name in ref:
        # Features and pooled outputs: `tol` absolute (the acceptance bound). Every token's state
        # (|x| about 6 at ViT-B/32 with random weights) is held to `tol` relative to its scale.
        bound = tol * max(1.0, float(np.abs(ref[name]).max())) if name.endswith("_hidden") else tol
        diff = np.abs(np.asarray(ours[name]) - ref[name]).max()
        assert diff <= bound, f"{name}: max abs diff {diff:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def from_hf_once():
    """`clip.from_hf(folder)` of a session fixture's folder, loaded once in this module and
    shared by the tests that only read the model (a ViT-B/32 load reads 600 MB and builds the
    model: about 3 CPU-s)."""
    loaded = {}

    def load(folder):
        if folder not in loaded:
            loaded[folder] = clip.from_hf(folder)
        return loaded[folder]

    return load


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_hf", "b32_hf"])
def test_from_hf_matches_transformers(fixture, request, rng, from_hf_once):
    folder, hf = request.getfixturevalue(fixture)
    model = from_hf_once(folder)
    pixels, ids = _inputs(rng, 4, hf.config.vision_config.image_size)
    ours = _jax_features(model, jnp.asarray(pixels), jnp.asarray(ids))
    assert ours["image"].shape == (4, hf.config.projection_dim)
    assert ours["vision_pooled"].shape == (4, hf.config.vision_config.hidden_size)
    assert ours["text_pooled"].shape == (4, hf.config.text_config.hidden_size)
    _assert_close(ours, _torch_features(hf, pixels, ids))


@pytest.mark.slow
def test_b32_config_and_parameter_count(b32_hf, from_hf_once):
    folder, hf = b32_hf
    model = from_hf_once(folder)
    assert model.config == clip.PRESETS["ViT-B/32"]
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_params == sum(p.numel() for p in hf.parameters())
    assert round(n_params / 1e6, 2) == 151.28  # appendix Table A1, one pair


def test_legacy_eos_id_pools_at_argmax(tmp_path, rng):
    # OpenAI's own configs say eos_token_id=2; Hugging Face then pools at argmax(input_ids).
    hf = save_random_hf_clip(tmp_path, TINY_HF, **{"text_config.eos_token_id": 2})
    model = clip.from_hf(tmp_path)
    assert model.text_model.eos_token_id == 2
    pixels, ids = _inputs(rng, 3, 32)
    ids[1, 5] = 49000  # not the largest id, so argmax still finds the EOT token
    _assert_close(_jax_features(model, jnp.asarray(pixels), jnp.asarray(ids)),
                  _torch_features(hf, pixels, ids))


@pytest.mark.slow
def test_text_attention_mask_matches(tiny_hf, rng):
    folder, hf = tiny_hf
    model = clip.from_hf(folder)
    pixels, ids = _inputs(rng, 3, 32)
    mask = (np.cumsum(ids == 49407, axis=1) <= 1).astype(np.int64)  # tokens up to the first EOT
    ref = _torch_features(hf, pixels, ids, attention_mask=mask)
    ours = model.encode_text(jnp.asarray(ids), jnp.asarray(mask))
    assert np.abs(np.asarray(ours) - ref["text"]).max() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_hf", "b32_hf"])
def test_export_roundtrip(fixture, request, tmp_path, rng, from_hf_once):
    folder, hf = request.getfixturevalue(fixture)
    model = from_hf_once(folder)
    clip.to_hf(model, tmp_path / "export")
    reloaded = transformers.CLIPModel.from_pretrained(tmp_path / "export").eval()
    pixels, ids = _inputs(rng, 2, hf.config.vision_config.image_size)
    ref, back = _torch_features(hf, pixels, ids), _torch_features(reloaded, pixels, ids)
    for name in ref:
        np.testing.assert_array_equal(back[name], ref[name], err_msg=name)
    assert reloaded.logit_scale.item() == pytest.approx(hf.logit_scale.item())
    again = clip.from_hf(tmp_path / "export")
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_random_init_exports_and_loads(tmp_path, rng):
    model = clip.create("tiny", seed=3)
    clip.to_hf(model, tmp_path)
    hf = transformers.CLIPModel.from_pretrained(tmp_path).eval()
    pixels, ids = _inputs(rng, 2, 32)
    _assert_close(_jax_features(model, jnp.asarray(pixels), jnp.asarray(ids)),
                  _torch_features(hf, pixels, ids))


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params(tiny_hf, rng):
    folder, _ = tiny_hf
    full, half = clip.from_hf(folder), clip.from_hf(folder, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(half, nnx.Param))} == {np.dtype("float32")}
    pixels, ids = _inputs(rng, 2, 32)
    a = _jax_features(full, jnp.asarray(pixels), jnp.asarray(ids))
    b = _jax_features(half, jnp.asarray(pixels), jnp.asarray(ids))
    for name in ("image", "text", "vision_pooled", "text_pooled", "vision_hidden", "text_hidden"):
        assert b[name].dtype == jnp.float32, name
        scale = float(jnp.abs(a[name]).max())
        err = float(jnp.abs(a[name] - b[name]).max())
        assert 0 < err < 0.05 * scale, f"{name}: bf16 error {err} vs scale {scale}"


def test_jit_compiles_once(tiny_hf, rng):
    model = clip.from_hf(tiny_hf[0])
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def encode(state, pixels):
        traces.append(1)
        return nnx.merge(graphdef, state).encode_image(pixels)

    for _ in range(3):
        encode(state, jnp.asarray(rng.standard_normal((2, 32, 32, 3), dtype=np.float32)))
    assert len(traces) == 1


# ----------------------------------------------------------------------------- bad checkpoints


def test_not_a_folder_with_config(tmp_path):
    with pytest.raises(clip.CheckpointError, match="no config.json"):
        clip.from_hf(tmp_path)


def test_not_a_clip_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(clip.CheckpointError, match="model_type='bert'"):
        clip.from_hf(tmp_path)


def test_missing_weights_file(tmp_path, tiny_hf):
    (tmp_path / "config.json").write_text((tiny_hf[0] / "config.json").read_text())
    with pytest.raises(clip.CheckpointError, match="no model.safetensors"):
        clip.from_hf(tmp_path)


def test_missing_and_unexpected_keys_are_named(tmp_path, tiny_hf):
    folder, _ = tiny_hf
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["extra_head.weight"] = tensors.pop("text_model.final_layer_norm.weight")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(clip.CheckpointError) as err:
        clip.from_hf(tmp_path)
    message = str(err.value)
    assert "missing keys: text_model.final_layer_norm.weight" in message
    assert "unexpected keys: extra_head.weight" in message


def test_shape_mismatch_is_named(tmp_path, tiny_hf):
    folder, _ = tiny_hf
    config = json.loads((folder / "config.json").read_text())
    config["projection_dim"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(clip.CheckpointError,
                       match=r"visual_projection.weight: file \(32, 64\), model \(16, 64\)"):
        clip.from_hf(tmp_path)


def test_wrong_image_size_is_a_clear_error(tiny_hf):
    model = clip.from_hf(tiny_hf[0])
    with pytest.raises(ValueError, match="not a multiple of the patch size 8"):
        model.encode_image(jnp.zeros((1, 30, 30, 3)))
    with pytest.raises(ValueError, match="image_size x image_size"):
        model.encode_image(jnp.zeros((1, 40, 40, 3)))


@pytest.mark.slow
def test_presets_build_abstractly():
    for name, cfg in clip.PRESETS.items():
        model = nnx.eval_shape(lambda cfg=cfg: clip.CLIPModel(cfg, rngs=nnx.Rngs(0)))
        out = jax.eval_shape(
            lambda m: m.encode_image(jnp.zeros((1, cfg.vision.image_size,
                                                cfg.vision.image_size, 3))), model)
        assert out.shape == (1, cfg.projection_dim), name
    with pytest.raises(ValueError, match="unknown CLIP preset"):
        clip.config_from_preset("ViT-H/99")


def test_sharded_checkpoint_loads(tmp_path, tiny_hf, rng):
    _, hf = tiny_hf
    hf.save_pretrained(tmp_path, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    pixels, ids = _inputs(rng, 2, 32)
    _assert_close(_jax_features(clip.from_hf(tmp_path), jnp.asarray(pixels), jnp.asarray(ids)),
                  _torch_features(hf, pixels, ids))


@pytest.mark.slow
def test_text_prefix_then_rest_equals_pooled(rng):
    """`pooled_from(*prefix(ids, k), ids, k)` is `pooled(ids)` for every split point; a prefix
    of every block, or a start past the last block, is refused."""
    model = clip.create("tiny", seed=1)
    text = model.text_model
    _, ids = _inputs(rng, 3, 32, length=16)

    @nnx.jit
    def split_runs(text, ids):
        return text.pooled(ids), [text.pooled_from(*text.prefix(ids, k), ids, k)
                                  for k in range(len(text.encoder.layers))]

    full, parts = split_runs(text, ids)
    for part in parts:
        np.testing.assert_allclose(part, full, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="prefix of 2 layers"):
        text.prefix(ids, 2)
    with pytest.raises(ValueError, match="start 2"):
        text.pooled_from(*text.prefix(ids, 1), ids, 2)


@pytest.mark.slow
def test_cpu_gradient_forms_change_no_gradient(rng):
    """gradient_forms="cpu" (a conditional with identical branches on each residual gradient;
    bias and LayerNorm parameter gradients as matmuls) is in the compiled backward pass of a
    model built with it, and only there; the forward and every gradient equal "plain"'s. The
    choice is a static attribute of every Linear / LayerNorm / EncoderLayer, "auto" follows the
    backend, and a bad value is refused."""
    from sclaro_jax.models import layers

    # The same weights (same seed) built both ways.
    models = {forms: clip.create("tiny", seed=2, gradient_forms=forms)
              for forms in ("cpu", "plain")}
    graphdef, params = nnx.split(models["cpu"], nnx.Param)
    # LayerNorms away from scale 1 / bias 0, so their gradients are not trivially related.
    params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), params)
    pixels, ids = _inputs(rng, 2, 32, length=16)

    out, hlo = {}, {}
    for forms, model in models.items():
        graphdef = nnx.graphdef(model)

        def loss(p, graphdef=graphdef):
            m = nnx.merge(graphdef, p)
            return jnp.sum(m.encode_image(pixels) ** 2) + jnp.sum(m.encode_text(ids) ** 2)

        fn = jax.jit(jax.value_and_grad(loss))
        out[forms] = fn(params)
        hlo[forms] = fn.lower(params).compile().as_text()
        owners = [m for _, m in nnx.iter_modules(model)
                  if isinstance(m, (layers.Linear, layers.LayerNorm, layers.EncoderLayer))]
        # 4 blocks of 6 Linears, 2 LayerNorms and the block; pre-, post- and final LayerNorm.
        assert len(owners) == 4 * 9 + 3
        assert {m.gradient_forms for m in owners} == {forms}
    assert "conditional(" in hlo["cpu"] and "conditional(" not in hlo["plain"]
    assert out["cpu"][0] == out["plain"][0]  # the forward is operation for operation the same
    for a, b in zip(jax.tree.leaves(out["cpu"][1]), jax.tree.leaves(out["plain"][1])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)

    backend = "cpu" if jax.default_backend() == "cpu" else "plain"
    auto = nnx.eval_shape(lambda: clip.CLIPModel(clip.config_from_preset("tiny"),
                                                 rngs=nnx.Rngs(0)))
    assert auto.text_model.encoder.layers[0].mlp.fc1.gradient_forms == backend
    assert auto.vision_model.post_layernorm.gradient_forms == backend
    with pytest.raises(ValueError, match="'auto', 'cpu', 'plain'.*'fast'"):
        clip.create("tiny", gradient_forms="fast")
