"""Export one level of a trained ScenarioCLIP / PyramidCLIP checkpoint for PyTorch users.

    python -m sclaro_jax.train.export --workdir DIR --level object --out OUT [--teacher] [--step N]
    python -m sclaro_jax.train.export --model CLIP --format open_clip --out OUT

`--model CLIP` exports a plain CLIP instead (a Hugging Face CLIPModel folder or an open_clip
checkpoint, as `config.model.init` takes them): `--format open_clip` writes an open_clip hub
folder (`open_clip_config.json` + `open_clip_model.safetensors`, which
`open_clip.create_model_and_transforms("local-dir:OUT")` loads), `--format hf` (the default) a
Hugging Face CLIPModel folder. A trained level cannot go to open_clip: its Linear+LayerNorm heads
have no place in open_clip's CLIP, so `--format open_clip --workdir` is refused.

OUT is a Hugging Face model folder that transformers loads with the model code it carries:

- config.json: a `CLIPConfig` of model_type "scenarioclip" (`projection_dim` = the heads' size,
  `scenarioclip_level` = the level), with `auto_map` sending `AutoConfig`, `AutoModel` and
  `AutoModelForZeroShotImageClassification` to modeling_scenarioclip.py;
- modeling_scenarioclip.py: `ScenarioCLIPModel`, transformers' `CLIPModel` whose
  `visual_projection` / `text_projection` are the level's heads, `nn.Sequential(nn.Linear(hidden,
  D), nn.LayerNorm(D))`, so `get_image_features` / `get_text_features` give our `encode_image` /
  `encode_text` and `forward`'s `logits_per_image` is exp(logit_scale) * cos;
- model.safetensors: the level's vision and text towers, its heads (`visual_projection.0.weight`,
  ...) and `logit_scale`;
- the CLIP tokenizer's vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json,
  and preprocessor_config.json (our image views as `CLIPImageProcessor` settings), so
  `CLIPProcessor.from_pretrained(OUT, trust_remote_code=True)` gives our token ids and pixels
  (transformers' tokenizer loader reads the config, so without the flag it asks whether to run
  the folder's code; `CLIPTokenizer.from_pretrained(OUT)` alone does not).

In PyTorch (README has the same; transformers 5's `get_*_features` return an output whose
`pooler_output` is the embedding):

    model = transformers.AutoModel.from_pretrained(OUT, trust_remote_code=True)
    processor = transformers.CLIPProcessor.from_pretrained(OUT, trust_remote_code=True)
    inputs = processor(images=image, return_tensors="pt")
    image_emb = model.get_image_features(**inputs).pooler_output  # [1, D]

`transformers.pipeline("zero-shot-image-classification", model=OUT, trust_remote_code=True)`
runs on it too. Our own readers: `scenarioclip.from_export(OUT)` and `python -m
sclaro_jax.eval.rocs --model OUT` load towers and heads; `clip.from_hf` refuses the folder (its
projections are not CLIP's) unless `towers_only=True`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from sclaro_jax import ops
# load_checkpoint / run_config live in sclaro_jax.checkpoint (below train and eval); re-exported
# here for callers of the old place.
from sclaro_jax.checkpoint import load_checkpoint, run_config  # noqa: F401
from sclaro_jax.data.tokenizer import ClipTokenizer
from sclaro_jax.models import clip, hf_weights, open_clip_weights
from sclaro_jax.models.scenarioclip import LEVELS, export_heads

PREPROCESSOR_FILE = "preprocessor_config.json"
# The transformers remote code each export carries (package data: a text file to copy; it
# imports torch, so nothing in sclaro_jax imports it).
REMOTE_CODE = Path(clip.__file__).parent / "remote" / "modeling_scenarioclip.py"


def image_processor_config(size: int) -> dict:
    """`CLIPImageProcessor` settings of our image views (`augment.resize_centre_crop`: bicubic
    resize of the short side to `size`, centre crop `size` x `size`; then `ops.normalize` with
    CLIP's mean and std)."""
    return {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "CLIPProcessor",  # what AutoProcessor.from_pretrained builds
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": size},
        "resample": 3,  # PIL.Image.BICUBIC
        "do_center_crop": True,
        "crop_size": {"height": size, "width": size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": ops.CLIP_MEAN.tolist(),
        "image_std": ops.CLIP_STD.tolist(),
    }


def export_level(model, level: str, out: str) -> str:
    """Write `level` of `model` to the folder `out` as the module docstring describes: towers,
    heads and logit scale in model.safetensors, the config with its `auto_map`, the remote code
    (`REMOTE_CODE`), the CLIP tokenizer's files and `preprocessor_config.json`."""
    if level not in LEVELS:
        raise ValueError(f"level {level!r} is not one of {LEVELS}")
    pair = model.pair(level)
    config = pair.config.replace(projection_dim=pair.vision_head.linear.out_features)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in hf_weights.hf_state_dict(pair).items()
               if k.startswith(("vision_model.", "text_model."))}
    tensors |= export_heads(pair)
    tensors["logit_scale"] = np.asarray(model.logit_scale(level), np.float32).reshape(())
    hf_weights.save_safetensors(tensors, folder / hf_weights.WEIGHTS_NAME,
                                metadata={"format": "pt"})
    shutil.copyfile(REMOTE_CODE, folder / REMOTE_CODE.name)
    module = REMOTE_CODE.stem
    (folder / "config.json").write_text(json.dumps(clip.hf_config(config) | {
        "architectures": ["ScenarioCLIPModel"],
        "model_type": clip.EXPORT_MODEL_TYPE,
        "auto_map": {"AutoConfig": f"{module}.ScenarioCLIPConfig",
                     "AutoModel": f"{module}.ScenarioCLIPModel",
                     "AutoModelForZeroShotImageClassification": f"{module}.ScenarioCLIPModel"},
        "scenarioclip_level": level,
    }, indent=2))
    write_processor_files(out, config)
    return out


def write_processor_files(out: str | os.PathLike, config: clip.CLIPConfig) -> None:
    """The CLIP tokenizer's files (at the text tower's context length) and
    `preprocessor_config.json` (our image views at its image size) in the folder `out`."""
    ClipTokenizer().save_pretrained(out, length=config.text.max_position_embeddings)
    with open(Path(out) / PREPROCESSOR_FILE, "w", encoding="utf-8") as f:
        json.dump(image_processor_config(config.vision.image_size), f, indent=2)


def open_clip_preprocess_cfg(size: int) -> dict:
    """open_clip's `preprocess_cfg` of our image views (as `image_processor_config`: bicubic
    resize of the short side, centre crop, CLIP's mean and std)."""
    return {"size": size, "mode": "RGB", "mean": ops.CLIP_MEAN.tolist(),
            "std": ops.CLIP_STD.tolist(), "interpolation": "bicubic", "resize_mode": "shortest",
            "fill_color": 0}


FORMATS = ("hf", "open_clip")
OPEN_CLIP_LEVEL_REFUSAL = (
    "--format open_clip cannot hold a trained ScenarioCLIP/PyramidCLIP level: its embeddings "
    "come from Linear+LayerNorm heads that open_clip's CLIP has no place for, so the file would "
    "not give them; export the level with --format hf (a Hugging Face folder whose model code "
    "applies the heads), or pass --model for a plain CLIP")


def export_clip(spec: str, out: str, fmt: str = "open_clip") -> str:
    """Write the plain CLIP `spec` (a Hugging Face CLIPModel folder or an open_clip checkpoint:
    `open_clip_weights.load_clip`) to `out` as an open_clip hub folder (`fmt` "open_clip") or a
    Hugging Face CLIPModel folder with tokenizer and preprocessor files ("hf")."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
    model = open_clip_weights.load_clip(spec)
    size = model.config.vision.image_size
    if fmt == "open_clip":
        open_clip_weights.save(model, out, preprocess_cfg=open_clip_preprocess_cfg(size))
        return out
    clip.to_hf(model, out)
    write_processor_files(out, model.config)
    return out


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
    --out) or 1 (workdir, checkpoint); --verbose shows their traceback instead."""
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
    except (UsageError, FileNotFoundError, clip.CheckpointError) as e:
        if args.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    print(f"wrote the {args.level} level of step {step} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
