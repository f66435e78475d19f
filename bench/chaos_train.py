"""Chaos benchmark: a demo training run killed N times at random moments, rerun after each kill
until it completes, then compared step by step with an uninterrupted run of the same config.

    python bench/chaos_train.py --kills 20 --steps 60 --out DIR [--seed S] [--json FILE]

Both runs use `configs/scenarioclip.py:demo` with `--config.train.steps=STEPS`,
`--config.log_every=1` (every step's loss in WORKDIR/metrics.jsonl),
`--config.checkpoint_every=5` (override with --checkpoint-every), no progress bar, no
evaluation, the demo dataset written once to DIR/demo (32 px) and one compilation cache
(DIR/jax_cache). The reference runs in DIR/reference, the killed one in DIR/chaos.

Each kill is one of SIGKILL, SIGTERM, SIGINT (SIGINT restored to its default in the child: a
background process of a non-interactive shell inherits it ignored), at one of two moments:

- step: after the process logs its first step ("step N done: ..."), a step is drawn in the next
  stretch of the run; when its loss appears in metrics.jsonl, the signal comes after a random
  fraction of a step's time (so in the middle of a later step);
- save: right after the log line "checkpoint at step N started" of a checkpoint drawn in the
  next stretch (the checkpoint is being written in the background).

The (signal, moment) pairs are spread evenly over the kills, in a random order. After each kill
the same command is run again; it must resume (an unfinished checkpoint is reported and
removed). PASS: every rerun resumed, the final metrics.jsonl holds steps 1..STEPS once each,
and the largest |loss difference| from the reference over all steps is 0 (the project resumes
exactly: the data iterator's position is in the checkpoint and the CPU step is deterministic).
Exit status 1 on FAIL. A SIGTERM / SIGINT that ends the process by its default action instead
of a graceful stop (one that comes while the last checkpoint is written, after the training
loop's handlers are gone) is counted in the table and printed as a note, not a failure: the
rerun must then resume as after a SIGKILL.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import queue
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
MOMENTS = ("step", "save")
FIRST = re.compile(r"step (\d+) done: loss \S+, ([\d.]+) s after the process started")
SAVE = re.compile(r"checkpoint at step (\d+) started")
RESUMED = re.compile(r"resumed from \S+ at step (\d+)")
UNFINISHED = "found an unfinished checkpoint"


def command(workdir: Path, data: Path, cache: Path, steps: int, checkpoint_every: int) -> list:
    return [sys.executable, str(ROOT / "launch" / "train.py"),
            "--config", str(ROOT / "configs" / "scenarioclip.py") + ":demo",
            "--workdir", str(workdir), f"--config.data.dir={data}",
            f"--config.compilation_cache={cache}", f"--config.train.steps={steps}",
            "--config.log_every=1", f"--config.checkpoint_every={checkpoint_every}",
            "--config.progress_bar=False", "--no-eval"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """One process of the launcher: stdout to a log file, stderr read line by line by a thread
    (into a queue, and appended to the same log)."""

    def __init__(self, cmd: list, log: Path):
        self.log = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     preexec_fn=_default_sigint)
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        self.out: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stderr, self.err,
                                                                   True), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stdout, self.out,
                                                                   False), daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self, stream, into: list, lines: bool) -> None:
        for line in stream:
            into.append(line)
            self.log.write(line)
            if lines:
                self.lines.put(line)
        if lines:
            self.lines.put(None)  # end of stderr

    def wait_for(self, pattern: re.Pattern, accept=lambda m: True, timeout: float = 1800):
        """The first match of `pattern` in a stderr line that `accept`s; None if stderr ends."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                return None
            m = pattern.search(line)
            if m and accept(m):
                return m
        return None

    def finish(self, timeout: float = 1800) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
            self.err.append(f"(chaos_train: killed after {timeout} s without exiting)\n")
        for t in self._threads:
            t.join(timeout=30)
        self.log.close()
        return rc

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def metric_steps(path: Path) -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass  # a line torn by a kill (cut back on resume)
    except FileNotFoundError:
        pass
    return rows


def last_step(path: Path) -> int:
    rows = metric_steps(path)
    return rows[-1]["step"] if rows else 0


def reference_run(cmd: list, workdir: Path, log: Path) -> tuple[float, float]:
    """The uninterrupted run; (its wall seconds, the median seconds between metrics lines)."""
    t0 = time.monotonic()
    run = Run(cmd, log)
    seen, times = 0, []
    while run.proc.poll() is None:
        n = last_step(workdir / "metrics.jsonl")
        if n > seen:
            seen = n
            times.append(time.monotonic())
        time.sleep(0.05)
    rc = run.finish()
    wall = time.monotonic() - t0
    if rc != 0 or "done:" not in run.stdout:
        sys.exit(f"the reference run failed (exit {rc}); its log: {log}\n{run.stderr[-3000:]}")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return wall, (statistics.median(gaps) if gaps else 0.1)


