"""`python -m data_prep`: the annotation pipeline's command line."""

import argparse
import sys


def _demo(args) -> int:
    from data_prep.demo import build_demo
    manifest = build_demo(args.out, overwrite=args.overwrite, split_seed=args.split_seed,
                          records_per_shard=args.records_per_shard)
    splits = ", ".join(f"{k} {v['records']}" for k, v in manifest["splits"].items())
    print(f"wrote {manifest['records']} records to {args.out} ({splits}); "
          f"relation regions from box masks standing in for SAM masks")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="SCLARO annotation pipeline: annotate images, curate labels, write shards.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="write the bundled demo dataset (real photographs from PyPI wheels, "
                     "hand-written annotations) as SCLARO shards",
        description="Turn data_prep/demo/annotations.json into ArrayRecord shards, "
                    "vocabularies and a manifest. Relation regions use box masks in place of "
                    "SAM masks.")
    demo.add_argument("--out", required=True, help="output folder")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace a dataset already in --out")
    demo.add_argument("--split-seed", type=int, default=42,
                      help="seed of the deterministic 70/10/20 split (default 42)")
    demo.add_argument("--records-per-shard", type=int, default=4,
                      help="records per ArrayRecord shard (default 4, so the demo has several)")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (FileExistsError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
