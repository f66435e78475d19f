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

Preprocessing without transformers: `image_config` + `preprocess` (PIL resize to S x S, rescale,
normalise, as `SiglipImageProcessor`), `load_tokenizer` (`tokenizer.json` through `tokenizers`,
or SigLIP 1's `spiece.model` through `sentencepiece`; padded to max_length=64 and truncated, as
the SigLIP processors are called).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import string
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sclaro_jax.models.clip import (
    MLP, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, CheckpointError, Encoder, PatchEmbedding,
    TextEmbeddings, _layer_norm, _read_safetensors, load_hf_state, patchify)

Array = jax.Array

__all__ = ["SiglipVisionConfig", "SiglipTextConfig", "SiglipConfig", "PRESETS", "SiglipModel",
           "create", "from_hf", "config_from_hf", "CheckpointError", "ImageConfig", "image_config",
           "preprocess", "load_tokenizer", "resize_weights"]

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig:
    """Field names follow transformers' `SiglipVisionConfig` / `Siglip2VisionConfig`.

    `num_patches` is set for SigLIP 2 NaFlex (the position table's size); SigLIP uses
    `image_size` and has `(image_size // patch_size) ** 2` positions."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
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
class SiglipTextConfig:
    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 64
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
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


def _pick(cls, sub: Mapping[str, Any]):
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in sub.items() if k in known and v is not None})


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
    cfg = SiglipConfig(_pick(SiglipVisionConfig, vision), _pick(SiglipTextConfig,
                                                                raw["text_config"]), model_type)
    if not cfg.vision.vision_use_head:
        raise CheckpointError(f"{where}: vision_use_head=false (no pooled image feature) is not "
                              "supported")
    return cfg


# --------------------------------------------------------------------------------------------
# Layers (attention, MLP, encoder, LayerNorm and text embeddings are clip.py's)
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

    def __init__(self, cfg: SiglipVisionConfig, *, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.probe = nnx.Param(jax.random.normal(rngs.params(), (1, 1, cfg.hidden_size)))
        self.attention = MultiheadAttention(cfg.hidden_size, cfg.num_attention_heads,
                                            dtype=dtype, rngs=rngs)
        self.layernorm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype,
                       rngs=rngs)

    def __call__(self, x: Array) -> Array:
        probe = jnp.broadcast_to(self.probe[...], (x.shape[0], 1, x.shape[-1]))
        h = self.attention(probe, x).astype(jnp.float32)
        h = h + self.mlp(self.layernorm(h).astype(self.dtype)).astype(jnp.float32)
        return h[:, 0]


class VisionTransformer(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embeddings = VisionEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.post_layernorm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)
        self.head = AttentionPoolingHead(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, pixels: Array) -> tuple[Array, Array]:
        """NHWC normalised pixels -> (post-LayerNorm last hidden state, pooled) in float32."""
        x = self.encoder(self.embeddings(pixels).astype(self.dtype)).astype(jnp.float32)
        x = self.post_layernorm(x)
        return x, self.head(x.astype(self.dtype))


class TextTransformer(nnx.Module):
    def __init__(self, cfg: SiglipTextConfig, *, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embeddings = TextEmbeddings(cfg, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.final_layer_norm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)
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

    def __init__(self, config: SiglipConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.text_model = TextTransformer(config.text, dtype=dtype, rngs=rngs)
        self.vision_model = VisionTransformer(config.vision, dtype=dtype, rngs=rngs)
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


def create(config: SiglipConfig | str, *, seed: int = 0, dtype=jnp.float32) -> SiglipModel:
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"unknown SigLIP preset {config!r}; known: {sorted(PRESETS)}")
        config = PRESETS[config]
    return SiglipModel(config, dtype=dtype, rngs=nnx.Rngs(seed))


# --------------------------------------------------------------------------------------------
# Hugging Face import
# --------------------------------------------------------------------------------------------


def _read_weights(folder: Path) -> dict[str, np.ndarray]:
    index = folder / WEIGHTS_INDEX_NAME
    if not (folder / WEIGHTS_NAME).exists() and index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{index} is not a safetensors index ({err})") from None
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
    try:
        return _read_safetensors(folder)
    except CheckpointError:
        raise
    except Exception as err:  # a truncated / corrupt file
        raise CheckpointError(f"{folder}: cannot read the safetensors weights ({err})") from err


def from_hf(path: str | os.PathLike, *, dtype=jnp.float32) -> SiglipModel:
    """A SigLIP / SigLIP 2 model from a Hugging Face folder (config.json + model.safetensors, or a
    sharded model.safetensors.index.json). Dispatches on config.json's model_type ("siglip",
    "siglip2"). No torch. Raises `CheckpointError` naming the file and any missing / unexpected
    keys or shape mismatches."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{config_file} is not valid JSON ({err})") from None
    config = config_from_hf(raw, str(config_file))
    tensors = _read_weights(folder)
    model = nnx.eval_shape(lambda: SiglipModel(config, dtype=dtype, rngs=nnx.Rngs(0)))
    kind = "Siglip2Model" if config.model_type == "siglip2" else "SiglipModel"
    load_hf_state(model, tensors, where=str(folder), kind=kind)
    return model


