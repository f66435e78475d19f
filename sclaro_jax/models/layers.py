"""Transformer layers shared by the CLIP (`clip.py`) and SigLIP (`siglip.py`) towers.

Hugging Face layout and names (`layer_norm1`, `self_attn.q_proj`, `mlp.fc1`, ...), so the weight
import is a rename of leaf names. Parameters are float32; `dtype` sets the compute dtype of the
matmuls; LayerNorms and the attention softmax are computed in float32.

`gradient_forms` ("cpu" or "plain", chosen when the model is built: `cpu_gradients.resolve`) is a
static attribute of each `Linear`, `LayerNorm` and `EncoderLayer` (which owns the residual adds):
"cpu" writes the backward pass in the forms XLA:CPU runs faster (`cpu_gradients`), with the same
forward numbers. `AttentionOptions` (set on a built model by `configure_attention`) say how each
`Attention` computes: its core (einsums, or `jax.nn.dot_product_attention` on XLA or cuDNN) and
whether q, k and v come from one matmul; never what it computes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sclaro_jax.models import cpu_gradients

Array = jax.Array
# The named scope of attention's core (q.k, softmax, weights.v), apart from its projections.
ATTENTION_SCOPE = "attention_core"
ATTENTION_IMPLEMENTATIONS = ("einsum", "xla", "cudnn")
# The custom-call target of cuDNN's fused attention (forward and backward) in a compiled GPU
# module's HLO: "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward", ...
_CUDNN_CALL = re.compile(r'custom_call_target="__cudnn\$fmha[^"]*"')


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """What `Encoder` reads; field names follow Hugging Face. The defaults are CLIP ViT-B's vision
    tower; the tower configs (`clip.VisionConfig`, `siglip.SiglipTextConfig`, ...) extend it."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"


def quick_gelu(x: Array) -> Array:
    """OpenAI CLIP's activation: x * sigmoid(1.702 x)."""
    return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "quick_gelu": quick_gelu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class LayerNorm(nnx.LayerNorm):
    """`nnx.LayerNorm` over the last axis (two-pass variance; same parameters, same forward
    numbers) whose scale and bias gradients are matmuls where `gradient_forms` is "cpu"."""

    def __init__(self, *args, gradient_forms: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.gradient_forms = cpu_gradients.resolve(gradient_forms)

    def __call__(self, x: Array, *, mask=None) -> Array:
        if mask is not None or self.scale is None or self.bias is None or \
                self.use_fast_variance or self.gradient_forms != "cpu":
            return super().__call__(x, mask=mask)
        stats = jnp.promote_types(jnp.result_type(x), jnp.float32)
        x32 = jnp.asarray(x, stats)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = cpu_gradients.scale_shift(x - mean, jax.lax.rsqrt(var + self.epsilon),
                                      self.scale[...], self.bias[...])
        return jnp.asarray(y, self.dtype or jnp.result_type(x, self.scale[...]))


class Linear(nnx.Linear):
    """`nnx.Linear` (same parameters, same forward numbers) whose output gradient is stored
    once and whose bias gradient is a matmul where `gradient_forms` is "cpu"."""

    def __init__(self, *args, gradient_forms: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.gradient_forms = cpu_gradients.resolve(gradient_forms)

    def __call__(self, inputs: Array) -> Array:
        if self.bias is None:
            return super().__call__(inputs)
        return self.apply(inputs, self.kernel[...], self.bias[...])

    def apply(self, inputs: Array, kernel: Array, bias: Array) -> Array:
        """This layer's computation with `kernel` [in, out] and `bias` [out] in place of its
        own (`fused_projection` passes several layers' side by side)."""
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y = self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                             precision=self.precision)
        if self.gradient_forms != "cpu":
            return y + bias
        return cpu_gradients.store_gradient(cpu_gradients.add_bias(y, bias))


def fused_projection(x: Array, projections: Sequence[Linear]) -> list[Array]:
    """`[p(x) for p in projections]` as one matmul against their kernels side by side
    ([d, k * d']): one GEMM with k times the columns instead of k (their parameters as they
    are; the gradients come back through the concatenation)."""
    kernel = jnp.concatenate([p.kernel[...] for p in projections], axis=1)
    bias = jnp.concatenate([p.bias[...] for p in projections])
    return jnp.split(projections[0].apply(x, kernel, bias), len(projections), axis=-1)


def residual(x: Array, gradient_forms: str) -> Array:
    """`x` itself; with "cpu" gradient forms its gradient is stored, not re-fused."""
    return cpu_gradients.store_gradient(x) if gradient_forms == "cpu" else x


def layer_norm(cfg: EncoderConfig, *, gradient_forms: str, rngs: nnx.Rngs) -> LayerNorm:
    """A LayerNorm of `cfg.hidden_size` features: float32 statistics and output, two-pass
    variance as PyTorch computes it."""
    return LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, dtype=jnp.float32,
                     use_fast_variance=False, gradient_forms=gradient_forms, rngs=rngs)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """How `Attention` computes, never what (the same numbers up to rounding).

    - `implementation`: "einsum" (q.k and weights.v as heads-major einsums, the softmax in
      float32: the fastest on XLA:CPU), "xla" (`jax.nn.dot_product_attention`, XLA's
      implementation) or "cudnn" (the same call with cuDNN's fused flash-attention kernel:
      CUDA GPUs, bfloat16 / float16 compute). A causal tower's mask reaches
      `dot_product_attention` as `is_causal` (cuDNN's kernel takes it natively, skipping the
      masked half), a kept query's causal row as a key length.
    - `fused_qkv`: q, k and v from one matmul against the q/k/v kernels side by side
      ([d, 3d]) instead of three (`fused_projection`); the parameters keep their Hugging Face
      names and shapes, so weight import, export and checkpoints do not change.
    """

    implementation: str = "einsum"
    fused_qkv: bool = False

    def __post_init__(self):
        if self.implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention implementation {self.implementation!r} is not one of "
                             f"{ATTENTION_IMPLEMENTATIONS}")


