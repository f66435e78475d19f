"""The detector's backbones: a run's encoders (a ScenarioCLIP / PyramidCLIP training workdir or
a Hugging Face CLIPModel folder), or, for the demo, a randomly initialised tiny CLIP tower."""

from __future__ import annotations

from pathlib import Path


def backbones(workdir: str, level_rpn: str, level_roi: str, teacher: bool, dtype=None):
    """(rpn vision tower, roi vision tower or None when one encoder feeds both, patch size,
    model name for the table); the towers compute in `dtype` (default: float32)."""
    import jax.numpy as jnp

    from sclaro_jax import bounds
    from sclaro_jax.models import clip

    dtype = jnp.dtype(dtype or jnp.float32)

    folder = Path(workdir)
    cfg_path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"--workdir {workdir} does not exist")
    from sclaro_jax.checkpoint import is_run, load_checkpoint, run_config

    if is_run(folder):  # checked complete (check_run): a damaged one is DamagedRunError
        config = run_config(str(folder))
        config.model.dtype = dtype.name
        model, step = load_checkpoint(str(folder), teacher=teacher, config=config, flag=None)
        rpn, roi = model.pair(level_rpn), model.pair(level_roi)
        patch = rpn.config.vision.patch_size
        kind = type(model).__name__
        if roi is rpn:
            return rpn.vision_model, None, patch, f"{kind} ({level_rpn}, step {step})"
        return (rpn.vision_model, roi.vision_model, patch,
                f"{kind} ({level_rpn} -> RPN, {level_roi} -> RoI, step {step})")
    if cfg_path.exists() and bounds.read_json(cfg_path).get("model_type") == "clip":
        model = clip.from_hf(folder, dtype=dtype, towers_only=True)  # the vision tower alone
        return model.vision_model, None, model.config.vision.patch_size, f"CLIP ({folder.name})"
    raise FileNotFoundError(f"--workdir {workdir} is neither a training workdir (config.json + "
                            "checkpoints/) nor a Hugging Face CLIPModel folder")


def from_config(config, dtype=None):
    """`backbones` of `config.backbone` (workdir, level_rpn, level_roi, teacher); an empty
    workdir gives the tiny preset's vision tower, randomly initialised from `config.seed` (the
    demo: no pretrained run needed)."""
    b = config.backbone
    if b.workdir:
        return backbones(b.workdir, b.level_rpn, b.level_roi, b.teacher, dtype)
    import jax.numpy as jnp

    from sclaro_jax.models import clip

    towers = clip.create("tiny", seed=config.seed, dtype=jnp.dtype(dtype or jnp.float32))
    return towers.vision_model, None, towers.config.vision.patch_size, "CLIP (tiny, random)"