# --------------------------------------------------------------------------------------------
# Preprocessing
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """What `SiglipImageProcessor` does: resize to `size` (H, W) with PIL `resample`, rescale,
    normalise. No crop."""

    size: tuple[int, int] = (224, 224)
    resample: int = 3  # PIL.Image.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)


def image_config(path: str | os.PathLike, size: int | None = None) -> ImageConfig:
    """`ImageConfig` from a folder's preprocessor_config.json.

    SigLIP: `size` {"height", "width"} from the file. SigLIP 2 NaFlex (`max_num_patches`,
    `patch_size`, no fixed size): square images of `size` pixels, by default the largest square
    grid within `max_num_patches` (256 patches of 16 -> 256 px), which is what
    `Siglip2ImageProcessor` gives a square image. `size` overrides either."""
    file = Path(path) / "preprocessor_config.json"
    if not file.is_file():
        raise CheckpointError(f"{Path(path)} has no preprocessor_config.json")
    raw = json.loads(file.read_text())
    if size is not None:
        hw = (int(size), int(size))
    elif "max_num_patches" in raw:
        patch = int(raw.get("patch_size", 16))
        grid = int(np.floor(np.sqrt(raw["max_num_patches"])))
        hw = (grid * patch, grid * patch)
    else:
        s = raw.get("size") or {}
        if "height" in s and "width" in s:
            hw = (int(s["height"]), int(s["width"]))
        elif "shortest_edge" in s:
            hw = (int(s["shortest_edge"]),) * 2
        else:
            raise CheckpointError(f"{file}: no usable 'size' ({s!r})")
    defaults = ImageConfig()
    return ImageConfig(
        size=hw,
        resample=int(raw.get("resample", defaults.resample)),
        do_resize=bool(raw.get("do_resize", True)),
        do_rescale=bool(raw.get("do_rescale", True)),
        rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
        do_normalize=bool(raw.get("do_normalize", True)),
        image_mean=tuple(float(x) for x in raw.get("image_mean", defaults.image_mean)),
        image_std=tuple(float(x) for x in raw.get("image_std", defaults.image_std)),
    )


