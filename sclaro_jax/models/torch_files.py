"""Tensors from PyTorch and safetensors weight files with numpy only (no torch).

`read_torch_file` reads the zip archive `torch.save` writes (PyTorch >= 1.6): a restricted
unpickler rebuilds each tensor from its storage as a numpy array (offsets, strides and dtypes
kept, bfloat16 through ml_dtypes) and refuses any other pickled class, so a file cannot run
code. Bounds before bytes: every tensor's offset, sizes and strides are checked against its
storage (non-negative, as many strides as sizes, the furthest element inside the storage, the
storage's element count times its dtype's size equal to its record's bytes) before any tensor
is made, so a crafted file cannot make the reader view memory past a record; a refusal is a
`CheckpointError` naming the file and the tensor's key.

`read_state_dict` reads a `.safetensors` or torch file into a flat {key: array} dict, unwrapping
training checkpoints (`{"state_dict": {"module.<key>": ...}}`).
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from sclaro_jax import bounds
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
    """One storage record of the archive: its dtype, element count (from data.pkl) and byte
    length (from the zip's directory), read only when a checked tensor needs its bytes."""

    def __init__(self, dtype, numel: int, record: str, nbytes: int, read):
        self.dtype, self.numel, self.record, self.nbytes = dtype, numel, record, nbytes
        self._read, self._array = read, None

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.frombuffer(self._read(), self.dtype)
        return self._array


class _Shape:
    """A tensor's shape and dtype without its data (`read_shapes`)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


class _Tensor:
    """A tensor as data.pkl describes it (storage, offset, sizes, strides), not yet checked or
    made: `read_torch_file` checks every one against its storage before it makes any."""

    def __init__(self, storage: _Storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


MAX_RANK = 32  # a tensor of more dimensions is refused (numpy's own limit is 64)
MAX_DEPTH = 64  # containers nested deeper than this are refused (a state dict nests 1-3)


def _ints(value) -> bool:
    return isinstance(value, tuple) and all(type(v) is int for v in value)


def _tensor_problem(t: _Tensor) -> str | None:
    """What is wrong with a tensor's layout over its storage (None: every element it views
    lies inside the storage, and its copy is no bigger than the storage)."""
    s = t.storage
    if s.numel * s.dtype.itemsize != s.nbytes:
        return (f"its storage {s.record} declares {s.numel} elements of {s.dtype.itemsize} "
                f"bytes but the record holds {s.nbytes} bytes")
    if type(t.offset) is not int or not _ints(t.size) or not _ints(t.stride):
        return "its offset, sizes and strides are not whole numbers"
    if len(t.size) != len(t.stride) or len(t.size) > MAX_RANK:
        return (f"{len(t.size)} sizes and {len(t.stride)} strides (equal counts, at most "
                f"{MAX_RANK}, are needed)")
    if t.offset < 0 or min(t.size + t.stride, default=0) < 0:
        return f"a negative offset, size or stride ({t.offset}, {t.size}, {t.stride})"
    count = int(np.prod(t.size, dtype=object))
    if count == 0:
        return None if t.offset <= s.numel else f"offset {t.offset} is past the storage"
    last = t.offset + sum((n - 1) * st for n, st in zip(t.size, t.stride))
    if last >= s.numel:
        return (f"offset {t.offset}, sizes {t.size} and strides {t.stride} reach element "
                f"{last}, past the {s.numel} elements of its storage {s.record}")
    if count > s.numel:
        return (f"sizes {t.size} hold {count} elements, more than the {s.numel} of its "
                f"storage (a stride-0 view): save a contiguous copy")
    return None


def _tensors(obj, path: str, found: list, depth: int = 0) -> str | None:
    """Every `_Tensor` in `obj` (dicts, lists, tuples) appended to `found` with the key path
    naming it; what is wrong (None: nothing) with containers nested too deep or a tensor in a
    set."""
    if depth > MAX_DEPTH:
        return f"containers nested more than {MAX_DEPTH} deep at {path}"
    if isinstance(obj, _Tensor):
        found.append((path or "(the top)", obj))
    elif isinstance(obj, (set, frozenset)) and any(isinstance(v, _Tensor) for v in obj):
        return f"a set of tensors at {path or '(the top)'}"
    items = (obj.items() if isinstance(obj, dict) else enumerate(obj)
             if isinstance(obj, (list, tuple)) else ())
    for k, v in items:
        key = (f"{path}.{k}" if path else str(k)) if isinstance(obj, dict) else f"{path}[{k}]"
        problem = _tensors(v, key, found, depth + 1)
        if problem:
            return problem
    return None


def _made(obj, shapes_only: bool):
    """`obj` with each (checked) `_Tensor` made: a numpy copy, or a `_Shape`."""
    if isinstance(obj, _Tensor):
        if shapes_only:
            return _Shape(obj.size, obj.storage.dtype)
        flat = obj.storage.array()
        view = np.lib.stride_tricks.as_strided(
            flat[obj.offset:], shape=obj.size,
            strides=tuple(s * flat.itemsize for s in obj.stride))
        return np.array(view)  # a copy: its own contiguous memory
    if isinstance(obj, dict):
        out = type(obj)()
        for k, v in obj.items():
            out[k] = _made(v, shapes_only)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_made(v, shapes_only) for v in obj)
    return obj


class _TorchUnpickler(pickle.Unpickler):
    """Unpickles a `torch.save` archive's data.pkl: only containers, numbers and tensors."""

    def __init__(self, file, records: dict, read_record, where: str):
        super().__init__(file)
        self._records, self._read_record, self._where = records, read_record, where
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
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self._where}: unknown persistent id {pid!r} in data.pkl")
        _, kind, key, _location, numel = pid[:5]
        if kind not in _STORAGE_DTYPES:
            raise CheckpointError(f"{self._where}: storage type {kind!r} is not supported")
        if not isinstance(key, str) or key not in self._records:
            raise CheckpointError(f"{self._where}: data.pkl names storage {key!r}, which the "
                                  "archive does not hold (or holds compressed)")
        if type(numel) is not int or numel < 0:
            raise CheckpointError(f"{self._where}: storage {key} declares {numel!r} elements")
        if key not in self._storages:
            self._storages[key] = _Storage(
                _np_dtype(_STORAGE_DTYPES[kind]), numel, self._records[key][0],
                self._records[key][1], lambda key=key: self._read_record(key))
        return self._storages[key]

    def _rebuild_tensor(self, storage, offset, size, stride, *_):
        if not isinstance(storage, _Storage):
            raise CheckpointError(f"{self._where}: a tensor's storage is a "
                                  f"{type(storage).__name__}, not a storage record")
        return _Tensor(storage, offset, size, stride)


