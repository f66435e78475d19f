"""Source adapters: the still images of SCLARO's five source datasets (and a plain folder,
webdataset .tar shards and Hugging Face `datasets` folders).

    for item in iter_source("openpsg", "/data/openpsg"):
        data, image = read_image(item)

Each adapter lists one source's images from its released on-disk layout (documented in the
adapter's docstring) as `SourceItem`s, sorted by id; images are read later, one at a time, by
`read_image` (an image inside a .tar or a `datasets` folder is read in place: the item keeps the
tar member's byte range, or the dataset row). Video sources (MMiT, PVSG) are read from
already-extracted frames: extracting frames from videos is not done here.

Ids are "<source>/<path-like key>", unique across sources, without whitespace (characters other
than letters, digits and ``/!$&'()*+,-.:;=@_~`` are percent-encoded, so distinct keys stay
distinct). A missing annotation file or folder raises `SourceError` naming it and the layout
expected; a missing or corrupt image raises `SourceError` from `read_image`, naming the item, so
a caller can count it as failed and go on. An image path that a data file names (or a listed
file that links) outside the folder it is relative to is listed with `outside_root` set and
never opened: `read_image` raises `OutsideRoot` (`sclaro_jax.paths.inside_root`).
"""

from __future__ import annotations

import csv
import functools
import logging
import os
import re
from typing import Callable, Iterable, Iterator

from data_prep.source_items import (SourceError, SourceItem, id_key, is_image, is_index,
                                    load_json, middle_frames, natural_order,
                                    read_image,  # noqa: F401  (re-exported)
                                    require_dir, require_file, under_root)

log = logging.getLogger(__name__)

PVSG_SUBSETS = ("vidor", "epic_kitchen", "ego4d")

SOURCES: dict[str, Callable[..., Iterator[SourceItem]]] = {}


def iter_source(kind: str, root: str, **options) -> Iterator[SourceItem]:
    """The items of source `kind` under `root`, sorted by id; `options` go to the adapter.

    The whole listing is made (and checked) before the first item is returned.
    """
    if kind not in SOURCES:
        raise SourceError(f"unknown source {kind!r}; known sources: {', '.join(sorted(SOURCES))}")
    return SOURCES[kind](root, **options)


# --------------------------------------------------------------------------- registration

def _adapter(name: str, title: str, layout: str, root_is_dir: bool = True):
    """Register `fn(root, **options) -> Iterable[SourceItem]` as source `name`. The registered
    function checks the root (a folder, unless `root_is_dir` is False: then the adapter checks
    it), sorts the items by id, and refuses duplicate ids and an empty listing."""
    def register(fn):
        @functools.wraps(fn)
        def adapter(root: str, **options) -> Iterator[SourceItem]:
            root = os.path.abspath(root)
            if root_is_dir and not os.path.isdir(root):
                raise SourceError(f"{title}: root folder {root} not found; expected {layout}")
            items = sorted(fn(root, **options), key=lambda item: item.id)
            if not items:
                raise SourceError(f"{title}: no images found under {root}; expected {layout}")
            for a, b in zip(items, items[1:]):
                if a.id == b.id:
                    raise SourceError(f"{title}: two images under {root} have the id "
                                      f"{a.id!r}: {a.path} and {b.path}")
            return iter(items)
        SOURCES[name] = adapter
        return adapter
    return register


# --------------------------------------------------------------------------- adapters

MMIT_LAYOUT = ("<root>/trainingSet.csv and <root>/validationSet.csv (or in <root>/annotations/), "
               "<root>/moments_categories.txt (or .csv) and frames in "
               "<root>/frames/<video path without extension>/*.jpg")


