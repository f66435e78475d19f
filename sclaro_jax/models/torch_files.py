"""Tensors from PyTorch and safetensors weight files with numpy only (no torch).

`read_torch_file` reads the zip archive `torch.save` writes (PyTorch >= 1.6): a restricted
unpickler rebuilds each tensor from its storage as a numpy array (offsets, strides and dtypes
kept, bfloat16 through ml_dtypes) and refuses any other pickled class, so a file cannot run
code. `read_state_dict` reads a `.safetensors` or torch file into a flat {key: array} dict,
unwrapping training checkpoints (`{"state_dict": {"module.<key>": ...}}`).
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from sclaro_jax.models.hf_weights import CheckpointError

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
