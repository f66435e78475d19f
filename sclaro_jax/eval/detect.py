"""Evaluate a detector run again: an alias of the launcher's `--eval-only` for detector runs.

    python -m sclaro_jax.eval.detect --workdir DIR [--config FILE_OR_NAME[:VARIANT]]
        [--config.KEY=VALUE ...] [--step N] [--no-progress] [--verbose]

is `python launch/train.py --workdir DIR --eval-only` with the same flags, run by the same code
(`launch.train.main`): one door for evaluating a detector, the launcher's. This command stays
so that existing users' commands and scripts keep working; it takes only the flags above, and
refuses a run that is not a detector's (ScenarioCLIP and the baselines: `python -m
sclaro_jax.eval.suite`).

DIR is a detector run, trained by `launch/train.py --config configs/detection.py[:demo]
--workdir DIR` (which evaluates it when training ends, the same way); this evaluates it again,
e.g. on another split (`--config.eval_split=val`) or dataset (`--config.data.dir=...`). The
recipe is DIR/config.json, or `--config`; overrides use the grammar of every command,
`--config.KEY=VALUE` (`sclaro_jax.config.apply_overrides`). The backbone (the encoders the
detector was trained on) is the recipe's `backbone.workdir`. A damaged checkpoint
(`checkpoint.check_run`) is refused with the step to pass as `--step` instead. Writes
DIR/results.json (every number and setting) and DIR/results.md (Model | AP | AP50 | AP75 | APr
| APc | APf) and prints the table (`sclaro_jax.detection.task`).
"""

from __future__ import annotations

import sys
from typing import Sequence

from sclaro_jax import cli

PROG = "python -m sclaro_jax.eval.detect"


def _parser():
    from sclaro_jax.config import CODE_NOTE

    p = cli.parser(PROG,
                   "COCO-style AP of a detector run's newest checkpoint (appendix protocol): "
                   "launch/train.py --workdir DIR --eval-only, for detector runs. Recipe "
                   "overrides: --config.KEY=VALUE (repeatable), as launch/train.py.")
    p.add_argument("--workdir", required=True,
                   help="the detector run (launch/train.py --config configs/detection.py "
                        "--workdir DIR)")
    p.add_argument("--config", default=None,
                   help="the recipe, a file or a name, FILE_OR_NAME[:VARIANT] (default: the "
                        f"run's config.json); {CODE_NOTE}")
    p.add_argument("--step", type=cli.number_in(0, cli.INT_MAX), default=None,
                   help="checkpoint step to evaluate (default: the newest)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="tracebacks on errors")
    return p


def parse_args(argv: Sequence[str] | None = None):
    """The arguments; the `--config.KEY=VALUE` (or `--config.KEY VALUE`) overrides, in order,
    as `args.overrides` ("KEY=VALUE")."""
    from sclaro_jax.config import split_overrides

    overrides, rest = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(rest)
    args.overrides = overrides
    return args


def launcher_args(args) -> list[str]:
    """The launcher's command line for `args` (`parse_args`): `--workdir DIR --eval-only`, and
    the same flags."""
    out = ["--workdir", args.workdir, "--eval-only"]
    out += ["--config", args.config] if args.config else []
    out += [f"--config.{item}" for item in args.overrides]
    out += ["--step", str(args.step)] if args.step is not None else []
    out += ["--no-progress"] if args.no_progress else []
    return out + (["--verbose"] if args.verbose else [])


def _launcher():
    """The launcher, the command line above the library (launch/, installed with it): imported
    when this alias runs, so that importing the library never loads it."""
    from launch import train
    return train


def parse(argv: Sequence[str] | None = None):
    """The launcher's reading of this command line (`launch.train.parse` of `launcher_args`):
    its flags and recipe, nothing run."""
    return _launcher().parse(launcher_args(parse_args(argv)), PROG)


def main(argv: Sequence[str] | None = None) -> int:
    return _launcher().main(launcher_args(parse_args(argv)), PROG, only="detection")


if __name__ == "__main__":
    from sclaro_jax.heap import freeze_for_process
    freeze_for_process()  # a command's process: its imports are not scanned again
    sys.exit(main())
