"""A training run's folder, read back: its config, its model, its checkpointed weights.

Below both `train` (which writes runs) and `eval` (which reads them), so neither imports the
other. A run folder holds `config.json` (the full `ml_collections` config the run was started
with) and `checkpoints/<step>/` (orbax: the training state `state`, with `params`, `teacher`,
`opt_state` and `step`, and the input pipeline's position `data`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from sclaro_jax.config import run_config  # noqa: F401 (re-exported: read without jax)
from sclaro_jax.models import clip, open_clip_weights, scenarioclip
from sclaro_jax.perf import PerfConfig
from sclaro_jax.run.complete import DamagedRunError, check_steps, restore_failed

__all__ = ["DamagedRunError", "build_model", "check_run", "is_run", "load_checkpoint",
           "read_params", "run_config"]

log = logging.getLogger(__name__)


def is_run(workdir) -> bool:
    """Whether WORKDIR is a training run's folder: it has `checkpoints/`, or its config.json is
    a run's config (`model` and `train` sections, no Hugging Face `model_type`), saved or not."""
    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        return True
    try:
        with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and "model_type" not in config
            and isinstance(config.get("model"), dict) and "train" in config)


def check_run(workdir: str, step: int | None = None, *, flag: str | None = "--step") -> int:
    """The checkpoint step of WORKDIR to read: `step`, or the newest. The one check of a run
    every reader makes before restoring (`run.complete.check_steps`): a missing checkpoints
    folder, a step the run does not hold, or a damaged checkpoint (an empty folder, a truncated
    or missing file) raise `DamagedRunError` naming the step, the file and what is wrong, and
    which complete step to pass with `flag` instead."""
    return check_steps(os.path.abspath(os.path.join(workdir, "checkpoints")), step, flag=flag)


def build_model(config, *, abstract: bool = False, perf: bool | PerfConfig = True):
    """The config's model (shapes only with `abstract`, e.g. to restore a checkpoint into: its
    towers' random init is not used, so `scenarioclip.build`'s notice about it is not logged).
    A run started from a pretrained CLIP (`config.model.init`) has that checkpoint's tower
    config (sizes, activation, text length), read from its config or shapes, not its weights;
    the preset when the checkpoint is no longer there (logged). Its attention computes as
    `config.perf` says (`PerfConfig.attention_options`), or as `perf` says when it is a
    PerfConfig (the run's, derived once); `perf=False` gives the default einsums, which run on
    any backend (a trained model to evaluate)."""
    preset = clip.preset_at(config.model.preset, config.data.image_size)  # tiny: data's size
    if perf is True:
        perf = PerfConfig.from_config(config)
    attention = perf.attention_options() if perf else None
    if abstract and config.model.init:
        try:
            preset = open_clip_weights.pretrained_config(config.model.init)
        except (clip.CheckpointError, OSError) as err:
            log.warning("model.init %s cannot be read (%s): the towers are built from preset "
                        "%s, which must match it", config.model.init, err, preset)

    def make():
        return scenarioclip.build(config.model.kind, preset=preset,
                                  init="" if abstract else config.model.init,
                                  warn_random=not abstract,
                                  dtype=jnp.dtype(config.model.dtype), seed=config.seed,
                                  embed_dim=config.model.embed_dim,
                                  gradient_forms=config.model.get("gradient_forms", "auto"),
                                  attention=attention)
    return nnx.eval_shape(make) if abstract else make()


def load_checkpoint(workdir: str, step: int | None = None, *, teacher: bool = False,
                    config=None, flag: str | None = "--step"):
    """(model, step): the student's weights (or the EMA teacher's with `teacher`) of a
    checkpoint of WORKDIR (the newest by default), in the model that WORKDIR/config.json (or
    `config`, the `ml_collections` config that built the run) describes.

    Only `state.params` / `state.teacher` are read (an orbax partial restore), never the
    optimiser state, so any layout of `opt_state` loads. `flag`: the command's flag that
    names a step, for DamagedRunError's advice (None: there is none)."""
    if config is None:
        config = run_config(workdir)
    step = check_run(workdir, step, flag=flag)
    graphdef, params = nnx.split(build_model(config, abstract=True, perf=False), nnx.Param)
    which = "teacher" if teacher else "params"
    item = {which: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                nnx.to_pure_dict(params))}
    restored = read_params(workdir, step, item, flag=flag)
    return nnx.merge(graphdef, restored[which]), int(step)


def read_params(workdir: str, step: int, item: dict, *, composite: bool = True,
                flag: str | None = "--step") -> dict:
    """The parts of the train state that `item` names (e.g. {"params": a tree of
    ShapeDtypeStructs}) from checkpoint `step` of WORKDIR/checkpoints (a step `check_run`
    gave), read alone: an orbax partial restore, so the optimiser state is never read and any
    layout of it loads. The reader of every run's checkpoints: `composite`, the state is the
    checkpoint's item "state" (ScenarioCLIP's, beside the input pipeline's position "data");
    otherwise the checkpoint is the state alone (the detector's). A file that fails to restore
    raises DamagedRunError naming the step and the complete one to pass with `flag` instead."""
    folder = os.path.abspath(os.path.join(workdir, "checkpoints"))
    args = ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True)
    with contextlib.closing(ocp.CheckpointManager(folder)) as manager:
        try:
            if composite:
                return manager.restore(step, args=ocp.args.Composite(state=args))["state"]
            return manager.restore(step, args=args)
        except (OSError, RuntimeError, ValueError) as e:  # what a damaged file raises
            raise restore_failed(folder, step, e, flag=flag) from e
