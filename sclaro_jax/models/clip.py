"""CLIP image and text towers as Flax NNX modules, with Hugging Face weight import and export.

The module tree mirrors Hugging Face's `CLIPModel` name for name (`vision_model.encoder.layers.3.
self_attn.q_proj`, ...), so the weight import is the one key map of `hf_weights`. `from_hf` reads
`config.json` + `model.safetensors` with numpy (no torch), `to_hf` writes a folder
`transformers.CLIPModel.from_pretrained` loads. The transformer layers are `layers.py`'s (shared
with SigLIP).

Numerics: parameters are float32 (`param_dtype`); `dtype` sets the compute dtype of the matmuls
(float32 by default, bfloat16 for training on GPU). LayerNorms, attention softmax and the pooled
outputs are computed in float32 whatever `dtype` is. `gradient_forms` ("auto", "cpu", "plain":
`cpu_gradients.resolve`) picks, when the model is built, the backward-pass forms for XLA:CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sclaro_jax.files import write_replacing
from sclaro_jax.models import cpu_gradients, hf_weights
from sclaro_jax.models.hf_weights import (  # noqa: F401  (re-exported: clip.CheckpointError, ...)
    WEIGHTS_INDEX_NAME, WEIGHTS_NAME, CheckpointError, hf_state_dict, load_hf_state)
from sclaro_jax.models.layers import (  # noqa: F401  (re-exported: clip.Attention, ...)
    ACTIVATIONS, MLP, Attention, Encoder, EncoderConfig, EncoderLayer, LayerNorm, Linear,
    PatchEmbedding, TextEmbeddings, layer_norm, patchify, quick_gelu, residual)

Array = jax.Array

# A level exported by `sclaro_jax.train.export` is a Hugging Face folder of model_type
# EXPORT_MODEL_TYPE whose `visual_projection` / `text_projection` are ScenarioCLIP's Linear+
# LayerNorm heads in torch `nn.Sequential` names (`visual_projection.0.weight`, ...; the
# transformers remote code it carries reads them), not CLIP's matrices. `load_with_heads` reads
# towers and heads (`scenarioclip.from_export`); `from_hf` loads its towers only when asked
# (`towers_only=True`) and refuses it otherwise.
EXPORT_MODEL_TYPE = "scenarioclip"
PROJECTIONS = ("visual_projection", "text_projection")
# Exports of older versions kept the heads in this file beside zero CLIP projections; such a
# folder is refused (zero projections), with a message asking for a new export.
HEADS_FILE = "scenarioclip_heads.safetensors"

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VisionConfig(EncoderConfig):
    """Vision tower sizes; field names follow Hugging Face `CLIPVisionConfig`."""

    image_size: int = 224
    patch_size: int = 32
    num_channels: int = 3

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class TextConfig(EncoderConfig):
    """Text tower sizes; field names follow Hugging Face `CLIPTextConfig`.

    `eos_token_id` decides EOT pooling exactly as Hugging Face does: the legacy value 2 (found in
    the OpenAI checkpoints' configs) pools at `argmax(input_ids)`, any other value at the first
    position holding that id.
    """

    hidden_size: int = 512
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    vocab_size: int = 49408
    max_position_embeddings: int = 77
    bos_token_id: int = 49406
    eos_token_id: int = 49407
    pad_token_id: int = 1


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
    text: TextConfig = dataclasses.field(default_factory=TextConfig)
    projection_dim: int = 512
    logit_scale_init_value: float = 2.6592

    def replace(self, **kwargs) -> "CLIPConfig":
        return dataclasses.replace(self, **kwargs)


def _text(width: int, heads: int, layers: int = 12) -> TextConfig:
    return TextConfig(hidden_size=width, intermediate_size=4 * width, num_attention_heads=heads,
                      num_hidden_layers=layers)


def _vision(width: int, heads: int, layers: int, patch: int, image: int = 224) -> VisionConfig:
    return VisionConfig(hidden_size=width, intermediate_size=4 * width, num_attention_heads=heads,
                        num_hidden_layers=layers, patch_size=patch, image_size=image)


PRESETS: dict[str, CLIPConfig] = {
    "ViT-B/32": CLIPConfig(_vision(768, 12, 12, 32), _text(512, 8), 512),
    "ViT-B/16": CLIPConfig(_vision(768, 12, 12, 16), _text(512, 8), 512),
    "ViT-L/14": CLIPConfig(_vision(1024, 16, 24, 14), _text(768, 12), 768),
    "ViT-L/14-336": CLIPConfig(_vision(1024, 16, 24, 14, 336), _text(768, 12), 768),
    # Test sizes: a few seconds to build and run on a CPU.
    "tiny": CLIPConfig(
        VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, image_size=32, patch_size=8),
        TextConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4),
        projection_dim=32),
}


# Presets whose vision tower takes the run's image size (`config.data.image_size`) instead of
# their own: the test-size model, at whatever size the data's views are.
FOLLOW_IMAGE_SIZE = ("tiny",)


def preset_at(name, image_size: int):
    """Preset `name` for `image_size` px images: a `FOLLOW_IMAGE_SIZE` preset ("tiny") with its
    vision tower's `image_size` set to it (its patch grid then fits: ValueError naming both
    config keys when `image_size` is not a multiple of its patch size); any other name (or a
    `CLIPConfig`) as it is."""
    if not isinstance(name, str) or name not in FOLLOW_IMAGE_SIZE:
        return name
    cfg = config_from_preset(name)
    if int(image_size) == cfg.vision.image_size:
        return cfg
    if int(image_size) % cfg.vision.patch_size:
        raise ValueError(f"config.model.preset={name!r} takes images in {cfg.vision.patch_size}"
                         f" px patches; config.data.image_size={image_size} is not a multiple "
                         f"of {cfg.vision.patch_size}")
    return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision,
                                                               image_size=int(image_size)))


def config_from_preset(name: str) -> CLIPConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown CLIP preset {name!r}; known: {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------------------------
# Towers
# --------------------------------------------------------------------------------------------


class VisionEmbeddings(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.class_embedding = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.hidden_size,), jnp.float32) * 0.02)
        self.patch_embedding = PatchEmbedding(cfg.patch_size, cfg.num_channels, cfg.hidden_size,
                                              dtype=dtype, rngs=rngs)
        self.position_embedding = nnx.Embed(cfg.num_patches + 1, cfg.hidden_size, rngs=rngs)

    def __call__(self, pixels: Array) -> Array:
        patches = self.patch_embedding(pixels).astype(jnp.float32)
        cls = jnp.broadcast_to(self.class_embedding[...], (patches.shape[0], 1, patches.shape[-1]))
        x = jnp.concatenate([cls, patches], axis=1)
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(
                f"{x.shape[1] - 1} patches but the position table holds "
                f"{self.position_embedding.num_embeddings - 1}: images must be "
                "image_size x image_size")
        return x + self.position_embedding.embedding[...]


class VisionTransformer(nnx.Module):
    """CLIP ViT: class token, pre-LayerNorm, encoder, post-LayerNorm on the class token."""

    def __init__(self, cfg: VisionConfig, *, dtype, gradient_forms: str, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embeddings = VisionEmbeddings(cfg, dtype=dtype, rngs=rngs)
        # `pre_layrnorm`: Hugging Face's spelling.
        self.pre_layrnorm = layer_norm(cfg, gradient_forms=gradient_forms, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, gradient_forms=gradient_forms, rngs=rngs)
        self.post_layernorm = layer_norm(cfg, gradient_forms=gradient_forms, rngs=rngs)

    def __call__(self, pixels: Array) -> tuple[Array, Array]:
        """`pixels` NHWC, CLIP-normalised. Returns (last hidden state, pooled) in float32."""
        x = self.encoder(self._embed(pixels)).astype(jnp.float32)
        return x, self.post_layernorm(x[:, 0])

    def pooled(self, pixels: Array) -> Array:
        """The pooled output alone: the last layer computes only the class token."""
        cls = jnp.zeros(pixels.shape[0], jnp.int32)
        x = self.encoder(self._embed(pixels), keep=cls)[:, 0].astype(jnp.float32)
        return self.post_layernorm(x)

    def _embed(self, pixels: Array) -> Array:
        return self.pre_layrnorm(self.embeddings(pixels)).astype(self.dtype)


def eot_positions(input_ids: Array, eos_token_id: int) -> Array:
    """Index of the token whose state is the text embedding, picked as Hugging Face picks it."""
    if eos_token_id == 2:  # legacy OpenAI configs: the EOT id is the largest id in the vocabulary
        return jnp.argmax(input_ids, axis=-1)
    return jnp.argmax(input_ids == eos_token_id, axis=-1)


class TextTransformer(nnx.Module):
    """CLIP text transformer: causal self-attention, final LayerNorm, EOT-token pooling."""

    def __init__(self, cfg: TextConfig, *, dtype, gradient_forms: str, rngs: nnx.Rngs):
        self.dtype = dtype
        self.eos_token_id = cfg.eos_token_id
        self.embeddings = TextEmbeddings(cfg, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, gradient_forms=gradient_forms, rngs=rngs,
                               causal=True)
        self.final_layer_norm = layer_norm(cfg, gradient_forms=gradient_forms, rngs=rngs)

    def __call__(self, input_ids: Array, attention_mask: Array | None = None
                 ) -> tuple[Array, Array]:
        """Returns (last hidden state, pooled EOT state) in float32.

        `attention_mask` ([B, L], 1 = token) is optional: with the causal mask, padding after the
        EOT token cannot change the pooled output.
        """
        x, mask = self._embed(input_ids, attention_mask)
        x = self.final_layer_norm(self.encoder(x, mask).astype(jnp.float32))
        pooled = jnp.take_along_axis(
            x, eot_positions(input_ids, self.eos_token_id)[:, None, None], axis=1)[:, 0]
        return x, pooled

    def pooled(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
        """The pooled output alone: the last layer computes only the EOT token."""
        x, mask = self._embed(input_ids, attention_mask)
        return self.pooled_from(x, mask, input_ids, 0)

    def prefix(self, input_ids: Array, layers: int, attention_mask: Array | None = None
               ) -> tuple[Array, Array | None]:
        """Embeddings and the first `layers` blocks: (hidden state [B, L, d], padding mask).
        `pooled_from(*prefix(ids, k), ids, k)` equals `pooled(ids)`; two models that share
        these weights (a student and its EMA teacher with frozen early blocks) can share it."""
        x, mask = self._embed(input_ids, attention_mask)
        return self.encoder.prefix(x, mask, layers), mask

    def pooled_from(self, hidden: Array, mask: Array | None, input_ids: Array,
                    start: int) -> Array:
        """`pooled` from the hidden state after the first `start` blocks."""
        eot = eot_positions(input_ids, self.eos_token_id)
        x = self.encoder(hidden, mask, keep=eot, start=start)
        return self.final_layer_norm(x[:, 0].astype(jnp.float32))

    def _embed(self, input_ids: Array, attention_mask: Array | None
               ) -> tuple[Array, Array | None]:
        """The embeddings and the keys' padding mask [B, 1, 1, L] (None without
        `attention_mask`); the encoder's attention is causal on its own."""
        mask = None
        if attention_mask is not None:
            mask = attention_mask.astype(bool)[:, None, None, :]
        return self.embeddings(input_ids).astype(self.dtype), mask


