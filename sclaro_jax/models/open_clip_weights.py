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
import math
import os
import pickle
import re
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sclaro_jax.models import clip, cpu_gradients, hf_weights
from sclaro_jax.models.hf_weights import CheckpointError

CONFIG_NAME = "open_clip_config.json"
WEIGHTS_NAME = "open_clip_model.safetensors"
# What a hub folder may hold, in open_clip's own order of preference.
WEIGHTS_NAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                 "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth")
FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# The activation suffix of a bare file (`FILE:quickgelu`) -> our `hidden_act`.
ACTIVATIONS = {"quickgelu": "quick_gelu", "gelu": "gelu"}
HEAD_WIDTH = 64  # a bare file's heads: width / 64
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
# Reading weights without torch
# --------------------------------------------------------------------------------------------

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes  # installed with jax
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class _Storage:
    def __init__(self, dtype, read):
        self.dtype, self._read, self._array = dtype, read, None

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.frombuffer(self._read(), self.dtype)
        return self._array


class _Shape:
    """A tensor's shape and dtype without its data (`read_shapes`)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


class _TorchUnpickler(pickle.Unpickler):
    """Unpickles a `torch.save` archive's data.pkl: only containers, numbers and tensors."""

    def __init__(self, file, read_record, where: str, shapes_only: bool):
        super().__init__(file)
        self._read_record, self._where, self._shapes_only = read_record, where, shapes_only
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild_tensor
        if module == "torch._utils" and name in ("_rebuild_parameter",
                                                 "_rebuild_parameter_with_state"):
            return lambda data, requires_grad, hooks, *rest: data
        if module == "torch" and name in _STORAGE_DTYPES:
            return name
        if module == "torch" and name == "Size":
            return tuple
        if module == "builtins" and name in ("set", "frozenset", "slice"):
            return {"set": set, "frozenset": frozenset, "slice": slice}[name]
        if module.startswith("__torch__"):
            raise CheckpointError(
                f"{self._where} is a TorchScript archive (e.g. OpenAI's original .pt files), "
                "not a state dict: load it with open_clip and save its state_dict() with "
                "torch.save or safetensors, then pass that file")
        raise CheckpointError(
            f"{self._where} pickles {module}.{name}, which this reader does not rebuild (it "
            "reads state dicts of tensors only): save the model's state_dict() alone, or as "
            "safetensors")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise CheckpointError(f"{self._where}: unknown persistent id {pid!r} in data.pkl")
        _, kind, key, _location, _numel = pid[:5]
        if kind not in _STORAGE_DTYPES:
            raise CheckpointError(f"{self._where}: storage type {kind!r} is not supported")
        if key not in self._storages:
            self._storages[key] = _Storage(_np_dtype(_STORAGE_DTYPES[kind]),
                                           lambda key=key: self._read_record(key))
        return self._storages[key]

    def _rebuild_tensor(self, storage: _Storage, offset, size, stride, *_):
        if self._shapes_only:
            return _Shape(size, storage.dtype)
        flat = storage.array()
        item = flat.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat[offset:], shape=tuple(size), strides=tuple(s * item for s in stride))
        return np.array(view)  # a copy: its own contiguous memory


def read_torch_file(path: str | os.PathLike, *, shapes_only: bool = False) -> Any:
    """The object a `torch.save` zip archive holds, tensors as numpy arrays (or `_Shape`s with
    `shapes_only`), rebuilt without torch; anything but containers, numbers and tensors is
    refused."""
    where = os.fspath(path)
    if not zipfile.is_zipfile(where):
        raise CheckpointError(
            f"{where} is not a zip archive: a legacy (pre-1.6) torch file or not a torch file at "
            "all. Re-save it with torch.save (or as .safetensors) and pass that file")
    with zipfile.ZipFile(where) as archive:
        names = archive.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if not pkl:
            raise CheckpointError(f"{where}: the zip archive has no data.pkl: not a torch file")
        prefix = pkl[0][: -len("data.pkl")]
        order = archive.read(prefix + "byteorder").decode() if prefix + "byteorder" in names \
            else "little"
        if order.strip() != "little":
            raise CheckpointError(f"{where}: big-endian torch files are not supported")

        def read_record(key: str) -> bytes:
            return archive.read(f"{prefix}data/{key}")

        with archive.open(pkl[0]) as f:
            return _TorchUnpickler(f, read_record, where, shapes_only).load()