@_adapter("mmit", "MMiT", MMIT_LAYOUT)
def mmit(root: str, *, splits: Iterable[str] = ("training", "validation"),
         frames_per_video: int = 1, frames_dir: str = "frames", frame_prefix: str = "",
         skip_missing: bool = False) -> Iterator[SourceItem]:
    """Multi-Moments in Time, from frames extracted beforehand.

    Layout (the official release's annotation files, as unpacked by mmaction2's
    tools/data/mmit; the files may lie in `<root>` or `<root>/annotations`)::

        <root>/trainingSet.csv, validationSet.csv   rows: video_path,label[,label...]
        <root>/moments_categories.txt (or .csv)     lines: name,index  (or one name per line,
                                                    index = line number)
        <root>/<frames_dir>/<video_path without extension>/<frame>.<jpg|png|...>

    A label is a category index (M-MiT) or a category name (MiT-style rows); the row's *first*
    label is the item's action (the category name). `splits` picks the CSV files
    ("<split>Set.csv"). Of a video's frames (the image files starting with `frame_prefix`,
    e.g. "img_" for mmaction2's rawframes, in natural order) the centre frames of
    `frames_per_video` equal segments are taken: one frame gives the middle frame (index n // 2).
    A video without a frames folder (or with no frames) is an error, or is skipped with a
    warning when `skip_missing`. Ids: "mmit/<video path without extension>/<frame file stem>".
    """
    title = "MMiT"
    if frames_per_video < 1:
        raise SourceError(f"{title}: frames_per_video must be at least 1, got {frames_per_video}")

    def find(name: str) -> str | None:
        for folder in (root, os.path.join(root, "annotations")):
            if os.path.isfile(os.path.join(folder, name)):
                return os.path.join(folder, name)
        return None

    categories_path = find("moments_categories.txt") or find("moments_categories.csv")
    if categories_path is None:
        raise SourceError(f"{title}: {os.path.join(root, 'moments_categories.txt')} not found; "
                          f"expected {MMIT_LAYOUT}")
    by_index = _mmit_categories(categories_path)
    names = set(by_index.values())
    frames_root = require_dir(title, os.path.join(root, frames_dir), MMIT_LAYOUT)

    missing = 0
    for split in splits:
        csv_path = find(f"{split}Set.csv")
        if csv_path is None:
            raise SourceError(f"{title}: {os.path.join(root, f'{split}Set.csv')} not found; "
                              f"expected {MMIT_LAYOUT} (pass splits=... to read fewer)")
        with open(csv_path, newline="", encoding="utf-8") as f:
            for line, row in enumerate(csv.reader(f), start=1):
                if not row or not "".join(row).strip():
                    continue
                if len(row) < 2 or not row[1].strip():
                    raise SourceError(f"{title}: {csv_path} line {line}: expected "
                                      f"video_path,label[,label...], got {','.join(row)!r}")
                video, label = row[0].strip(), row[1].strip()
                if is_index(label) and int(label) in by_index:
                    action = by_index[int(label)]
                elif label in names:
                    action = label
                else:
                    raise SourceError(f"{title}: {csv_path} line {line}: label {label!r} is "
                                      f"neither an index nor a name in {categories_path}")
                stem = os.path.splitext(video)[0]
                items = _mmit_frames(frames_root, stem, action, frames_per_video, frame_prefix)
                if not items:
                    if skip_missing:
                        missing += 1
                        continue
                    raise SourceError(f"{title}: no frames for video {video!r} "
                                      f"({csv_path} line {line}) in "
                                      f"{os.path.join(frames_root, stem)}; expected "
                                      f"{MMIT_LAYOUT} (or pass skip_missing=True)")
                yield from items
    if missing:
        log.warning("MMiT: skipped %d videos without frames under %s", missing, frames_root)


def _mmit_frames(frames_root: str, stem: str, action: str, frames_per_video: int,
                 frame_prefix: str) -> list[SourceItem]:
    """The items of a video's chosen frames ([] without any); one item, refused unread, when
    the video's folder lies outside the frames folder."""
    folder, outside = under_root(frames_root, stem)
    if outside:
        return [SourceItem(id=f"mmit/{id_key(stem)}", source="mmit", path=folder, action=action,
                           outside_root=outside)]
    frames = (sorted((n for n in os.listdir(folder) if is_image(n) and n.startswith(frame_prefix)),
                     key=natural_order) if os.path.isdir(folder) else [])
    items = []
    for i in middle_frames(len(frames), frames_per_video):
        path, outside = under_root(frames_root, os.path.join(stem, frames[i]))
        items.append(SourceItem(id=f"mmit/{id_key(stem)}/{id_key(os.path.splitext(frames[i])[0])}",
                                source="mmit", path=path, action=action, outside_root=outside))
    return items


