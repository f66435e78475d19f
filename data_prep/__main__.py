"""`python -m data_prep`: the annotation pipeline's command line. Each sub-command's flags and
run live beside its code: `data_prep.cli` (demo, demo-models, reshard) and each wing's `cli`
module.

The conventions of `sclaro_jax.cli`: flags with hyphens (the underscore spelling is a hidden
alias), a usage error is one `error: ... (see PROG --help)` line (exit 2), and any other user
error (a missing file, a dataset already in --out, ...) prints one `error:` line and exits 2.
`curate` also exits 3 after its first pass (label the clusters file, then rerun)."""

import argparse
import sys

from data_prep import cli
from data_prep.annotate import cli as annotate_cli
from data_prep.curate import cli as curate_cli
from data_prep.rocs import cli as rocs_cli
from data_prep.scene_graphs import cli as import_cli
from sclaro_jax import cli as cli_conventions


def build_parser() -> argparse.ArgumentParser:
    """The parser of every sub-command, in the order --help lists them."""
    parser = cli_conventions.ArgumentParser(
        prog="python -m data_prep",
        description="SCLARO annotation pipeline: annotate images, curate labels, write shards.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cli.add_demo(sub)
    cli.add_demo_models(sub)
    annotate_cli.add_parser(sub)
    import_cli.add_parser(sub)
    curate_cli.add_parser(sub)
    cli.add_reshard(sub)
    rocs_cli.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a usage error: one line, naming the commands
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser.error(f"a command is required: one of {', '.join(sub.choices)}")
    try:
        return args.func(args)
    except (*cli_conventions.USER_ERRORS, RuntimeError) as e:
        return cli_conventions.fail(e, getattr(args, "verbose", False))


if __name__ == "__main__":
    from sclaro_jax.heap import freeze_for_process
    freeze_for_process()  # a command's process: its imports are not scanned again
    sys.exit(main())

