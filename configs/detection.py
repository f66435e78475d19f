"""Faster R-CNN + FPN detection with a run's encoders as backbones (the appendix protocol).

The recipe lives in the installed package as `sclaro_jax.configs.detection`
(`--config detection` and `load_config("detection")` load it from any folder); this
file is its name in a checkout.
"""

from sclaro_jax.configs.detection import VARIANTS, get_config  # noqa: F401
