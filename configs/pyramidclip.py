"""PyramidCLIP as the reference runs it: one shared pair at all levels, three InfoNCE losses

The recipe lives in the installed package as `sclaro_jax.configs.pyramidclip`
(`--config pyramidclip` and `load_config("pyramidclip")` load it from any folder); this
file is its name in a checkout.
"""

from sclaro_jax.configs.pyramidclip import VARIANTS, get_config  # noqa: F401
