"""Starting Ray for `annotate --engine ray`: `start_ray` connects to the cluster a user names
(`--ray-address`, or the RAY_ADDRESS environment variable), or starts Ray on this machine
listening on 127.0.0.1 only.

A Ray started on this machine takes by default the address others reach the machine at: its
GCS server, raylet, object manager, workers and agents then listen on every interface, and
anyone who can reach the machine (a shared cluster node, say) can connect to them and run code
as the user, with nothing but Ray's own token (in the versions that have one) in the way. The
Ray started here takes the loopback address instead, as Ray itself does on macOS and Windows
(its single-machine mode, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` off), and every one of those
processes binds to it. Should a Ray version take another address all the same, that Ray is
shut down and the run refused.
"""

from __future__ import annotations

import ipaddress
import logging
import os


# a Ray started here keeps this many idle task workers (Ray's variable; the user's value wins)
IDLE_WORKERS = ("RAY_num_workers_soft_limit", "64")


def start_ray(address: str = "", **kwargs) -> None:
    """`ray.init` as `--engine ray` does it: connect to the cluster at `address` (or
    RAY_ADDRESS), or start Ray on this machine on 127.0.0.1 (`kwargs` such as num_cpus go to
    ray.init). A Ray it starts keeps idle task workers alive (`RAY_num_workers_soft_limit`,
    unless set): by default a node reaps the idle workers above its CPU count within a second,
    and the stage actors alone exceed that on a small machine, so every block write would start
    a new Python process (about 2 CPU seconds of imports, which the stages then lack)."""
    import ray
    from ray._private import ray_constants

    init = dict(include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or None, **init, **kwargs)
        return
    os.environ.setdefault(*IDLE_WORKERS)
    # Ray reads its single-machine switch at import: set for this start only
    single, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(address=None, **init, **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = single
    node = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node).is_loopback:
        ray.shutdown()
        raise RuntimeError(f"the Ray started on this machine took the address {node}, not "
                           f"127.0.0.1, so others could reach it; start one yourself (ray start "
                           f"--head) and pass --ray-address")
