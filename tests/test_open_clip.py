"""open_clip checkpoints in and out: our CLIP exported for open_clip gives open_clip's own
embeddings; open_clip models (QuickGELU and GELU, a 24-token context) read from a hub folder and
from bare torch files without torch round-trip bit-exactly; training starts from an open_clip
file; what we cannot express is refused by name."""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import open_clip
import pytest
import torch

from conftest import TINY_HF, drawn_in_numpy, save_random_hf_clip
from flax import nnx

from sclaro_jax import ops
from sclaro_jax.models import clip, hf_weights, open_clip_weights as ocw
from sclaro_jax.train import export

jax.config.update("jax_default_matmul_precision", "highest")
TOL = 1e-5
# A tiny open_clip model whose heads are width / 64 (what a bare file's shapes imply).
TINY_OC = dict(embed_dim=32,
               vision_cfg=dict(image_size=32, layers=2, width=128, patch_size=8, head_width=64,
                               mlp_ratio=2.0),
               text_cfg=dict(context_length=24, vocab_size=49408, width=128, heads=2, layers=2,
                             mlp_ratio=2.0))


def _random_open_clip(cfg, seed):
    """open_clip's own CLIP with every weight moved off its init (LayerNorms, biases too)."""
    torch.manual_seed(seed)
    model = open_clip.CLIP(**cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _random_ours(config, seed):
    """Our CLIPModel of `config` with random weights drawn in numpy (`conftest.drawn_in_numpy`):
    faster on a CPU than `clip.create`'s initialisers."""
    return drawn_in_numpy(lambda: clip.CLIPModel(config, rngs=nnx.Rngs(0)), seed)


def _inputs(image_size, length, seed=0, batch=2):
    """NCHW pixels and token ids whose EOT (49407, the largest id) sits at different places."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, image_size, image_size, generator=g)
    ids = torch.randint(1, 49406, (batch, length), generator=g)
    for row, eot in enumerate(range(5, 5 + 3 * batch, 3)):
        ids[row, 0], ids[row, eot], ids[row, eot + 1:] = 49406, 49407, 0
    return pixels, ids


def _theirs(model, pixels, ids):
    with torch.no_grad():
        return model.encode_image(pixels).numpy(), model.encode_text(ids).numpy()


def _ours(model, pixels, ids):
    return (np.asarray(model.encode_image(jnp.asarray(pixels.permute(0, 2, 3, 1).numpy()))),
            np.asarray(model.encode_text(jnp.asarray(ids.numpy()))))


@nnx.jit
def _encode_jit(model, pixels, ids):
    return model.encode_image(pixels), model.encode_text(ids)


def _ours_jit(model, pixels, ids):
    """`_ours` as one compiled program (ViT-B/32: op by op, each of its hundreds of operations
    is dispatched alone, twice the CPU time of one compile)."""
    return tuple(np.asarray(x) for x in _encode_jit(
        model, jnp.asarray(pixels.permute(0, 2, 3, 1).numpy()), jnp.asarray(ids.numpy())))


def _assert_close(got, want):
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)


def _load_open_clip(folder):
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    return model.eval(), preprocess


# --------------------------------------------------------------------------------------------
# (b) open_clip -> ours -> open_clip
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["quickgelu", "gelu"])
def oc_model(request, tmp_path_factory):
    """(variant, open_clip model, hub folder, bare training-checkpoint .bin) of one variant."""
    variant = request.param
    cfg = TINY_OC | {"quick_gelu": variant == "quickgelu"}
    model = _random_open_clip(cfg, seed=len(variant))
    root = tmp_path_factory.mktemp(f"oc_{variant}")
    hub = root / "hub"
    hub.mkdir()
    (hub / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg,
                                                           "preprocess_cfg": {}}))
    torch.save(model.state_dict(), hub / "open_clip_pytorch_model.bin")
    bare = root / "bare" / "epoch_3.pt"  # open_clip's training checkpoint, DDP key names
    bare.parent.mkdir()
    torch.save({"epoch": 3, "name": "run", "state_dict": {
        f"module.{k}": v for k, v in model.state_dict().items()}}, bare)
    return variant, model, hub, bare


@pytest.mark.slow
def test_open_clip_hub_folder_and_bare_file_give_open_clips_embeddings(oc_model):
    variant, theirs, hub, bare = oc_model
    act = {"quickgelu": "quick_gelu", "gelu": "gelu"}[variant]
    pixels, ids = _inputs(32, 24)
    want = _theirs(theirs, pixels, ids)
    from_hub = ocw.load(hub)
    from_bare = ocw.load(f"{bare}:{variant}")
    for model in (from_hub, from_bare):
        assert model.config.vision.hidden_act == model.config.text.hidden_act == act
        assert model.config.text.max_position_embeddings == 24
        _assert_close(_ours(model, pixels, ids), want)
    # the bare file's shapes give the hub config's sizes; its shapes alone give the config too
    assert from_bare.config == from_hub.config == ocw.read_config(f"{bare}:{variant}")
    assert ocw.pretrained_config(hub) == from_hub.config


def test_open_clip_round_trip_is_bit_exact(oc_model, tmp_path):
    variant, theirs, _, bare = oc_model
    out = tmp_path / "out"
    ocw.save(ocw.load(f"{bare}:{variant}"), out)
    again, _ = _load_open_clip(out)
    want, got = theirs.state_dict(), again.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    act = again.transformer.resblocks[0].mlp.gelu  # the activation open_clip built
    assert type(act).__name__ == ("QuickGELU" if variant == "quickgelu" else "GELU")
    pixels, ids = _inputs(32, 24, seed=1)
    _assert_close(_theirs(again, pixels, ids), _theirs(theirs, pixels, ids))


@pytest.mark.parametrize("oc_model", ["gelu"], indirect=True)
def test_a_bare_safetensors_file_reads_like_the_torch_file(oc_model, tmp_path):
    from safetensors.torch import save_file

    variant, theirs, hub, _ = oc_model
    file = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(file))
    a, b = ocw.load(f"{file}:gelu"), ocw.load(hub)
    flat = dict(hf_weights.hf_state_dict(b))
    for key, value in hf_weights.hf_state_dict(a).items():
        assert np.array_equal(value, flat[key]), key


def test_torch_reader_keeps_strides_offsets_and_dtypes(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    half = torch.randn(3, 2).to(torch.bfloat16)
    data = {"t": base.t(), "view": base[1:, 2:4], "half": half, "i": torch.tensor([3, -1]),
            "p": torch.nn.Parameter(torch.ones(2))}
    torch.save({"state_dict": data, "epoch": 1}, tmp_path / "x.bin")
    got = ocw.read_state_dict(tmp_path / "x.bin")
    for key, value in data.items():
        want = value.detach().float().numpy() if key == "half" else value.detach().numpy()
        assert np.array_equal(np.asarray(got[key], want.dtype), want), key
        assert got[key].shape == tuple(value.shape)
    from safetensors.torch import save_file  # bfloat16, which safetensors.numpy cannot read

    save_file({"half": half, "f16": half.half()}, str(tmp_path / "x.safetensors"))
    got = ocw.read_state_dict(tmp_path / "x.safetensors")
    assert np.array_equal(np.asarray(got["half"], np.float32), half.float().numpy())
    assert np.array_equal(got["f16"], half.half().numpy())


# --------------------------------------------------------------------------------------------
# (a) ours -> open_clip
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_clip_exported_by_the_cli_gives_our_features_in_open_clip(tmp_path, capsys):
    """From a Hugging Face folder (transformers' legacy eos id 2: open_clip's argmax pooling)
    and from an open_clip file of the tiny preset (eos id 49407: open_clip's "eos" pooling)."""
    hf = tmp_path / "hf"
    save_random_hf_clip(hf, TINY_HF, seed=3)
    tiny = _random_ours(clip.PRESETS["tiny"], seed=4)
    ocw.save(tiny, tmp_path / "tiny_oc")
    for source, model in ((hf, clip.from_hf(hf)), (tmp_path / "tiny_oc", tiny)):
        out = tmp_path / f"{source.name}_out"
        assert export.main(["--model", str(source), "--format", "open_clip",
                            "--out", str(out)]) == 0
        theirs, preprocess = _load_open_clip(out)
        tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
        ids = tokenizer(["a dog on a sofa", "two people riding a horse in the field"])
        assert ids.shape == (2, 77)
        pixels, _ = _inputs(32, 77, seed=5)
        _assert_close(_theirs(theirs, pixels, ids), _ours(model, pixels, ids))
        cfg = theirs.visual.preprocess_cfg
        assert cfg["size"] in (32, (32, 32)) and cfg["interpolation"] == "bicubic"
        np.testing.assert_allclose(cfg["mean"], ops.CLIP_MEAN, rtol=1e-7)
        np.testing.assert_allclose(cfg["std"], ops.CLIP_STD, rtol=1e-7)
    assert json.loads((out / "open_clip_config.json").read_text())["model_cfg"]["text_cfg"][
        "pool_type"] == "eos"
    capsys.readouterr()


@pytest.mark.parametrize("oc_model", ["gelu"], indirect=True)
def test_open_clip_to_hugging_face_by_the_cli(oc_model, tmp_path, capsys):
    import transformers

    _, theirs, hub, _ = oc_model
    out = tmp_path / "hf"
    assert export.main(["--model", str(hub), "--format", "hf", "--out", str(out)]) == 0
    assert f"wrote {hub} to {out} (hf format)" in capsys.readouterr().out
    hf = transformers.CLIPModel.from_pretrained(out).eval()
    assert hf.config.vision_config.hidden_act == "gelu"
    pixels, ids = _inputs(32, 24, seed=3)
    with torch.no_grad():
        got = (hf.get_image_features(pixel_values=pixels), hf.get_text_features(input_ids=ids))
    got = [np.asarray(getattr(g, "pooler_output", g)) for g in got]
    _assert_close(got, _theirs(theirs, pixels, ids))
    assert (out / "preprocessor_config.json").is_file() and (out / "vocab.json").is_file()


@pytest.mark.slow
def test_vit_b32_exports_to_open_clip(tmp_path):
    ours = _random_ours(clip.PRESETS["ViT-B/32"], seed=7)
    ocw.save(ours, tmp_path / "b32")
    theirs, _ = _load_open_clip(tmp_path / "b32")
    pixels, ids = _inputs(224, 77, seed=6, batch=1)
    _assert_close(_theirs(theirs, pixels, ids), _ours_jit(ours, pixels, ids))


@pytest.mark.slow
def test_hidden_act_goes_through_hugging_face_folders(tmp_path):
    import transformers

    hf = save_random_hf_clip(tmp_path / "a", TINY_HF, seed=8, **{"vision_config.hidden_act":
                                                                   "gelu",
                                                                   "text_config.hidden_act":
                                                                   "gelu"})
    ours = clip.from_hf(tmp_path / "a")
    assert ours.config.vision.hidden_act == ours.config.text.hidden_act == "gelu"
    pixels, ids = _inputs(32, 12, seed=2)
    with torch.no_grad():
        want = (hf.get_image_features(pixel_values=pixels), hf.get_text_features(input_ids=ids))
    want = [np.asarray(getattr(w, "pooler_output", w)) for w in want]
    _assert_close(_ours(ours, pixels, ids), want)
    clip.to_hf(ours, tmp_path / "b")
    back = transformers.CLIPConfig.from_pretrained(tmp_path / "b")
    assert back.vision_config.hidden_act == back.text_config.hidden_act == "gelu"


# --------------------------------------------------------------------------------------------
# (c) training from an open_clip file
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_training_starts_from_an_open_clip_file(tmp_path, demo_dir, shared_launcher):
    cfg = dict(embed_dim=32, quick_gelu=False,
               vision_cfg=dict(image_size=32, layers=2, width=64, patch_size=8, head_width=64,
                               mlp_ratio=2.0),
               text_cfg=dict(context_length=40, vocab_size=49408, width=64, heads=1, layers=2,
                             mlp_ratio=2.0))
    model = _random_open_clip(cfg, seed=11)
    file = tmp_path / "oc" / "model.bin"
    file.parent.mkdir()
    torch.save(model.state_dict(), file)
    workdir = tmp_path / "run"
    result = shared_launcher.run(
        [sys.executable, "launch/train.py", "--config", "configs/pyramidclip.py:demo",
         "--workdir", str(workdir), f"--config.data.dir={demo_dir}",
         f"--config.model.init={file}:gelu", "--config.train.steps=2", "--config.log_every=1",
         "--config.progress_bar=False"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)

    from sclaro_jax.checkpoint import load_checkpoint
    trained, _ = load_checkpoint(str(workdir))
    pair = trained.pair("global")
    # restored into the file's towers: GELU, its 40 text positions
    assert pair.config.vision.hidden_act == pair.config.text.hidden_act == "gelu"
    assert pair.text_model.embeddings.position_embedding.embedding.shape == (40, 64)
    # the demo freezes the first block of each tower: still the file's weights
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    q, k, v = np.split(sd["visual.transformer.resblocks.0.attn.in_proj_weight"], 3)
    block = pair.vision_model.encoder.layers[0]
    assert np.array_equal(np.asarray(block.self_attn.k_proj.kernel[...]).T, k)
    assert np.array_equal(np.asarray(block.mlp.fc1.kernel[...]).T,
                          sd["visual.transformer.resblocks.0.mlp.c_fc.weight"])
    # the last block has trained away from them
    last = pair.vision_model.encoder.layers[1]
    assert not np.allclose(np.asarray(last.mlp.fc1.kernel[...]).T,
                           sd["visual.transformer.resblocks.1.mlp.c_fc.weight"])


# --------------------------------------------------------------------------------------------
# (d) refusals
# --------------------------------------------------------------------------------------------


def _refusal(fn, *args):
    with pytest.raises(clip.CheckpointError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize("oc_model", ["quickgelu"], indirect=True)
def test_a_bare_file_without_its_activation_is_refused_naming_both(oc_model, tmp_path):
    variant, theirs, hub, bare = oc_model
    msg = _refusal(ocw.load, bare)
    assert f"{bare}:quickgelu" in msg and f"{bare}:gelu" in msg and "open_clip_config" in msg
    assert ocw.is_open_clip(bare) and not ocw.is_open_clip(tmp_path)
    # a suffix that contradicts the config beside the file
    beside = tmp_path / "w.bin"
    beside.write_bytes((hub / "open_clip_pytorch_model.bin").read_bytes())
    (tmp_path / "open_clip_config.json").write_text((hub / "open_clip_config.json").read_text())
    assert "gelu" in _refusal(ocw.load, f"{beside}:gelu")
    assert ocw.load(beside).config.vision.hidden_act == "quick_gelu"  # the config says it
    # heads cannot be read from shapes when the width is not a multiple of 64
    small = {k: v for k, v in theirs.state_dict().items()}
    small["token_embedding.weight"] = torch.zeros(10, 48)
    torch.save(small, tmp_path / "odd.bin")
    (tmp_path / "open_clip_config.json").unlink()
    assert "text width 48 is not a multiple of 64" in _refusal(ocw.load,
                                                                 f"{tmp_path / 'odd.bin'}:gelu")


@pytest.mark.parametrize("section, key, value", [
    ("vision_cfg", "attentional_pool", True),
    ("vision_cfg", "timm_model_name", "vit_base_patch16_224"),
    ("text_cfg", "hf_model_name", "roberta-base"),
    ("text_cfg", "proj_type", "mlp"),
    (None, "custom_text", True),
    (None, "init_logit_bias", -10.0),
])
def test_open_clip_settings_we_cannot_express_are_named(tmp_path, section, key, value):
    cfg = json.loads(json.dumps(TINY_OC))
    (cfg[section] if section else cfg)[key] = value
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
    (tmp_path / "open_clip_model.safetensors").write_bytes(b"")
    msg = _refusal(ocw.load, tmp_path)
    assert key in msg and "only plain ViT CLIP models load" in msg, msg


@pytest.mark.parametrize("oc_model", ["gelu"], indirect=True)
def test_a_level_takes_open_clip_towers_of_its_activation_only(oc_model):
    from sclaro_jax.models import scenarioclip

    _, theirs, hub, _ = oc_model

    def build(preset):  # shapes only: load_hf_into_level replaces the towers' every weight
        return nnx.eval_shape(lambda: scenarioclip.build("pyramidclip", preset=preset,
                                                         embed_dim=8, warn_random=False))

    msg = _refusal(scenarioclip.load_hf_into_level, build("tiny"), "object", hub)
    assert "vision tower uses gelu, the object level's quick_gelu" in msg
    model = build(ocw.read_config(hub))
    scenarioclip.load_hf_into_level(model, "object", hub)
    got = np.asarray(model.pair("global").text_model.encoder.layers[1].mlp.fc2.kernel[...]).T
    assert np.array_equal(got, theirs.state_dict()["transformer.resblocks.1.mlp.c_proj.weight"])


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("oc_model", ["gelu"], indirect=True)
def test_unsupported_keys_and_torchscript_are_refused(oc_model, tmp_path):
    variant, theirs, _, _ = oc_model
    state = dict(theirs.state_dict())
    state["visual.attn_pool.query"] = torch.zeros(4, 128)
    torch.save(state, tmp_path / "pool.bin")
    msg = _refusal(ocw.load, f"{tmp_path / 'pool.bin'}:gelu")
    assert "'visual.attn_pool.query'" in msg and "attention pooling" in msg
    torch.jit.script(torch.nn.Linear(2, 2)).save(str(tmp_path / "jit.pt"))
    assert "TorchScript" in _refusal(ocw.load, f"{tmp_path / 'jit.pt'}:gelu")


def test_export_refuses_open_clip_for_a_trained_level_and_mixed_activations(tmp_path, capsys):
    out = tmp_path / "out"
    code = export.main(["--workdir", str(tmp_path), "--level", "object", "--format",
                        "open_clip", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not out.exists()
    assert "Linear+LayerNorm heads" in err and "--format hf" in err
    config = clip.PRESETS["tiny"]
    mixed = nnx.eval_shape(lambda: clip.CLIPModel(config.replace(
        vision=dataclasses.replace(config.vision, hidden_act="gelu")), rngs=nnx.Rngs(0)))
    assert "both 'quick_gelu' or both 'gelu'" in _refusal(ocw.save, mixed, out)
    assert not out.exists()