class CLIPModel(nnx.Module):
    """Image and text towers with CLIP's projections and logit scale.

    `vision_pooled` / `text_pooled` give the pooled outputs before projection (768-d / 512-d at
    ViT-B/32), which ScenarioCLIP puts its own heads on; `encode_image` / `encode_text` give the
    projected features of Hugging Face's `get_image_features` / `get_text_features`.
    """

    def __init__(self, config: CLIPConfig, *, dtype=jnp.float32, gradient_forms: str = "auto",
                 rngs: nnx.Rngs):
        self.config = config
        forms = cpu_gradients.resolve(gradient_forms)
        self.vision_model = VisionTransformer(config.vision, dtype=dtype, gradient_forms=forms,
                                              rngs=rngs)
        self.text_model = TextTransformer(config.text, dtype=dtype, gradient_forms=forms,
                                          rngs=rngs)
        self.visual_projection = nnx.Linear(config.vision.hidden_size, config.projection_dim,
                                            use_bias=False, rngs=rngs)
        self.text_projection = nnx.Linear(config.text.hidden_size, config.projection_dim,
                                          use_bias=False, rngs=rngs)
        self.logit_scale = nnx.Param(jnp.asarray(config.logit_scale_init_value, jnp.float32))

    def vision_pooled(self, pixels: Array) -> Array:
        """`[B, H, W, 3]` CLIP-normalised pixels -> post-LayerNorm class token `[B, width]`."""
        return self.vision_model.pooled(pixels)

    def text_pooled(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
        """`[B, L]` token ids -> final-LayerNorm EOT state `[B, width]`."""
        return self.text_model.pooled(input_ids, attention_mask)

    def encode_image(self, pixels: Array) -> Array:
        """Same numbers as Hugging Face `CLIPModel.get_image_features` (which takes NCHW)."""
        return self.visual_projection(self.vision_pooled(pixels))

    def encode_text(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
        """Same numbers as Hugging Face `CLIPModel.get_text_features`."""
        return self.text_projection(self.text_pooled(input_ids, attention_mask))

    def __call__(self, pixels: Array, input_ids: Array) -> tuple[Array, Array]:
        return self.encode_image(pixels), self.encode_text(input_ids)


def create(config: CLIPConfig | str = "ViT-B/32", *, seed: int = 0, dtype=jnp.float32,
           gradient_forms: str = "auto") -> CLIPModel:
    """A randomly initialised CLIP model from a config or a preset name (`PRESETS`)."""
    if isinstance(config, str):
        config = config_from_preset(config)
    return CLIPModel(config, dtype=dtype, gradient_forms=gradient_forms, rngs=nnx.Rngs(seed))


# --------------------------------------------------------------------------------------------
# Hugging Face import / export
# --------------------------------------------------------------------------------------------


def _config_from_hf(raw: Mapping[str, Any], where: str) -> CLIPConfig:
    if raw.get("model_type") not in ("clip", EXPORT_MODEL_TYPE, None) \
            or "vision_config" not in raw or "text_config" not in raw:
        raise CheckpointError(
            f"{where} is not a Hugging Face CLIPModel config (model_type="
            f"{raw.get('model_type')!r}, needs 'vision_config' and 'text_config')")

    return CLIPConfig(
        vision=hf_weights.config_fields(VisionConfig, raw["vision_config"] or {}),
        text=hf_weights.config_fields(TextConfig, raw["text_config"] or {}),
        projection_dim=raw.get("projection_dim", 512),
        logit_scale_init_value=raw.get("logit_scale_init_value", 2.6592),
    )


def hf_config(config: CLIPConfig) -> dict[str, Any]:
    """`config` as a Hugging Face `CLIPConfig` config.json dict."""
    vision = dataclasses.asdict(config.vision) | {"model_type": "clip_vision_model",
                                                   "projection_dim": config.projection_dim}
    text = dataclasses.asdict(config.text) | {"model_type": "clip_text_model",
                                               "projection_dim": config.projection_dim}
    return {
        "architectures": ["CLIPModel"],
        "model_type": "clip",
        "projection_dim": config.projection_dim,
        "logit_scale_init_value": config.logit_scale_init_value,
        "initializer_factor": 1.0,
        "vision_config": vision,
        "text_config": text,
    }


_config_to_hf = hf_config  # the old name (bench scripts)


def from_hf(path: str | os.PathLike, *, dtype=jnp.float32, gradient_forms: str = "auto",
            towers_only: bool = False) -> CLIPModel:
    """A CLIP model from a Hugging Face `CLIPModel` folder (`config.json` + `model.safetensors`).

    No torch needed. `dtype` is the compute dtype; parameters are always float32.
    Raises `CheckpointError` naming missing / unexpected keys and shape mismatches, and, unless
    `towers_only` (a caller that uses only `vision_model` / `text_model`), a ScenarioCLIP export
    (its projections are heads: `scenarioclip.from_export` reads them) or a folder whose
    `visual_projection` or `text_projection` is all zeros: `encode_image` / `encode_text` would
    give zero embeddings. With `towers_only` an export's CLIP projections are zeros.
    """
    model, heads = load_with_heads(path, dtype=dtype, gradient_forms=gradient_forms)
    if towers_only:
        return model
    if heads:
        raise CheckpointError(_export_message(Path(path)))
    zero = [name for name in PROJECTIONS if not jnp.any(getattr(model, name).kernel[...])]
    if zero:
        raise CheckpointError(_zero_projections_message(Path(path), zero))
    return model


def load_with_heads(path: str | os.PathLike, *, dtype=jnp.float32, gradient_forms: str = "auto"
                    ) -> tuple[CLIPModel, dict[str, np.ndarray]]:
    """The CLIP towers of a Hugging Face folder and the tensors of its ScenarioCLIP heads
    (`visual_projection.0.weight`, ... as in the file; none for a plain CLIP folder, whose
    projections load as usual). With heads, the model's CLIP projections are zeros."""
    forms = cpu_gradients.resolve(gradient_forms)
    heads: dict[str, np.ndarray] = {}

    def prepare(config: CLIPConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        plain = {f"{name}.weight" for name in PROJECTIONS}
        heads.update({k: v for k, v in tensors.items()
                      if k.split(".")[0] in PROJECTIONS and k not in plain})
        if not heads:
            return tensors
        widths = {"visual_projection": config.vision.hidden_size,
                  "text_projection": config.text.hidden_size}
        return {k: v for k, v in tensors.items() if k not in heads} | {
            f"{name}.weight": np.zeros((config.projection_dim, widths[name]), np.float32)
            for name in PROJECTIONS}

    model = hf_weights.load(
        path, _config_from_hf,
        lambda config: CLIPModel(config, dtype=dtype, gradient_forms=forms, rngs=nnx.Rngs(0)),
        kind=lambda config: "CLIP", prepare=prepare)
    return model, heads


def _export_message(folder: Path) -> str:
    """Why `from_hf` refuses a ScenarioCLIP export without `towers_only`, and what loads it."""
    return (f"{folder} is a ScenarioCLIP export (python -m sclaro_jax.train.export): its "
            "visual_projection / text_projection are Linear+LayerNorm heads, not CLIP's "
            "projection matrices. Load towers and heads with "
            "sclaro_jax.models.scenarioclip.from_export (python -m sclaro_jax.eval.rocs --model "
            "does), in PyTorch with transformers.AutoModel.from_pretrained(folder, "
            "trust_remote_code=True); towers_only=True loads the towers alone")


def _zero_projections_message(folder: Path, zero: list[str]) -> str:
    """Why a CLIP folder with all-zero projections (`zero`: their names) is refused; one that
    holds an older export's heads file is asked to be exported again."""
    old = (folder / HEADS_FILE).is_file()
    why = (f"It is a level exported by an older sclaro_jax, with its heads in {HEADS_FILE}: "
           "export it again with python -m sclaro_jax.train.export (the heads now live in "
           "model.safetensors, read by scenarioclip.from_export and by transformers.AutoModel "
           "with trust_remote_code=True)" if old else
           "Pass a CLIP folder with trained projections, or towers_only=True to load the "
           "towers alone")
    return (f"{folder}: {' and '.join(zero)} {'is' if len(zero) == 1 else 'are'} all zeros, so "
            "its image and text features (get_image_features / get_text_features) would be "
            f"zeros. {why}")


def to_hf(model: CLIPModel, path: str | os.PathLike) -> Path:
    """Write `model` as a folder `transformers.CLIPModel.from_pretrained(path)` loads (files
    with the umask's permissions)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(hf_config(model.config), indent=2)
    write_replacing(folder / "config.json", lambda f: f.write(text), text=True)
    hf_weights.save_safetensors(hf_state_dict(model), folder / WEIGHTS_NAME,
                                metadata={"format": "pt"})
    return folder
