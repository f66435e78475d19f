"""SigLIP and SigLIP 2 image and text towers as Flax NNX modules, loaded from Hugging Face folders.

Supported (no torch, no transformers needed at run time):

* `SiglipModel` folders (config.json `model_type: "siglip"`): the SigLIP checkpoints such as
  google/siglip-so400m-patch14-384, and the fixed-resolution SigLIP 2 checkpoints such as
  google/siglip2-so400m-patch16-384 (also `SiglipModel` folders). Images must be
  `image_size x image_size` (no position-embedding interpolation, as `get_image_features`
  without `interpolate_pos_encoding`).
* `Siglip2Model` NaFlex folders (`model_type: "siglip2"`): the patch embedding is a Linear over
  flattened patches and the position table (a `sqrt(num_patches)` square grid) is resized with
  bilinear + antialias interpolation to the image's patch grid, exactly as Hugging Face does.
  Static shapes: one patch grid per call; every image of a batch is resized to the same `H x W`
  (multiples of the patch size, square by default: see `image_config`), so there is no padding
  and `pixel_attention_mask` is all ones. The pixels are `[B, H, W, 3]` and are patchified here in
  the order `Siglip2ImageProcessor` uses: grid row-major, each patch as (row, column, channel).

Architecture (both): patch embedding + learned position embedding, pre-LayerNorm encoder
(`gelu_pytorch_tanh` MLP, bidirectional attention), `post_layernorm`, then a multi-head attention
pooling head (learned probe, `nn.MultiheadAttention`, LayerNorm, MLP residual) whose output is the
image feature. Text: token + position embedding, bidirectional encoder, `final_layer_norm`, the
LAST token's state (padding included, SigLIP's convention with `padding="max_length"`) through a
Linear `head`. `logit_scale` / `logit_bias`: `logits = exp(scale) * cos + bias`.

`encode_image` / `encode_text` equal transformers' `get_image_features(...).pooler_output` /
`get_text_features(...).pooler_output`. Parameters are float32; `dtype` (e.g. bfloat16) sets
the matmul compute dtype; LayerNorms, softmax and outputs are float32.

So400m shapes (`PRESETS`, random init; real configs come from config.json):
  siglip-so400m-patch14-384:  vision width 1152, 27 layers, MLP 4304, 16 heads, patch 14 at 384
                              (27 x 27 = 729 patches); text width 1152 (27 layers, MLP 4304,
                              16 heads, 64 positions, vocab 32000).
  siglip2-so400m-patch16-384: the same towers with patch 16 at 384 (24 x 24 = 576 patches), text
                              vocab 256000 (Gemma tokenizer).

Preprocessing without transformers (`siglip_inputs`, re-exported here): `image_config` +
`preprocess` (PIL resize to S x S, rescale, normalise, as `SiglipImageProcessor`),
`load_tokenizer` (`tokenizer.json` through `tokenizers`, or SigLIP 1's `spiece.model` through
`sentencepiece`; padded to max_length=64 and truncated, as the SigLIP processors are called).
`gradient_forms` as in `clip` (`cpu_gradients.resolve`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sclaro_jax.models import cpu_gradients, hf_weights
from sclaro_jax.models.hf_weights import CheckpointError
from sclaro_jax.models.layers import (
    MLP, Encoder, EncoderConfig, PatchEmbedding, TextEmbeddings, layer_norm, patchify)
from sclaro_jax.models.siglip_inputs import (  # noqa: F401  (re-exported: siglip.preprocess, ...)
    ImageConfig, image_config, load_tokenizer, preprocess)

Array = jax.Array

__all__ = ["SiglipVisionConfig", "SiglipTextConfig", "SiglipConfig", "PRESETS", "SiglipModel",
           "create", "from_hf", "config_from_hf", "CheckpointError", "ImageConfig", "image_config",
           "preprocess", "load_tokenizer", "resize_weights"]

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SiglipEncoderConfig(EncoderConfig):
    """What both SigLIP towers change in the encoder defaults."""

    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig(_SiglipEncoderConfig):
    """Field names follow transformers' `SiglipVisionConfig` / `Siglip2VisionConfig`.

    `num_patches` is set for SigLIP 2 NaFlex (the position table's size); SigLIP uses
    `image_size` and has `(image_size // patch_size) ** 2` positions."""

    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    vision_use_head: bool = True
    num_patches: int | None = None

    @property
    def naflex(self) -> bool:
        return self.num_patches is not None

    @property
    def num_positions(self) -> int:
        return self.num_patches if self.naflex else (self.image_size // self.patch_size) ** 2

    @property
    def position_grid(self) -> int:
        return int(round(self.num_positions ** 0.5))


@dataclasses.dataclass(frozen=True)
class SiglipTextConfig(_SiglipEncoderConfig):
    vocab_size: int = 32000
    max_position_embeddings: int = 64
    projection_size: int | None = None  # None: hidden_size

    @property
    def out_size(self) -> int:
        return self.projection_size or self.hidden_size


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    vision: SiglipVisionConfig = dataclasses.field(default_factory=SiglipVisionConfig)
    text: SiglipTextConfig = dataclasses.field(default_factory=SiglipTextConfig)
    model_type: str = "siglip"  # or "siglip2" (NaFlex)


def _so400m_vision(patch: int, image: int) -> SiglipVisionConfig:
    return SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                              num_attention_heads=16, patch_size=patch, image_size=image)


def _so400m_text(vocab: int) -> SiglipTextConfig:
    return SiglipTextConfig(vocab_size=vocab, hidden_size=1152, intermediate_size=4304,
                            num_hidden_layers=27, num_attention_heads=16)


PRESETS: dict[str, SiglipConfig] = {
    "siglip-so400m-patch14-384": SiglipConfig(_so400m_vision(14, 384), _so400m_text(32000)),
    "siglip2-so400m-patch16-384": SiglipConfig(_so400m_vision(16, 384), _so400m_text(256000)),
}


def _square(value, name: str, where: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise CheckpointError(f"{where}: non-square {name} {value} is not supported")
        value = value[0]
    return int(value)


def config_from_hf(raw: Mapping[str, Any], where: str = "config.json") -> SiglipConfig:
    """A `SiglipConfig` from a transformers config.json dict (model_type siglip or siglip2)."""
    model_type = raw.get("model_type")
    if model_type not in ("siglip", "siglip2") or not raw.get("vision_config") \
            or not raw.get("text_config"):
        raise CheckpointError(
            f"{where} is not a Hugging Face SiglipModel / Siglip2Model config (model_type="
            f"{model_type!r}; needs model_type 'siglip' or 'siglip2' with 'vision_config' and "
            "'text_config')")
    vision = dict(raw["vision_config"])
    vision["patch_size"] = _square(vision.get("patch_size", 16), "patch_size", where)
    if model_type == "siglip2":
        vision.setdefault("num_patches", 256)
        vision.pop("image_size", None)
        grid = int(round(vision["num_patches"] ** 0.5))
        if grid * grid != vision["num_patches"]:
            raise CheckpointError(f"{where}: num_patches {vision['num_patches']} is not a square")
    else:
        vision.pop("num_patches", None)
        vision["image_size"] = _square(vision.get("image_size", 224), "image_size", where)
    cfg = SiglipConfig(hf_weights.config_fields(SiglipVisionConfig, vision),
                       hf_weights.config_fields(SiglipTextConfig, raw["text_config"]), model_type)
    if not cfg.vision.vision_use_head:
        raise CheckpointError(f"{where}: vision_use_head=false (no pooled image feature) is not "
                              "supported")
    return cfg


# --------------------------------------------------------------------------------------------
# Layers (attention, MLP, encoder, LayerNorm and text embeddings are layers.py's)
# --------------------------------------------------------------------------------------------


class ConvPatchEmbedding(PatchEmbedding):
    """SigLIP's stride-p Conv2d patch embedding, with bias (HF `patch_embedding.weight/.bias`)."""

    def __init__(self, patch: int, channels: int, dim: int, *, dtype, rngs: nnx.Rngs):
        super().__init__(patch, channels, dim, dtype=dtype, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, pixels: Array) -> Array:
        return super().__call__(pixels) + self.bias[...].astype(self.dtype)


class LinearPatchEmbedding(nnx.Module):
    """SigLIP 2 NaFlex: a Linear (with bias) over patches flattened as (row, column, channel).

    `kernel` [p*p*C, D] / `bias` are HF `patch_embedding.weight` (transposed) / `.bias`."""

    def __init__(self, patch: int, channels: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.patch = patch
        self.dtype = dtype
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (patch * patch * channels, dim), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, pixels: Array) -> Array:
        patches = patchify(pixels, self.patch).astype(self.dtype)
        return patches @ self.kernel[...].astype(self.dtype) + self.bias[...].astype(self.dtype)


def resize_weights(grid: int, size: int) -> np.ndarray:
    """`[size, grid]` weights of `F.interpolate(mode="bilinear", align_corners=False,
    antialias=True)` along one axis, computed as transformers' `Siglip2VisionEmbeddings`
    computes them (float32)."""
    f32 = np.float32
    scale = f32(grid) / f32(size)
    support = max(scale, f32(1.0))
    center = (np.arange(size, dtype=f32) + f32(0.5)) * scale - f32(0.5)
    source = np.arange(grid, dtype=f32)
    weights = np.maximum(f32(1) - np.abs(source[None, :] - center[:, None]) / support, f32(0))
    return (weights / weights.sum(-1, keepdims=True)).astype(f32)


class VisionEmbeddings(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, dtype, rngs: nnx.Rngs):
        self.naflex = cfg.naflex
        self.patch = cfg.patch_size
        self.grid = cfg.position_grid
        embed = LinearPatchEmbedding if cfg.naflex else ConvPatchEmbedding
        self.patch_embedding = embed(cfg.patch_size, cfg.num_channels, cfg.hidden_size,
                                     dtype=dtype, rngs=rngs)
        self.position_embedding = nnx.Embed(cfg.num_positions, cfg.hidden_size, rngs=rngs)

    def __call__(self, pixels: Array) -> Array:
        _, h, w, _ = pixels.shape
        if self.naflex and (h % self.patch or w % self.patch):
            raise ValueError(f"image size {h}x{w} is not a multiple of the patch size "
                             f"{self.patch}")
        gh, gw = h // self.patch, w // self.patch
        # SigLIP's "valid" stride-p conv drops the last h % p rows / w % p columns (384 px at
        # patch 14: 27 patches, 6 px unused).
        pixels = pixels[:, :gh * self.patch, :gw * self.patch]
        table = self.position_embedding.embedding[...].astype(jnp.float32)
        if (gh, gw) != (self.grid, self.grid):
            if not self.naflex:
                raise ValueError(
                    f"a {gh}x{gw} patch grid but the position table is {self.grid}x{self.grid}: "
                    f"images must be {self.grid * self.patch}x{self.grid * self.patch} (up to "
                    f"{self.patch - 1} more pixels are ignored)")
            # Static grid: the resize is one constant [gh*gw, grid*grid] matrix.
            weights = np.einsum("ar,bc->abrc", resize_weights(self.grid, gh),
                                resize_weights(self.grid, gw)).reshape(gh * gw, -1)
            table = jnp.asarray(weights) @ table
        return self.patch_embedding(pixels).astype(jnp.float32) + table


class MultiheadAttention(nnx.Module):
    """`torch.nn.MultiheadAttention` (batch_first) with its packed `in_proj_weight` [3d, d]
    kept in PyTorch layout, so the Hugging Face keys load unchanged."""

    def __init__(self, dim: int, heads: int, *, dtype, rngs: nnx.Rngs):
        if dim % heads:
            raise ValueError(f"hidden size {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.dtype = dtype
        init = jax.nn.initializers.xavier_uniform()
        self.in_proj_weight = nnx.Param(init(rngs.params(), (3 * dim, dim), jnp.float32))
        self.in_proj_bias = nnx.Param(jnp.zeros((3 * dim,), jnp.float32))
        self.out_proj = nnx.Linear(dim, dim, dtype=dtype, rngs=rngs)

    def __call__(self, queries: Array, x: Array) -> Array:
        b, m, d = queries.shape
        head_dim = d // self.heads
        w = self.in_proj_weight[...].astype(self.dtype)
        bias = self.in_proj_bias[...].astype(self.dtype)

        def proj(t, i):  # [b, n, d] -> [b, heads, n, head_dim]
            t = t.astype(self.dtype) @ w[i * d:(i + 1) * d].T + bias[i * d:(i + 1) * d]
            return t.reshape(b, t.shape[1], self.heads, head_dim).transpose(0, 2, 1, 3)

        q = proj(queries, 0) * jnp.asarray(head_dim**-0.5, self.dtype)
        k, v = proj(x, 1), proj(x, 2)
        logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
        weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bhkd->bhqd", weights, v)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, m, d))


class AttentionPoolingHead(nnx.Module):
    """SigLIP's MAP head: a learned probe attends to all tokens, then x + MLP(LayerNorm(x))."""

    def __init__(self, cfg: SiglipVisionConfig, *, dtype, gradient_forms: str, rngs: nnx.Rngs):
        self.dtype = dtype
        self.probe = nnx.Param(jax.random.normal(rngs.params(), (1, 1, cfg.hidden_size)))
        self.attention = MultiheadAttention(cfg.hidden_size, cfg.num_attention_heads,
                                            dtype=dtype, rngs=rngs)
        self.layernorm = layer_norm(cfg, gradient_forms=gradient_forms, rngs=rngs)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype,
                       gradient_forms=gradient_forms, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        probe = jnp.broadcast_to(self.probe[...], (x.shape[0], 1, x.shape[-1]))
        h = self.attention(probe, x).astype(jnp.float32)
        h = h + self.mlp(self.layernorm(h).astype(self.dtype)).astype(jnp.float32)
        return h[:, 0]


class VisionTransformer(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, dtype, gradient_forms: str, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embeddings = VisionEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, gradient_forms=gradient_forms, rngs=rngs)
        self.post_layernorm = layer_norm(cfg, gradient_forms=gradient_forms, rngs=rngs)
        self.head = AttentionPoolingHead(cfg, dtype=dtype, gradient_forms=gradient_forms,
                                         rngs=rngs)

    def __call__(self, pixels: Array) -> tuple[Array, Array]:
        """NHWC normalised pixels -> (post-LayerNorm last hidden state, pooled) in float32."""
        x = self.encoder(self.embeddings(pixels).astype(self.dtype)).astype(jnp.float32)
        x = self.post_layernorm(x)
        return x, self.head(x.astype(self.dtype))


class TextTransformer(nnx.Module):
    def __init__(self, cfg: SiglipTextConfig, *, dtype, gradient_forms: str, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embeddings = TextEmbeddings(cfg, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, gradient_forms=gradient_forms, rngs=rngs)
        self.final_layer_norm = layer_norm(cfg, gradient_forms=gradient_forms, rngs=rngs)
        self.head = nnx.Linear(cfg.hidden_size, cfg.out_size, dtype=dtype, rngs=rngs)

    def __call__(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
        """`[B, L]` ids -> head(final LayerNorm state of the last position) `[B, out]` float32.

        The last layer computes only the last token (same numbers, less work)."""
        b, n = input_ids.shape
        mask = None
        if attention_mask is not None:  # key padding, as transformers' bidirectional mask
            mask = jnp.broadcast_to(attention_mask.astype(bool)[:, None, None, :], (b, 1, n, n))
        x = self.embeddings(input_ids).astype(self.dtype)
        last = jnp.full((b,), n - 1, jnp.int32)
        x = self.encoder(x, mask, keep=last)[:, 0].astype(jnp.float32)
        return self.head(self.final_layer_norm(x).astype(self.dtype)).astype(jnp.float32)


class SiglipModel(nnx.Module):
    """SigLIP / SigLIP 2 image and text towers with `logit_scale` and `logit_bias`."""

    def __init__(self, config: SiglipConfig, *, dtype=jnp.float32, gradient_forms: str = "auto",
                 rngs: nnx.Rngs):
        self.config = config
        towers = dict(dtype=dtype, gradient_forms=cpu_gradients.resolve(gradient_forms), rngs=rngs)
        self.text_model = TextTransformer(config.text, **towers)
        self.vision_model = VisionTransformer(config.vision, **towers)
        self.logit_scale = nnx.Param(jnp.zeros((1,), jnp.float32))
        self.logit_bias = nnx.Param(jnp.zeros((1,), jnp.float32))

    def encode_image(self, pixels: Array) -> Array:
        """`[B, H, W, 3]` float32 normalised pixels -> `[B, width]`, the pooled output of
        `get_image_features`. SigLIP: H = W = image_size (H // patch = the position grid);
        SigLIP 2 NaFlex: any multiple of the patch size (one grid for the batch)."""
        return self.vision_model(pixels)[1]

    def encode_text(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
        """`[B, L]` ids (padded to max_length as SigLIP is used) -> `[B, projection_size]`."""
        return self.text_model(input_ids, attention_mask)

    def logits(self, image_features: Array, text_features: Array) -> Array:
        """`logits_per_image` `[B_img, B_text]`: exp(logit_scale) * cosine + logit_bias."""
        img = image_features / jnp.linalg.norm(image_features, axis=-1, keepdims=True)
        txt = text_features / jnp.linalg.norm(text_features, axis=-1, keepdims=True)
        return img @ txt.T * jnp.exp(self.logit_scale[...]) + self.logit_bias[...]


def create(config: SiglipConfig | str, *, seed: int = 0, dtype=jnp.float32,
           gradient_forms: str = "auto") -> SiglipModel:
    """A randomly initialised SigLIP model from a config or a preset name (`PRESETS`)."""
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"unknown SigLIP preset {config!r}; known: {sorted(PRESETS)}")
        config = PRESETS[config]
    return SiglipModel(config, dtype=dtype, gradient_forms=gradient_forms, rngs=nnx.Rngs(seed))


# --------------------------------------------------------------------------------------------
# Hugging Face import
# --------------------------------------------------------------------------------------------


def from_hf(path: str | os.PathLike, *, dtype=jnp.float32, gradient_forms: str = "auto"
            ) -> SiglipModel:
    """A SigLIP / SigLIP 2 model from a Hugging Face folder (config.json + model.safetensors, or a
    sharded model.safetensors.index.json). Dispatches on config.json's model_type ("siglip",
    "siglip2"). No torch. Raises `CheckpointError` naming the file and any missing / unexpected
    keys or shape mismatches."""
    forms = cpu_gradients.resolve(gradient_forms)
    return hf_weights.load(
        path, config_from_hf,
        lambda config: SiglipModel(config, dtype=dtype, gradient_forms=forms, rngs=nnx.Rngs(0)),
        kind=lambda config: "Siglip2Model" if config.model_type == "siglip2" else "SiglipModel")