def take_rows(t: Array, keep: Array) -> Array:
    """`t` [b, n, ...] at token `keep[i]` of each row i: [b, 1, ...]."""
    return jnp.take_along_axis(t, keep.reshape((-1,) + (1,) * (t.ndim - 1)), axis=1)


def _query_rows(mask: Array | None, keep: Array) -> Array | None:
    """A per-query mask [., 1, n, n] at the kept queries' rows, [b, 1, 1, n]; a keys-only mask
    [., 1, 1, n] (or None) as it is."""
    if mask is None or mask.shape[-2] == 1:
        return mask
    mask = jnp.broadcast_to(mask, (keep.shape[0],) + mask.shape[1:])
    return take_rows(mask.swapaxes(1, 2), keep).swapaxes(1, 2)


class Attention(nnx.Module):
    """Multi-head self-attention with separate q/k/v/out projections (Hugging Face layout).
    A `causal` one (the text towers) lets each token see itself and the tokens before it;
    `options` (`AttentionOptions`, set by `configure_attention`) say how it computes."""

    def __init__(self, dim: int, heads: int, *, dtype, gradient_forms: str, rngs: nnx.Rngs,
                 causal: bool = False):
        if dim % heads:
            raise ValueError(f"hidden size {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.dtype = dtype
        self.causal = causal
        self.options = AttentionOptions()

        def proj() -> Linear:
            return Linear(dim, dim, dtype=dtype, gradient_forms=gradient_forms, rngs=rngs)

        self.q_proj, self.k_proj, self.v_proj, self.out_proj = proj(), proj(), proj(), proj()

    def __call__(self, x: Array, mask: Array | None, keep: Array | None = None) -> Array:
        """`x` [b, n, d] attends to itself, [b, n, d]; with `keep` (int [b]) only token
        `keep[i]` of each row queries, [b, 1, d]. `mask` (bool, broadcastable to [b, 1, n, n],
        or [b, 1, 1, n] for the keys alone; None: every key) hides keys on top of `causal`."""
        b, _, d = x.shape
        q, k, v = self._qkv(x, keep)
        mask = mask if keep is None else _query_rows(mask, keep)
        with jax.named_scope(ATTENTION_SCOPE):
            if self.options.implementation == "einsum":
                out = self._einsum_core(q, k, v, mask, keep)
            else:
                out = self._dot_product_core(q, k, v, mask, keep)
        return self.out_proj(out.reshape(b, q.shape[1], d))

    def _qkv(self, x: Array, keep: Array | None) -> tuple[Array, Array, Array]:
        """q (the kept tokens' alone with `keep`), k, v as [b, tokens, heads, head_dim]."""
        queries = x if keep is None else take_rows(x, keep)
        if not self.options.fused_qkv:
            q, k, v = self.q_proj(queries), self.k_proj(x), self.v_proj(x)
        elif keep is None:
            q, k, v = fused_projection(x, (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, (k, v) = self.q_proj(queries), fused_projection(x, (self.k_proj, self.v_proj))
        return tuple(t.reshape(*t.shape[:2], self.heads, -1) for t in (q, k, v))

    def _einsum_core(self, q, k, v, mask, keep) -> Array:
        # Heads-major layout: the batched q.k and weights.v matmuls are the fastest this way
        # on XLA:CPU.
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        q = q * jnp.asarray(q.shape[-1] ** -0.5, self.dtype)
        if self.causal:
            keys = jnp.arange(k.shape[2])
            rows = keys[:, None] if keep is None else keep[:, None, None, None]
            causal = keys <= rows  # [n, n], or [b, 1, 1, n] for the kept queries
            mask = causal if mask is None else causal & mask
        logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
        if mask is not None:
            logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        return jnp.einsum("bhqk,bhkd->bhqd", weights, v).transpose(0, 2, 1, 3)

    def _dot_product_core(self, q, k, v, mask, keep) -> Array:
        lengths, causal = None, self.causal
        if causal and keep is not None:  # the query at position p sees keys 0..p
            lengths, causal = (keep + 1).astype(jnp.int32), False
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=q.shape[-1] ** -0.5, is_causal=causal,
            key_value_seq_lengths=lengths, implementation=self.options.implementation)


def configure_attention(model: nnx.Module, options: AttentionOptions) -> None:
    """Every `Attention` of `model` computes as `options` say, in place. "cudnn" is refused
    (ValueError naming the switch) where cuDNN's kernel cannot run: a model whose attention
    computes in float32, or a process whose default backend is not a GPU."""
    found = [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]
    if options.implementation == "cudnn":
        wide = sorted({str(jnp.dtype(m.dtype)) for m in found} - {"bfloat16", "float16"})
        if wide:
            raise ValueError(f"attention implementation 'cudnn' (config.perf.attention) takes "
                             f"bfloat16 / float16 compute, not {', '.join(wide)}: set "
                             "model.dtype='bfloat16', or use 'xla' or 'einsum'")
        if jax.default_backend() != "gpu":
            raise ValueError(f"attention implementation 'cudnn' (config.perf.attention) runs "
                             "cuDNN's fused attention kernel, which needs a CUDA GPU; this "
                             f"process's default backend is {jax.default_backend()!r}: use "
                             "'xla' (jax.nn.dot_product_attention on XLA) or 'einsum'")
    for module in found:
        module.options = options


def cudnn_attention_calls(hlo_text: str) -> int:
    """How many calls of cuDNN's fused attention (forward or backward) the HLO text of a
    compiled module (`jitted.lower(...).compile().as_text()`) holds: 0 where XLA computed
    attention itself."""
    return len(_CUDNN_CALL.findall(hlo_text))


class MLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, act: str, *, dtype, gradient_forms: str,
                 rngs: nnx.Rngs):
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {sorted(ACTIVATIONS)}")
        self.act = act
        self.fc1 = Linear(dim, hidden, dtype=dtype, gradient_forms=gradient_forms, rngs=rngs)
        self.fc2 = Linear(hidden, dim, dtype=dtype, gradient_forms=gradient_forms, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class EncoderLayer(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: EncoderConfig, *, dtype, gradient_forms: str, rngs: nnx.Rngs,
                 causal: bool = False):
        self.dtype = dtype
        self.gradient_forms = forms = cpu_gradients.resolve(gradient_forms)
        self.layer_norm1 = layer_norm(cfg, gradient_forms=forms, rngs=rngs)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, dtype=dtype,
                                   gradient_forms=forms, rngs=rngs, causal=causal)
        self.layer_norm2 = layer_norm(cfg, gradient_forms=forms, rngs=rngs)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype,
                       gradient_forms=forms, rngs=rngs)

    def __call__(self, x: Array, mask: Array | None = None, keep: Array | None = None) -> Array:
        """`x` [b, n, d] -> [b, n, d]; with `keep` (int [b]) only that token's output, [b, 1, d].

        Attention still reads every token, so the kept outputs equal the full layer's."""
        h = self.layer_norm1(x).astype(self.dtype)
        if keep is None:
            x = residual(x + self.self_attn(h, mask), self.gradient_forms)
            return residual(x + self.mlp(self.layer_norm2(x).astype(self.dtype)),
                            self.gradient_forms)
        x = take_rows(x, keep) + self.self_attn(h, mask, keep)
        return x + self.mlp(self.layer_norm2(x).astype(self.dtype))


class Encoder(nnx.Module):
    def __init__(self, cfg: EncoderConfig, *, dtype, gradient_forms: str, rngs: nnx.Rngs,
                 causal: bool = False):
        self.layers = nnx.List(
            [EncoderLayer(cfg, dtype=dtype, gradient_forms=gradient_forms, rngs=rngs,
                          causal=causal) for _ in range(cfg.num_hidden_layers)])

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


class TextEmbeddings(nnx.Module):
    """Token + learned position embeddings (`cfg`: vocab_size, hidden_size,
    max_position_embeddings), in float32."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
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
