"""Evaluate a detector run: COCO-style AP of its newest checkpoint (the appendix protocol).

    python -m sclaro_jax.eval.detect --workdir DIR [--config FILE_OR_NAME[:VARIANT]]
        [--config.KEY=VALUE ...] [--step N] [--no-progress]

DIR is a detector run, trained by `launch/train.py --config configs/detection.py[:demo]
--workdir DIR` (which evaluates it when training ends, the same way); this command evaluates it
again, e.g. on another split (`--config.eval_split=val`) or dataset (`--config.data.dir=...`).
The recipe is DIR/config.json, or `--config`; overrides use the launcher's grammar,
`--config.KEY=VALUE`. The backbone (the encoders the detector was trained on) is the recipe's
`backbone.workdir`. A damaged checkpoint (`checkpoint.check_run`) is refused with the step to
pass as `--step` instead. Writes DIR/results.json (every number and setting) and
DIR/results.md (Model | AP | AP50 | AP75 | APr | APc | APf) and prints the table
(`sclaro_jax.detection.task`).
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from sclaro_jax import cli

PROG = "python -m sclaro_jax.eval.detect"


def _parser():
    from sclaro_jax.config import CODE_NOTE

    p = cli.parser(PROG,
                   "COCO-style AP of a detector run's newest checkpoint (appendix protocol). "
                   "Recipe overrides: --config.KEY=VALUE (repeatable), as launch/train.py.")
    p.add_argument("--workdir", required=True,
                   help="the detector run (launch/train.py --config configs/detection.py "
                        "--workdir DIR)")
    p.add_argument("--config", default=None,
                   help="the recipe, a file or a name, FILE_OR_NAME[:VARIANT] (default: the "
                        f"run's config.json); {CODE_NOTE}")
    p.add_argument("--step", type=int, default=None,
                   help="checkpoint step to evaluate (default: the newest)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="tracebacks on errors")
    return p


def parse_args(argv: Sequence[str] | None = None):
    """The arguments; the `--config.KEY=VALUE` (or `--config.KEY VALUE`) overrides, in order,
    as `args.overrides` ("KEY=VALUE")."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            key, sep, value = arg[len("--config."):].partition("=")
            if not sep and i + 1 < len(argv):
                value, sep, i = argv[i + 1], "=", i + 1
            overrides.append(f"{key}{sep}{value}")
        else:
            rest.append(arg)
        i += 1
    args = _parser().parse_args(rest)
    args.overrides = overrides
    return args


def run(args):
    """The task's evaluation of `args.workdir` (`run.task.Evaluated`)."""
    import os

    from sclaro_jax.checkpoint import run_config
    from sclaro_jax.config import apply_overrides, load_config
    from sclaro_jax.run import task as tasks

    if not os.path.isdir(args.workdir):
        raise FileNotFoundError(f"--workdir {args.workdir} does not exist: pass a detector run "
                                "(launch/train.py --config configs/detection.py --workdir DIR)")
    config = load_config(args.config) if args.config else run_config(args.workdir)
    try:
        apply_overrides(config, args.overrides)
    except (KeyError, ValueError) as e:  # a usage error: the launcher's form of it
        raise ValueError(f"{cli.message(e)} (see {PROG} --help)") from None
    task = tasks.of(config)
    if task.name != "detection":
        raise ValueError(f"{args.workdir} is a {task.name} run, not a detector's: evaluate it "
                         "with python -m sclaro_jax.eval.suite")
    task.check(config)
    return task.evaluate(config, args.workdir, progress=not args.no_progress, step=args.step)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sclaro_jax").setLevel(logging.INFO)
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's INFO lines
    try:
        evaluated = run(args)
    except (*cli.USER_ERRORS, ImportError) as e:
        return cli.fail(e, args.verbose)
    print(f"{evaluated.table}\n\nresults: {evaluated.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
