"""The command-line plumbing the sub-commands of `python -m data_prep` share, and the three
commands of the shared level: `demo` (the bundled demo dataset), `demo-models` (what `annotate`
needs to run on a CPU) and `reshard` (training views of another size). Each wing's own
sub-command lives in its `cli` module."""

import argparse
import os

from sclaro_jax.cli import writable


def command(sub, name: str, func, doc: str) -> argparse.ArgumentParser:
    """A sub-command `name` run by `func(args)`, documented by its module's docstring `doc`:
    "`python -m data_prep NAME`: SUMMARY." (the line in the list of commands), a blank line,
    then the description that `NAME --help` shows."""
    head, _, description = doc.strip().partition("\n\n")
    summary = " ".join(head.split()).partition(": ")[2].rstrip(".")
    parser = sub.add_parser(name, help=summary, description=" ".join(description.split()))
    parser.set_defaults(func=func)
    return parser


def view_flags(parser: argparse.ArgumentParser, keep_default: bool | None) -> None:
    """--image-size and the originals flag of a command that writes records. `keep_default`:
    True keeps the originals unless --no-keep-originals (demo); None keeps those the input
    holds unless --no-keep-originals (reshard); False keeps them only with --keep-originals
    (annotate, whose work folder keeps them anyway)."""
    parser.add_argument("--image-size", type=int, default=224, metavar="S",
                        help="size of the stored training views (schema version 2): the "
                             "model's input size (default 224)")
    what = ("also store the full-size photographs and relation regions, which localisation "
            "and MINER crops need")
    if keep_default is False:
        parser.add_argument("--keep-originals", action="store_true",
                            help=f"{what} (default: views only)")
        return
    parser.add_argument("--keep-originals", action=argparse.BooleanOptionalAction,
                        default=keep_default,
                        help=f"{what} (default: keep" + (
                            ")" if keep_default else " them when --in has them)")
                        + "; --no-keep-originals writes the views only")


def write_flags(parser: argparse.ArgumentParser, *, overwrite: bool = True) -> None:
    """--overwrite (a command that writes a dataset to --out) and --no-progress."""
    if overwrite:
        parser.add_argument("--overwrite", action="store_true",
                            help="replace a dataset already in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def quiet_model_bars() -> None:
    """No progress bars from transformers or huggingface_hub (loading weights, writing shards):
    what --no-progress means for a command that loads models."""
    import huggingface_hub.utils
    import transformers

    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def describe(manifest: dict) -> str:
    """'schema version 2, 224 px views, originals kept' and the like."""
    if manifest["schema_version"] == 1:
        return "schema version 1, originals only"
    return (f"schema version {manifest['schema_version']}, {manifest['view_size']} px views, "
            f"originals {'kept' if manifest['originals'] else 'dropped'}")


def add_demo(sub) -> None:
    """`demo`: the bundled demo dataset as shards."""
    demo = command(sub, "demo", run_demo, run_demo.__doc__)
    demo.add_argument("--out", required=True, type=writable, help="output folder")
    demo.add_argument("--split-seed", type=int, default=42,
                      help="seed of the deterministic 70/10/20 split (default 42)")
    demo.add_argument("--records-per-shard", type=int, default=4,
                      help="records per ArrayRecord shard (default 4, so the demo has several)")
    view_flags(demo, keep_default=True)
    write_flags(demo)


def run_demo(args) -> int:
    """`python -m data_prep demo`: write the bundled demo dataset (real photographs from PyPI wheels,
    hand-written annotations) as SCLARO shards.

    Turn data_prep/demo/annotations.json into ArrayRecord shards, vocabularies and a manifest.
    Relation regions use box masks in place of SAM masks.
    """
    from data_prep.demo import build_demo
    manifest = build_demo(args.out, overwrite=args.overwrite, split_seed=args.split_seed,
                          records_per_shard=args.records_per_shard, image_size=args.image_size,
                          keep_originals=args.keep_originals, progress=not args.no_progress)
    splits = ", ".join(f"{k} {v['records']}" for k, v in manifest["splits"].items())
    print(f"wrote {manifest['records']} records ({describe(manifest)}) to {args.out} "
          f"({splits}); relation regions from box masks standing in for SAM masks")
    return 0


def add_demo_models(sub) -> None:
    """`demo-models`: tiny random models, demo photographs and VLM replies for `annotate`."""
    dm = command(sub, "demo-models", run_demo_models, run_demo_models.__doc__)
    dm.add_argument("--out", required=True, metavar="DIR", type=writable,
                    help="the folder to write")
    dm.add_argument("--photos", type=int, default=6, metavar="N",
                    help="how many photographs of the bundled demo to copy, in its order "
                         "(default 6; it has 14)")
    dm.add_argument("--overwrite", action="store_true",
                    help="replace the models, photographs and replies already in --out")
    write_flags(dm, overwrite=False)


def run_demo_models(args) -> int:
    """`python -m data_prep demo-models`: write tiny random models, demo photographs and VLM
    replies to try `annotate` on a CPU without any download.

    Writes DIR/grounding-dino (a tiny random GroundingDINO with its processor, save_pretrained
    layout), DIR/sam_tiny.pth (a tiny random SAM: --sam-type tiny), DIR/photos (real photographs
    of the bundled demo) and DIR/replies.json (--vlm-replies, written from the demo's
    hand-written annotations), then prints the annotate command that runs on them. The models
    are random: their boxes and masks mean nothing. For trying the pipeline, not for making data.
    """
    from data_prep.demo_models import report, write_demo_models
    print(report(args.out, write_demo_models(args.out, photos=args.photos,
                                             overwrite=args.overwrite,
                                             progress=not args.no_progress)))
    return 0


def add_reshard(sub) -> None:
    """`reshard`: a dataset rewritten with training views of one size."""
    res = command(sub, "reshard", run_reshard, run_reshard.__doc__)
    res.add_argument("--in", dest="src", required=True, metavar="DIR",
                     help="the dataset folder to read")
    res.add_argument("--out", required=True, metavar="DIR", type=writable,
                     help="the dataset folder to write (not --in)")
    view_flags(res, keep_default=None)
    res.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="N",
                     help="processes making the views (default: all %(default)s cores); the "
                          "output does not depend on it")
    res.add_argument("--verbose", action="store_true",
                     help="log each shard as it is finished")
    write_flags(res)


def run_reshard(args) -> int:
    """`python -m data_prep reshard`: convert a dataset (schema version 1 or 2) to version 2 with
    training views of one size.

    Stream every record of --in into a new dataset in --out with object, relation and global
    training views at --image-size, keeping the originals that --in holds unless
    --no-keep-originals (views of another size are made from the originals, so a version-2
    dataset written without them converts only to its own size). Splits, records per
    shard and the manifest's creation time are the input's: the same command writes the same bytes.
    A killed run leaves only a hidden .writing-* folder; rerun the same command.
    """
    import logging

    from data_prep.reshard import reshard
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    manifest = reshard(args.src, args.out, image_size=args.image_size,
                       keep_originals=args.keep_originals, overwrite=args.overwrite,
                       progress=not args.no_progress, workers=args.workers)
    old = manifest["converted_from"]
    print(f"wrote {manifest['records']} records ({describe(manifest)}) to {args.out} from "
          f"{args.src} (schema version {old['schema_version']}"
          + (f", {old['view_size']} px views)" if old["view_size"] else ")"))
    return 0
