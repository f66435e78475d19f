"""open_clip checkpoints in and out of our `clip.CLIPModel`, with numpy only (no torch).

Read (`load`, `read_config`): an open_clip checkpoint given as

* a folder in open_clip's hub layout: `open_clip_config.json` (its `model_cfg`) and
  `open_clip_model.safetensors` or `open_clip_pytorch_model.bin`;
* a bare weights file, `.safetensors` or a torch `.bin` / `.pt` / `.pth` (read without torch: the
  zip archive `torch.save` writes, unpickled by a restricted unpickler that rebuilds each tensor
  from its storage as a numpy array; training checkpoints `{"state_dict": {"module.<key>": ...}}` too).
  The sizes come from the tensors' shapes (heads: width / 64, the convention of OpenAI's and
  open_clip's own state-dict builder), but the activation is not in the weights: it comes from an
  `open_clip_config.json` beside the file, else from a suffix the user adds to the path,
  `FILE:quickgelu` (OpenAI-trained and `*-quickgelu` models) or `FILE:gelu` (most
  LAION/DataComp-trained models). Without either the file is refused; nothing is guessed.

Write (`save`): a folder `open_clip.create_model_and_transforms("local-dir:OUT")` loads
(`open_clip_config.json` + `open_clip_model.safetensors`).

The open_clip and Hugging Face state dicts hold the same numbers under other names: the fused
attention input projection `attn.in_proj_weight` ([3d, d], rows q, k, v) is Hugging Face's
`q_proj`, `k_proj`, `v_proj`; `visual.proj` and `text_projection` ([width, embed]) are the
transposed `visual_projection.weight` / `text_projection.weight`. Everything else is a rename, so
the conversion goes through `hf_weights` (`load_hf_state`, `hf_state_dict`).

Only what our CLIP computes is accepted: a ViT image tower with a class token, pre- and post-
LayerNorm and a linear projection; open_clip's own text transformer with EOT (argmax / eos)
pooling and a linear projection; QuickGELU or GELU; LayerNorm eps 1e-5. Anything else (a timm or
ResNet image tower, a Hugging Face text tower, attention pooling, layer scale, SigLIP's logit
bias, ...) is refused with the setting or key named (`CheckpointError`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sclaro_jax import bounds
from sclaro_jax.files import write_replacing
from sclaro_jax.models import clip, cpu_gradients, hf_weights
from sclaro_jax.models.hf_weights import CheckpointError
from sclaro_jax.models.open_clip_config import (config_from_open_clip, config_from_state,
                                                model_config, refuse_unsupported_keys)
from sclaro_jax.models.torch_files import read_state_dict

CONFIG_NAME = "open_clip_config.json"
WEIGHTS_NAME = "open_clip_model.safetensors"
# What a hub folder may hold, in open_clip's own order of preference.
WEIGHTS_NAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                 "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth")
FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# The activation suffix of a bare file (`FILE:quickgelu`) -> our `hidden_act`.
ACTIVATIONS = {"quickgelu": "quick_gelu", "gelu": "gelu"}
# Entries some checkpoints carry besides the weights (JIT leftovers, buffers): never loaded.
_IGNORED_KEYS = ("input_resolution", "context_length", "vocab_size", "attn_mask",
                 "visual.attn_mask")


def _act_choices(file) -> str:
    return (f"{file}:quickgelu (OpenAI-trained and *-quickgelu models) or {file}:gelu (most "
            "LAION/DataComp-trained models)")


# --------------------------------------------------------------------------------------------
# Which checkpoint is it
# --------------------------------------------------------------------------------------------


def split_spec(spec: str | os.PathLike) -> tuple[Path, str | None]:
    """(path, activation or None) of `spec`, which may end in `:quickgelu` / `:gelu`."""
    text = os.fspath(spec)
    head, sep, tail = text.rpartition(":")
    if sep and tail.lower() in ACTIVATIONS and head:
        return Path(head), ACTIVATIONS[tail.lower()]
    return Path(text), None


def is_open_clip(spec: str | os.PathLike) -> bool:
    """Whether `spec` names an open_clip checkpoint (a hub folder, a weights file, or either with
    an activation suffix) rather than a Hugging Face CLIPModel folder."""
    path, act = split_spec(spec)
    if act is not None or path.suffix.lower() in FILE_SUFFIXES:
        return True
    return path.is_dir() and (path / CONFIG_NAME).is_file()


def _weights_in(folder: Path) -> Path:
    for name in WEIGHTS_NAMES:
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"{folder} has {CONFIG_NAME} but none of the weights files "
                          f"{', '.join(WEIGHTS_NAMES)}: copy the checkpoint's weights there")


def _resolve(spec) -> tuple[Path, Path | None, str | None]:
    """(weights file, open_clip_config.json or None, activation from a suffix or None)."""
    path, act = split_spec(spec)
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise CheckpointError(f"{path} has no {CONFIG_NAME}: not an open_clip hub folder "
                                  "(name its weights file instead)")
        return _weights_in(path), path / CONFIG_NAME, act
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: pass an open_clip checkpoint file or "
                              "folder")
    beside = path.parent / CONFIG_NAME
    return path, beside if beside.is_file() else None, act


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------
def _read_json(file: Path) -> dict:
    try:
        raw = bounds.read_json(file)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} is not readable JSON ({err})") from None
    if not isinstance(raw, dict) or "model_cfg" not in raw:
        raise CheckpointError(f"{file} has no 'model_cfg': not an open_clip config")
    return raw


def _config(weights: Path, config_file: Path | None, act: str | None, read_state
            ) -> clip.CLIPConfig:
    """The checkpoint's config: from `config_file` (checked before any weights are read) or
    from the shapes of `read_state()` and the activation suffix `act`."""
    if config_file is not None:
        config = config_from_open_clip(_read_json(config_file)["model_cfg"], str(config_file))
        if act is not None and act != config.vision.hidden_act:
            raise CheckpointError(
                f"{weights}: the activation suffix says {act} but {config_file} says "
                f"{config.vision.hidden_act} (quick_gelu={act == 'quick_gelu'}): drop the "
                "suffix or fix the config")
        refuse_unsupported_keys(read_state(), str(weights))
        return config
    if act is None:
        raise CheckpointError(
            f"{weights}: an open_clip weights file does not say its activation (QuickGELU or "
            f"GELU) and no {CONFIG_NAME} is beside it; name it with a suffix: "
            f"{_act_choices(weights)}")
    return config_from_state(read_state(), act, str(weights))


def read_config(spec: str | os.PathLike) -> clip.CLIPConfig:
    """The `CLIPConfig` of an open_clip checkpoint (reading shapes, not weights)."""
    weights, config_file, act = _resolve(spec)
    return _config(weights, config_file, act,
                   lambda: read_state_dict(weights, shapes_only=True))


# --------------------------------------------------------------------------------------------
# The key map
# --------------------------------------------------------------------------------------------

_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
          "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
# (open_clip key, Hugging Face key) of the tensors stored transposed on one side
_TRANSPOSED = (("visual.proj", "visual_projection.weight"),
               ("text_projection", "text_projection.weight"))


def _key_map(config: clip.CLIPConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """([(open_clip key, HF key)] of the tensors that are only renamed (`_TRANSPOSED` ones
    transposed too), [(open_clip prefix, HF prefix)] of each block's attention, whose fused
    `in_proj_{weight,bias}` is HF's `q_proj`, `k_proj`, `v_proj` stacked)."""
    renamed = [("visual.class_embedding", "vision_model.embeddings.class_embedding"),
               ("visual.conv1.weight", "vision_model.embeddings.patch_embedding.weight"),
               ("visual.positional_embedding",
                "vision_model.embeddings.position_embedding.weight"),
               ("token_embedding.weight", "text_model.embeddings.token_embedding.weight"),
               ("positional_embedding", "text_model.embeddings.position_embedding.weight"),
               ("logit_scale", "logit_scale"), *_TRANSPOSED]
    for theirs, ours in (("visual.ln_pre", "vision_model.pre_layrnorm"),
                         ("visual.ln_post", "vision_model.post_layernorm"),
                         ("ln_final", "text_model.final_layer_norm")):
        renamed += [(f"{theirs}.{leaf}", f"{ours}.{leaf}") for leaf in ("weight", "bias")]
    attention = []
    for oc, hf, n in (("visual.transformer.resblocks", "vision_model.encoder.layers",
                       config.vision.num_hidden_layers),
                      ("transformer.resblocks", "text_model.encoder.layers",
                       config.text.num_hidden_layers)):
        for i in range(n):
            a, b = f"{oc}.{i}", f"{hf}.{i}"
            renamed += [(f"{a}.{theirs}.{leaf}", f"{b}.{ours}.{leaf}")
                        for theirs, ours in _BLOCK.items() for leaf in ("weight", "bias")]
            attention.append((a, b))
    return renamed, attention


def _moved(key: str, value) -> np.ndarray:
    """A renamed tensor as the other side stores it: projections transposed, the logit scale a
    scalar."""
    value = np.asarray(value, np.float32)
    if any(key in pair for pair in _TRANSPOSED):
        return value.T
    return value.reshape(()) if key == "logit_scale" else value


def to_hf_state(state: Mapping[str, np.ndarray], config: clip.CLIPConfig, where: str
                ) -> dict[str, np.ndarray]:
    """An open_clip state dict -> Hugging Face `CLIPModel` keys (float32), checking that
    every key is used."""
    state = {k: v for k, v in state.items() if k not in _IGNORED_KEYS}
    used: set[str] = set()

    def take(key):
        if key not in state:
            raise CheckpointError(f"{where}: missing key {key!r} for a CLIP of this config")
        used.add(key)
        return state[key]

    renamed, attention = _key_map(config)
    out = {hf: _moved(oc, take(oc)) for oc, hf in renamed}
    for a, b in attention:
        for leaf in ("weight", "bias"):
            q, k, v = np.split(np.asarray(take(f"{a}.attn.in_proj_{leaf}"), np.float32), 3,
                               axis=0)
            for name, part in zip("qkv", (q, k, v)):
                out[f"{b}.self_attn.{name}_proj.{leaf}"] = part
    extra = sorted(set(state) - used)
    if extra:
        shown = ", ".join(extra[:8]) + (f", ... ({len(extra)} in all)" if len(extra) > 8 else "")
        raise CheckpointError(f"{where}: keys our CLIP cannot express: {shown}")
    return {k: np.array(v, order="C") for k, v in out.items()}


def from_hf_state(hf: Mapping[str, np.ndarray], config: clip.CLIPConfig
                  ) -> dict[str, np.ndarray]:
    """Hugging Face `CLIPModel` keys -> an open_clip state dict (float32)."""
    renamed, attention = _key_map(config)
    out = {oc: _moved(hfk, hf[hfk]) for oc, hfk in renamed}
    for a, b in attention:
        for leaf in ("weight", "bias"):
            out[f"{a}.attn.in_proj_{leaf}"] = np.concatenate(
                [hf[f"{b}.self_attn.{x}_proj.{leaf}"] for x in "qkv"], axis=0)
    return {k: np.array(v, np.float32, order="C") for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Load / save
# --------------------------------------------------------------------------------------------


def load(spec: str | os.PathLike, *, dtype=jnp.float32, gradient_forms: str = "auto"
         ) -> clip.CLIPModel:
    """Our `clip.CLIPModel` from an open_clip checkpoint (module docstring: a hub folder, or a
    weights file with `open_clip_config.json` beside it or an activation suffix)."""
    weights, config_file, act = _resolve(spec)
    cache: dict = {}

    def read_state():
        if "state" not in cache:
            cache["state"] = read_state_dict(weights)
        return cache["state"]

    config = _config(weights, config_file, act, read_state)
    state = read_state()
    hf = to_hf_state(state, config, str(weights))
    forms = cpu_gradients.resolve(gradient_forms)
    model = nnx.eval_shape(lambda: clip.CLIPModel(config, dtype=dtype, gradient_forms=forms,
                                                  rngs=nnx.Rngs(0)))
    hf_weights.load_hf_state(model, hf, where=str(weights), kind="CLIP")
    return model


def load_clip(spec: str | os.PathLike, *, dtype=jnp.float32, gradient_forms: str = "auto",
              towers_only: bool = False) -> clip.CLIPModel:
    """A pretrained CLIP from either kind of checkpoint: an open_clip one (`is_open_clip`) or
    a Hugging Face CLIPModel folder (`clip.from_hf`)."""
    if is_open_clip(spec):
        return load(spec, dtype=dtype, gradient_forms=gradient_forms)
    return clip.from_hf(spec, dtype=dtype, gradient_forms=gradient_forms,
                        towers_only=towers_only)


def pretrained_config(spec: str | os.PathLike) -> clip.CLIPConfig:
    """The `CLIPConfig` of either kind of checkpoint, without reading its weights."""
    if is_open_clip(spec):
        return read_config(spec)
    raw, file = hf_weights.read_config_json(spec)
    return clip._config_from_hf(raw, str(file))


def save(model: clip.CLIPModel, out: str | os.PathLike, *,
         preprocess_cfg: Mapping[str, Any] | None = None) -> Path:
    """Write `model` as an open_clip hub folder (`open_clip_config.json` with `model_cfg` and
    `preprocess_cfg`, and `open_clip_model.safetensors`) that
    `open_clip.create_model_and_transforms("local-dir:OUT")` loads."""
    folder = Path(out)
    cfg = {"model_cfg": model_config(model.config, type(model).__name__),
           "preprocess_cfg": dict(preprocess_cfg or {})}
    state = from_hf_state(hf_weights.hf_state_dict(model), model.config)
    folder.mkdir(parents=True, exist_ok=True)
    hf_weights.save_safetensors(state, folder / WEIGHTS_NAME, metadata={"format": "pt"})
    write_replacing(folder / CONFIG_NAME, lambda f: json.dump(cfg, f, indent=2), text=True)
    return folder