def _safetensors(path: Path, shapes_only: bool) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            if shapes_only:
                return {k: _Shape(f.get_slice(k).get_shape(), None) for k in f.keys()}
            return {k: f.get_tensor(k) for k in f.keys()}
    except CheckpointError:
        raise
    except Exception as err:  # a truncated / corrupt file, or bf16 numpy cannot hold
        if "bf16" in str(err).lower() or "bfloat16" in str(err).lower():
            return _safetensors_bf16(path, shapes_only)
        raise CheckpointError(f"{path}: cannot read the safetensors weights ({err})") from err


def _safetensors_bf16(path: Path, shapes_only: bool) -> dict:
    """safetensors with bfloat16 tensors (safetensors.numpy cannot hold them): parsed here."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    dtypes = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
              "I32": np.int32, "BF16": "bfloat16"}
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _np_dtype(dtypes[info["dtype"]])
        if shapes_only:
            out[key] = _Shape(info["shape"], dtype)
            continue
        start, stop = info["data_offsets"]
        out[key] = np.frombuffer(raw[8 + n + start:8 + n + stop], dtype).reshape(info["shape"])
    return out


def read_state_dict(path: str | os.PathLike, *, shapes_only: bool = False) -> dict[str, Any]:
    """The open_clip state dict of a weights file (numpy arrays; `_Shape`s with `shapes_only`):
    a training checkpoint's `state_dict` entry, its `module.` prefixes dropped."""
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        state = _safetensors(path, shapes_only)
    else:
        state = read_torch_file(path, shapes_only=shapes_only)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{path} holds no state dict (a dict of tensors, or a training "
                              "checkpoint with a 'state_dict' entry)")
    if all(str(k).startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return dict(state)


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

# Settings our CLIP computes exactly, each with the values we accept (None: any value, it does
# not change the weights or the embeddings).
_TOP_OK = {"embed_dim": None, "quick_gelu": None, "vision_cfg": None, "text_cfg": None,
           "init_logit_scale": None, "cast_dtype": None, "output_dict": None,
           "init_logit_bias": (None,), "custom_text": (False,),
           "nonscalar_logit_scale": (False,)}
_VISION_OK = {"layers": None, "width": None, "head_width": None, "mlp_ratio": None,
              "patch_size": None, "image_size": None, "patch_dropout": None,
              "output_tokens": None, "attn_pooler_queries": None, "attn_pooler_heads": None,
              "ls_init_value": (None,), "attentional_pool": (False,), "no_ln_pre": (False,),
              "pos_embed_type": ("learnable",), "final_ln_after_pool": (False,),
              "pool_type": ("tok",), "act_kwargs": (None, {}), "norm_kwargs": (None, {}),
              "block_type": (None, "default"), "qk_norm": (False,),
              "scaled_cosine_attn": (False,), "scale_heads": (False,),
              "scale_attn_inner": (False,), "scale_attn": (False,), "scale_fc": (False,),
              "timm_model_name": (None, ""), "timm_model_pretrained": None, "timm_pool": None,
              "timm_proj": None, "timm_proj_bias": None, "timm_drop": None,
              "timm_drop_path": None}
_TEXT_OK = {"context_length": None, "vocab_size": None, "width": None, "heads": None,
            "layers": None, "mlp_ratio": None, "output_tokens": None, "pad_id": None,
            "eos_id": None, "hf_model_pretrained": None, "hf_proj_type": None,
            "hf_pooler_type": None,
            "ls_init_value": (None,), "embed_cls": (False,), "no_causal_mask": (False,),
            "final_ln_after_pool": (False,), "pool_type": ("argmax", "eos"),
            "proj_bias": (False,), "proj_type": ("linear",), "act_kwargs": (None, {}),
            "norm_kwargs": (None, {}), "block_type": (None, "default"), "qk_norm": (False,),
            "scaled_cosine_attn": (False,), "scale_heads": (False,),
            "scale_attn_inner": (False,), "scale_attn": (False,), "scale_fc": (False,),
            "hf_model_name": (None, ""), "hf_tokenizer_name": (None, ""),
            "tokenizer_mode": (None,), "tokenizer_kwargs": (None, {})}


def _check_settings(section: Mapping[str, Any], allowed: Mapping[str, Any], where: str):
    for key, value in section.items():
        if key not in allowed:
            raise CheckpointError(f"{where}: the open_clip setting {key!r} is not one our CLIP "
                                  "can express (only plain ViT CLIP models load)")
        ok = allowed[key]
        if ok is not None and value not in ok:
            raise CheckpointError(
                f"{where}: open_clip setting {key}={value!r} is not supported (our CLIP needs "
                f"{' or '.join(repr(v) for v in ok)}): only plain ViT CLIP models load")


def config_from_open_clip(model_cfg: Mapping[str, Any], where: str) -> clip.CLIPConfig:
    """Our `CLIPConfig` from an open_clip `model_cfg`; settings we cannot compute are refused,
    naming them."""
    if not isinstance(model_cfg, Mapping):
        raise CheckpointError(f"{where} has no 'model_cfg' object")
    _check_settings(model_cfg, _TOP_OK, f"{where} model_cfg")
    vision, text = model_cfg.get("vision_cfg") or {}, model_cfg.get("text_cfg") or {}
    _check_settings(vision, _VISION_OK, f"{where} model_cfg.vision_cfg")
    _check_settings(text, _TEXT_OK, f"{where} model_cfg.text_cfg")
    if "embed_dim" not in model_cfg:
        raise CheckpointError(f"{where}: model_cfg has no embed_dim")
    layers = vision.get("layers", 12)
    if not isinstance(layers, int):
        raise CheckpointError(f"{where}: model_cfg.vision_cfg.layers={layers!r} is a ResNet "
                              "image tower; only ViT image towers load")
    image = vision.get("image_size", 224)
    if isinstance(image, (list, tuple)):
        if len(set(image)) != 1:
            raise CheckpointError(f"{where}: model_cfg.vision_cfg.image_size={image!r} is not "
                                  "square; only square images are supported")
        image = image[0]
    act = "quick_gelu" if model_cfg.get("quick_gelu", False) else "gelu"
    vw, tw = vision.get("width", 768), text.get("width", 512)
    head_width = vision.get("head_width", 64)
    if vw % head_width:
        raise CheckpointError(f"{where}: vision width {vw} is not a multiple of head_width "
                              f"{head_width}")
    pool = text.get("pool_type", "argmax")
    scale = model_cfg.get("init_logit_scale")  # only for a random init; the weights hold it
    extra = {} if scale is None else {"logit_scale_init_value": float(scale)}
    return clip.CLIPConfig(
        vision=clip.VisionConfig(
            hidden_size=vw, intermediate_size=int(vw * vision.get("mlp_ratio", 4.0)),
            num_hidden_layers=layers, num_attention_heads=vw // head_width,
            image_size=int(image), patch_size=vision.get("patch_size", 16), hidden_act=act),
        text=clip.TextConfig(
            hidden_size=tw, intermediate_size=int(tw * text.get("mlp_ratio", 4.0)),
            num_hidden_layers=text.get("layers", 12), num_attention_heads=text.get("heads", 8),
            vocab_size=text.get("vocab_size", 49408),
            max_position_embeddings=text.get("context_length", 77),
            # open_clip's argmax pooling (EOT = the largest id) is our legacy eos id 2
            eos_token_id=2 if pool == "argmax" else text.get("eos_id", 2), hidden_act=act),
        projection_dim=model_cfg["embed_dim"], **extra)


def _count_blocks(state: Mapping[str, Any], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = {int(m.group(1)) for k in state if (m := pattern.match(k))}
    return max(found) + 1 if found else 0


def _refuse_unsupported_keys(state: Mapping[str, Any], where: str) -> None:
    """Name the first key of an open_clip model our CLIP cannot express."""
    markers = [
        ("visual.trunk.", "a timm image tower"),
        ("visual.layer1.", "a ResNet image tower"),
        ("visual.attn_pool.", "attention pooling in the image tower"),
        ("text.", "a custom text tower (CustomTextCLIP: a Hugging Face or custom text "
                  "encoder)"),
        ("logit_bias", "SigLIP's logit bias"),
        (".ls_1.", "layer scale"),
        ("text_decoder.", "a CoCa text decoder"),
    ]
    for marker, what in markers:
        key = next((k for k in state if k.startswith(marker) or
                    (marker.startswith(".") and marker in k)), None)
        if key is not None:
            raise CheckpointError(f"{where}: key {key!r} belongs to {what}, which our CLIP "
                                  "cannot express; only plain ViT CLIP models load")
    for need in ("visual.conv1.weight", "visual.proj", "token_embedding.weight",
                 "text_projection", "visual.ln_pre.weight"):
        if need not in state:
            raise CheckpointError(f"{where}: no {need!r}: not a plain ViT open_clip CLIP state "
                                  "dict (a different image or text tower, or no projection)")


def config_from_state(state: Mapping[str, Any], act: str, where: str) -> clip.CLIPConfig:
    """Our `CLIPConfig` from an open_clip state dict's shapes (arrays or `_Shape`s) and the
    activation the user named; heads are width / 64."""
    _refuse_unsupported_keys(state, where)
    conv = tuple(state["visual.conv1.weight"].shape)
    vw, patch = conv[0], conv[2]
    grid = math.isqrt(state["visual.positional_embedding"].shape[0] - 1)
    tw = state["token_embedding.weight"].shape[1]
    for name, width in (("vision", vw), ("text", tw)):
        if width % HEAD_WIDTH:
            raise CheckpointError(
                f"{where}: {name} width {width} is not a multiple of {HEAD_WIDTH}, so the heads "
                "cannot be read from the weights: put the model's open_clip_config.json beside "
                "the file")
    return clip.CLIPConfig(
        vision=clip.VisionConfig(
            hidden_size=vw,
            intermediate_size=state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            num_hidden_layers=_count_blocks(state, "visual.transformer.resblocks."),
            num_attention_heads=vw // HEAD_WIDTH, image_size=grid * patch, patch_size=patch,
            hidden_act=act),
        text=clip.TextConfig(
            hidden_size=tw,
            intermediate_size=state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            num_hidden_layers=_count_blocks(state, "transformer.resblocks."),
            num_attention_heads=tw // HEAD_WIDTH,
            vocab_size=state["token_embedding.weight"].shape[0],
            max_position_embeddings=state["positional_embedding"].shape[0],
            eos_token_id=2, hidden_act=act),
        projection_dim=state["visual.proj"].shape[1])


def _read_json(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
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
        _refuse_unsupported_keys(read_state(), str(weights))
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


def _towers(config: clip.CLIPConfig):
    """(open_clip prefix, HF prefix, layers) of each tower's blocks."""
    return (("visual.transformer.resblocks", "vision_model.encoder.layers",
             config.vision.num_hidden_layers),
            ("transformer.resblocks", "text_model.encoder.layers",
             config.text.num_hidden_layers))


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
        return np.asarray(state[key], np.float32)

    out = {
        "vision_model.embeddings.class_embedding": take("visual.class_embedding"),
        "vision_model.embeddings.patch_embedding.weight": take("visual.conv1.weight"),
        "vision_model.embeddings.position_embedding.weight":
            take("visual.positional_embedding"),
        "visual_projection.weight": take("visual.proj").T,
        "text_model.embeddings.token_embedding.weight": take("token_embedding.weight"),
        "text_model.embeddings.position_embedding.weight": take("positional_embedding"),
        "text_projection.weight": take("text_projection").T,
        "logit_scale": take("logit_scale").reshape(()),
    }
    for ours, theirs in (("vision_model.pre_layrnorm", "visual.ln_pre"),
                         ("vision_model.post_layernorm", "visual.ln_post"),
                         ("text_model.final_layer_norm", "ln_final")):
        for leaf in ("weight", "bias"):
            out[f"{ours}.{leaf}"] = take(f"{theirs}.{leaf}")
    for oc, hf, n in _towers(config):
        for i in range(n):
            a, b = f"{oc}.{i}", f"{hf}.{i}"
            for theirs, ours in _BLOCK.items():
                for leaf in ("weight", "bias"):
                    out[f"{b}.{ours}.{leaf}"] = take(f"{a}.{theirs}.{leaf}")
            for leaf in ("weight", "bias"):
                q, k, v = np.split(take(f"{a}.attn.in_proj_{leaf}"), 3, axis=0)
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
    out = {
        "visual.class_embedding": hf["vision_model.embeddings.class_embedding"],
        "visual.conv1.weight": hf["vision_model.embeddings.patch_embedding.weight"],
        "visual.positional_embedding": hf["vision_model.embeddings.position_embedding.weight"],
        "visual.proj": hf["visual_projection.weight"].T,
        "token_embedding.weight": hf["text_model.embeddings.token_embedding.weight"],
        "positional_embedding": hf["text_model.embeddings.position_embedding.weight"],
        "text_projection": hf["text_projection.weight"].T,
        "logit_scale": hf["logit_scale"].reshape(()),
    }
    for ours, theirs in (("vision_model.pre_layrnorm", "visual.ln_pre"),
                         ("vision_model.post_layernorm", "visual.ln_post"),
                         ("text_model.final_layer_norm", "ln_final")):
        for leaf in ("weight", "bias"):
            out[f"{theirs}.{leaf}"] = hf[f"{ours}.{leaf}"]
    for oc, hfp, n in _towers(config):
        for i in range(n):
            a, b = f"{oc}.{i}", f"{hfp}.{i}"
            for theirs, ours in _BLOCK.items():
                for leaf in ("weight", "bias"):
                    out[f"{a}.{theirs}.{leaf}"] = hf[f"{b}.{ours}.{leaf}"]
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
    folder = Path(spec)
    file = folder / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err})") from None
    return clip._config_from_hf(raw, str(file))


def model_config(config: clip.CLIPConfig, where: str = "the model") -> dict[str, Any]:
    """The open_clip `model_cfg` of our config; `CheckpointError` for one open_clip cannot
    express."""
    v, t = config.vision, config.text
    acts = {v.hidden_act, t.hidden_act}
    if len(acts) != 1 or not acts <= {"quick_gelu", "gelu"}:
        raise CheckpointError(
            f"{where}: hidden_act vision={v.hidden_act!r}, text={t.hidden_act!r}; open_clip "
            "needs both 'quick_gelu' or both 'gelu'")
    bad = [f"{name} {what}" for name, c in (("vision", v), ("text", t)) for what in
           ([f"layer_norm_eps={c.layer_norm_eps}"] if c.layer_norm_eps != 1e-5 else []) +
           ([f"intermediate_size={c.intermediate_size}"]
            if c.intermediate_size != int(c.hidden_size * (c.intermediate_size / c.hidden_size))
            else [])]
    if v.num_channels != 3:
        bad.append(f"vision num_channels={v.num_channels}")
    if bad:
        raise CheckpointError(f"{where}: open_clip cannot express {', '.join(bad)}")
    text = {"context_length": t.max_position_embeddings, "vocab_size": t.vocab_size,
            "width": t.hidden_size, "heads": t.num_attention_heads,
            "layers": t.num_hidden_layers, "mlp_ratio": t.intermediate_size / t.hidden_size}
    if t.eos_token_id != 2:  # pool at the first eos id, as our TextTransformer does
        text |= {"pool_type": "eos", "eos_id": t.eos_token_id}
    return {
        "embed_dim": config.projection_dim,
        "quick_gelu": v.hidden_act == "quick_gelu",
        "vision_cfg": {"image_size": v.image_size, "layers": v.num_hidden_layers,
                       "width": v.hidden_size, "head_width": v.hidden_size // v.num_attention_heads,
                       "mlp_ratio": v.intermediate_size / v.hidden_size,
                       "patch_size": v.patch_size},
        "text_cfg": text,
    }


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
    (folder / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return folder
