"""Streaming sources: img2dataset's webdataset shards (`webdataset`) and Hugging Face `datasets`
folders (`hf`), read in place. `data_prep.sources` registers them (sorting, duplicate and
empty-listing checks) as the sources `webdataset` and `hf`; the items carry where their bytes
lie (a tar member's byte range, a dataset row) and `data_prep.source_items.read_image` reads
just those bytes when the item's block runs."""

from __future__ import annotations

import logging
import os
import tarfile
from typing import Iterator

from data_prep.source_items import SourceError, SourceItem, id_key
from sclaro_jax import bounds

log = logging.getLogger(__name__)


WEBDATASET_LAYOUT = ("webdataset shards: <dir>/{00000..00009}.tar (brace pattern), a folder of "
                     ".tar files or one .tar; per key <key>.<jpg|png|webp> with <key>.txt "
                     "(caption) and <key>.json, as img2dataset's webdataset output writes them")
WDS_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp")


def webdataset(root: str, *, name: str = "webdataset",
               skip_missing: bool = False) -> Iterator[SourceItem]:
    """Uncompressed webdataset shards, e.g. img2dataset's `--output_format webdataset`::

        <dir>/00000.tar   members <key>.jpg (or .png, .webp, ...)  the image
                                  <key>.txt                        its caption
                                  <key>.json   {"caption", "key", "url", ...}  (caption used
                                               when there is no .txt)
        <dir>/00001.tar, ...

    `root` is a tar, a folder (its *.tar files) or a brace pattern such as
    "/data/cc3m/{00000..00331}.tar" (every tar it names must exist). The key of a member is its
    name up to the first dot of the file name (webdataset's rule), folders included. Nothing is
    unpacked: the listing reads the tar headers only, and `read_image` later reads exactly the
    image member's bytes. Ids "<name>/<shard>/<key>", shard = the tar's file name without .tar;
    `name` (default "webdataset") is also the items' `source`: name=cc3m gives CC3M downloaded
    as tars the ids and source of the `cc3m` adapter over img2dataset's files layout. A key
    without an image is an error naming the tar and key, or is skipped with a warning when
    `skip_missing`. The caption is kept in `SourceItem.caption`.
    """
    title = "webdataset"
    name = str(name)  # --source-option name=123 arrives as a number
    missing = 0
    for tar_path in _tar_paths(root):
        shard = os.path.basename(tar_path)
        shard = shard[:-4] if shard.lower().endswith(".tar") else os.path.splitext(shard)[0]
        keys: dict[str, dict[str, tarfile.TarInfo]] = {}
        try:
            size = os.path.getsize(tar_path)
            with tarfile.open(tar_path, "r:") as tar:
                for member in tar:  # headers only: the data of each member is seeked past
                    if not member.isfile():
                        continue
                    if member.offset_data + member.size > size:
                        raise SourceError(
                            f"{title}: {tar_path} is truncated: member {member.name} needs "
                            f"bytes up to {member.offset_data + member.size}, the file has "
                            f"{size}; download the shard again")
                    folder, _, base = member.name.rpartition("/")
                    stem, dot, ext = base.partition(".")
                    if not dot or not stem:
                        continue
                    key = f"{folder}/{stem}" if folder else stem
                    keys.setdefault(key, {})[ext.lower()] = member
                captions = {}
                for key, members in keys.items():
                    captions[key] = _wds_caption(tar, tar_path, members)
        except tarfile.TarError as e:
            raise SourceError(f"{title}: cannot read {tar_path}: {type(e).__name__}: {e} (an "
                              f"uncompressed .tar is expected; a truncated or compressed "
                              f"shard must be downloaded again or decompressed)") from None
        for key, members in keys.items():
            images = [ext for ext in WDS_IMAGE_EXTENSIONS if ext in members]
            if len(images) > 1:
                raise SourceError(f"{title}: {tar_path}: key {key!r} has {len(images)} images "
                                  f"({', '.join(members[e].name for e in images)}); expected "
                                  f"one per key")
            if not images:
                if skip_missing:
                    missing += 1
                    continue
                raise SourceError(f"{title}: {tar_path}: key {key!r} has no image (members "
                                  f"{', '.join(m.name for m in members.values())}); expected "
                                  f"{WEBDATASET_LAYOUT} (or pass skip_missing=true)")
            member = members[images[0]]
            yield SourceItem(id=f"{id_key(name)}/{id_key(shard)}/{id_key(key)}", source=name,
                             path=tar_path, caption=captions[key], member=member.name,
                             offset=member.offset_data, size=member.size)
    if missing:
        log.warning("webdataset: skipped %d keys without an image in %s", missing, root)


def _tar_paths(root: str) -> list[str]:
    """The tars a webdataset root names: a brace pattern, a folder of .tar files or a .tar."""
    title = "webdataset"
    if "{" in root:
        import braceexpand
        paths = list(braceexpand.braceexpand(root))
        absent = [p for p in paths if not os.path.isfile(p)]
        if absent:
            raise SourceError(f"{title}: {len(absent)} of the {len(paths)} tars of {root} are "
                              f"missing, e.g. {absent[0]}; download them or narrow the pattern")
        return paths
    if os.path.isdir(root):
        paths = sorted(os.path.join(root, n) for n in os.listdir(root)
                       if n.lower().endswith(".tar") and not n.startswith("."))
        if not paths:
            raise SourceError(f"{title}: no .tar files in {root}; expected {WEBDATASET_LAYOUT}")
        return paths
    if os.path.isfile(root):
        return [root]
    raise SourceError(f"{title}: {root} not found; expected {WEBDATASET_LAYOUT}")


