"""Data-parallel and FSDP steps on 8 host CPU devices give the single-device numbers."""

from conftest import run_script

SCRIPT = r'''
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
sys_path = __import__("sys").path.insert(0, "tests")
from test_train_core import _batch, CFG
from sclaro_jax.models import scenarioclip
from sclaro_jax.train import core, sharding

assert len(jax.devices()) == 8
batch = _batch(0, batch_size=8)
out = {}
for strategy in ("none", "dp", "fsdp"):
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=16, seed=0)
    graphdef, state, tx = core.init_state(model, CFG)
    step_fn = core.make_train_step(graphdef, tx, CFG)
    mesh = sharding.make_mesh(strategy)
    jitted, state = sharding.jit_step(step_fn, state, mesh, strategy)
    losses = []
    for i in range(2):
        state, metrics = jitted(state, sharding.put_batch(_batch(i, batch_size=8), mesh))
        losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    leaves = jax.tree.leaves(state.params)
    if strategy == "fsdp":
        split = [x for x in leaves if not x.sharding.is_fully_replicated]
        assert len(split) > 10, len(split)
        big = max(leaves, key=lambda x: x.size)
        shard = big.addressable_shards[0].data
        assert shard.size * 8 == big.size, (shard.shape, big.shape)
    out[strategy] = losses
    print(strategy, losses)
# The loss of step 1 (same start) and of step 2 (after one sharded update), and the gradient
# norms. Parameters themselves are not compared at 1e-5: Adam turns float32 summation-order
# differences in near-zero gradients into update differences of up to ~lr.
for strategy in ("dp", "fsdp"):
    for (loss, gnorm), (loss1, gnorm1) in zip(out[strategy], out["none"]):
        assert abs(loss - loss1) <= 1e-5, (strategy, loss, loss1)
        assert abs(gnorm - gnorm1) <= 1e-5 * max(1.0, gnorm1), (strategy, gnorm, gnorm1)
print("OK")
'''


def test_dp_and_fsdp_match_one_device():
    run_script(SCRIPT)
