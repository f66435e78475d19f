"""Model definitions.

`clip`: CLIP image/text towers with Hugging Face weight import/export; `siglip`: SigLIP / SigLIP 2
towers (inputs in `siglip_inputs`); `scenarioclip`: ScenarioCLIP / PyramidCLIP on CLIP towers.
Shared pieces: `layers` (the transformer layers), `cpu_gradients` (the backward-pass forms a
model picks with `gradient_forms`), `hf_weights` (Hugging Face folders and the key map).
"""

from sclaro_jax.models import clip

__all__ = ["clip"]