def kill_plan(kills: int, rng: random.Random) -> list[tuple[str, str]]:
    """`kills` (signal, moment) pairs, every pair equally often (up to one), in random order."""
    pairs = list(itertools.product(SIGNALS, MOMENTS))
    rng.shuffle(pairs)
    plan = (pairs * math.ceil(kills / len(pairs)))[:kills]
    rng.shuffle(plan)
    return plan


def chaos_run(cmd: list, workdir: Path, out: Path, plan: list, steps: int, every: int,
              step_time: float, rng: random.Random) -> dict:
    """Run `cmd` until it completes, delivering the kills of `plan` one per process."""
    kills, runs, problems, notes = [], [], [], []
    pending = list(plan)
    t0 = time.monotonic()
    while True:
        if len(runs) > len(plan) + 10:
            problems.append(f"gave up after {len(runs)} processes")
            break
        log = out / f"chaos_run_{len(runs):02d}.log"
        run = Run(cmd, log)
        record = {"log": log.name, "resumed_at": None, "unfinished_reported": False}
        kill = None
        if pending:
            sig, moment = pending[0]
            first = run.wait_for(FIRST)
            if first is not None:
                start = int(first.group(1)) - 1  # the step the process resumed from
                kill = {"signal": sig, "moment": moment, "started_at": start}
                # the next stretch of the run: the steps left shared among the kills left
                span = max(1, math.ceil((steps - start) / len(pending)))
                hi = min(start + span, steps - 1)
                saves = [s for s in range(start + 1, steps + 1) if s % every == 0 or s == steps]
                if moment == "step" and start + 1 > hi:
                    moment = kill["moment"] = "save"  # only the last step is left
                if moment == "save":
                    near = [s for s in saves if s <= max(hi, saves[0])]
                    target = rng.choice(near)
                    kill["target"] = target
                    m = run.wait_for(SAVE, lambda m, t=target: int(m.group(1)) >= t)
                    delay = 0.0
                else:
                    target = rng.randint(start + 1, hi)
                    kill["target"] = target
                    delay = rng.uniform(0.0, step_time)
                    m = None
                    while run.proc.poll() is None:
                        if last_step(workdir / "metrics.jsonl") >= target:
                            m = True
                            break
                        time.sleep(0.02)
                    if m:
                        time.sleep(delay)
                if (m is not None) and run.proc.poll() is None:
                    kill["at_step"] = last_step(workdir / "metrics.jsonl")
                    kill["delay_s"] = round(delay, 3)
                    kill["t"] = round(time.monotonic() - t0, 1)
                    os.kill(run.proc.pid, SIGNALS[sig])
                    pending.pop(0)
                else:
                    kill = None  # the process ended first: the kill goes to the next one
        rc = run.finish()
        err, stdout = run.stderr, run.stdout
        resumed = RESUMED.search(err)
        record.update(exit=rc, resumed_at=int(resumed.group(1)) if resumed else None,
                      unfinished_reported=UNFINISHED in err)
        if kill is not None:
            stopped = re.search(r"stopped at step (\d+) of", stdout)
            kill.update(exit=rc, stopped_at=int(stopped.group(1)) if stopped else None,
                        completed="done:" in stdout)
            if kill["signal"] != "SIGKILL" and rc == -SIGNALS[kill["signal"]]:
                # not a graceful stop: the signal's default action ended the process (as when
                # it comes while the last checkpoint is written, after the loop); the rerun
                # must resume as after a SIGKILL
                kill["ungraceful"] = True
                notes.append(f"{kill['signal']} during {kill['moment']} {kill['target']} ended "
                             f"the process (exit {rc}), no graceful stop ({log.name})")
            elif kill["signal"] != "SIGKILL" and rc != 0:
                problems.append(f"{kill['signal']} gave exit {rc} ({log.name})")
            if "Traceback" in err:
                problems.append(f"a traceback after {kill['signal']} ({log.name})")
            kills.append(kill)
            record["kill"] = kill
        before = runs[-1].get("kill") if runs else None
        if before and before["stopped_at"] is not None and \
                record["resumed_at"] != before["stopped_at"]:  # a graceful stop's checkpoint
            problems.append(f"{log.name}: resumed at {record['resumed_at']}, not at step "
                            f"{before['stopped_at']} where the run before stopped")
        runs.append(record)
        if kill is None and rc != 0:
            problems.append(f"{log.name}: exit {rc} without a kill:\n{err[-2000:]}")
            break
        if "done:" in stdout:
            break
    return {"kills": kills, "runs": runs, "problems": problems, "notes": notes,
            "pending": pending,
            "wall_s": time.monotonic() - t0}


