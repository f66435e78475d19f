"""ScenarioCLIP: the paper recipe (../shared/DESIGN.md section 2); `:demo` for the bundled data.

Fields here are what the model side uses so far; the trainer's fields arrive with it.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 42
    config.model = ml_collections.ConfigDict()
    config.model.preset = "ViT-B/32"  # sclaro_jax.models.clip.PRESETS
    config.model.init = ""  # a Hugging Face CLIPModel folder; empty = random init
    config.model.dtype = "float32"  # compute dtype; "bfloat16" on GPU
    if arg == "demo":
        config.model.preset = "tiny"
    elif arg not in (None, ""):
        raise ValueError(f"unknown config variant {arg!r}; known: demo")
    return config
