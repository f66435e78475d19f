"""A training run as a user starts it, timed: cold (a fresh compilation cache), stopped with
SIGTERM after some steps as a job scheduler or Ctrl-C would, then the same command again on the
warm cache, resuming. From the two logs and the run's metrics.jsonl: the seconds to compile
every executable, the seconds from process start to the first loss, examples/s from the real
input pipeline, and MFU / useful MFU (FLOPs of the step at each batch's packed size / at its
real crops, from the run's own config.json).

    python bench/bench_run_start.py --out DIR --stop-after 6 -- \\
        python3 launch/train.py --config configs/scenarioclip.py --workdir W ...
    python bench/bench_run_start.py --report W --out DIR      # the report again (any machine)

The command must name its `--workdir`; --stop-after counts its metrics lines
(`config.log_every` steps each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

COMPILED = re.compile(r"compiled the train step for (\d+) batch shape\(s\) in ([\d.]+) s")
FIRST = re.compile(r"step (\d+) done: loss ([\d.eE+-]+|nan|inf), ([\d.]+) s after the process")


def rows_in(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def run_cold_then_warm(cmd: list[str], workdir: Path, out: Path, stop_after: int,
                       timeout: float = 3600) -> None:
    """The command until `stop_after` metrics lines exist (then SIGTERM: it stops after the
    current step with a checkpoint), then again to its end; logs OUT/run_cold.log and
    OUT/run_warm.log."""
    with open(out / "run_cold.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while proc.poll() is None and rows_in(workdir / "metrics.jsonl") < stop_after:
            if time.monotonic() - t0 > timeout:
                break
            time.sleep(0.1)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout)
    with open(out / "run_warm.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)


def start_figures(log: str) -> dict:
    """Compile seconds and first-loss seconds of one start, from its log."""
    compiled, first = COMPILED.search(log), FIRST.search(log)
    return {"executables": int(compiled.group(1)) if compiled else None,
            "compile_s": float(compiled.group(2)) if compiled else None,
            "first_step": int(first.group(1)) if first else None,
            "first_loss_after_start_s": float(first.group(3)) if first else None}


@dataclasses.dataclass(frozen=True)
class UsefulLine:
    """The useful FLOPs of a step at a batch's real crops (`n_o` objects, `n_r` relations): the
    line through the step's FLOPs at `crops` slots of each level and at twice as many of one
    (`step_flops`), which bench_step_variants.py records in its JSON (`useful_flops`) for the
    run stage to take instead of lowering the step three times again."""
    base: float
    slope_objects: float
    slope_relations: float
    crops: int

    def __call__(self, n_o, n_r) -> float:
        return (self.base + self.slope_objects * (n_o - self.crops)
                + self.slope_relations * (n_r - self.crops))


def step_flops(config, useful: UsefulLine | None = None):
    """(all(packed_size), useful(objects, relations)): the FLOPs of the train step of `config`
    (a run's config.json: every switch included) at one of its packed sizes (`packed_size` in
    metrics.jsonl: both levels' slots) and at a batch's real crops, counted by XLA on the step
    lowered at abstract shapes (nothing is allocated or compiled). Useful FLOPs are the line
    through three lowerings (the step is linear in the crop slots, to its k^2 contrastive
    terms): a `UsefulLine`, or `useful` when given (then nothing is lowered for it)."""
    import functools

    import jax

    from bench_gpu_train import lowered_flops
    from sclaro_jax.checkpoint import build_model
    from sclaro_jax.data import batch as fields
    from sclaro_jax.data import packing
    from sclaro_jax.perf import PerfConfig
    from sclaro_jax.train import core, trainer

    tcfg = trainer.train_config(config, 1000)
    perf = PerfConfig.from_config(config)
    made = {}

    def init():
        graphdef, state, tx = core.init_state(build_model(config), tcfg)
        made.update(graphdef=graphdef, tx=tx)
        return state

    state = jax.eval_shape(init)
    step = jax.jit(core.make_train_step(made["graphdef"], made["tx"], tcfg,
                                        fused_update=perf.fused_update))
    batch = config.data.batch_size
    pcfg = trainer.pipeline_config(config, host_batch=batch)

    @functools.lru_cache(maxsize=None)
    def at(k_o: int, k_r: int) -> float:
        sizes = packing.PackedSizes(batch, (k_o,), (k_r,), 0, 0)
        specs = fields.batch_specs(batch, dataclasses.replace(pcfg, layout="packed",
                                                              packed=sizes))
        return lowered_flops(step.lower(state, {name: jax.ShapeDtypeStruct(*spec)
                                                for name, spec in specs.items()}))

    if useful is None:
        k = 4 * batch
        base = at(k, k)
        useful = UsefulLine(base, (at(2 * k, k) - base) / k, (at(k, 2 * k) - base) / k, k)
    tiers = {o + r: (o, r) for o, r in zip(pcfg.packed.objects, pcfg.packed.relations)}
    return lambda packed_size: at(*tiers[packed_size]), useful


def useful_line_of(path: str) -> UsefulLine | None:
    """The `useful_flops` line a bench_step_variants.py JSON records (None: no such file, or
    none recorded: the variants stage failed or was stopped before its default step)."""
    try:
        line = json.loads(Path(path).read_text()).get("useful_flops")
    except (OSError, ValueError):
        return None
    return UsefulLine(**line) if line else None


def report(workdir: Path, out: Path, peak_tflops: float, useful_from: str = "") -> dict:
    """run.json in OUT: each start's compile and first-loss seconds (its log) and the run's
    throughput over its metrics lines after each start's first (which holds the start-up).
    A line's `examples_per_sec` covers the steps since the line before it; its crops and packed
    size are its own step's, a sample of those steps, so MFU over many lines is unbiased.
    `useful_from`: a bench_step_variants.py JSON whose useful-FLOPs line (of the same recipe's
    default step) is taken instead of lowering this run's step three times."""
    from sclaro_jax.checkpoint import run_config

    config = run_config(str(workdir))
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl", encoding="utf-8")]
    logs = {name: (out / f"run_{name}.log").read_text() for name in ("cold", "warm")
            if (out / f"run_{name}.log").exists()}
    starts = {name: start_figures(text) for name, text in logs.items()}
    firsts = {s["first_step"] for s in starts.values() if s["first_step"]}
    keep, previous = [], None
    for r in rows:
        started = previous is None or any(previous < f <= r["step"] for f in firsts)
        if not started and r["examples_per_sec"] > 0:
            keep.append((r, r["step"] - previous))
        previous = r["step"]
    if not keep:
        raise SystemExit(f"{workdir}/metrics.jsonl: no lines past each start's first; run "
                         "more steps or log more often")
    given = useful_line_of(useful_from) if useful_from else None
    all_flops, useful_flops = step_flops(config, useful=given)
    batch = config.data.batch_size
    seconds = np.array([n * batch / r["examples_per_sec"] for r, n in keep])
    steps = np.array([n for _, n in keep])
    done = np.array([n * all_flops(r["packed_size"]) for r, n in keep])
    useful = np.array([n * useful_flops(r["crops_objects"], r["crops_relations"])
                       for r, n in keep])
    peak = peak_tflops * 1e12
    result = {"starts": starts, "lines": len(keep), "steps_timed": int(steps.sum()),
              "examples_per_sec": batch * steps.sum() / seconds.sum(),
              "data_wait_fraction": float(np.average([r["data_wait_fraction"] for r, _ in keep],
                                                     weights=seconds)),
              "tflops_per_step": float(done.sum() / steps.sum() / 1e12),
              "useful_tflops_per_step": float(useful.sum() / steps.sum() / 1e12),
              "mfu": float(done.sum() / seconds.sum() / peak),
              "useful_mfu": float(useful.sum() / seconds.sum() / peak),
              "peak_tflops": peak_tflops, "perf": dict(config.get("perf", {})),
              "useful_flops": {**dataclasses.asdict(useful_flops),
                               "from": useful_from if given is not None else "this run's step"}}
    (out / "run.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the logs and run.json")
    parser.add_argument("--stop-after", type=int, default=6,
                        help="metrics lines of the cold start before it is stopped (SIGTERM)")
    parser.add_argument("--report", default="", metavar="WORKDIR",
                        help="only the report of a run already made (its logs in --out)")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--useful-flops-from", default="", metavar="JSON",
                        help="take the useful-FLOPs line from bench_step_variants.py's JSON of "
                             "the same recipe (else the run's step is lowered for it)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        workdir = Path(args.report)
    else:
        if "--workdir" not in cmd:
            parser.error("give the training command after --, with its --workdir")
        workdir = Path(cmd[cmd.index("--workdir") + 1])
        run_cold_then_warm(cmd, workdir, out, args.stop_after)
    print(json.dumps(report(workdir, out, args.peak_tflops, args.useful_flops_from), indent=2))


if __name__ == "__main__":
    main()
