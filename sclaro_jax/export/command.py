"""Export one level of a trained ScenarioCLIP / PyramidCLIP checkpoint for PyTorch users.

    python -m sclaro_jax.train.export --workdir DIR --level object --out OUT [--teacher] [--step N]
    python -m sclaro_jax.train.export --model CLIP --format open_clip --out OUT

`--model CLIP` exports a plain CLIP instead (a Hugging Face CLIPModel folder or an open_clip
checkpoint, as `config.model.init` takes them): `--format open_clip` writes an open_clip hub
folder (`open_clip_config.json` + `open_clip_model.safetensors`, which
`open_clip.create_model_and_transforms("local-dir:OUT")` loads), `--format hf` (the default) a
Hugging Face CLIPModel folder. A trained level cannot go to open_clip: its Linear+LayerNorm heads
have no place in open_clip's CLIP, so `--format open_clip --workdir` is refused.

OUT is the folder `sclaro_jax.export.hf` describes: a Hugging Face model folder transformers
loads with the model code it carries (`AutoModel.from_pretrained(OUT, trust_remote_code=True)`).

This module is the command's code, beside the library it drives (`sclaro_jax.export.hf`); users
run it by its address `python -m sclaro_jax.train.export` (`sclaro_jax/train/export.py`).
"""

from __future__ import annotations

import os

from sclaro_jax import cli
from sclaro_jax.checkpoint import load_checkpoint
from sclaro_jax.export.hf import FORMATS, export_clip, export_level
from sclaro_jax.models.scenarioclip import LEVELS

OPEN_CLIP_LEVEL_REFUSAL = (
    "--format open_clip cannot hold a trained ScenarioCLIP/PyramidCLIP level: its embeddings "
    "come from Linear+LayerNorm heads that open_clip's CLIP has no place for, so the file would "
    "not give them; export the level with --format hf (a Hugging Face folder whose model code "
    "applies the heads), or pass --model for a plain CLIP")


class UsageError(ValueError):
    """A command-line mistake the message says how to fix."""


def check_out(out: str) -> None:
    """Refuse an --out that holds files, before any work (UsageError); `cli.writable`, its
    parse-time type, refuses one that cannot be written."""
    if os.path.isdir(out) and os.listdir(out):
        raise UsageError(f"--out {out} is not empty: pass a new or empty folder (an export "
                         "never overwrites files)")


def main(argv=None) -> int:
    """The command line (the conventions of `sclaro_jax.cli`). User errors (arguments, --out,
    a damaged or missing checkpoint: `checkpoint.check_run`, a missing workdir, a CLIP
    checkpoint that cannot be read) print one `error: ...` line and exit 2; --verbose shows
    their traceback too."""
    parser = cli.parser("python -m sclaro_jax.train.export", __doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a training workdir (export one level: --level)")
    source.add_argument("--model", help="a plain CLIP to export instead: a Hugging Face "
                        "CLIPModel folder or an open_clip checkpoint (hub folder, or FILE with "
                        "open_clip_config.json beside it, or FILE:quickgelu / FILE:gelu)")
    parser.add_argument("--level", choices=LEVELS, help="the level of --workdir to export")
    parser.add_argument("--format", choices=FORMATS, default="hf",
                        help="hf: a Hugging Face CLIPModel folder (default); open_clip: an "
                        "open_clip hub folder (--model only)")
    parser.add_argument("--out", required=True, type=cli.writable,
                        help="output folder (new or empty)")
    parser.add_argument("--step", type=int, default=None,
                        help="checkpoint step (default: the newest)")
    parser.add_argument("--teacher", action="store_true", help="export the EMA teacher")
    parser.add_argument("--verbose", action="store_true",
                        help="print the traceback of an error, not just its message")
    args = parser.parse_args(argv)
    try:
        if args.model is not None:
            if args.level or args.step is not None or args.teacher:
                raise UsageError("--level, --step and --teacher are for --workdir, not --model")
            check_out(args.out)
            export_clip(args.model, args.out, args.format)
            print(f"wrote {args.model} to {args.out} ({args.format} format)")
            return 0
        if args.format == "open_clip":
            raise UsageError(OPEN_CLIP_LEVEL_REFUSAL)
        if args.level is None:
            raise UsageError("--workdir needs --level (one of " + ", ".join(LEVELS) + ")")
        check_out(args.out)
        model, step = load_checkpoint(args.workdir, args.step, teacher=args.teacher)
        export_level(model, args.level, args.out)
    except cli.USER_ERRORS as e:  # DamagedRunError and clip.CheckpointError are ValueErrors
        return cli.fail(e, args.verbose)
    print(f"wrote the {args.level} level of step {step} to {args.out}")
    return 0
