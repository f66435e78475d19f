"""Data-parallel and FSDP steps on 8 host CPU devices give the single-device numbers."""

import pytest
from conftest import run_script

SCRIPT = r'''
import os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # the suite's flags too
                           + " --xla_force_host_platform_device_count=8")
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
sys_path = __import__("sys").path.insert(0, "tests")
from test_train_core import _batch, CFG
from sclaro_jax.models import scenarioclip
from sclaro_jax.run import sharding
from sclaro_jax.train import core

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


@pytest.mark.slow
def test_dp_and_fsdp_match_one_device():
    run_script(SCRIPT)


def test_two_hosts_read_the_one_host_global_batches(demo_dir):
    """Host h of 2 (batch 4 each) reads records 4h..4h+3 of every one-host batch of 8: the global
    batches, augmentation draws included, do not depend on the number of hosts."""
    import grain.python as grain
    import numpy as np

    from sclaro_jax.data.pipeline import PipelineConfig, make_loader

    cfg = PipelineConfig(image_size=32, max_objects=8, max_relations=6)
    one = iter(make_loader(demo_dir, "train", 8, config=cfg, seed=42))
    hosts = [iter(make_loader(demo_dir, "train", 4, config=cfg, seed=42,
                              shard_options=grain.ShardOptions(h, 2))) for h in range(2)]
    for _ in range(3):  # 24 samples of the 10 records: past the epoch boundaries
        want, parts = next(one), [next(h) for h in hosts]
        for key in want:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), want[key],
                                          err_msg=key)


def test_global_batch_positions_and_the_one_host_sampler():
    import grain.python as grain

    from sclaro_jax.data.sampler import GlobalBatchSampler

    # one host: Grain's own sampler (order, augmentation rng, and the repr its restore checks)
    old = grain.IndexSampler(num_records=10, shard_options=grain.ShardOptions(0, 1, True),
                             shuffle=True, seed=42)
    new = GlobalBatchSampler(10, grain.ShardOptions(0, 1, True), 4, 2, shuffle=True, seed=42)
    assert repr(new) == repr(old)
    for i in range(30):
        assert new[i].record_key == old[i].record_key
        assert new[i].rng.integers(2 ** 31) == old[i].rng.integers(2 ** 31)
    # 3 hosts, batch 2, 2 Grain workers: worker w's j-th batch on host h (Grain hands host h
    # positions i*3 + h, and worker w every second of them) is slots 2h, 2h+1 of the one-host
    # batch 2j+w (6 records, which one-host worker w makes from positions w, w+2, ...)
    hosts = [GlobalBatchSampler(100, grain.ShardOptions(h, 3), 2, 2, shuffle=False, seed=0)
             for h in range(3)]
    for h, sampler in enumerate(hosts):
        local = [sampler.position(i * 3 + h) for i in range(8)]
        for w in range(2):
            mine = local[w::2]  # this worker's positions, two batches of 2
            for j in range(2):
                batch = [w + 2 * (j * 6 + 2 * h + t) for t in range(2)]
                assert mine[2 * j:2 * j + 2] == batch, (h, w, j)
    # finite epochs: every host stops after the same whole global batches
    finite = GlobalBatchSampler(10, grain.ShardOptions(1, 2), 2, 0, shuffle=True, seed=1,
                                num_epochs=1)
    assert len(finite) == 8
    assert max(finite.position(i) for i in range(1, 8, 2)) < 10


def test_initialize_distributed_refuses_a_partial_environment():
    import pytest

    from sclaro_jax.run.sharding import initialize_distributed

    with pytest.raises(ValueError, match=r"\['JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES'\] "
                                         r"set but not \['JAX_PROCESS_ID'\]"):
        initialize_distributed({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234",
                                "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID 2 is not in 0\.\.1"):
        initialize_distributed({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234",
                                "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"})
    with pytest.raises(ValueError, match="must be integers"):
        initialize_distributed({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234",
                                "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"})
