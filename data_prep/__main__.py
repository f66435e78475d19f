"""`python -m data_prep`: the annotation pipeline's command line."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="SCLARO annotation pipeline: annotate images, curate labels, write shards.")
    parser.add_subparsers(dest="command", metavar="COMMAND",
                          description="none built yet: `demo`, `annotate` and `curate` arrive "
                                      "with the records, annotation and curation issues")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
