"""The files of a MINER ANN index (`sclaro_jax.miner.index`): the index folder, its JSON, .npy
and FAISS files written whole and read back with their limits, and opening an index or a set of
shards with its settings checked (`Shard`). See `sclaro_jax.miner.index` for the method."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from sclaro_jax import bounds
from sclaro_jax.miner.index.settings import (SETTINGS, VERSION, IndexFileError, _compare,
                                             faiss)


def _index_folder(out: Path) -> None:
    """Make the index folder `out`, or take an empty one or an index build's (meta.json);
    refuse a folder of other files (the build writes and removes files there)."""
    from sclaro_jax.files import refuse_shared_folder
    refuse_shared_folder(out)
    if out.is_dir() and not (out / "meta.json").is_file() and any(out.iterdir()):
        raise IndexFileError(f"--out {out} holds files but no index (meta.json): pass a new or "
                             "empty folder, or an index folder to resume its build")
    out.mkdir(parents=True, exist_ok=True)


def _views_to_write(path: Path) -> np.memmap:
    """The build's views.npy mapped for writing: never a link's target."""
    if path.is_symlink():
        raise IndexFileError(f"{path} is a symbolic link: an index build writes its own "
                             "views.npy; remove it, or pass another --out")
    return np.load(path, mmap_mode="r+")


def _write_json(path: Path, obj) -> None:
    from sclaro_jax.files import write_replacing
    write_replacing(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True)),
                    text=True, fsync=True)


def _write_npy(path: Path, arr) -> None:
    from sclaro_jax.files import write_replacing
    write_replacing(path, lambda f: np.save(f, arr), fsync=True)


def _write_index(path: Path, index) -> None:
    from sclaro_jax.files import write_replacing
    data = faiss().serialize_index(index)
    write_replacing(path, lambda f: f.write(data.tobytes()), fsync=True)


def _read_index(path: Path):
    """A FAISS index file, deserialised with faiss's byte and loop limits set to the file's own
    size (faiss's defaults allow a 1 TiB vector): no vector or loop it declares can be larger
    than the bytes that hold it, so a crafted header is refused before it is allocated. (The
    IVF-PQ precomputed table, computed rather than read, is skipped: inner-product indexes,
    all of ours, never use it.)"""
    if not path.is_file():
        raise IndexFileError(f"{path}: missing")
    f, data = faiss(), np.fromfile(path, dtype=np.uint8)
    limits = [(getattr(f, f"get_deserialization_{k}_limit", None),
               getattr(f, f"set_deserialization_{k}_limit", None)) for k in ("vector_byte", "loop")]
    saved = [(get(), set_) for get, set_ in limits if get and set_]
    try:
        for _, set_ in saved:
            set_(max(1, data.size))
        return f.deserialize_index(data, getattr(f, "IO_FLAG_SKIP_PRECOMPUTE_TABLE", 0))
    except (RuntimeError, MemoryError) as e:
        raise IndexFileError(f"{path}: unreadable FAISS index, or one declaring more than its "
                             f"{data.size} bytes hold ({str(e).strip().splitlines()[-1][:200]})"
                             ) from None
    finally:
        for value, set_ in saved:
            set_(value)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise IndexFileError(f"{path}: missing (not a MINER index folder, or its build never "
                             f"started)")
    try:
        return bounds.read_json(path)
    except bounds.BoundsError:
        raise
    except ValueError as e:
        raise IndexFileError(f"{path}: not JSON ({e}); the file is damaged") from None


# --------------------------------------------------------------------------------------------
# Open and search
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Shard:
    """One opened index folder."""

    path: Path
    meta: dict
    views: np.ndarray        # float16 [n, 1 + R, D], memory-mapped
    r_i: np.ndarray          # float32 [n]
    glob: object             # faiss index over [g, -r_i / 2]
    crops: object            # faiss index over the crops, or None

    @property
    def offset(self) -> int:
        return self.meta["offset"]

    @property
    def n(self) -> int:
        return self.meta["images"]

    def memory_bytes(self) -> int:
        """Bytes of the in-memory part: the FAISS indexes (serialised) and r_i."""
        f = faiss()
        size = len(f.serialize_index(self.glob)) + self.r_i.nbytes
        return size + (len(f.serialize_index(self.crops)) if self.crops is not None else 0)


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cold(views: np.ndarray) -> bool:
    """Whether an opened views.npy is too big to stay in the page cache: more than half of this
    machine's memory. The re-rank then reads its rows from disk, a few KB each at random places;
    `open_index` advises the mapping random (the kernel's read-around of read_ahead_kb, often
    megabytes, on every page fault would read megabytes per row) and `prefetch` starts each
    batch's reads at once."""
    return isinstance(views, np.memmap) and views.nbytes > _ram_bytes() // 2


def prefetch(views: np.ndarray, rows: np.ndarray) -> None:
    """For a `cold` views file: ask the kernel to start reading the given rows now, one
    posix_fadvise(WILLNEED) per run of adjacent rows, so the gather's page faults find reads
    under way together instead of waiting for one after another. Nothing for a warm file (the
    ~1.4 us a call would be pure cost when the rows are cached)."""
    if not cold(views) or not hasattr(os, "posix_fadvise") or not len(rows):
        return
    rows = np.unique(rows)
    cut = np.nonzero(np.diff(rows) != 1)[0] + 1
    first, last = rows[np.r_[0, cut]], rows[np.r_[cut - 1, len(rows) - 1]]
    size = views.strides[0]
    fd = os.open(views.filename, os.O_RDONLY)
    try:
        for a, b in zip(first.tolist(), last.tolist()):
            os.posix_fadvise(fd, views.offset + a * size, (b - a + 1) * size,
                             os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def kept(meta: dict, man: dict) -> str:
    """What an unfinished build has done, from its meta.json and manifest.json: "3 of 8 chunks
    stored, 0 added"."""
    chunks = -(-meta.get("images", 0) // max(1, meta.get("chunk", 1)))
    return (f"{len(man.get('stored', []))} of {chunks} chunks stored, "
            f"{len(man.get('added', []))} added")


def open_index(path) -> Shard:
    """Open one finished index folder; an unfinished build, a missing or truncated file is an
    `IndexFileError` naming the file."""
    path = Path(path)
    meta = _read_json(path / "meta.json")
    man = _read_json(path / "manifest.json")
    if not man.get("complete") or "files" not in meta:
        raise IndexFileError(f"{path}: the build is not finished ({kept(meta, man)}); run the "
                             f"same build command again to resume it")
    if meta.get("version") != VERSION:
        raise IndexFileError(f"{path / 'meta.json'}: index version {meta.get('version')}, this "
                             f"code reads {VERSION}; rebuild the index")
    for name, size in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise IndexFileError(f"{f}: missing; rebuild the index")
        if f.stat().st_size != size:
            raise IndexFileError(f"{f}: {f.stat().st_size} bytes, the build wrote {size} "
                                 f"(truncated or replaced); rebuild the index")
    views = np.load(path / "views.npy", mmap_mode="r")
    if cold(views) and hasattr(getattr(views, "_mmap", None), "madvise"):
        views._mmap.madvise(mmap.MADV_RANDOM)  # no megabytes of read-around per 9 KB row
    r_i = np.load(path / "r_i.npy")
    glob = _read_index(path / "global.faiss")
    crops = _read_index(path / "crops.faiss") if meta["n_crops"] else None
    return Shard(path, meta, views, r_i, glob, crops)


def open_shards(paths: Sequence, expect: Optional[dict] = None,
                opened: Optional[list] = None) -> list[Shard]:
    """Open the index folders of one gallery (one folder, or every shard i/N of a sharded
    build, in any order) and check they agree with each other and with `expect` (e.g.
    {"encoder": ..., "crop_rule": ..., "dim": ...}): a difference is refused naming both.
    `opened`: shards already opened, checked again (against another `expect`)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not opened and not paths:
        raise ValueError("no index folder given")
    shards = sorted(opened or (open_index(p) for p in paths), key=lambda s: s.meta["shard"][0])
    first = shards[0]
    for s in shards[1:]:
        _compare({f: first.meta.get(f) for f in SETTINGS if f not in ("shard",)}, s.meta,
                 f"{s.path / 'meta.json'} (beside {first.path})",
                 [f for f in SETTINGS if f != "shard"])
    count = first.meta["shard"][1]
    have = [s.meta["shard"][0] for s in shards]
    if have != list(range(count)):
        raise IndexFileError(f"{', '.join(str(s.path) for s in shards)}: shards {have} of "
                             f"{count}; a search needs each shard 0..{count - 1} once")
    if expect:
        _compare(expect, first.meta, str(first.path / "meta.json"), list(expect))
    return shards
