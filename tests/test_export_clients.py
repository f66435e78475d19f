"""An exported level as transformers' own clients read it: `AutoModel.from_pretrained(export,
trust_remote_code=True)` runs the model code the folder carries and gives our embeddings
(`get_image_features` / `get_text_features`) and logits (`forward`), for the tiny preset and a
random ViT-B/32; `CLIPProcessor` / `AutoProcessor` give our token ids and pixels; the
zero-shot-image-classification pipeline gives softmax(exp(logit_scale) * cos) of our model; and
without `trust_remote_code` transformers refuses the folder instead of loading a plain CLIPModel
with fresh projections."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from conftest import drawn_in_numpy

from sclaro_jax import ops
from sclaro_jax.data import augment
from sclaro_jax.data.tokenizer import ClipTokenizer
from sclaro_jax.models import scenarioclip
from sclaro_jax.export.hf import export_level

IDS = np.array([[49406, 320, 1125, 49407, 49407, 49407], [49406, 500, 49407, 49407, 49407, 49407],
                [49406, 7, 8, 9, 10, 49407]], np.int64)


@pytest.fixture(scope="module", autouse=True)
def precision_and_module_cache(tmp_path_factory):
    """Highest-precision fp32 matmuls; transformers' copies of remote code go to a tmp folder,
    not ~/.cache/huggingface/modules (the folder is read when transformers is imported, so the
    module attribute is patched too)."""
    import transformers.dynamic_module_utils as dynamic

    cache = str(tmp_path_factory.mktemp("hf_modules"))
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_MODULES_CACHE", cache)
        mp.setattr(dynamic, "HF_MODULES_CACHE", cache)
        yield
    jax.config.update("jax_default_matmul_precision", old)


@pytest.fixture(scope="module")
def tiny():
    """A tiny ScenarioCLIP (no training) whose heads and scales are not the init values, and
    its object level exported."""
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=24, seed=1,
                               warn_random=False)
    for i, level in enumerate(scenarioclip.LEVELS):
        pair = model.pair(level)
        pair.vision_head.linear.bias[...] += 0.3
        pair.text_head.norm.scale[...] *= 1.5 + i
        pair.text_head.norm.bias[...] -= 0.2
        getattr(model, f"{level}_logit_scale")[...] = jnp.float32(3.0 + i)
    return model


@pytest.fixture(scope="module")
def tiny_export(tiny, tmp_path_factory):
    return export_level(tiny, "object", str(tmp_path_factory.mktemp("tiny") / "object"))


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _auto_model(folder):
    return transformers.AutoModel.from_pretrained(folder, trust_remote_code=True).eval()


def _features(out):
    return getattr(out, "pooler_output", out).numpy()  # transformers 5: a BaseModelOutput


def _torch_embeddings(model, pixels_nhwc, ids):
    with torch.no_grad():
        image = model.get_image_features(
            pixel_values=torch.from_numpy(np.asarray(pixels_nhwc)).permute(0, 3, 1, 2))
        text = model.get_text_features(input_ids=torch.from_numpy(ids))
    return _features(image), _features(text)


def _assert_parity(model, level, folder, pixels):
    pair = model.pair(level)
    hf = _auto_model(folder)
    assert type(hf).__name__ == "ScenarioCLIPModel"
    assert isinstance(hf, transformers.CLIPModel)
    image, text = _torch_embeddings(hf, pixels, IDS)
    ours_image = np.asarray(pair.encode_image(jnp.asarray(pixels)))
    ours_text = np.asarray(pair.encode_text(jnp.asarray(IDS, jnp.int32)))
    np.testing.assert_allclose(image, ours_image, atol=1e-5, rtol=0)
    np.testing.assert_allclose(text, ours_text, atol=1e-5, rtol=0)
    assert hf.logit_scale.item() == pytest.approx(float(model.logit_scale(level)), abs=1e-7)
    return hf, ours_image, ours_text


@pytest.mark.slow
@pytest.mark.parametrize("level", ["object", "relation"])
def test_automodel_gives_our_embeddings_and_logits_tiny(tiny, tiny_export, tmp_path, level):
    folder = tiny_export if level == "object" else export_level(tiny, level, str(tmp_path / level))
    pixels = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
    hf, image, text = _assert_parity(tiny, level, folder, pixels)
    # forward: logits_per_image = exp(logit_scale) * cos(image, text), from our embeddings
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(IDS),
                 pixel_values=torch.from_numpy(pixels).permute(0, 3, 1, 2))
    cos = _unit(image) @ _unit(text).T
    want = np.exp(float(tiny.logit_scale(level))) * cos
    np.testing.assert_allclose(out.logits_per_image.numpy(), want, atol=1e-4, rtol=1e-5)
    # the other levels' weights differ: the export took this level's towers and heads
    other = np.asarray(tiny.pair("global").encode_image(jnp.asarray(pixels)))
    assert np.abs(other - image).max() > 1e-3
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["model_type"] == "scenarioclip" and config["scenarioclip_level"] == level
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel",
                                       "AutoModelForZeroShotImageClassification"}


@pytest.mark.slow
def test_automodel_gives_our_embeddings_vit_b32(tmp_path):
    """A random-weight PyramidCLIP at ViT-B/32 sizes (one pair: one 600 MB export)."""
    model = drawn_in_numpy(lambda: scenarioclip.build("pyramidclip", preset="ViT-B/32", seed=2,
                                                      warn_random=False), seed=2)
    assert type(model).__name__ == "PyramidCLIP" and float(model.logit_scale("relation")) > 2.6
    folder = export_level(model, "relation", str(tmp_path / "relation"))
    pixels = np.random.default_rng(1).normal(size=(2, 224, 224, 3)).astype(np.float32)
    hf, _, _ = _assert_parity(model, "relation", folder, pixels)
    assert hf.visual_projection[0].weight.shape == (512, 768)
    assert hf.text_projection[0].weight.shape == (512, 512)


def test_automodel_refuses_the_export_without_trust_remote_code(tiny_export):
    """model_type "scenarioclip": transformers asks for trust_remote_code rather than loading
    the folder into a plain CLIPModel with newly initialised projections."""
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModel.from_pretrained(tiny_export)


def _our_pixels(image: np.ndarray, size: int) -> np.ndarray:
    return ops.normalize(np.asarray(augment.resize_centre_crop(Image.fromarray(image), size)))


def _no_prompt(*args):
    raise AssertionError("transformers asked whether to run the folder's code")


def test_processors_give_our_pixels_and_ids(tiny_export, monkeypatch):
    """With trust_remote_code=True (docs/exports.md's line) the processors load without
    transformers' interactive remote-code prompt (AutoTokenizer reads the folder's config)."""
    import skimage.data

    monkeypatch.setattr("builtins.input", _no_prompt)
    captions = ["a photo of a cat", "A man RIDING a horse, on the beach!", "café naïve 日本語"]
    image = skimage.data.coffee()  # 400 x 600: resized to 32 x 48, then cropped
    grey_level = 1 / 255 / ops.CLIP_STD.min()
    for cls in (transformers.CLIPProcessor, transformers.AutoProcessor):
        processor = cls.from_pretrained(tiny_export, trust_remote_code=True)
        assert type(processor) is transformers.CLIPProcessor, cls
        batch = processor(text=captions, images=image, padding="max_length", truncation=True,
                          return_tensors="np")
        np.testing.assert_array_equal(batch["input_ids"], ClipTokenizer()(captions, length=77))
        pixels = np.asarray(batch["pixel_values"])[0].transpose(1, 2, 0)
        # torchvision's bicubic resize, not PIL's: within one grey level (test_export has the
        # PIL backend's exact match)
        np.testing.assert_allclose(pixels, _our_pixels(image, 32), atol=1.01 * grey_level,
                                   rtol=0)


@pytest.mark.slow
def test_zero_shot_pipeline_scores_are_our_softmax(tiny, tiny_export):
    labels = ["cat", "dog on a mat", "a man riding a horse"]
    rng = np.random.default_rng(3)
    pipe = transformers.pipeline("zero-shot-image-classification", model=tiny_export,
                                 trust_remote_code=True)
    pair = tiny.pair("object")
    texts = [f"This is a photo of {label}." for label in labels]  # the pipeline's template
    text = np.asarray(pair.encode_text(jnp.asarray(ClipTokenizer()(texts, length=77))))
    # an image already 32 x 32: no resampling, so the pipeline's pixels are exactly ours
    for image in (rng.integers(0, 256, (32, 32, 3), np.uint8),
                  rng.integers(0, 256, (32, 32, 3), np.uint8)):
        pixels = _our_pixels(image, 32)
        emb = np.asarray(pair.encode_image(jnp.asarray(pixels[None])))
        logits = np.exp(float(tiny.logit_scale("object"))) * (_unit(emb) @ _unit(text).T)[0]
        want = np.exp(logits - logits.max())
        want /= want.sum()
        got = {r["label"]: r["score"] for r in pipe(Image.fromarray(image),
                                                     candidate_labels=labels)}
        np.testing.assert_allclose([got[label] for label in labels], want, atol=1e-5, rtol=0)
        assert max(want) - min(want) > 1e-3  # scores that tell the labels apart


@pytest.mark.slow
def test_remote_model_initialises_its_heads_and_round_trips_to_our_reader(tiny, tiny_export,
                                                                          tmp_path):
    """A fresh `ScenarioCLIPModel` (from_config) initialises the heads by its own rule (not
    CLIP's, which needs a bare `.weight`); a loaded one saved by `save_pretrained` (e.g. after
    fine-tuning in PyTorch) is read back by `scenarioclip.from_export` with the same weights."""
    config = transformers.AutoConfig.from_pretrained(tiny_export, trust_remote_code=True)
    assert type(config).__name__ == "ScenarioCLIPConfig" and config.projection_dim == 24
    torch.manual_seed(0)
    fresh = transformers.AutoModel.from_config(config, trust_remote_code=True)
    for head, width in ((fresh.visual_projection, 64), (fresh.text_projection, 48)):
        assert head[0].weight.std().item() == pytest.approx(width ** -0.5, rel=0.15)
        assert not head[0].bias.any() and not head[1].bias.any()
        assert bool((head[1].weight == 1).all())
    assert fresh.logit_scale.item() == pytest.approx(config.logit_scale_init_value)
    hf = _auto_model(tiny_export)
    hf.save_pretrained(tmp_path / "saved")
    pixels = np.random.default_rng(4).normal(size=(2, 32, 32, 3)).astype(np.float32)
    back = scenarioclip.from_export(tmp_path / "saved")
    np.testing.assert_array_equal(back.encode_image(jnp.asarray(pixels)),
                                  tiny.pair("object").encode_image(jnp.asarray(pixels)))


@pytest.mark.slow
def test_exports_page_snippet_gives_our_embeddings(tiny, tiny_export, monkeypatch):
    """docs/exports.md's lines, verbatim: AutoModel + CLIPProcessor on an image (32 x 32: no
    resampling, so the processor's pixels are exactly ours) and on captions (padded to the
    longest, with an attention mask: the EOT pooling sees the same tokens as our 77-token ids)."""
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (32, 32, 3), np.uint8))
    captions = ["a dog on a mat", "a man riding a horse on the beach"]
    OUT = tiny_export  # noqa: N806  (docs/exports.md's name)
    monkeypatch.setattr("builtins.input", _no_prompt)
    model = transformers.AutoModel.from_pretrained(OUT, trust_remote_code=True)
    processor = transformers.CLIPProcessor.from_pretrained(OUT, trust_remote_code=True)
    inputs = processor(images=image, return_tensors="pt")
    with torch.no_grad():
        image_emb = model.get_image_features(**inputs).pooler_output  # [1, D]
        text_emb = model.get_text_features(**processor(text=captions, padding=True,
                                                       return_tensors="pt")).pooler_output
    pair = tiny.pair("object")
    ours = pair.encode_image(jnp.asarray(_our_pixels(np.asarray(image), 32)[None]))
    np.testing.assert_allclose(image_emb.numpy(), np.asarray(ours), atol=1e-5, rtol=0)
    ours = pair.encode_text(jnp.asarray(ClipTokenizer()(captions, length=77)))
    np.testing.assert_allclose(text_emb.numpy(), np.asarray(ours), atol=1e-5, rtol=0)