def _wds_caption(tar: tarfile.TarFile, tar_path: str, members: dict) -> str | None:
    """The key's caption: its .txt member, else the "caption" of its .json (as img2dataset)."""
    def text(member) -> str:
        f = tar.extractfile(member)
        try:
            return f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise SourceError(f"webdataset: {tar_path} member {member.name}: not UTF-8 "
                              f"text ({e})") from None
    if "txt" in members:
        return text(members["txt"]).strip()
    if "json" in members:
        try:
            meta = bounds.parse_json(text(members["json"]), members["json"].name)
        except ValueError as e:
            raise SourceError(f"webdataset: {tar_path} member {members['json'].name}: "
                              f"not JSON ({e})") from None
        caption = meta.get("caption") if isinstance(meta, dict) else None
        return caption.strip() if isinstance(caption, str) else None
    return None


HF_LAYOUT = ("a Hugging Face `datasets` folder written by save_to_disk (a Dataset, or a "
             "DatasetDict with one folder per split) with an Image() column")


def hf(root: str, *, name: str = "hf", split: str | None = None,
       image_column: str | None = None, id_column: str | None = None,
       caption_column: str | None = None) -> Iterator[SourceItem]:
    """A Hugging Face `datasets` folder written with `Dataset.save_to_disk` (or
    `DatasetDict.save_to_disk`: pick the split with `split`, default "train" when there is one
    or the only split). Opened with `datasets.load_from_disk` (memory-mapped; nothing is decoded
    here).

    The image column is `image_column`, else the first `datasets.Image()` feature; `read_image`
    reads the row's raw stored bytes (`Image(decode=False)`), so a JPEG stays byte for byte.
    Ids "<name>/<id>" (`name` default "hf", also the items' `source`): id = the `id_column`
    value (default the "key" column, else "id", when there is one), else the row index
    zero-padded to the width of the last one. The caption (`caption_column`, default "caption"
    or "text" when present) is kept in `SourceItem.caption`.
    """
    import datasets
    title = "hf"
    # --source-option values arrive parsed as JSON: name=2024 is a number
    name, split, image_column, id_column, caption_column = (
        None if v is None else str(v)
        for v in (name, split, image_column, id_column, caption_column))
    try:
        ds = datasets.load_from_disk(root)
    except Exception as e:  # FileNotFoundError, an unreadable folder
        raise SourceError(f"{title}: cannot open {root} with datasets.load_from_disk: "
                          f"{type(e).__name__}: {e}; expected {HF_LAYOUT}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = sorted(ds)
        if split is None:
            split = "train" if "train" in ds else (splits[0] if len(splits) == 1 else None)
            if split is None:
                raise SourceError(f"{title}: {root} holds the splits {', '.join(splits)}; pass "
                                  f"split=NAME")
        if split not in ds:
            raise SourceError(f"{title}: {root} has no split {split!r}; its splits: "
                              f"{', '.join(splits)}")
        ds = ds[split]
    elif split is not None:
        raise SourceError(f"{title}: {root} is a single Dataset without splits; leave out "
                          f"split={split}")
    features = ds.features
    if image_column is None:
        image_column = next((c for c, f in features.items() if isinstance(f, datasets.Image)),
                            None)
        if image_column is None:
            raise SourceError(f"{title}: {root} has no Image() column (columns: "
                              f"{', '.join(features)}); pass image_column=NAME")
    for option, column in (("image_column", image_column), ("id_column", id_column),
                           ("caption_column", caption_column)):
        if column is not None and column not in features:
            raise SourceError(f"{title}: {root} has no column {column!r} ({option}); columns: "
                              f"{', '.join(features)}")
    if not isinstance(features[image_column], datasets.Image):
        raise SourceError(f"{title}: {root} column {image_column!r} is "
                          f"{type(features[image_column]).__name__}, not Image()")
    if id_column is None:
        id_column = next((c for c in ("key", "id") if c in features), None)
    if caption_column is None:
        caption_column = next((c for c in ("caption", "text") if c in features), None)
    if getattr(ds, "_indices", None) is not None:  # a saved selection: rows by position
        raise SourceError(f"{title}: {root} was saved with an indices mapping; save it with "
                          f"ds.flatten_indices().save_to_disk(...)")
    n = len(ds)
    table = ds.data  # arrow columns: no image is decoded
    ids = (table.column(id_column).to_pylist() if id_column
           else [f"{i:0{len(str(max(n - 1, 0)))}d}" for i in range(n)])
    captions = table.column(caption_column).to_pylist() if caption_column else [None] * n
    for row, (key, caption) in enumerate(zip(ids, captions)):
        if key is None or str(key) == "":
            raise SourceError(f"{title}: {root} row {row}: empty {id_column!r}")
        yield SourceItem(id=f"{id_key(name)}/{id_key(str(key))}", source=name, path=root,
                         caption=caption.strip() if isinstance(caption, str) else None,
                         split=split, column=image_column, row=row)
