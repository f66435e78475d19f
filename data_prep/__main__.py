"""`python -m data_prep`: the annotation pipeline's command line. Each sub-command's flags and
run live beside its code: `data_prep.cli` (demo, reshard) and each wing's `cli` module."""

import argparse
import sys

from data_prep import cli
from data_prep.annotate import cli as annotate_cli
from data_prep.curate import cli as curate_cli
from data_prep.rocs import cli as rocs_cli


def build_parser() -> argparse.ArgumentParser:
    """The parser of every sub-command, in the order --help lists them."""
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="SCLARO annotation pipeline: annotate images, curate labels, write shards.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cli.add_demo(sub)
    annotate_cli.add_parser(sub)
    curate_cli.add_parser(sub)
    cli.add_reshard(sub)
    rocs_cli.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (FileExistsError, FileNotFoundError, KeyError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

