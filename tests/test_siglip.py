"""Flax SigLIP / SigLIP 2 towers, preprocessing and tokenizer against transformers' PyTorch
SiglipModel / Siglip2Model and processors, on tiny random checkpoints."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from sclaro_jax.models import siglip, siglip_inputs
from sclaro_jax.models.layers import patchify
from tiny_siglip import save_tiny_siglip

jax.config.update("jax_default_matmul_precision", "highest")
TOL = 1e-5
PATCH = 8


@pytest.fixture(scope="module")
def tiny_siglip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_siglip")
    return folder, save_tiny_siglip(folder, "siglip")


@pytest.fixture(scope="module")
def tiny_siglip2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_siglip2")
    return folder, save_tiny_siglip(folder, "siglip2")


def _ids(rng, batch=3, length=64, vocab=96):
    return rng.integers(0, vocab, (batch, length))


def _torch_siglip2_image(hf, pixels, pad_to=None):
    """What Siglip2ImageProcessor feeds for a batch resized to one square grid: patches in
    processor order, optionally padded to `pad_to` patches with the mask zero there."""
    b, h, w, _ = pixels.shape
    patches = patchify(jnp.asarray(pixels), PATCH)
    n = patches.shape[1]
    pad_to = pad_to or n
    values = np.zeros((b, pad_to, patches.shape[-1]), np.float32)
    values[:, :n] = np.asarray(patches)
    mask = np.zeros((b, pad_to), np.int64)
    mask[:, :n] = 1
    shapes = torch.tensor([[h // PATCH, w // PATCH]] * b)
    with torch.no_grad():
        return hf.get_image_features(pixel_values=torch.from_numpy(values),
                                     pixel_attention_mask=torch.from_numpy(mask),
                                     spatial_shapes=shapes).pooler_output.numpy()


def _diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


# ------------------------------------------------------------------------------- model parity


@pytest.mark.slow
def test_siglip_matches_transformers(tiny_siglip, rng):
    folder, hf = tiny_siglip
    model = siglip.from_hf(folder)
    assert model.config.model_type == "siglip"
    pixels = rng.standard_normal((2, 32, 32, 3), dtype=np.float32)
    ids = _ids(rng)
    mask = np.ones_like(ids)
    mask[1, 40:] = 0
    with torch.no_grad():
        px, tid = torch.from_numpy(pixels).permute(0, 3, 1, 2), torch.from_numpy(ids)
        ref_img = hf.get_image_features(px).pooler_output.numpy()
        ref_txt = hf.get_text_features(tid).pooler_output.numpy()
        ref_masked = hf.get_text_features(
            tid, attention_mask=torch.from_numpy(mask)).pooler_output.numpy()
        ref_logits = hf(input_ids=tid, pixel_values=px).logits_per_image.numpy()
    img = nnx.jit(lambda m, x: m.encode_image(x))(model, jnp.asarray(pixels))
    txt = nnx.jit(lambda m, x: m.encode_text(x))(model, jnp.asarray(ids))
    masked = model.encode_text(jnp.asarray(ids), jnp.asarray(mask))
    assert img.shape == ref_img.shape == (2, 48) and txt.shape == ref_txt.shape == (3, 48)
    assert _diff(img, ref_img) <= TOL
    assert _diff(txt, ref_txt) <= TOL
    assert _diff(masked, ref_masked) <= TOL
    assert _diff(model.logits(img, txt), ref_logits) <= 1e-4  # logits are scaled by exp(2.3)


@pytest.mark.parametrize("grid", [4, 6, 3])  # the table's own 4x4 grid, up- and down-sampled
def test_siglip2_matches_transformers(tiny_siglip2, rng, grid):
    folder, hf = tiny_siglip2
    model = siglip.from_hf(folder)
    assert model.config.model_type == "siglip2" and model.config.vision.position_grid == 4
    pixels = rng.standard_normal((2, grid * PATCH, grid * PATCH, 3), dtype=np.float32)
    ours = nnx.jit(lambda m, x: m.encode_image(x))(model, jnp.asarray(pixels))
    ref = _torch_siglip2_image(hf, pixels)
    assert ours.shape == ref.shape == (2, 48)
    assert _diff(ours, ref) <= TOL
    # The processor pads to max_num_patches with a zero mask there: same features.
    assert _diff(ours, _torch_siglip2_image(hf, pixels, pad_to=grid * grid + 5)) <= TOL


@pytest.mark.slow
def test_siglip2_text_matches_transformers(tiny_siglip2, rng):
    folder, hf = tiny_siglip2
    ids = _ids(rng)
    with torch.no_grad():
        ref = hf.get_text_features(torch.from_numpy(ids)).pooler_output.numpy()
    assert _diff(siglip.from_hf(folder).encode_text(jnp.asarray(ids)), ref) <= TOL


def test_resize_weights_match_torch_interpolate():
    table = np.random.default_rng(1).standard_normal((1, 5, 4, 4)).astype(np.float32)
    for size in (2, 3, 4, 7, 9):
        ref = torch.nn.functional.interpolate(torch.from_numpy(table), size=(size, size),
                                              mode="bilinear", align_corners=False,
                                              antialias=True).numpy()
        w = siglip.resize_weights(4, size)
        ours = np.einsum("ar,bc,nrc->nab", w, w, table[0])
        assert _diff(ours, ref[0]) <= 1e-6, size


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params(tiny_siglip2, rng):
    folder, _ = tiny_siglip2
    full, half = siglip.from_hf(folder), siglip.from_hf(folder, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(half, nnx.Param))} == {np.dtype("float32")}
    pixels = jnp.asarray(rng.standard_normal((2, 40, 40, 3), dtype=np.float32))
    ids = jnp.asarray(_ids(rng))
    encode = nnx.jit(lambda m, x, t: (m.encode_image(x), m.encode_text(t)))
    for a, b in zip(encode(full, pixels, ids), encode(half, pixels, ids)):
        assert b.dtype == jnp.float32
        assert 0 < _diff(a, b) < 0.05 * float(jnp.abs(a).max())


@pytest.mark.slow
def test_sharded_checkpoint_loads(tmp_path, tiny_siglip, rng):
    folder, hf = tiny_siglip
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = _ids(rng)
    with torch.no_grad():
        ref = hf.get_text_features(torch.from_numpy(ids)).pooler_output.numpy()
    assert _diff(siglip.from_hf(tmp_path).encode_text(jnp.asarray(ids)), ref) <= TOL


def test_presets_build_abstractly():
    import dataclasses

    for name, cfg in siglip.PRESETS.items():
        assert (cfg.vision.hidden_size, cfg.vision.num_hidden_layers,
                cfg.vision.intermediate_size, cfg.vision.num_attention_heads) == (1152, 27, 4304, 16)
        # Full width, one layer deep (27 layers and a 256k vocabulary trace slowly on 2 cores).
        short = dataclasses.replace(
            cfg, vision=dataclasses.replace(cfg.vision, num_hidden_layers=1),
            text=dataclasses.replace(cfg.text, num_hidden_layers=1, vocab_size=100))
        model = nnx.eval_shape(lambda: siglip.SiglipModel(short, rngs=nnx.Rngs(0)))
        size = cfg.vision.image_size
        out = jax.eval_shape(lambda m: m.encode_image(jnp.zeros((1, size, size, 3))), model)
        assert out.shape == (1, 1152), name
        grid = model.vision_model.embeddings.position_embedding.num_embeddings
        assert grid == (27 * 27 if cfg.vision.patch_size == 14 else 24 * 24), name


# ------------------------------------------------------------------------------ bad checkpoints


def test_errors(tmp_path, tiny_siglip):
    folder, _ = tiny_siglip
    with pytest.raises(siglip.CheckpointError, match="no config.json"):
        siglip.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip", "text_config": {},
                                                      "vision_config": {}}))
    with pytest.raises(siglip.CheckpointError, match="model_type='clip'"):
        siglip.from_hf(tmp_path)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(siglip.CheckpointError, match="no model.safetensors"):
        siglip.from_hf(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["vision_model.head.attention.in_proj_weight"]
    tensors["vision_model.head.probe"] = tensors["vision_model.head.probe"][:, :, :8]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(siglip.CheckpointError) as err:
        siglip.from_hf(tmp_path)
    assert "missing keys: vision_model.head.attention.in_proj_weight" in str(err.value)
    assert "vision_model.head.probe: file (1, 1, 8), model (1, 1, 48)" in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_wrong_image_size_is_a_clear_error(tiny_siglip):
    model = siglip.from_hf(tiny_siglip[0])
    for size in (40, 30):  # a larger grid, and a smaller one (not a multiple of the patch)
        with pytest.raises(ValueError, match="images must be 32x32"):
            model.encode_image(jnp.zeros((1, size, size, 3)))


@pytest.mark.slow
def test_siglip_ignores_pixels_past_the_last_patch(tiny_siglip, rng):
    # As the real so400m-patch14-384: 384 px / 14 -> 27 patches, the conv drops the rest.
    folder, hf = tiny_siglip
    pixels = rng.standard_normal((2, 35, 35, 3), dtype=np.float32)
    with torch.no_grad():
        ref = hf.get_image_features(
            torch.from_numpy(pixels).permute(0, 3, 1, 2)).pooler_output.numpy()
    assert _diff(siglip.from_hf(folder).encode_image(jnp.asarray(pixels)), ref) <= TOL


def test_siglip2_grid_must_be_whole_patches(tiny_siglip2):
    with pytest.raises(ValueError, match="not a multiple of the patch size 8"):
        siglip.from_hf(tiny_siglip2[0]).encode_image(jnp.zeros((1, 30, 30, 3)))


# -------------------------------------------------------------------------------- preprocessing


def test_preprocess_matches_siglip_image_processor(tiny_siglip):
    from skimage import data

    folder, _ = tiny_siglip
    images = [data.chelsea(), data.astronaut()]
    cfg = siglip.image_config(folder, size=224)
    assert cfg.size == (224, 224) and cfg.resample == 3
    ours = siglip.preprocess(images, cfg)
    assert ours.shape == (2, 224, 224, 3) and ours.dtype == np.float32
    kw = dict(size={"height": 224, "width": 224}, return_tensors="np")
    pil = transformers.SiglipImageProcessorPil.from_pretrained(folder)(images, **kw)
    tv = transformers.SiglipImageProcessor.from_pretrained(folder)(images, **kw)
    # PIL backend: the same PIL bicubic resize -> identical. Torchvision backend: its own
    # antialiased bicubic: a few pixels one uint8 level off (1 level = 2/255 normalised; seen:
    # max 0.0078, mean 2.3e-5).
    assert _diff(ours, pil["pixel_values"].transpose(0, 2, 3, 1)) <= 1e-6
    tv_diff = np.abs(ours - np.asarray(tv["pixel_values"]).transpose(0, 2, 3, 1))
    assert tv_diff.mean() < 1e-3 and tv_diff.max() <= 2 / 255 + 1e-5


def test_siglip2_patches_match_processor(tiny_siglip2):
    from skimage import data

    folder, _ = tiny_siglip2
    cfg = siglip.image_config(folder)  # 16 patches of 8 -> a 4x4 grid, 32 px
    assert cfg.size == (32, 32) and cfg.resample == 2
    image = data.astronaut()  # square, so the processor's grid is 4x4 too
    ours = np.asarray(patchify(jnp.asarray(siglip.preprocess([image], cfg)), PATCH))
    ref = transformers.Siglip2ImageProcessorPil.from_pretrained(folder)([image],
                                                                       return_tensors="np")
    assert ref["spatial_shapes"].tolist() == [[4, 4]]
    assert ref["pixel_attention_mask"].all()
    assert _diff(ours, ref["pixel_values"]) <= 1e-6


# -------------------------------------------------------------------------------- tokenizer

TEXTS = ["a photo of a cat", "A Photo of a DOG!", "", "  two  people, riding bicycles.  ",
         " ".join(["children playing football in the park"] * 20)]  # truncated at 64


@pytest.mark.parametrize("fixture", ["tiny_siglip", "tiny_siglip2"])
def test_tokenizer_matches_transformers(fixture, request):
    folder, hf = request.getfixturevalue(fixture)
    tokenize = siglip.load_tokenizer(folder)
    ours = tokenize(TEXTS)
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(folder)(
        TEXTS, padding="max_length", max_length=64, truncation=True, return_tensors="np")
    assert ours.dtype == np.int32 and ours.shape == (len(TEXTS), 64)
    np.testing.assert_array_equal(ours, ref["input_ids"])
    eos = hf.config.text_config.eos_token_id
    assert ours[-1, -1] == eos  # truncation keeps the end-of-sequence token


def test_tokenizer_needs_a_tokenizer_file(tmp_path):
    with pytest.raises(siglip.CheckpointError, match="neither tokenizer.json .* nor spiece.model"):
        siglip.load_tokenizer(tmp_path)


@pytest.mark.parametrize("lower", [True, False])
def test_sentencepiece_folder_gives_siglip_tokenizer_ids(tmp_path, lower):
    """SigLIP 1 folders ship spiece.model only: our ids equal transformers' SiglipTokenizer's
    (padding="max_length", truncation) on a SentencePiece model trained here."""
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS[:4] + ["the quick brown fox jumps over the lazy dog",
                                             "a red motorcycle parked near a wall",
                                             "Caf\u00e9 au lait on a small table"]) * 10)
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "spiece"), vocab_size=70,
        model_type="unigram", pad_id=-1, eos_id=1, unk_id=2, bos_id=-1,
        hard_vocab_limit=False, minloglevel=2)
    folder = tmp_path / "siglip1"
    transformers.SiglipTokenizer(vocab_file=str(tmp_path / "spiece.model"),
                                 do_lower_case=lower).save_pretrained(folder)
    assert not (folder / "tokenizer.json").exists()
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    texts = TEXTS + ["Two DOGS, playing!!", "a </s> b", "<unk>x", "\u00e9mile's caf\u00e9", "zzz qqq",
                     "  leading space", "\u2581lower block", "x </s>", "<unk> <unk>", "A.B.C"]
    ours = siglip.load_tokenizer(folder, max_length=16)(texts)
    want = ref(texts, padding="max_length", max_length=16, truncation=True,
               return_tensors="np")["input_ids"]
    np.testing.assert_array_equal(ours, want)


def test_siglip_canonicalisation():
    # SiglipTokenizer.canonicalize_text: lowercase, drop string.punctuation, squeeze whitespace,
    # strip.
    assert siglip_inputs._canonicalize("  A Photo, of a DOG!\n  (2) ", True) == "a photo of a dog 2"
    assert siglip_inputs._canonicalize("Keep CASE.", False) == "Keep CASE"
