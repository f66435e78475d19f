"""ScenarioCLIP w/o KD: three pairs, contrastive alignment only (same recipe otherwise).

The recipe lives in the installed package as `sclaro_jax.configs.scenarioclip_nokd`
(`--config scenarioclip_nokd` and `load_config("scenarioclip_nokd")` load it from any folder); this
file is its name in a checkout.
"""

from sclaro_jax.configs.scenarioclip_nokd import VARIANTS, get_config  # noqa: F401
