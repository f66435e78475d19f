"""Same numbers before and after a change to the run machinery: the ScenarioCLIP demo run and a
small detection run (fixed seeds), each run with the code of one checkout, their metrics.jsonl
(and the detection results) compared number by number.

    python bench/run_parity.py run --code CHECKOUT --out DIR     # once per checkout
    python bench/run_parity.py compare DIR_BEFORE DIR_AFTER [--tol 1e-6]
    python bench/run_parity.py resume --code CHECKOUT --from DIR_BEFORE --out DIR

`run` writes DIR/demo (the demo shards), DIR/scn (24 steps of configs/scenarioclip.py:demo) and
DIR/det (the detector on DIR/scn's encoders, 64 px, 15 steps: `launch/train.py --config
configs/detection.py:demo`, or `python -m sclaro_jax.eval.detect` in checkouts before the
tasks). `resume`
continues copies of another checkout's scn and det folders with CHECKOUT's code (their
checkpoints restore: the orbax layout is unchanged) by a few steps.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

SCN = ["--config.checkpoint_every=8", "--config.log_every=4",
       "--config.train.ema_warmup_steps=6", "--config.compilation_cache=", "--config.progress_bar=false"]
DET = ["batch_size=2", "log_every=1", "checkpoint_every=10", "eval_batch_size=4",
       "detector.image_size=64", "detector.rpn_pre_nms_top_n_train=64",
       "detector.rpn_post_nms_top_n_train=32", "detector.box_batch_size_per_image=16",
       "compilation_cache="]
TIMING = {"examples_per_sec", "data_wait_fraction"}


def _run(code, args):
    env = dict(os.environ, PYTHONPATH=code)
    result = subprocess.run([sys.executable, *args], cwd=code, env=env, capture_output=True,
                            text=True)
    if result.returncode:
        sys.exit(f"failed: {args}\n{result.stderr[-4000:]}")
    return result.stdout


def _longer(code):
    """The flag that lets CHECKOUT continue a run to a new length (the run's length is part of
    its config since the run folder checks it; older checkouts continue without it)."""
    with open(os.path.join(code, "sclaro_jax", "eval", "detect.py"), encoding="utf-8") as f:
        text = f.read()
    return ["--allow-config-change"] if "--allow-config-change" in text or _tasks(code) else []


def _tasks(code):
    """Whether CHECKOUT trains the detector through the launcher's task (since issue 50; before,
    `python -m sclaro_jax.eval.detect` trained and evaluated it)."""
    return os.path.exists(os.path.join(code, "sclaro_jax", "detection", "task.py"))


def scn(code, out, data, steps, longer=()):
    _run(code, ["launch/train.py", "--config", "configs/scenarioclip.py:demo", "--workdir",
                os.path.join(out, "scn"), f"--config.data.dir={data}",
                f"--config.train.steps={steps}", *SCN, *longer])


def det(code, out, data, epochs, longer=()):
    """The detector on DIR/scn's encoders (global -> RPN, object -> RoI), trained and
    evaluated into DIR/det, by the command of CHECKOUT's time."""
    if _tasks(code):
        _run(code, ["launch/train.py", "--config", "configs/detection.py:demo", "--workdir",
                    os.path.join(out, "det"), f"--config.data.dir={data}",
                    f"--config.backbone.workdir={os.path.join(out, 'scn')}",
                    "--config.progress_bar=false",
                    *[f"--config.{kv}" for kv in DET + [f"epochs={epochs}"]], *longer])
        return
    sets = [x for kv in DET + [f"epochs={epochs}"] for x in ("--set", kv)]
    _run(code, ["-m", "sclaro_jax.eval.detect", "--workdir", os.path.join(out, "scn"),
                "--data", data, "--config", "demo", "--out", os.path.join(out, "det"),
                "--no-progress", *sets, *longer])


def cmd_run(args):
    data = os.path.join(args.out, "demo")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        _run(args.code, ["-c", "import sys; from data_prep.demo import build_demo; "
                         "build_demo(sys.argv[1], image_size=32, progress=False)", data])
    scn(args.code, args.out, data, 24)
    det(args.code, args.out, data, 3)


def cmd_resume(args):
    for name in ("scn", "det", "demo"):
        shutil.copytree(os.path.join(args.source, name), os.path.join(args.out, name),
                        dirs_exist_ok=True)
    data = os.path.join(args.out, "demo")
    scn(args.code, args.out, data, 28, _longer(args.code))
    det(args.code, args.out, data, 4, _longer(args.code))


def _rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _numbers(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _numbers(v, f"{prefix}{k}.")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield prefix[:-1], float(tree)


def compare(a, b, tol):
    """(number of values compared, largest difference, list of mismatches)."""
    pairs = []
    for name in ("scn/metrics.jsonl", "det/metrics.jsonl"):
        ra, rb = _rows(os.path.join(a, name)), _rows(os.path.join(b, name))
        if [r["step"] for r in ra] != [r["step"] for r in rb]:
            return 0, math.inf, [f"{name}: logged steps differ"]
        for x, y in zip(ra, rb):
            if set(x) != set(y):
                return 0, math.inf, [f"{name}: fields differ {sorted(set(x) ^ set(y))}"]
            pairs += [(f"{name}:{x['step']}:{k}", x[k], y[k]) for k in x if k not in TIMING]
    ma = dict(_numbers(json.load(open(os.path.join(a, "det/results.json")))["metrics"]))
    mb = dict(_numbers(json.load(open(os.path.join(b, "det/results.json")))["metrics"]))
    pairs += [(f"det/results.json:{k}", v, mb[k]) for k, v in ma.items()]
    worst, bad = 0.0, []
    for name, x, y in pairs:
        if isinstance(x, float) and math.isnan(x) and math.isnan(y):
            continue
        d = abs(x - y)
        worst = max(worst, d)
        if d > tol:
            bad.append(f"{name}: {x} vs {y}")
    return len(pairs), worst, bad


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--code", required=True)
    r.add_argument("--out", required=True)
    s = sub.add_parser("resume")
    s.add_argument("--code", required=True)
    s.add_argument("--from", dest="source", required=True)
    s.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--tol", type=float, default=1e-6)
    args = p.parse_args()
    if args.cmd == "run":
        cmd_run(args)
    elif args.cmd == "resume":
        cmd_resume(args)
    else:
        n, worst, bad = compare(args.a, args.b, args.tol)
        print(f"{n} values compared, largest difference {worst:.3g}, {len(bad)} over {args.tol}")
        print("\n".join(bad[:20]))
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
