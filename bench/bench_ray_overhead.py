"""What Ray Data itself costs on this machine while `annotate --engine ray` streams: the
pipeline's shape (a VLM, N detector and a SAM actor pool, one block per task, a Datasink
writing each block) with stage actors that only sleep, so that every CPU second measured is
Ray's own (the driver's streaming executor, the stage actors' core workers, raylet, GCS, the
stats / autoscaling / actor-location actors, idle workers).

    python bench/bench_ray_overhead.py                 # 2 detector actors, 3 s per block
    python bench/bench_ray_overhead.py --detectors 1

CPU time per process is read from /proc (Linux) at the start and end of a window in the
steady phase (after `--skip` seconds, `--window` seconds long) and printed as a percentage of
one core, largest first.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (command line, user + system CPU seconds) for every process we can read."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[int(pid)] = (cmd or "?", (int(fields[11]) + int(fields[12])) / tick)
    return out


def name(cmd: str, pid: int) -> str:
    """A short name: the executable and script for a program, Ray's title for a worker."""
    if pid == os.getpid():
        return "this driver (Ray Data's streaming executor)"
    if cmd.startswith("ray::MapWorker"):
        return "ray::MapWorker (the stage actors)"
    if cmd.startswith("/"):
        words = cmd.split(" ")
        script = [w for w in words[1:] if w.endswith(".py")][:1] \
            if os.path.basename(words[0]).startswith("python") else []
        return " ".join(os.path.basename(w) for w in words[:1] + script)
    return cmd.split(" ")[0]


class Sleep:
    """A stage actor that does no work: `seconds` of sleep per block."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, batch):
        time.sleep(self.seconds)
        return batch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--detectors", type=int, default=2)
    parser.add_argument("--detect-s", type=float, default=3.0,
                        help="seconds a detector actor sleeps per block")
    parser.add_argument("--sam-s", type=float, default=0.4)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--skip", type=float, default=15.0)
    parser.add_argument("--window", type=float, default=20.0)
    args = parser.parse_args()
    import pandas as pd
    import ray
    import ray.data
    from ray.data import DataContext
    from ray.data.datasource import Datasink

    from data_prep.annotate.ray_engine import SINK_CPUS
    from data_prep.annotate.ray_start import start_ray

    class NullSink(Datasink):
        def write(self, blocks, ctx):
            for _ in blocks:
                pass

    start_ray(num_cpus=os.cpu_count())
    ctx = DataContext.get_current()
    ctx.target_max_block_size = None
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ds = ray.data.from_pandas([pd.DataFrame({"id": [f"{k}a", f"{k}b"], "block": [k, k]})
                               for k in range(args.blocks)])
    for seconds, actors in ((0.01, 1), (args.detect_s, args.detectors), (args.sam_s, 1)):
        ds = ds.map_batches(Sleep, fn_constructor_args=(seconds,), batch_size=None,
                            compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=0.4)
    window = {}

    def sample():
        time.sleep(args.skip)
        before, t0 = cpu_seconds(), time.perf_counter()
        time.sleep(args.window)
        after, seconds = cpu_seconds(), time.perf_counter() - t0
        used = collections.Counter()
        for pid, (cmd, cpu) in after.items():
            if pid in before:
                used[name(cmd, pid)] += cpu - before[pid][1]
        window.update(used=used, seconds=seconds)

    sampler = threading.Thread(target=sample)
    t0 = time.perf_counter()
    sampler.start()
    ds.write_datasink(NullSink(), ray_remote_args={"num_cpus": SINK_CPUS})
    run = time.perf_counter() - t0
    sampler.join()
    ray.shutdown()
    if run < args.skip + args.window:
        print(f"warning: the run ({run:.0f} s) ended inside the window; raise --blocks")
    used, seconds = window["used"], window["seconds"]
    print(f"{args.blocks} blocks, 1 VLM + {args.detectors} detector + 1 SAM actors that sleep "
          f"({args.detect_s} s / {args.sam_s} s per block), {os.cpu_count()} cores, "
          f"ray {ray.__version__}; run {run:.1f} s, window {seconds:.1f} s")
    print(f"all processes: {sum(used.values()) / seconds * 100:.1f}% of a core")
    for cmd, cpu in used.most_common(14):
        if cpu / seconds >= 0.002:
            print(f"  {cpu / seconds * 100:5.1f}%  {cmd}")


if __name__ == "__main__":
    main()
