"""Model definitions. `clip`: CLIP image/text towers with Hugging Face weight import/export."""

from sclaro_jax.models import clip

__all__ = ["clip"]
