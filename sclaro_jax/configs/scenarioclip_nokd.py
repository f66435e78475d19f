"""ScenarioCLIP w/o KD: three pairs, contrastive alignment only (same recipe otherwise)."""

from sclaro_jax.configs import scenarioclip

VARIANTS = scenarioclip.VARIANTS
RANGES = scenarioclip.RANGES


def get_config(arg: str | None = None):
    c = scenarioclip.get_config(arg)
    c.train.lambda_kd = 0.0
    return c
