"""CLIP image and text towers as Flax NNX modules, with Hugging Face weight import and export.

The module tree mirrors Hugging Face's `CLIPModel` name for name (`vision_model.encoder.layers.3.
self_attn.q_proj`, ...), so the one key map in `_hf_key` is a rename of leaf names plus the two
transposes PyTorch layouts need. `from_hf` reads `config.json` + `model.safetensors` with numpy
(no torch), `to_hf` writes a folder `transformers.CLIPModel.from_pretrained` loads.

Numerics: parameters are float32 (`param_dtype`); `dtype` sets the compute dtype of the matmuls
(float32 by default, bfloat16 for training on GPU). LayerNorms, attention softmax and the pooled
outputs are computed in float32 whatever `dtype` is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Vision tower sizes; field names follow Hugging Face `CLIPVisionConfig`."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    image_size: int = 224
    patch_size: int = 32
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Text tower sizes; field names follow Hugging Face `CLIPTextConfig`.

    `eos_token_id` decides EOT pooling exactly as Hugging Face does: the legacy value 2 (found in
    the OpenAI checkpoints' configs) pools at `argmax(input_ids)`, any other value at the first
    position holding that id.
    """

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
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


def config_from_preset(name: str) -> CLIPConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown CLIP preset {name!r}; known: {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


def quick_gelu(x: Array) -> Array:
    """OpenAI CLIP's activation: x * sigmoid(1.702 x)."""
    return x * jax.nn.sigmoid(1.702 * x)


# CPU gradient forms. Two rewrites of the backward pass, with the same numbers, for XLA:CPU:
# - Cotangent barriers. The residual-stream gradient of each block is an element-wise sum of the
#   blocks above it; XLA:CPU's fusion duplicates that chain into each consumer (the transposing
#   copies feeding the weight-gradient matmuls) instead of storing it, so a 12-block tower
#   recomputes it about quadratically. `residual` is an identity whose backward passes the
#   gradient through a conditional with identical branches, which XLA cannot fuse across: the
#   gradient is written once per residual add. The same barrier on each `Linear`'s output
#   stores its gradient once for the weight-gradient and input-gradient matmuls (otherwise the
#   MLP's activation derivative is recomputed inside a transposing copy, ~40 M elements/s).
# - Column sums as matmuls. Bias and LayerNorm scale/bias gradients sum over every row; XLA:CPU
#   splits such sums into reduce-windows about half as fast as a matmul with a ones vector.
# Measured on the ViT-B/32 training step in bench/README.md ("CPU gradient forms"). Off on GPUs
# and TPUs, whose fusion differs and where a conditional costs a host round trip. None = on where
# the default backend is the CPU; True / False force it (benchmarks, tests).
CPU_GRADIENT_FORMS: bool | None = None


def _cpu_forms_on() -> bool:
    if CPU_GRADIENT_FORMS is None:
        return jax.default_backend() == "cpu"
    return CPU_GRADIENT_FORMS


def _materialise(g: Array) -> Array:
    # The predicate reads the data, so XLA cannot fold the conditional away; both branches
    # return the gradient unchanged.
    keep = jnp.isfinite(g.reshape(-1)[0])
    return jax.lax.cond(keep, lambda t: t, lambda t: t * 1, g)


@jax.custom_vjp
def _store_gradient(x: Array) -> Array:
    return x


def _store_gradient_fwd(x: Array):
    return x, None


def _store_gradient_bwd(_, g: Array):
    return (_materialise(g),)


_store_gradient.defvjp(_store_gradient_fwd, _store_gradient_bwd)


def _column_sum(t: Array, dtype) -> Array:
    # A sum over every row as a matmul with a ones vector: XLA:CPU runs such sums as split
    # reduce-windows, about twice as slow as the GEMV.
    rows = t.reshape(-1, t.shape[-1])
    ones = jnp.ones(rows.shape[0], rows.dtype)
    return jnp.dot(ones, rows, preferred_element_type=jnp.float32).astype(dtype)


@jax.custom_vjp
def _add_bias(y: Array, bias: Array) -> Array:
    return y + bias


def _add_bias_fwd(y: Array, bias: Array):
    return y + bias, bias


def _add_bias_bwd(bias: Array, g: Array):
    return g, _column_sum(g, bias.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


@jax.custom_vjp
def _scale_shift(centred: Array, inv_std: Array, scale: Array, bias: Array) -> Array:
    # Flax's LayerNorm arithmetic, operation for operation: (x - mean) * (rsqrt * scale) + bias.
    return centred * (inv_std * scale) + bias


def _scale_shift_fwd(centred, inv_std, scale, bias):
    return _scale_shift(centred, inv_std, scale, bias), (centred, inv_std, scale, bias)


def _scale_shift_bwd(res, g):
    centred, inv_std, scale, bias = res
    return (g * (inv_std * scale),
            jnp.sum(g * centred * scale, axis=-1, keepdims=True),
            _column_sum(g * centred * inv_std, scale.dtype),
            _column_sum(g, bias.dtype))


_scale_shift.defvjp(_scale_shift_fwd, _scale_shift_bwd)


class LayerNorm(nnx.LayerNorm):
    """`nnx.LayerNorm` over the last axis (two-pass variance; same parameters, same forward
    numbers) whose scale and bias gradients are matmuls where CPU_GRADIENT_FORMS are on."""

    def __call__(self, x: Array, *, mask=None) -> Array:
        if mask is not None or self.scale is None or self.bias is None or \
                self.use_fast_variance or not _cpu_forms_on():
            return super().__call__(x, mask=mask)
        stats = jnp.promote_types(jnp.result_type(x), jnp.float32)
        x32 = jnp.asarray(x, stats)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = _scale_shift(x - mean, jax.lax.rsqrt(var + self.epsilon), self.scale[...],
                         self.bias[...])
        return jnp.asarray(y, self.dtype or jnp.result_type(x, self.scale[...]))


class Linear(nnx.Linear):
    """`nnx.Linear` (same parameters, same forward numbers) whose output gradient is stored
    once and whose bias gradient is a matmul where CPU_GRADIENT_FORMS are on."""

    def __call__(self, inputs: Array) -> Array:
        if self.bias is None or not _cpu_forms_on():
            return super().__call__(inputs)
        inputs, kernel, bias = self.promote_dtype(
            (inputs, self.kernel[...], self.bias[...]), dtype=self.dtype)
        y = self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                             precision=self.precision)
        return _store_gradient(_add_bias(y, bias))


def residual(x: Array) -> Array:
    """`x` itself; under differentiation on the CPU its gradient is stored, not re-fused (see
    CPU_GRADIENT_FORMS)."""
    return _store_gradient(x) if _cpu_forms_on() else x


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "quick_gelu": quick_gelu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def _layer_norm(dim: int, eps: float, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # float32 statistics and output, two-pass variance as PyTorch computes it.
    return LayerNorm(dim, epsilon=eps, dtype=jnp.float32, use_fast_variance=False, rngs=rngs)


class Attention(nnx.Module):
    """Multi-head self-attention with separate q/k/v/out projections (Hugging Face layout)."""

    def __init__(self, dim: int, heads: int, *, dtype, rngs: nnx.Rngs):
        if dim % heads:
            raise ValueError(f"hidden size {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.dtype = dtype
        linear = lambda: Linear(dim, dim, dtype=dtype, rngs=rngs)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = linear(), linear(), linear(), linear()

    def __call__(self, x: Array, mask: Array | None, queries: Array | None = None) -> Array:
        """`x` [b, n, d] attends to itself, or only `queries` [b, m, d] (a subset of the
        tokens of `x`, with `mask` rows to match) attend to `x`."""
        queries = x if queries is None else queries
        b, _, d = x.shape
        head_dim = d // self.heads

        def heads(t: Array) -> Array:  # [b, n, d] -> [b, heads, n, head_dim]
            return t.reshape(b, t.shape[1], self.heads, head_dim).transpose(0, 2, 1, 3)

        # Heads-major layout: the batched q.k and weights.v matmuls are the fastest this way
        # (measured on XLA:CPU).
        q = heads(self.q_proj(queries)) * jnp.asarray(head_dim**-0.5, self.dtype)
        k, v = heads(self.k_proj(x)), heads(self.v_proj(x))
        logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
        if mask is not None:
            logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bhkd->bhqd", weights, v)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, queries.shape[1], d))


class MLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, act: str, *, dtype, rngs: nnx.Rngs):
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {sorted(ACTIVATIONS)}")
        self.act = act
        self.fc1 = Linear(dim, hidden, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(hidden, dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class EncoderLayer(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: VisionConfig | TextConfig, *, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.layer_norm1 = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, dtype=dtype, rngs=rngs)
        self.layer_norm2 = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype,
                       rngs=rngs)

    def __call__(self, x: Array, mask: Array | None = None, keep: Array | None = None) -> Array:
        """`x` [b, n, d] -> [b, n, d]; with `keep` (int [b]) only that token's output, [b, 1, d].

        Attention still reads every token, so the kept outputs equal the full layer's."""
        h = self.layer_norm1(x).astype(self.dtype)
        if keep is None:
            x = residual(x + self.self_attn(h, mask))
            return residual(x + self.mlp(self.layer_norm2(x).astype(self.dtype)))

        def pick(t):
            return jnp.take_along_axis(t, keep.reshape((-1,) + (1,) * (t.ndim - 1)), axis=1)

        if mask is not None:  # [., 1, n, n] -> the kept query rows [b, 1, 1, n]
            mask = jnp.broadcast_to(mask, (x.shape[0],) + mask.shape[1:]).swapaxes(1, 2)
            mask = pick(mask).swapaxes(1, 2)
        x = pick(x) + self.self_attn(h, mask, queries=pick(h))
        return x + self.mlp(self.layer_norm2(x).astype(self.dtype))


class Encoder(nnx.Module):
    def __init__(self, cfg: VisionConfig | TextConfig, *, dtype, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [EncoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])

    def __call__(self, x: Array, mask: Array | None = None, keep: Array | None = None,
                 *, start: int = 0) -> Array:
        """All tokens through every layer; with `keep` (int [b]) the last layer computes only
        that token per row (the pooled token), returning [b, 1, d]. That skips most of the last
        layer's work when only the pooled output is wanted, with the same numbers. `start`
        skips the first layers (`x` is then the output of `prefix(., start)`)."""
        *body, last = self.layers
        if not 0 <= start < len(self.layers):
            raise ValueError(f"start {start} is not a layer index below {len(self.layers)}")
        for layer in body[start:]:
            x = layer(x, mask)
        return last(x, mask, keep)

    def prefix(self, x: Array, mask: Array | None, layers: int) -> Array:
        """The first `layers` layers (fewer than all), every token."""
        if not 0 <= layers < len(self.layers):
            raise ValueError(f"a prefix of {layers} layers: the encoder has {len(self.layers)}")
        for layer in self.layers[:layers]:
            x = layer(x, mask)
        return x


def patchify(pixels: Array, patch: int) -> Array:
    """NHWC `[b, h, w, c]` -> `[b, (h/p)*(w/p), p*p*c]`: patches in row-major grid order, each
    flattened as (row in patch, column in patch, channel)."""
    b, h, w, c = pixels.shape
    p = patch
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {p}")
    patches = pixels.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return patches.reshape(b, (h // p) * (w // p), p * p * c)


class PatchEmbedding(nnx.Module):
    """Non-overlapping patch projection (a stride-`p` convolution without bias) on NHWC input.

    Written as a reshape plus one matmul; the kernel is stored as a conv kernel `[p, p, C, D]`.
    """

    def __init__(self, patch: int, channels: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.patch = patch
        self.dtype = dtype
        init = jax.nn.initializers.lecun_normal(in_axis=(0, 1, 2), out_axis=3)
        self.kernel = nnx.Param(init(rngs.params(), (patch, patch, channels, dim), jnp.float32))

    def __call__(self, pixels: Array) -> Array:
        patches = patchify(pixels, self.patch).astype(self.dtype)
        kernel = self.kernel[...].reshape(patches.shape[-1], -1).astype(self.dtype)
        return patches @ kernel


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

    def __init__(self, cfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embeddings = VisionEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.pre_layrnorm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)  # HF spelling
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.post_layernorm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)

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

    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.eos_token_id = cfg.eos_token_id
        self.embeddings = TextEmbeddings(cfg, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.final_layer_norm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)

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
               ) -> tuple[Array, Array]:
        """Embeddings and the first `layers` blocks: (hidden state [B, L, d], attention mask).
        `pooled_from(*prefix(ids, k), ids, k)` equals `pooled(ids)`; two models that share
        these weights (a student and its EMA teacher with frozen early blocks) can share it."""
        x, mask = self._embed(input_ids, attention_mask)
        return self.encoder.prefix(x, mask, layers), mask

    def pooled_from(self, hidden: Array, mask: Array, input_ids: Array, start: int) -> Array:
        """`pooled` from the hidden state after the first `start` blocks."""
        eot = eot_positions(input_ids, self.eos_token_id)
        x = self.encoder(hidden, mask, keep=eot, start=start)
        return self.final_layer_norm(x[:, 0].astype(jnp.float32))

    def _embed(self, input_ids: Array, attention_mask: Array | None) -> tuple[Array, Array]:
        n = input_ids.shape[-1]
        mask = jnp.tril(jnp.ones((n, n), bool))[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.astype(bool)[:, None, None, :]
        return self.embeddings(input_ids).astype(self.dtype), mask


class TextEmbeddings(nnx.Module):
    def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs):
        self.token_embedding = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.position_embedding = nnx.Embed(cfg.max_position_embeddings, cfg.hidden_size,
                                            rngs=rngs)

    def __call__(self, input_ids: Array) -> Array:
        n = input_ids.shape[-1]
        if n > self.position_embedding.num_embeddings:
            raise ValueError(f"text of {n} tokens exceeds the "
                             f"{self.position_embedding.num_embeddings} positions of the model")
        return (self.token_embedding(input_ids)
                + self.position_embedding.embedding[...][:n].astype(jnp.float32))


class CLIPModel(nnx.Module):
    """Image and text towers with CLIP's projections and logit scale.

    `vision_pooled` / `text_pooled` give the pooled outputs before projection (768-d / 512-d at
    ViT-B/32), which ScenarioCLIP puts its own heads on; `encode_image` / `encode_text` give the
    projected features of Hugging Face's `get_image_features` / `get_text_features`.
    """

    def __init__(self, config: CLIPConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.vision_model = VisionTransformer(config.vision, dtype=dtype, rngs=rngs)
        self.text_model = TextTransformer(config.text, dtype=dtype, rngs=rngs)
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


def create(config: CLIPConfig | str = "ViT-B/32", *, seed: int = 0, dtype=jnp.float32
           ) -> CLIPModel:
    """A randomly initialised CLIP model from a config or a preset name (`PRESETS`)."""
    if isinstance(config, str):
        config = config_from_preset(config)
    return CLIPModel(config, dtype=dtype, rngs=nnx.Rngs(seed))


# --------------------------------------------------------------------------------------------
# Hugging Face import / export
# --------------------------------------------------------------------------------------------

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Buffers some Hugging Face checkpoints carry; they are recomputed, never loaded.
_IGNORED_HF_KEYS = ("vision_model.embeddings.position_ids", "text_model.embeddings.position_ids")
_LEAF_TO_HF = {"kernel": "weight", "scale": "weight", "embedding": "weight"}


class CheckpointError(ValueError):
    """A folder that does not hold a CLIP checkpoint this model can load."""


def _hf_key(path: tuple) -> str:
    """Our NNX parameter path -> Hugging Face state-dict key (the one key map)."""
    *parents, leaf = (str(p) for p in path)
    return ".".join([*parents, _LEAF_TO_HF.get(leaf, leaf)])


def _to_hf_layout(path: tuple, value: np.ndarray) -> np.ndarray:
    """Our layout -> PyTorch layout. Linear `[in, out]` -> `[out, in]`; conv `[p, p, C, D]` ->
    `[D, C, p, p]`. The inverse is `_from_hf_layout`; the transposes live only here."""
    if path[-1] != "kernel":
        return value
    return value.T if value.ndim == 2 else value.transpose(3, 2, 0, 1)


def _from_hf_layout(path: tuple, value: np.ndarray) -> np.ndarray:
    if path[-1] != "kernel":
        return value
    return value.T if value.ndim == 2 else value.transpose(2, 3, 1, 0)


def _config_from_hf(raw: Mapping[str, Any], where: str) -> CLIPConfig:
    if raw.get("model_type") not in ("clip", None) or "vision_config" not in raw \
            or "text_config" not in raw:
        raise CheckpointError(
            f"{where} is not a Hugging Face CLIPModel config (model_type="
            f"{raw.get('model_type')!r}, needs 'vision_config' and 'text_config')")

    def pick(cls, sub: Mapping[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in sub.items() if k in known and v is not None})

    return CLIPConfig(
        vision=pick(VisionConfig, raw["vision_config"] or {}),
        text=pick(TextConfig, raw["text_config"] or {}),
        projection_dim=raw.get("projection_dim", 512),
        logit_scale_init_value=raw.get("logit_scale_init_value", 2.6592),
    )


def _config_to_hf(config: CLIPConfig) -> dict[str, Any]:
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


def _read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    single, index = folder / WEIGHTS_NAME, folder / WEIGHTS_INDEX_NAME
    if single.exists():
        files = [single]
    elif index.exists():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        present = sorted(p.name for p in folder.iterdir())
        raise CheckpointError(
            f"{folder} has no {WEIGHTS_NAME} (or {WEIGHTS_INDEX_NAME}); found {present}. "
            "Save the model with `save_pretrained(..., safe_serialization=True)`.")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _abstract_model(config: CLIPConfig, dtype) -> CLIPModel:
    """A CLIPModel whose parameters are shape/dtype placeholders, for `load_hf_state` to fill."""
    return nnx.eval_shape(lambda: CLIPModel(config, dtype=dtype, rngs=nnx.Rngs(0)))


def load_hf_state(model: nnx.Module, tensors: Mapping[str, np.ndarray], where: str = "checkpoint",
                  *, kind: str = "CLIP") -> None:
    """Write Hugging Face state-dict tensors into `model` in place, checking names and shapes.

    Every parameter is replaced, so `model` may be a shape-only model from `nnx.eval_shape`."""
    flat = nnx.to_flat_state(nnx.state(model))
    expected = {_hf_key(path): (path, var) for path, var in flat}
    names = set(tensors) - set(_IGNORED_HF_KEYS)
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    wrong_shape = []
    for key in sorted(names & set(expected)):
        path, var = expected[key]
        want = _to_hf_layout(path, np.empty(var.shape, np.bool_)).shape
        if tuple(tensors[key].shape) != want:
            wrong_shape.append(f"{key}: file {tuple(tensors[key].shape)}, model {want}")
    if missing or unexpected or wrong_shape:
        lines = [f"{where} does not match a {kind} model of this config:"]
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected),
                             ("shape mismatches", wrong_shape)):
            if items:
                shown = ", ".join(items[:12]) + (f", ... ({len(items)} in all)"
                                                 if len(items) > 12 else "")
                lines.append(f"  {title}: {shown}")
        raise CheckpointError("\n".join(lines))
    for key, (path, var) in expected.items():
        value = _from_hf_layout(path, np.asarray(tensors[key], dtype=np.float32))
        var.set_value(jnp.asarray(value, dtype=var.dtype))


def from_hf(path: str | os.PathLike, *, dtype=jnp.float32) -> CLIPModel:
    """A CLIP model from a Hugging Face `CLIPModel` folder (`config.json` + `model.safetensors`).

    No torch needed. `dtype` is the compute dtype; parameters are always float32.
    Raises `CheckpointError` naming missing / unexpected keys and shape mismatches.
    """
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    config = _config_from_hf(json.loads(config_file.read_text()), str(config_file))
    tensors = _read_safetensors(folder)
    model = _abstract_model(config, dtype)  # shapes only: no random init to throw away
    load_hf_state(model, tensors, where=str(folder))
    return model


def hf_state_dict(model: CLIPModel) -> dict[str, np.ndarray]:
    """The model's parameters as a Hugging Face `CLIPModel` state dict of float32 numpy arrays."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    # np.array(order="C"), not np.ascontiguousarray: the latter turns the 0-d logit scale 1-d.
    return {_hf_key(path): np.array(_to_hf_layout(path, np.asarray(var[...], np.float32)),
                                    order="C")
            for path, var in flat}


def to_hf(model: CLIPModel, path: str | os.PathLike) -> Path:
    """Write `model` as a folder `transformers.CLIPModel.from_pretrained(path)` loads."""
    from safetensors.numpy import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_config_to_hf(model.config), indent=2))
    tmp = folder / (WEIGHTS_NAME + ".tmp")
    save_file(hf_state_dict(model), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / WEIGHTS_NAME)
    return folder
