"""Numeric pieces every layer shares, each written once: pixel normalisation and L2 normalisation.

This module sits at the bottom of the package (it imports only numpy and jax), so the input
pipeline, the models, the losses, MINER and the evaluators all call the same code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# CLIP's per-channel pixel statistics (RGB), as OpenAI CLIP and Hugging Face's CLIPImageProcessor.
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)


def normalize(pixels, mean=CLIP_MEAN, std=CLIP_STD, max_value: float = 255.0):
    """[..., 3] pixels in [0, max_value] -> float32 (pixels / max_value - mean) / std.

    CLIP's mean/std by default; a SigLIP processor passes its own mean, std and 1 / its rescale
    factor. Works on numpy arrays (on the host, returning numpy) and on jax arrays or tracers
    (inside a jitted step, returning jax), with the same arithmetic."""
    x = pixels.astype(np.float32) / np.float32(max_value)
    return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def l2_normalize(x: jax.Array, axis: int = -1) -> jax.Array:
    """x / ||x|| along `axis`, in float32 (a zero vector stays zero): x * rsqrt(max(|x|^2, 1e-24))."""
    x = jnp.asarray(x).astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis, keepdims=True), 1e-24))
