"""Tensors from PyTorch and safetensors weight files with numpy only (no torch).

`read_torch_file` reads the zip archive `torch.save` writes (PyTorch >= 1.6): a restricted
unpickler rebuilds each tensor from its storage as a numpy array (offsets, strides and dtypes
kept, bfloat16 through ml_dtypes) and refuses any other pickled class, so a file cannot run
code. Bounds before bytes: every tensor's offset, sizes and strides are checked against its
storage (non-negative, as many strides as sizes, the furthest element inside the storage, the
storage's element count times its dtype's size equal to its record's bytes) before any tensor
is made, so a crafted file cannot make the reader view memory past a record; a refusal is a
`CheckpointError` naming the file and the tensor's key. The pickle is bounded before it is
unpickled: data.pkl over `MAX_PICKLE_BYTES` is refused unread, and its opcodes are walked first
(`pickletools.genops`: every opcode known and whole), each memo index at most the number of
opcodes before it and each FRAME inside the file, so no opcode makes the unpickler allocate what
the file does not hold (Python's unpickler sizes its memo by the index it is given). What it
builds is bounded too: a walk visits at most one value per byte of data.pkl (containers sharing
their contents over and over are refused, not walked 2^60 times), and the tensors made (copies)
hold at most `MAX_COPIES` times the bytes of their storages. Any error of a malformed pickle,
zip or record is a `CheckpointError` naming the file.

`read_state_dict` reads a `.safetensors` or torch file into a flat {key: array} dict, unwrapping
training checkpoints (`{"state_dict": {"module.<key>": ...}}`).
"""

from __future__ import annotations

import io
import lzma
import os
import pickle
import pickletools
import reprlib
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from sclaro_jax import bounds
from sclaro_jax.models.errors import CheckpointError

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


class _Sealed:
    """A value the unpickler makes that data.pkl may not change: pickle's BUILD opcode on it
    (which would set its attributes, an element count past its record say) is refused."""

    def __setstate__(self, state):
        raise pickle.UnpicklingError(f"data.pkl sets the state of a {type(self).__name__}")


class _Storage(_Sealed):
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


class _Tensor(_Sealed):
    """A tensor as data.pkl describes it (storage, offset, sizes, strides), not yet checked or
    made: `read_torch_file` checks every one against its storage before it makes any."""

    def __init__(self, storage: _Storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


MAX_RANK = 32  # a tensor of more dimensions is refused (numpy's own limit is 64)
MAX_DEPTH = 64  # containers nested deeper than this are refused (a state dict nests 1-3)
MAX_PICKLE_BYTES = 64 << 20  # data.pkl of a state dict: kilobytes to a few MiB
MAX_MEMBER_BYTES = 64  # the archive's byteorder member ("little")
MAX_COPIES = 4  # the tensors made may hold this many times the bytes of the storages they view
_INT64 = 1 << 63  # offsets, sizes, strides and element counts are torch's int64s
_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")


def _shown(value) -> str:
    """A short repr of a value from a file (reprlib's; an int past Python's digit limit for
    printing, in it or inside it, by its type)."""
    try:
        return reprlib.repr(value)
    except ValueError:
        return f"a {type(value).__name__} too long to show"


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
    if any(abs(v) >= _INT64 for v in (t.offset, *t.size, *t.stride)):
        return "an offset, size or stride past 64 bits"
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


def _tensors(obj, path: str, found: list, budget: list[int], depth: int = 0) -> str | None:
    """Every `_Tensor` in `obj` (dicts, lists, tuples) appended to `found` with the key path
    naming it; what is wrong (None: nothing) with containers nested too deep, more values than
    `budget[0]` (data.pkl's bytes: containers that share their contents make a walk visit more
    values than the pickle wrote) or a tensor in a set."""
    if depth > MAX_DEPTH:
        return f"containers nested more than {MAX_DEPTH} deep at {path}"
    budget[0] -= 1
    if budget[0] < 0:
        return "containers that share their contents over and over (more values than bytes)"
    if isinstance(obj, _Tensor):
        found.append((path or "(the top)", obj))
    elif isinstance(obj, (set, frozenset)) and any(isinstance(v, _Tensor) for v in obj):
        return f"a set of tensors at {path or '(the top)'}"
    items = (obj.items() if isinstance(obj, dict) else enumerate(obj)
             if isinstance(obj, (list, tuple)) else ())
    for k, v in items:
        name = k if isinstance(k, str) else _shown(k)
        key = (f"{path}.{name}" if path else str(name)) if isinstance(obj, dict) \
            else f"{path}[{k}]"
        problem = _tensors(v, key, found, budget, depth + 1)
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
            raise CheckpointError(f"{self._where}: unknown persistent id {_shown(pid)} "
                                  "in data.pkl")
        _, kind, key, _location, numel = pid[:5]
        if not isinstance(kind, str) or kind not in _STORAGE_DTYPES:
            raise CheckpointError(f"{self._where}: storage type {_shown(kind)} is not "
                                  "supported")
        if not isinstance(key, str) or key not in self._records:
            raise CheckpointError(f"{self._where}: data.pkl names storage {_shown(key)},"
                                  " which the archive does not hold (or holds compressed)")
        if type(numel) is not int or not 0 <= numel < _INT64:
            raise CheckpointError(f"{self._where}: storage {_shown(key)} declares "
                                  f"{_shown(numel)} elements")
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


def _check_pickle(data: bytes) -> None:
    """pickle.UnpicklingError (or ValueError) unless every opcode of `data` is known and whole,
    each memo index is at most the number of opcodes before it and each FRAME lies inside
    `data`: then unpickling allocates nothing the file does not hold."""
    for count, (op, arg, pos) in enumerate(pickletools.genops(data)):
        if op.name in _MEMO_PUTS and arg > count:
            raise pickle.UnpicklingError(f"memo index {arg} at byte {pos}, after only {count} "
                                         "opcodes")
        if op.name == "FRAME" and arg > len(data) - pos:
            raise pickle.UnpicklingError(f"a FRAME of {arg} bytes at byte {pos}, past the end")


# what a malformed pickle raises in Python's unpickler (and pickletools): a wrong opcode, a
# short read, an int too big, a REDUCE of something not callable, an attribute missing, ...
_PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, OverflowError, TypeError, AttributeError,
                  ValueError, IndexError, KeyError, RecursionError)