def _mmit_categories(path: str) -> dict[int, str]:
    """index -> name from lines 'name,index' or one name per line (index = line number)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = [row for row in csv.reader(f) if row and "".join(row).strip()]
    if not rows:
        raise SourceError(f"MMiT: {path} holds no categories")
    if all(len(row) == 1 for row in rows):
        return {i: row[0].strip() for i, row in enumerate(rows)}
    by_index = {}
    for line, row in enumerate(rows, start=1):
        if len(row) != 2 or not is_index(row[1].strip()):
            raise SourceError(f"MMiT: {path} row {line}: expected name,index, got "
                              f"{','.join(row)!r}")
        by_index[int(row[1])] = row[0].strip()
    return by_index


CC3M_LAYOUT = ("img2dataset's 'files' output (<root>/00000/000000000.jpg with .txt caption and "
               ".json), or tsv=<file> with rows caption<TAB>filename and images in "
               "<root>/images/<filename>")


@_adapter("cc3m", "CC3M", CC3M_LAYOUT)
def cc3m(root: str, *, tsv: str | None = None,
         images_dir: str = "images") -> Iterator[SourceItem]:
    """Conceptual Captions 3M, downloaded with img2dataset or listed by a TSV.

    img2dataset "files" layout (default)::

        <root>/<shard: digits>/<key>.<jpg|png|webp>   the image
        <root>/<shard>/<key>.txt                      its caption (else "caption" in .json)
        <root>/<shard>/<key>.json, <shard>.parquet, <shard>_stats.json   (not needed)

    ids "cc3m/<shard>/<key>", e.g. "cc3m/00000/000000001". Failed downloads have no image file
    and are absent. img2dataset's webdataset (.tar) output is read by the `webdataset` source
    with the option name=cc3m, which gives the same ids (and captions) as this layout.

    TSV layout (`tsv` = a file, relative to `root` or absolute): rows `caption<TAB>filename`
    (no quoting; a first row "caption<TAB>filename" is a header and skipped), images at
    `<root>/<images_dir>/<filename>`; ids "cc3m/<filename without extension>".
    The caption is kept in `SourceItem.caption`.
    """
    title = "CC3M"
    if tsv is not None:
        yield from _cc3m_tsv(root, tsv, images_dir)
        return
    shards = sorted(n for n in os.listdir(root)
                    if is_index(n) and os.path.isdir(os.path.join(root, n)))
    if not shards:
        raise SourceError(f"{title}: no shard folders (<root>/00000/, ...) in {root}; expected "
                          f"{CC3M_LAYOUT}")
    for shard in shards:
        folder = os.path.join(root, shard)
        for name in os.listdir(folder):
            if not is_image(name):
                continue
            key = os.path.splitext(name)[0]
            path, outside = under_root(root, os.path.join(shard, name))
            yield SourceItem(id=f"cc3m/{id_key(shard)}/{id_key(key)}", source="cc3m",
                             path=path, outside_root=outside,
                             caption=_img2dataset_caption(os.path.join(folder, key)))


def _img2dataset_caption(stem: str) -> str | None:
    if os.path.isfile(stem + ".txt"):
        with open(stem + ".txt", encoding="utf-8") as f:
            return f.read().strip()
    if os.path.isfile(stem + ".json"):
        caption = load_json("CC3M", stem + ".json").get("caption")
        return caption.strip() if isinstance(caption, str) else None
    return None


def _cc3m_tsv(root: str, tsv: str, images_dir: str) -> Iterator[SourceItem]:
    title = "CC3M"
    tsv_path = require_file(title, os.path.join(root, tsv), CC3M_LAYOUT)
    images = require_dir(title, os.path.join(root, images_dir), CC3M_LAYOUT)
    with open(tsv_path, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE),
                                   start=1):
            if not row:
                continue
            if len(row) != 2 or not row[1].strip():
                raise SourceError(f"{title}: {tsv_path} line {line}: expected "
                                  f"caption<TAB>filename, got {len(row)} fields")
            caption, filename = row[0].strip(), row[1].strip()
            if line == 1 and (caption.lower(), filename.lower()) == ("caption", "filename"):
                continue
            rel = os.path.normpath(filename)
            path, outside = under_root(images, filename)  # outside: listed, never read
            yield SourceItem(id=f"cc3m/{id_key(os.path.splitext(rel)[0])}", source="cc3m",
                             path=path, caption=caption, outside_root=outside)


OPENPSG_LAYOUT = ("<root>/psg.json (or <root>/psg/psg.json) whose 'data' entries name images "
                  "in <root>/coco/<file_name>, e.g. coco/train2017/000000000009.jpg")


def openpsg_files(root: str, layout: str = OPENPSG_LAYOUT) -> tuple[str, str]:
    """(psg.json, the coco folder) of an OpenPSG root: <root>/psg.json or <root>/psg/psg.json,
    and <root>/coco; `SourceError` naming the one missing and the `layout` expected."""
    path = os.path.join(root, "psg.json")
    if not os.path.isfile(path) and os.path.isfile(os.path.join(root, "psg", "psg.json")):
        path = os.path.join(root, "psg", "psg.json")
    require_file("OpenPSG", path, layout)
    return path, require_dir("OpenPSG", os.path.join(root, "coco"), layout)


@_adapter("openpsg", "OpenPSG", OPENPSG_LAYOUT)
def openpsg(root: str) -> Iterator[SourceItem]:
    """OpenPSG (panoptic scene graphs on COCO images), as laid out by the OpenPSG repository::

        <root>/psg.json        (or <root>/psg/psg.json) {"data": [{"file_name":
                               "train2017/000000000009.jpg", "image_id": ..., "height", "width",
                               "segments_info", "relations", ...}, ...], "thing_classes", ...}
        <root>/coco/<file_name>   COCO train2017/ and val2017/ images

    Every entry of "data" is an item (train and test alike), id "openpsg/<image_id>". Image
    files are not checked here; a missing one fails in `read_image`.
    """
    title = "OpenPSG"
    path, coco = openpsg_files(root)
    doc = load_json(title, path)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise SourceError(f"{title}: {path} has no 'data' list; expected {OPENPSG_LAYOUT}")
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not entry.get("file_name") or \
                entry.get("image_id") in (None, ""):
            raise SourceError(f"{title}: {path} data[{i}] lacks 'file_name' or 'image_id'")
        path, outside = under_root(coco, entry["file_name"])
        yield SourceItem(id=f"openpsg/{id_key(str(entry['image_id']))}", source="openpsg",
                         path=path, outside_root=outside)


PVSG_LAYOUT = ("<root>/pvsg.json and frames in <root>/<vidor|epic_kitchen|ego4d>/frames/"
               "<video_id>/<frame:04d>.png")


@_adapter("pvsg", "PVSG", PVSG_LAYOUT)
def pvsg(root: str, *, stride: int = 25, skip_missing: bool = False) -> Iterator[SourceItem]:
    """PVSG (panoptic video scene graphs), from the frames OpenPVSG's unzip_and_extract.py
    writes::

        <root>/pvsg.json     {"data": [{"video_id": ..., "meta": {"num_frames": N, ...},
                             "objects", "relations", ...}, ...], "split", "objects", ...}
        <root>/<subset>/frames/<video_id>/0000.png, 0001.png, ...
                             subset: vidor, epic_kitchen or ego4d (whichever holds the video)

    Frames 0, stride, 2*stride, ... below meta.num_frames are taken; the default 25 is one
    frame every 5 s at PVSG's 5 fps (about 15 frames per video). A video whose frames folder
    is in no subset is an error, or is skipped with a warning when `skip_missing`. Frame files
    are not checked here; a missing one fails in `read_image`. Ids "pvsg/<video_id>/<frame:04d>".
    """
    title = "PVSG"
    if stride < 1:
        raise SourceError(f"{title}: stride must be at least 1, got {stride}")
    path = require_file(title, os.path.join(root, "pvsg.json"), PVSG_LAYOUT)
    doc = load_json(title, path)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise SourceError(f"{title}: {path} has no 'data' list; expected {PVSG_LAYOUT}")
    missing = 0
    for i, entry in enumerate(data):
        video = entry.get("video_id") if isinstance(entry, dict) else None
        meta = entry.get("meta") if isinstance(entry, dict) else None
        num_frames = meta.get("num_frames") if isinstance(meta, dict) else None
        if not video or not isinstance(num_frames, int) or num_frames < 1:
            raise SourceError(f"{title}: {path} data[{i}] lacks 'video_id' or a positive "
                              f"'meta.num_frames'")
        folders = [os.path.join(root, subset, "frames", video) for subset in PVSG_SUBSETS]
        found = [f for f in folders if os.path.isdir(f)]
        if not found:
            if skip_missing:
                missing += 1
                continue
            raise SourceError(f"{title}: no frames folder for video {video!r}: none of "
                              f"{', '.join(folders)} exists; expected {PVSG_LAYOUT} "
                              f"(or pass skip_missing=True)")
        subset = os.path.dirname(os.path.dirname(found[0]))  # <root>/<subset>
        for frame in range(0, num_frames, stride):
            path, outside = under_root(subset, os.path.join("frames", video, f"{frame:04d}.png"))
            yield SourceItem(id=f"pvsg/{id_key(video)}/{frame:04d}", source="pvsg",
                             path=path, outside_root=outside)
    if missing:
        log.warning("PVSG: skipped %d videos without a frames folder under %s", missing, root)


KITTI_LAYOUT = "<root>/training/image_2/NNNNNN_10.png (and <root>/testing/...)"
_KITTI_NAME = re.compile(r"^(\d{6})_(\d{2})\.png$")


@_adapter("kitti2015", "KITTI2015", KITTI_LAYOUT)
def kitti2015(root: str, *, subsets: Iterable[str] = ("training", "testing"),
              cameras: Iterable[str] = ("image_2",),
              frames: Iterable[str] = ("10",)) -> Iterator[SourceItem]:
    """KITTI 2015 scene flow (the unpacked data_scene_flow.zip)::

        <root>/<training|testing>/<image_2|image_3>/NNNNNN_10.png, NNNNNN_11.png

    `image_2` is the left colour camera; `_10` is the annotated frame of each pair, `_11` the
    one after it. By default the left `_10` frames of both subsets (400 images). Ids
    "kitti2015/<subset>/<camera>/NNNNNN_10".
    """
    title = "KITTI2015"
    frames = {f"{int(f):02d}" for f in frames}
    for subset in subsets:
        for camera in cameras:
            folder = require_dir(title, os.path.join(root, subset, camera),
                                  f"{KITTI_LAYOUT} (pass subsets=/cameras= to read fewer)")
            for name in os.listdir(folder):
                m = _KITTI_NAME.match(name)
                if m and m.group(2) in frames:
                    path, outside = under_root(folder, name)  # a link out of the folder
                    yield SourceItem(id=f"kitti2015/{subset}/{camera}/{name[:-4]}",
                                     source="kitti2015", path=path, outside_root=outside)


FOLDER_LAYOUT = "image files (.jpg .jpeg .png .bmp .webp) anywhere under <root>"


@_adapter("folder", "folder", FOLDER_LAYOUT)
def image_folder(root: str) -> Iterator[SourceItem]:
    """Every image file (.jpg .jpeg .png .bmp .webp, any case) under `root`, recursively;
    hidden files and folders (names starting with '.') are skipped; links to folders are not
    followed, and a file that links out of `root` is listed but never read (`outside_root`).
    Ids "folder/<path relative to root, extension included>"."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if is_image(name):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                path, outside = under_root(root, rel)
                yield SourceItem(id=f"folder/{id_key(rel)}", source="folder", path=path,
                                 outside_root=outside)


# The streaming sources: shards and dataset folders read in place (data_prep.stream_sources).
from data_prep import stream_sources  # noqa: E402

webdataset = _adapter("webdataset", "webdataset", stream_sources.WEBDATASET_LAYOUT,
                      root_is_dir=False)(stream_sources.webdataset)
hf = _adapter("hf", "hf", stream_sources.HF_LAYOUT)(stream_sources.hf)
