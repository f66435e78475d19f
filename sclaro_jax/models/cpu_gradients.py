"""CPU gradient forms: two rewrites of the backward pass, with the same numbers, for XLA:CPU.

- Cotangent barriers. The residual-stream gradient of each block is an element-wise sum of the
  blocks above it; XLA:CPU's fusion duplicates that chain into each consumer (the transposing
  copies feeding the weight-gradient matmuls) instead of storing it, so a 12-block tower
  recomputes it about quadratically. `store_gradient` is an identity whose backward passes the
  gradient through a conditional with identical branches, which XLA cannot fuse across: the
  gradient is written once per residual add. The same barrier on each `layers.Linear`'s output
  stores its gradient once for the weight-gradient and input-gradient matmuls (otherwise the
  MLP's activation derivative is recomputed inside a transposing copy).
- Column sums as matmuls. Bias and LayerNorm scale/bias gradients sum over every row; XLA:CPU
  splits such sums into reduce-windows, slower than a matmul with a ones vector.

Timings: see bench/README.md ("CPU gradient forms"). Off on GPUs and TPUs, whose fusion differs
and where a conditional costs a host round trip. A model picks them when it is built, with its
`gradient_forms` argument (`resolve`): "cpu" uses them, "plain" does not, "auto" is "cpu" where
the default backend is the CPU and "plain" elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

GRADIENT_FORMS = ("auto", "cpu", "plain")


def resolve(gradient_forms: str) -> str:
    """"auto" -> "cpu" where `jax.default_backend()` is the CPU, else "plain"; "cpu" / "plain"
    stay as they are; anything else is a ValueError naming the three choices."""
    if gradient_forms not in GRADIENT_FORMS:
        raise ValueError(f"gradient_forms must be one of {GRADIENT_FORMS} (\"auto\": \"cpu\" on "
                         f"a CPU backend, else \"plain\"), got {gradient_forms!r}")
    if gradient_forms == "auto":
        return "cpu" if jax.default_backend() == "cpu" else "plain"
    return gradient_forms


def _materialise(g: Array) -> Array:
    # The predicate reads the data, so XLA cannot fold the conditional away; both branches
    # return the gradient unchanged.
    keep = jnp.isfinite(g.reshape(-1)[0])
    return jax.lax.cond(keep, lambda t: t, lambda t: t * 1, g)


@jax.custom_vjp
def store_gradient(x: Array) -> Array:
    """`x` itself; its gradient is stored once (a cotangent barrier), not re-fused."""
    return x


def _store_gradient_fwd(x: Array):
    return x, None


def _store_gradient_bwd(_, g: Array):
    return (_materialise(g),)


store_gradient.defvjp(_store_gradient_fwd, _store_gradient_bwd)


def _column_sum(t: Array, dtype) -> Array:
    # A sum over every row as a matmul with a ones vector: XLA:CPU runs such sums as split
    # reduce-windows, slower than the GEMV.
    rows = t.reshape(-1, t.shape[-1])
    ones = jnp.ones(rows.shape[0], rows.dtype)
    return jnp.dot(ones, rows, preferred_element_type=jnp.float32).astype(dtype)


@jax.custom_vjp
def add_bias(y: Array, bias: Array) -> Array:
    """`y + bias`, the bias gradient a column sum as a matmul."""
    return y + bias


def _add_bias_fwd(y: Array, bias: Array):
    return y + bias, bias


def _add_bias_bwd(bias: Array, g: Array):
    return g, _column_sum(g, bias.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


@jax.custom_vjp
def scale_shift(centred: Array, inv_std: Array, scale: Array, bias: Array) -> Array:
    """Flax's LayerNorm arithmetic, operation for operation: (x - mean) * (rsqrt * scale) + bias;
    the scale and bias gradients are column sums as matmuls."""
    return centred * (inv_std * scale) + bias


def _scale_shift_fwd(centred, inv_std, scale, bias):
    return scale_shift(centred, inv_std, scale, bias), (centred, inv_std, scale, bias)


def _scale_shift_bwd(res, g):
    centred, inv_std, scale, bias = res
    return (g * (inv_std * scale),
            jnp.sum(g * centred * scale, axis=-1, keepdims=True),
            _column_sum(g * centred * inv_std, scale.dtype),
            _column_sum(g, bias.dtype))


scale_shift.defvjp(_scale_shift_fwd, _scale_shift_bwd)
