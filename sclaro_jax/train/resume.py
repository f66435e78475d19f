"""Restoring a run's full train state (student, teacher, optimiser state, step) and its Grain
iterator from an orbax checkpoint, including checkpoints of the older optimiser-state layout.

Checkpoints written before the optimiser state was keyed by parameter names hold it over a
Python list of the trainable leaves (in `jax.tree.leaves(params)` order). Those leaves are the
leaves of today's `core.trainable_part(params)` in the same order, so such a checkpoint is
restored into the list layout and its leaves are put into today's structure, unchanged.
"""

from __future__ import annotations

import os

import grain.python as grain
import jax
import orbax.checkpoint as ocp

from sclaro_jax.train import core


def positional_opt_state(state: core.TrainState, cfg: core.TrainConfig):
    """The optimiser state in the old list layout (its shapes, on this process's first device),
    as a restore target."""
    labels = core.param_labels(state.params, cfg)
    tx = core.make_optimizer(cfg, jax.tree.leaves(core.trainable_part(labels, labels)))
    shapes = jax.eval_shape(tx.init, jax.tree.leaves(core.trainable_part(state.params, labels)))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        shapes)


def _moments_are_lists(tree) -> bool:
    if isinstance(tree, dict):
        if isinstance(tree.get("mu"), (list, tuple)):
            return True
        return any(_moments_are_lists(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_moments_are_lists(v) for v in tree)
    return False


def is_positional(checkpoint_dir: str) -> bool:
    """Whether the checkpoint step folder holds the old list-layout optimiser state."""
    meta = ocp.StandardCheckpointer().metadata(os.path.join(checkpoint_dir, "state"))
    return _moments_are_lists(meta.item_metadata["opt_state"])


def restore(manager: ocp.CheckpointManager, step: int, state: core.TrainState, iterator,
            cfg: core.TrainConfig) -> core.TrainState:
    """The train state at `step` (shaped and placed like `state`); `iterator` (a Grain
    DataLoader iterator) is set to where that step left off."""
    legacy = is_positional(os.path.join(str(manager.directory), str(step)))
    target = state.replace(opt_state=positional_opt_state(state, cfg)) if legacy else state
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target),
        data=grain.PyGrainCheckpointRestore(iterator)))["state"]
    if not legacy:
        return restored
    leaves = jax.tree.leaves(restored.opt_state)
    template, treedef = jax.tree.flatten(state.opt_state)
    if [x.shape for x in leaves] != [x.shape for x in template]:
        raise ValueError(f"checkpoint {step} in {manager.directory}: its list-layout optimiser "
                         "state does not match this config's trainable parameters (was it "
                         "written with other frozen_vision_layers / frozen_text_layers?)")
    placed = [jax.device_put(x, t.sharding) for x, t in zip(leaves, template)]
    return restored.replace(opt_state=jax.tree.unflatten(treedef, placed))
