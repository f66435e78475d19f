"""Hugging Face model folders for the CLIP and SigLIP towers: config.json, safetensors weights
(one file or a sharded index) read with numpy (no torch), and the one key map between our NNX
parameter paths and Hugging Face state-dict keys.

The module trees mirror Hugging Face's name for name (`vision_model.encoder.layers.3.self_attn.
q_proj`, ...), so the key map (`hf_key`) renames leaf names only, and the two transposes PyTorch
layouts need live in `to_hf_layout` / `from_hf_layout`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sclaro_jax import bounds
from sclaro_jax.files import write_replacing
from sclaro_jax.models.errors import CheckpointError  # raised here; its home needs no JAX

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Buffers some Hugging Face checkpoints carry; they are recomputed, never loaded.
_IGNORED_HF_KEYS = ("vision_model.embeddings.position_ids", "text_model.embeddings.position_ids")
_LEAF_TO_HF = {"kernel": "weight", "scale": "weight", "embedding": "weight"}


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` to the safetensors file `path`, atomically and never through a link
    (`files.write_replacing`: a temporary file of its own moved into place), with the
    permissions an ordinary new file gets (0666 less the umask: 0644 under umask 022;
    safetensors' own `save_file` makes its file 0600 under a name of its choosing)."""
    from safetensors.numpy import save

    data = save(dict(tensors), metadata=metadata)
    return write_replacing(path, lambda f: f.write(data))


def hf_key(path: tuple) -> str:
    """Our NNX parameter path -> Hugging Face state-dict key (the one key map)."""
    *parents, leaf = (str(p) for p in path)
    return ".".join([*parents, _LEAF_TO_HF.get(leaf, leaf)])


def to_hf_layout(path: tuple, value: np.ndarray) -> np.ndarray:
    """Our layout -> PyTorch layout. Linear `[in, out]` -> `[out, in]`; conv `[p, p, C, D]` ->
    `[D, C, p, p]`. The inverse is `from_hf_layout`; the transposes live only here."""
    if path[-1] != "kernel":
        return value
    return value.T if value.ndim == 2 else value.transpose(3, 2, 0, 1)


def from_hf_layout(path: tuple, value: np.ndarray) -> np.ndarray:
    if path[-1] != "kernel":
        return value
    return value.T if value.ndim == 2 else value.transpose(2, 3, 1, 0)


def config_fields(cls, sub: Mapping[str, Any]):
    """A config dataclass `cls` from a config.json section: the fields `cls` knows, None left
    at the default."""
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in sub.items() if k in known and v is not None})


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of `folder`'s model.safetensors, or of the shards its index names."""
    from safetensors.numpy import load_file

    single, index = folder / WEIGHTS_NAME, folder / WEIGHTS_INDEX_NAME
    if single.exists():
        files = [single]
    elif index.exists():
        try:
            shards = sorted(set(bounds.read_json(index)["weight_map"].values()))
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{index} is not a safetensors index ({err})") from None
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        files = [folder / s for s in shards]
    else:
        present = sorted(p.name for p in folder.iterdir())
        raise CheckpointError(
            f"{folder} has no {WEIGHTS_NAME} (or {WEIGHTS_INDEX_NAME}); found {present}. "
            "Save the model with `save_pretrained(..., safe_serialization=True)`.")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as err:  # a truncated / corrupt file
            raise CheckpointError(f"{folder}: cannot read the safetensors weights ({err})") \
                from err
    return tensors


def load_hf_state(model: nnx.Module, tensors: Mapping[str, np.ndarray], where: str = "checkpoint",
                  *, kind: str = "CLIP") -> None:
    """Write Hugging Face state-dict tensors into `model` in place, checking names and shapes.

    Every parameter is replaced, so `model` may be a shape-only model from `nnx.eval_shape`."""
    flat = nnx.to_flat_state(nnx.state(model))
    expected = {hf_key(path): (path, var) for path, var in flat}
    names = set(tensors) - set(_IGNORED_HF_KEYS)
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    wrong_shape = []
    for key in sorted(names & set(expected)):
        path, var = expected[key]
        want = to_hf_layout(path, np.empty(var.shape, np.bool_)).shape
        if tuple(tensors[key].shape) != want:
            wrong_shape.append(f"{key}: file {tuple(tensors[key].shape)}, model {want}")
    if missing or unexpected or wrong_shape:
        lines = [f"{where} does not match a {kind} model of this config:"]
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected),
                             ("shape mismatches", wrong_shape)):
            if items:
                shown = ", ".join(items[:12]) + (f", ... ({len(items)} in all)"
                                                 if len(items) > 12 else "")
                lines.append(f"{title}: {shown}")
        raise CheckpointError(" ".join(lines[:1]) + " " + "; ".join(lines[1:]))
    for key, (path, var) in expected.items():
        value = from_hf_layout(path, np.asarray(tensors[key], dtype=np.float32))
        var.set_value(jnp.asarray(value, dtype=var.dtype))


def read_config_json(path: str | os.PathLike) -> tuple[dict, Path]:
    """(config.json's dict, its path) of a Hugging Face model folder; CheckpointError naming the
    folder or file when it is missing or not JSON."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        return bounds.read_json(config_file), config_file
    except ValueError as err:
        raise CheckpointError(f"{config_file} is not valid JSON ({err})") from None


def load(path: str | os.PathLike, config_from_hf: Callable[[Mapping[str, Any], str], Any],
         build: Callable[[Any], nnx.Module], kind: Callable[[Any], str],
         prepare: Callable[[Any, dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
         ) -> nnx.Module:
    """A model from a Hugging Face folder: `config_from_hf(config.json dict, file name)` gives
    the config, `build(config)` the model (built with shapes only, then every parameter read
    from the safetensors), `kind(config)` the model's name for error messages;
    `prepare(config, tensors)`, when given, returns the tensors to load in place of the file's."""
    folder = Path(path)
    raw, config_file = read_config_json(folder)
    config = config_from_hf(raw, str(config_file))
    tensors = read_safetensors(folder)
    if prepare is not None:
        tensors = prepare(config, tensors)
    model = nnx.eval_shape(lambda: build(config))  # shapes only: no random init to throw away
    load_hf_state(model, tensors, where=str(folder), kind=kind(config))
    return model


def hf_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's parameters as a Hugging Face state dict of float32 numpy arrays."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    # np.array(order="C"), not np.ascontiguousarray: the latter turns the 0-d logit scale 1-d.
    return {hf_key(path): np.array(to_hf_layout(path, np.asarray(var[...], np.float32)),
                                   order="C")
            for path, var in flat}