# what a damaged zip archive raises in zipfile (RuntimeError: encrypted; NotImplementedError,
# a RuntimeError: an unknown compression method)
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, RuntimeError, zlib.error,
               lzma.LZMAError)


def _unpickle(data: bytes, records: dict, read_record, where: str):
    """data.pkl's object (`_TorchUnpickler`), its opcodes checked first (`_check_pickle`)."""
    try:
        _check_pickle(data)
        return _TorchUnpickler(io.BytesIO(data), records, read_record, where).load()
    except CheckpointError:
        raise
    except _PICKLE_ERRORS as err:
        raise CheckpointError(f"{where}: data.pkl is not a pickle this reader reads "
                              f"({type(err).__name__}: {str(err)[:200]}); the file is damaged "
                              "or crafted") from None


def _member(archive: zipfile.ZipFile, name: str, limit: int, where: str) -> bytes:
    """The bytes of archive member `name`, refused unread when it declares more than `limit`."""
    size = archive.getinfo(name).file_size
    if size > limit:
        raise CheckpointError(f"{where}: {name} is {size:,} bytes, over the {limit:,} this "
                              "reader reads: not a torch file it reads")
    return archive.read(name)


def _read_archive(archive: zipfile.ZipFile, where: str, shapes_only: bool) -> Any:
    names = archive.namelist()
    pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
    if not pkl:
        raise CheckpointError(f"{where}: the zip archive has no data.pkl: not a torch file")
    prefix = pkl[0][: -len("data.pkl")]
    order = (_member(archive, prefix + "byteorder", MAX_MEMBER_BYTES, where).decode(
        "ascii", "replace") if prefix + "byteorder" in names else "little")
    if order.strip() != "little":
        raise CheckpointError(f"{where}: big-endian torch files are not supported")
    # storage key -> (record name, bytes): torch.save stores records uncompressed, so the
    # bytes read are the bytes on disk
    records = {info.filename[len(prefix) + 5:]: (info.filename[len(prefix):], info.file_size)
               for info in archive.infolist()
               if info.filename.startswith(prefix + "data/")
               and info.compress_type == zipfile.ZIP_STORED}

    def read_record(key: str) -> bytes:
        data = archive.read(f"{prefix}data/{key}")
        if len(data) != records[key][1]:
            raise CheckpointError(f"{where}: record {records[key][0]} holds {len(data)} bytes, "
                                  f"not the {records[key][1]} its directory entry says")
        return data

    data = _member(archive, pkl[0], MAX_PICKLE_BYTES, where)
    obj = _unpickle(data, records, read_record, where)
    found: list = []
    problem = _tensors(obj, "", found, [len(data)])
    if problem:
        raise CheckpointError(f"{where}: {problem}: not a state dict this reader reads")
    distinct = {id(t): (k, t) for k, t in found}  # a tensor listed twice is checked once
    for key, tensor in distinct.values():
        problem = _tensor_problem(tensor)
        if problem:
            raise CheckpointError(f"{where}: tensor {key}: {problem}; the file is damaged "
                                  "or crafted, and is not read")
    made = {i: int(np.prod(t.size, dtype=object)) * t.storage.dtype.itemsize
            for i, (_, t) in distinct.items()}
    copies = sum(made[id(t)] for _, t in found)  # each listing is a copy
    held = sum({id(t.storage): t.storage.nbytes for _, t in distinct.values()}.values())
    if not shapes_only and copies > MAX_COPIES * held:
        raise CheckpointError(f"{where}: its tensors view their {held:,} bytes of storage as "
                              f"{copies:,} bytes, over {MAX_COPIES} times as many: the file is "
                              "damaged or crafted, and is not read")
    return _made(obj, shapes_only)


