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
"""

from __future__ import annotations

import argparse
import os
import sys

from sclaro_jax.checkpoint import DamagedRunError, load_checkpoint
from sclaro_jax.export.hf import FORMATS, export_clip, export_level
from sclaro_jax.models import clip
from sclaro_jax.models.scenarioclip import LEVELS

OPEN_CLIP_LEVEL_REFUSAL = (
    "--format open_clip cannot hold a trained ScenarioCLIP/PyramidCLIP level: its embeddings "
    "come from Linear+LayerNorm heads that open_clip's CLIP has no place for, so the file would "
    "not give them; export the level with --format hf (a Hugging Face folder whose model code "
    "applies the heads), or pass --model for a plain CLIP")


class UsageError(ValueError):
    """A command-line mistake the message says how to fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def check_out(out: str) -> None:
    """Refuse an --out that holds files or cannot be written, before any work (UsageError)."""
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise UsageError(f"--out {out} is a file: pass a new or empty folder")
        if os.listdir(out):
            raise UsageError(f"--out {out} is not empty: pass a new or empty folder (an export "
                             "never overwrites files)")
        target = out
    else:
        target = os.path.dirname(os.path.abspath(out))
        while not os.path.exists(target):
            target = os.path.dirname(target)
        if not os.path.isdir(target):
            raise UsageError(f"--out {out}: {target} is a file, so the folder cannot be "
                             "made; pass another path")
    if not os.access(target, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: cannot write in {target} (permission denied); pass a "
                         "folder you can write")


def main(argv=None) -> int:
    """The command line. User errors print one `error: ...` line and exit 2 (arguments,
    --out, a damaged or missing checkpoint: `checkpoint.check_run`) or 1 (workdir, a CLIP
    checkpoint); --verbose shows their traceback instead."""
    parser = _Parser(prog="python -m sclaro_jax.train.export",
                     description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a training workdir (export one level: --level)")
    source.add_argument("--model", help="a plain CLIP to export instead: a Hugging Face "
                        "CLIPModel folder or an open_clip checkpoint (hub folder, or FILE with "
                        "open_clip_config.json beside it, or FILE:quickgelu / FILE:gelu)")
    parser.add_argument("--level", choices=LEVELS, help="the level of --workdir to export")
    parser.add_argument("--format", choices=FORMATS, default="hf",
                        help="hf: a Hugging Face CLIPModel folder (default); open_clip: an "
                        "open_clip hub folder (--model only)")
    parser.add_argument("--out", required=True, help="output folder (new or empty)")
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
    except (UsageError, DamagedRunError, FileNotFoundError, clip.CheckpointError) as e:
        if args.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (UsageError, DamagedRunError)) else 1
    print(f"wrote the {args.level} level of step {step} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