def read_torch_file(path: str | os.PathLike, *, shapes_only: bool = False) -> Any:
    """The object a `torch.save` zip archive holds, tensors as numpy arrays (or `_Shape`s with
    `shapes_only`), rebuilt without torch; anything but containers, numbers and tensors is
    refused. Every tensor's offset, sizes and strides are checked against its storage (and the
    storage's element count against its record's bytes) before any tensor is made:
    `CheckpointError` naming the file and the tensor's key otherwise."""
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
        # storage key -> (record name, bytes): torch.save stores records uncompressed, so the
        # bytes read are the bytes on disk
        records = {info.filename[len(prefix) + 5:]: (info.filename[len(prefix):], info.file_size)
                   for info in archive.infolist()
                   if info.filename.startswith(prefix + "data/")
                   and info.compress_type == zipfile.ZIP_STORED}

        def read_record(key: str) -> bytes:
            return archive.read(f"{prefix}data/{key}")

        with archive.open(pkl[0]) as f:
            obj = _TorchUnpickler(f, records, read_record, where).load()
        found: list = []
        problem = _tensors(obj, "", found)
        if problem:
            raise CheckpointError(f"{where}: {problem}: not a state dict this reader reads")
        for key, tensor in found:
            problem = _tensor_problem(tensor)
            if problem:
                raise CheckpointError(f"{where}: tensor {key}: {problem}; the file is damaged "
                                      "or crafted, and is not read")
        return _made(obj, shapes_only)


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
    header = bounds.parse_json(raw[8:8 + n], str(path))
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
