"""ScenarioCLIP, the paper recipe (docs/design.md, section 2); `:demo` trains on the bundled demo.

The recipe lives in the installed package as `sclaro_jax.configs.scenarioclip`
(`--config scenarioclip` and `load_config("scenarioclip")` load it from any folder); this
file is its name in a checkout.
"""

from sclaro_jax.configs.scenarioclip import VARIANTS, get_config  # noqa: F401
