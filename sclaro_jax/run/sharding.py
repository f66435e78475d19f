"""Data-parallel and FSDP layouts of the train state and batches over a `jax.sharding` mesh.

One mesh axis, "data", over every device of every host (`jax.devices()`):
- "dp": parameters, teacher and optimiser state replicated; batches split along their leading
  (batch) axis.
- "fsdp": additionally every array of the state with an axis divisible by the device count (and
  at least `min_size` elements) is split along its largest such axis, so each device holds 1/n
  of the parameters, teacher and Adam moments; XLA gathers them for the matmuls.
- "none": one device, nothing sharded.
The jitted step is the same function in all three; only the shardings differ.

Many processes (`config.distributed`): `initialize_distributed()` joins them before anything
touches a device; the mesh then spans the devices of every process, each process feeds its own
part of every global batch (`put_batch`), and a checkpoint restores onto any mesh (orbax reads
each array into the target's sharding), so a run written with fsdp over 8 devices resumes on one.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sclaro_jax import compile

STRATEGIES = ("none", "dp", "fsdp")
AXIS = "data"


ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_distributed(environ=None) -> tuple[int, int]:
    """Join a multi-process run; returns (process index, process count). Call it first, before
    any JAX computation (launch/train.py does for `config.distributed`).

    The coordinator's "host:port", the number of processes and this process's id come from
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID when set (all three, e.g. to
    run several processes on one machine), else from the cluster JAX detects (SLURM, Open MPI,
    Cloud TPU, ...). Cross-process collectives on CPU go through gloo."""
    environ = os.environ if environ is None else environ
    given = {k: environ.get(k) for k in ENV if environ.get(k)}
    if given and len(given) < len(ENV):
        raise ValueError(f"multi-process run: {sorted(given)} set but not "
                         f"{sorted(set(ENV) - set(given))}; set all three of {list(ENV)} "
                         "(or none, to let JAX detect the cluster)")
    kwargs = {}
    if given:
        try:
            count, index = int(given["JAX_NUM_PROCESSES"]), int(given["JAX_PROCESS_ID"])
        except ValueError:
            raise ValueError("JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers, not "
                             f"{given['JAX_NUM_PROCESSES']!r} and "
                             f"{given['JAX_PROCESS_ID']!r}") from None
        if not 0 <= index < count:
            raise ValueError(f"JAX_PROCESS_ID {index} is not in 0..{count - 1} "
                             f"(JAX_NUM_PROCESSES {count})")
        kwargs = dict(coordinator_address=given["JAX_COORDINATOR_ADDRESS"],
                      num_processes=count, process_id=index)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # before the CPU backend
    jax.distributed.initialize(**kwargs)
    return jax.process_index(), jax.process_count()


def make_mesh(strategy: str, devices=None) -> Mesh | None:
    if strategy not in STRATEGIES:
        raise ValueError(f"sharding strategy {strategy!r} is not one of {STRATEGIES}")
    if strategy == "none":
        return None
    devices = np.asarray(jax.devices() if devices is None else devices)
    return Mesh(devices.reshape(-1), (AXIS,))


def _leaf_spec(x, n: int, strategy: str, min_size: int) -> P:
    shape = getattr(x, "shape", ())
    if strategy != "fsdp" or not shape or int(np.prod(shape)) < min_size:
        return P()
    candidates = [i for i, d in enumerate(shape) if d % n == 0]
    if not candidates:
        return P()
    axis = max(candidates, key=lambda i: shape[i])
    return P(*([None] * axis + [AXIS]))


def state_shardings(state, mesh: Mesh | None, strategy: str, min_size: int = 2 ** 12):
    """A pytree of NamedShardings for the train state (None without a mesh)."""
    if mesh is None:
        return None
    n = mesh.devices.size
    return jax.tree.map(lambda x: NamedSharding(mesh, _leaf_spec(x, n, strategy, min_size)),
                        state)


def batch_sharding(mesh: Mesh | None):
    return None if mesh is None else NamedSharding(mesh, P(AXIS))


def put_batch(batch: dict, mesh: Mesh | None) -> dict:
    """Host batch (this process's part on multi-host) -> global arrays split on the batch axis."""
    if mesh is None:
        return batch
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in batch.items()}


def place(state, shardings):
    """`jax.device_put(state, shardings)` (one sharding or a tree of them); abstract leaves
    (`jax.ShapeDtypeStruct`, a state to restore a checkpoint into) get the sharding attached."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x, s: place(x, s), state, shardings)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings)
                        if isinstance(x, jax.ShapeDtypeStruct) else jax.device_put(x, shardings),
                        state)


def jit_step(step_fn, state, mesh: Mesh | None, strategy: str, *,
             compiler_options: dict | None = None):
    """(jitted step, state placed on the mesh, or on this process's first device without one;
    an abstract state gets its shardings attached: `place`). The state is donated; our per-backend XLA options apply (`sclaro_jax.compile`; see
    bench/README.md), `compiler_options` over them (`config.perf.xla_options`). Placing every
    leaf explicitly matters when a state mixes arrays committed to a device (restored or
    imported weights) with uncommitted ones (new heads): the first call would otherwise compile
    once for the mix and again for the step's own outputs."""
    if mesh is None:
        state = place(state, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        return compile.jit(step_fn, options=compiler_options, donate_argnums=0), state
    shardings = state_shardings(state, mesh, strategy)
    state = place(state, shardings)
    replicated = NamedSharding(mesh, P())
    jitted = compile.jit(step_fn, options=compiler_options,
                         in_shardings=(shardings, batch_sharding(mesh)),
                         out_shardings=(shardings, replicated), donate_argnums=0)
    return jitted, state