def compare(workdir: Path, reference: Path, steps: int) -> dict:
    got, want = metric_steps(workdir / "metrics.jsonl"), metric_steps(
        reference / "metrics.jsonl")
    got_steps = [r["step"] for r in got]
    ref = {r["step"]: r["loss"] for r in want}
    diffs = [abs(r["loss"] - ref[r["step"]]) for r in got if r["step"] in ref]
    return {"steps_once": got_steps == list(range(1, steps + 1)),
            "reference_steps_once": [r["step"] for r in want] == list(range(1, steps + 1)),
            "rows": len(got), "max_abs_loss_diff": max(diffs) if diffs else math.inf,
            "equal_steps": sum(d == 0 for d in diffs)}


def table(result: dict) -> str:
    kills = result["kills"]
    lines = ["| signal | during a step | during a save | total |", "|---|---|---|---|"]
    for sig in SIGNALS:
        n = [sum(k["signal"] == sig and k["moment"] == m for k in kills) for m in MOMENTS]
        lines.append(f"| {sig} | {n[0]} | {n[1]} | {sum(n)} |")
    n = [sum(k["moment"] == m for k in kills) for m in MOMENTS]
    lines.append(f"| all | {n[0]} | {n[1]} | {sum(n)} |")
    c = result["compare"]
    lines += ["", "| kills survived | reruns | unfinished checkpoints removed | wall s (reference) "
              "| steps (each once) | largest abs loss difference | SIGTERM/SIGINT not graceful |",
              "|---|---|---|---|---|---|---|",
              f"| {result['survived']} of {result['kills_asked']} | {result['reruns']} | "
              f"{result['unfinished_removed']} | {result['wall_s']:.0f} "
              f"({result['reference_wall_s']:.0f}) | {result['steps']} "
              f"({'yes' if c['steps_once'] else 'NO'}) | {c['max_abs_loss_diff']:.3g} | "
              f"{sum(bool(k.get('ungraceful')) for k in kills)} |"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="kills to survive (default 20)")
    p.add_argument("--steps", type=int, default=60, help="the run's steps (default 60)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints "
                   "(default 5)")
    p.add_argument("--out", required=True, help="folder for the data, both runs and the logs "
                   "(emptied first)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill plan (default 0)")
    p.add_argument("--json", help="also write the result (every kill) to this JSON file")
    args = p.parse_args(argv)
    if args.kills < 0 or args.steps < 2 or args.checkpoint_every < 1:
        p.error("--kills >= 0, --steps >= 2, --checkpoint-every >= 1")

    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    data, cache = out / "demo", out / "jax_cache"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "data_prep", "demo", "--out", str(data),
                    "--image-size", "32"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # its progress bar
    rng = random.Random(args.seed)
    plan = kill_plan(args.kills, rng)

    ref = out / "reference"
    print(f"reference run: {ref} ...", flush=True)
    ref_wall, step_time = reference_run(
        command(ref, data, cache, args.steps, args.checkpoint_every), ref,
        out / "reference.log")
    print(f"  {ref_wall:.0f} s, {step_time:.2f} s a step", flush=True)
    work = out / "chaos"
    print(f"chaos run: {work}, {args.kills} kills ...", flush=True)
    result = chaos_run(command(work, data, cache, args.steps, args.checkpoint_every), work, out,
                       plan, args.steps, args.checkpoint_every, step_time, rng)
    result.update(compare=compare(work, ref, args.steps), kills_asked=args.kills,
                  survived=len(result["kills"]), reruns=len(result["runs"]) - 1,
                  unfinished_removed=sum(r["unfinished_reported"] for r in result["runs"]),
                  reference_wall_s=ref_wall, step_time_s=step_time, steps=args.steps,
                  seed=args.seed, total_wall_s=time.monotonic() - t0)
    c = result["compare"]
    ok = (not result["problems"] and not result["pending"] and c["steps_once"]
          and c["reference_steps_once"] and c["max_abs_loss_diff"] == 0)
    result["pass"] = ok
    for k in result["kills"]:
        print(f"  {k['signal']:7} {k['moment']:4} resumed from {k['started_at']:3}, "
              f"target {k['target']:3}, at step {k.get('at_step')}, exit {k['exit']}"
              + (f", stopped at {k['stopped_at']}" if k["stopped_at"] is not None else "")
              + (" (completed)" if k["completed"] else ""))
    for note in result["notes"]:
        print("note:", note)
    for problem in result["problems"]:
        print("problem:", problem)
    if result["pending"]:
        print(f"kills not delivered: {len(result['pending'])}")
    print()
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