def read_torch_file(path: str | os.PathLike, *, shapes_only: bool = False) -> Any:
    """The object a `torch.save` zip archive holds, tensors as numpy arrays (or `_Shape`s with
    `shapes_only`), rebuilt without torch; anything but containers, numbers and tensors is
    refused. Every tensor's offset, sizes and strides are checked against its storage (and the
    storage's element count against its record's bytes) before any tensor is made, and the
    pickle's opcodes before it is unpickled: `CheckpointError` naming the file (and the
    tensor's key) otherwise."""
    where = os.fspath(path)
    try:
        if not zipfile.is_zipfile(where):  # which raises for some damaged end records
            raise CheckpointError(
                f"{where} is not a zip archive: a legacy (pre-1.6) torch file or not a torch "
                "file at all. Re-save it with torch.save (or as .safetensors) and pass that file")
        with zipfile.ZipFile(where) as archive:
            return _read_archive(archive, where, shapes_only)
    except _ZIP_ERRORS as err:
        raise CheckpointError(f"{where}: a damaged zip archive ({type(err).__name__}: "
                              f"{str(err)[:200]})") from None


def _safetensors(path: Path, shapes_only: bool) -> dict:
    """The tensors of a safetensors file, its header checked by the safetensors library; those
    with bfloat16 tensors (which safetensors.numpy cannot hold) read by `_safetensors_bf16`."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            if shapes_only:
                return {k: _Shape(v.get_shape(), None) for k, v in slices.items()}
            if not any(v.get_dtype() == "BF16" for v in slices.values()):
                return {k: f.get_tensor(k) for k in slices}
    except Exception as err:  # a truncated / corrupt file (the library's own error types)
        raise CheckpointError(f"{path}: cannot read the safetensors weights ({err})") from err
    return _safetensors_bf16(path)


_SAFETENSORS_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "F16": np.float16, "BF16": "bfloat16", "U32": np.uint32, "I32": np.int32,
    "F32": np.float32, "U64": np.uint64, "I64": np.int64, "F64": np.float64}


def _safetensors_entry(info, data_bytes: int) -> str | None:
    """What is wrong with one tensor's header entry (None: its dtype is one read here, its shape
    whole numbers and its data_offsets the bytes of that shape inside the data)."""
    if not isinstance(info, dict):
        return "is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPES:
        return f"dtype {_shown(dtype)} is not one of {sorted(_SAFETENSORS_DTYPES)}"
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK
            and all(type(n) is int and 0 <= n < _INT64 for n in shape)):
        return f"shape {_shown(shape)} is not a list of whole numbers"
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(n) is int for n in offsets) and 0 <= offsets[0] <= offsets[1]
            <= data_bytes):
        return f"data_offsets {_shown(offsets)} are not two offsets into the data"
    need = int(np.prod(shape, dtype=object)) * _np_dtype(_SAFETENSORS_DTYPES[dtype]).itemsize
    if offsets[1] - offsets[0] != need:
        return (f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, its shape "
                f"{shape} of {dtype} {need}")
    return None


def _safetensors_bf16(path: Path) -> dict:
    """safetensors with bfloat16 tensors (safetensors.numpy cannot hold them), read here from
    the format's description: the header checked entry by entry before any tensor is made."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    if len(raw) < 8 or n > len(raw) - 8:
        raise CheckpointError(f"{path}: a safetensors header of {n} bytes in a file of "
                              f"{len(raw)}")
    header = bounds.parse_json(raw[8:8 + n], str(path))
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        problem = _safetensors_entry(info, len(raw) - 8 - n)
        if problem:
            raise CheckpointError(f"{path}: tensor {key}: {problem}")
        start, stop = info["data_offsets"]
        out[key] = np.frombuffer(raw[8 + n + start:8 + n + stop], _np_dtype(
            _SAFETENSORS_DTYPES[info["dtype"]])).reshape(info["shape"])
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
    odd = next((k for k in state if not isinstance(k, str)), None)
    if odd is not None:
        raise CheckpointError(f"{path}: state dict key {_shown(odd)} is not a string")
    if all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return dict(state)