def preprocess(images: Sequence[np.ndarray], cfg: ImageConfig) -> np.ndarray:
    """uint8 `[H, W, 3]` images -> float32 `[B, S, S, 3]` model input (NHWC)."""
    from PIL import Image

    out = []
    for img in images:
        img = np.asarray(img)
        if img.ndim == 2:
            img = np.repeat(img[..., None], 3, axis=-1)
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] not in (3, 4):
            raise ValueError(f"expected uint8 [H, W, 3] images, got {img.dtype} {img.shape}")
        img = img[..., :3]
        if cfg.do_resize and img.shape[:2] != cfg.size:
            img = np.asarray(Image.fromarray(img).resize(cfg.size[::-1], resample=cfg.resample))
        x = img.astype(np.float32)
        if cfg.do_rescale:
            x = x * np.float32(cfg.rescale_factor)
        if cfg.do_normalize:
            x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std,
                                                                          np.float32)
        out.append(x)
    return np.stack(out).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _canonicalize(text: str, lower: bool) -> str:
    """`SiglipTokenizer.canonicalize_text`: lowercase, drop ASCII punctuation, squeeze spaces.
    The SentencePiece SigLIP tokenizer does this in Python, outside any tokenizer.json."""
    if lower:
        text = text.lower()
    text = text.translate(str.maketrans("", "", string.punctuation))
    return re.sub(r"\s+", " ", text).strip()


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _text_max_length(folder: Path, max_length: int | None) -> int:
    """`max_length`, or 64 capped by the text tower's `max_position_embeddings`."""
    if max_length is None and (folder / "config.json").is_file():
        raw = json.loads((folder / "config.json").read_text())
        positions = (raw.get("text_config") or {}).get("max_position_embeddings")
        if positions:
            max_length = min(64, int(positions))
    return max_length or 64


def _sentencepiece_tokenizer(folder: Path, max_length: int | None
                             ) -> Callable[[Sequence[str]], np.ndarray]:
    """transformers' `SiglipTokenizer` ids from `spiece.model`, with the `sentencepiece` package,
    step for step as transformers runs it (legacy mode, its default): `"\u2581" + text`; split
    around the special tokens (eos / unk / pad strings, whitespace beside them dropped); each
    other piece canonicalised (lowercase unless `do_lower_case` is false, ASCII punctuation
    removed, whitespace squeezed) and encoded as `unk + piece` with the unk's own pieces cut
    off; a lone leading "\u2581" before a special token dropped; then cut to `max_length - 1`,
    `</s>` appended, padded with the pad id to `max_length`."""
    try:
        import sentencepiece
    except ImportError:
        raise CheckpointError(
            f"{folder} has a SentencePiece tokenizer (spiece.model) and no tokenizer.json; "
            "reading it needs the sentencepiece package: pip install 'sclaro-jax[eval]'") from None
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
    tcfg_file = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_file.read_text()) if tcfg_file.is_file() else {}
    names = {key: _token_str(tcfg.get(key)) or default for key, default in
             (("eos_token", "</s>"), ("unk_token", "<unk>"), ("pad_token", "</s>"))}
    special = {}
    for key, token in names.items():
        i = sp.piece_to_id(token)
        if sp.id_to_piece(i) != token:
            raise CheckpointError(f"{folder}/spiece.model has no {key} {token!r}")
        special[token] = i
    unk, eos, pad = names["unk_token"], special[names["eos_token"]], special[names["pad_token"]]
    unk_pieces = len(sp.encode(unk, out_type=str))
    lower = bool(tcfg.get("do_lower_case", True))
    split = re.compile(r"\s*(" + "|".join(re.escape(t) for t in sorted(special, key=len,
                                                                       reverse=True)) + r")\s*")
    length = _text_max_length(folder, max_length)

    def pieces(text: str) -> list[str]:
        out: list[str] = []
        for part in split.split("\u2581" + text.replace("\u2581", " ")):
            if part in special:
                out.append(part)
            elif part:
                encoded = sp.encode(unk + _canonicalize(part, lower), out_type=str)
                out.extend(encoded[unk_pieces:] if len(encoded) >= unk_pieces else encoded)
        if len(out) > 1 and out[0] == "\u2581" and out[1] in special:
            out = out[1:]
        return out

    def encode(text: str) -> list[int]:
        ids = [special.get(p, sp.piece_to_id(p)) for p in pieces(text)][:length - 1] + [eos]
        return ids + [pad] * (length - len(ids))

    def tokenize(texts: Sequence[str] | str) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        return np.asarray([encode(t) for t in texts], np.int32).reshape(len(texts), length)

    return tokenize


