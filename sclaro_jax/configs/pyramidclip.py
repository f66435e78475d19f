"""PyramidCLIP as the reference runs it: one shared pair at all levels, three InfoNCE losses
with their own scales, no KD (same recipe otherwise)."""

from sclaro_jax.configs import scenarioclip

VARIANTS = scenarioclip.VARIANTS
RANGES = scenarioclip.RANGES


def get_config(arg: str | None = None):
    c = scenarioclip.get_config(arg)
    c.model.kind = "pyramidclip"
    c.train.lambda_kd = 0.0
    return c
