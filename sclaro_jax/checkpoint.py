"""A training run's folder, read back: its config, its model, its checkpointed weights.

Below both `train` (which writes runs) and `eval` (which reads them), so neither imports the
other. A run folder holds `config.json` (the full `ml_collections` config the run was started
with) and `checkpoints/<step>/` (orbax).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_collections
from flax import nnx

from sclaro_jax.models import scenarioclip


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a training run wrote to WORKDIR/config.json."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir} is not a training workdir "
                                "(or pass the run's config)")
    with open(path, encoding="utf-8") as f:
        return ml_collections.ConfigDict(json.load(f))


def build_model(config, *, abstract: bool = False):
    """The config's model (shapes only with `abstract`, e.g. to restore a checkpoint into)."""
    def make():
        return scenarioclip.build(config.model.kind, preset=config.model.preset,
                                  init="" if abstract else config.model.init,
                                  dtype=jnp.dtype(config.model.dtype), seed=config.seed,
                                  embed_dim=config.model.embed_dim)
    return nnx.eval_shape(make) if abstract else make()