def load_tokenizer(path: str | os.PathLike, max_length: int | None = None
                   ) -> Callable[[Sequence[str]], np.ndarray]:
    """`texts -> int32 [N, max_length]`, the ids of the HF tokenizer called with
    `padding="max_length", max_length=64, truncation=True` (SigLIP's convention).

    A folder with `spiece.model` and no `tokenizer.json` (SigLIP 1) goes through
    `_sentencepiece_tokenizer`. Otherwise: reads `tokenizer.json` (fast-tokenizer file) with
    `tokenizers`; its normaliser, pre-tokeniser
    and post-processor (special tokens) apply as written. On top, from tokenizer_config.json:
    pad token, padding / truncation side, explicit `add_bos_token` / `add_eos_token` (which
    transformers turns into the post-processor), and the class-specific text handling
    transformers adds in Python: `Siglip2Tokenizer` (model_type siglip2) lowercases,
    `SiglipTokenizer` canonicalises (lowercase, strip punctuation). `max_length` defaults to 64,
    capped by the text tower's `max_position_embeddings`.
    """
    from tokenizers import Tokenizer, normalizers, processors

    folder = Path(path)
    file = folder / "tokenizer.json"
    if not file.is_file():
        if (folder / "spiece.model").is_file():  # SigLIP 1 folders: SentencePiece only
            return _sentencepiece_tokenizer(folder, max_length)
        raise CheckpointError(
            f"{folder} has neither tokenizer.json (a fast-tokenizer file, as SigLIP 2 folders "
            "ship) nor spiece.model (SigLIP 1's SentencePiece model): copy the model's tokenizer "
            "files into the folder")
    tok = Tokenizer.from_file(str(file))
    tcfg_file = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_file.read_text()) if tcfg_file.is_file() else {}
    model_type = None
    if (folder / "config.json").is_file():
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    max_length = _text_max_length(folder, max_length)

    cls = tcfg.get("tokenizer_class")
    canonical = cls == "SiglipTokenizer"
    if cls == "Siglip2Tokenizer" or (model_type == "siglip2" and cls in (None, "GemmaTokenizer",
                                                                         "GemmaTokenizerFast")):
        norm = tok.normalizer
        tok.normalizer = (normalizers.Lowercase() if norm is None
                          else normalizers.Sequence([normalizers.Lowercase(), norm]))

    def tid(name: str) -> tuple[str, int] | None:
        token = _token_str(tcfg.get(name))
        if token is None:
            return None
        i = tok.token_to_id(token)
        if i is None:
            raise CheckpointError(f"{tcfg_file}: {name} {token!r} is not in tokenizer.json")
        return token, i

    if "add_bos_token" in tcfg or "add_eos_token" in tcfg:  # as TokenizersBackend rebuilds it
        bos = tid("bos_token") if tcfg.get("add_bos_token") else None
        eos = tid("eos_token") if tcfg.get("add_eos_token") else None
        single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"]
                          + ([f"{eos[0]}:0"] if eos else []))
        pair = single + " " + " ".join(([f"{bos[0]}:1"] if bos else []) + ["$B:1"]
                                       + ([f"{eos[0]}:1"] if eos else []))
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t])

    pad = tid("pad_token") or tid("eos_token")
    if pad is None:
        raise CheckpointError(f"{folder}: no pad_token in tokenizer_config.json")
    tok.enable_truncation(max_length, direction=tcfg.get("truncation_side", "right"))
    tok.enable_padding(direction=tcfg.get("padding_side", "right"), pad_id=pad[1],
                       pad_token=pad[0], length=max_length)
    lower = bool(tcfg.get("do_lower_case", True))

    def tokenize(texts: Sequence[str] | str) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        texts = [_canonicalize(t, lower) if canonical else t for t in texts]
        return np.asarray([e.ids for e in tok.encode_batch(list(texts))], np.int32).reshape(
            len(texts), max_length)

    tokenize.max_length = max_length  # type: ignore[attr-defined]
    tokenize.pad_id = pad[1]  # type: ignore[attr-defined]
    return tokenize
