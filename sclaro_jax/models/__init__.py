"""Model definitions.

`clip`: CLIP image/text towers with Hugging Face weight import/export; `siglip`: SigLIP / SigLIP 2
towers (inputs in `siglip_inputs`); `scenarioclip`: ScenarioCLIP / PyramidCLIP on CLIP towers.
Shared pieces: `layers` (the transformer layers), `cpu_gradients` (the backward-pass forms a
model picks with `gradient_forms`), `hf_weights` (Hugging Face folders and the key map),
`torch_files` (the torch-file reader, no JAX) and `errors` (`CheckpointError`).

`clip` is imported when first named (`sclaro_jax.models.clip`), not with the package: a module
of it that needs no JAX loads without JAX and flax.
"""

__all__ = ["clip"]


def __getattr__(name: str):
    if name == "clip":
        import importlib
        return importlib.import_module("sclaro_jax.models.clip")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
