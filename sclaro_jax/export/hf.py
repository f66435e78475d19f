"""One level of a trained ScenarioCLIP / PyramidCLIP model, or a plain CLIP, as files PyTorch
libraries load (`python -m sclaro_jax.train.export` is the command line over this module).

`export_level(model, level, out)` writes OUT, a Hugging Face model folder that transformers loads
with the model code it carries:

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

In PyTorch (docs/exports.md has the same; transformers 5's `get_*_features` return an output whose
`pooler_output` is the embedding):

    model = transformers.AutoModel.from_pretrained(OUT, trust_remote_code=True)
    processor = transformers.CLIPProcessor.from_pretrained(OUT, trust_remote_code=True)
    inputs = processor(images=image, return_tensors="pt")
    image_emb = model.get_image_features(**inputs).pooler_output  # [1, D]

`transformers.pipeline("zero-shot-image-classification", model=OUT, trust_remote_code=True)`
runs on it too. Our own readers: `scenarioclip.from_export(OUT)` and `python -m
sclaro_jax.eval.rocs --model OUT` load towers and heads; `clip.from_hf` refuses the folder (its
projections are not CLIP's) unless `towers_only=True`.

`export_clip(spec, out, fmt)` writes a plain CLIP (a Hugging Face CLIPModel folder or an
open_clip checkpoint) as an open_clip hub folder (`open_clip_config.json` +
`open_clip_model.safetensors`, which `open_clip.create_model_and_transforms("local-dir:OUT")`
loads) or a Hugging Face CLIPModel folder. A trained level has no open_clip form: its
Linear+LayerNorm heads have no place in open_clip's CLIP.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from sclaro_jax import ops
from sclaro_jax.data.tokenizer import ClipTokenizer
from sclaro_jax.files import write_replacing
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
    code = REMOTE_CODE.read_bytes()
    write_replacing(folder / REMOTE_CODE.name, lambda f: f.write(code))
    module = REMOTE_CODE.stem
    hf_config = clip.hf_config(config) | {
        "architectures": ["ScenarioCLIPModel"],
        "model_type": clip.EXPORT_MODEL_TYPE,
        "auto_map": {"AutoConfig": f"{module}.ScenarioCLIPConfig",
                     "AutoModel": f"{module}.ScenarioCLIPModel",
                     "AutoModelForZeroShotImageClassification": f"{module}.ScenarioCLIPModel"},
        "scenarioclip_level": level,
    }
    write_replacing(folder / "config.json", lambda f: json.dump(hf_config, f, indent=2),
                    text=True)
    write_processor_files(out, config)
    return out


def write_processor_files(out: str | os.PathLike, config: clip.CLIPConfig) -> None:
    """The CLIP tokenizer's files (at the text tower's context length) and
    `preprocessor_config.json` (our image views at its image size) in the folder `out`."""
    ClipTokenizer().save_pretrained(out, length=config.text.max_position_embeddings)
    processor = image_processor_config(config.vision.image_size)
    write_replacing(Path(out) / PREPROCESSOR_FILE, lambda f: json.dump(processor, f, indent=2),
                    text=True)


def open_clip_preprocess_cfg(size: int) -> dict:
    """open_clip's `preprocess_cfg` of our image views (as `image_processor_config`: bicubic
    resize of the short side, centre crop, CLIP's mean and std)."""
    return {"size": size, "mode": "RGB", "mean": ops.CLIP_MEAN.tolist(),
            "std": ops.CLIP_STD.tolist(), "interpolation": "bicubic", "resize_mode": "shortest",
            "fill_color": 0}


FORMATS = ("hf", "open_clip")


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
