"""Text-to-image retrieval splits: ROCS, COCO-style captions, Karpathy test splits.

Every loader returns a `RetrievalSplit`: the gallery's images (decoded lazily, RGB uint8) and one
query per caption with the index of its ground-truth image (the paper's protocol: each caption is
one query with one ground-truth image).

Layouts read:
- **ROCS / any Hugging Face dataset saved with `save_to_disk`** (`load_hf_folder`): a folder with
  `state.json` (one split) or `dataset_dict.json` (several; pick one with `split`). One image
  column (a `datasets.Image` feature, or a path string relative to the folder), one caption
  column (a string, or a list of strings: one query each), optionally an image-id column; rows
  that share an image id (or, without one, identical image bytes) are one gallery image.
  Columns are found by name (`image`/`img`; `caption`/`captions`/`text`/`sentences`/`query`;
  `image_id`/`filename`/`file_name`/`img_id`/`id`) unless named explicitly. Needs the
  `datasets` package (extra `eval`).
- **COCO captions JSON** (`load_coco_captions`): `{"images": [{"id", "file_name"}],
  "annotations": [{"image_id", "caption"}]}` with images under `image_dir`.
- **Karpathy splits** (`load_karpathy`): `dataset_coco.json` / `dataset_flickr30k.json`,
  `{"images": [{"filename", "filepath"?, "split", "sentences": [{"raw"}]}]}`; the standard test
  splits are `split="test"` (COCO 5K, Flickr30K 1K).

An image whose path (a file name in a JSON, a dataset row's path) resolves outside the folder it
is relative to (the image folder, the dataset folder) is left out of the gallery unread, with
its captions, and counted in `RetrievalSplit.skipped["outside_root"]`
(`sclaro_jax.paths.inside_root`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from sclaro_jax import bounds

from sclaro_jax.paths import OUTSIDE_ROOT, inside_root

IMAGE_COLUMNS = ("image", "img", "jpg", "png")
CAPTION_COLUMNS = ("caption", "captions", "text", "sentences", "query", "queries")
ID_COLUMNS = ("image_id", "filename", "file_name", "img_id", "image_path", "id")


class SplitError(ValueError):
    """A retrieval split that cannot be read; the message names the file and what is wrong."""


@dataclasses.dataclass
class RetrievalSplit:
    """A gallery of images and the caption queries that each name one of them."""

    name: str
    image_ids: list[str]
    queries: list[str]
    gt: np.ndarray  # int64 [Q]: index into image_ids
    load_image: Callable[[int], np.ndarray]  # i -> RGB uint8 [H, W, 3]
    source: str = ""
    skipped: dict = dataclasses.field(default_factory=dict)  # reason -> images left out

    def __post_init__(self):
        self.gt = np.asarray(self.gt, np.int64)
        if len(self.queries) != len(self.gt):
            raise SplitError(f"{self.source}: {len(self.queries)} queries but {len(self.gt)} "
                             "ground-truth indices")
        if len(self.image_ids) == 0 or len(self.queries) == 0:
            raise SplitError(f"{self.source}: split {self.name!r} has {len(self.image_ids)} "
                             f"images and {len(self.queries)} queries; both must be non-empty")
        if self.gt.min() < 0 or self.gt.max() >= len(self.image_ids):
            raise SplitError(f"{self.source}: a ground-truth index is outside the gallery")

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    def fingerprint(self) -> str:
        """A hash of the image ids, queries and ground truth (keys the embedding cache)."""
        h = hashlib.sha256()
        h.update(json.dumps([self.image_ids, self.queries, self.gt.tolist()]).encode())
        return h.hexdigest()[:16]

    def subset(self, max_images: int) -> "RetrievalSplit":
        """The first `max_images` images and the queries whose ground truth is among them."""
        if max_images >= self.num_images:
            return self
        keep = self.gt < max_images
        return RetrievalSplit(f"{self.name}[:{max_images}]", self.image_ids[:max_images],
                              [q for q, k in zip(self.queries, keep) if k], self.gt[keep],
                              self.load_image, self.source, self.skipped)


def read_rgb(path: str | os.PathLike) -> np.ndarray:
    """An image file as RGB uint8 [H, W, 3]; a clear error naming the file otherwise (an image
    over the pixel limit, `bounds.check_pixels`, is refused before it is decoded)."""
    try:
        with bounds.open_image(path, f"image {bounds.printable(path)}") as img:
            return np.asarray(img.convert("RGB"))
    except FileNotFoundError:
        raise SplitError(f"image file not found: {bounds.printable(path)}") from None
    except bounds.BoundsError as e:
        raise SplitError(str(e)) from None
    except OSError as e:
        raise SplitError(f"cannot decode image {bounds.printable(path)}: {e}") from None


def _group(ids: Sequence[str], captions: Sequence[Sequence[str]], name: str, source: str,
           load: Callable[[int], np.ndarray], outside: int = 0) -> RetrievalSplit:
    """Rows (image id, its captions) -> a split. Rows sharing an id are one gallery image (loaded
    from its first row); gallery order is first appearance. `outside`: the images left out as
    outside their root."""
    index: dict[str, int] = {}
    first_row: list[int] = []
    queries, gt = [], []
    for row, (image_id, caps) in enumerate(zip(ids, captions)):
        if image_id not in index:
            index[image_id] = len(first_row)
            first_row.append(row)
        for cap in caps:
            cap = cap.strip()
            if cap:
                queries.append(cap)
                gt.append(index[image_id])
    return RetrievalSplit(name, list(index), queries, np.array(gt, np.int64),
                          lambda i: load(first_row[i]), source,
                          {OUTSIDE_ROOT: outside} if outside else {})


def _captions(value, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and "raw" in value:
        return [value["raw"]]
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_captions(v, where))
        return out
    raise SplitError(f"{where}: a caption is {type(value).__name__}, expected a string or a "
                     "list of strings")


def load_coco_captions(json_path: str | os.PathLike, image_dir: str | os.PathLike | None = None,
                       name: str | None = None) -> RetrievalSplit:
    """A COCO captions file (`{"images": [...], "annotations": [...]}`); images in `image_dir`
    (default: the JSON's folder)."""
    json_path = Path(json_path)
    image_dir = Path(image_dir) if image_dir is not None else json_path.parent
    data = _read_json(json_path)
    for key in ("images", "annotations"):
        if not isinstance(data.get(key), list):
            raise SplitError(f"{json_path}: no {key!r} list; not a COCO captions file")
    files = {}
    for i, im in enumerate(data["images"]):
        if "id" not in im or "file_name" not in im:
            raise SplitError(f"{json_path}: images[{i}] lacks 'id' or 'file_name'")
        files[im["id"]] = im["file_name"]
    caps: dict = {}
    for i, ann in enumerate(data["annotations"]):
        if ann.get("image_id") not in files:
            raise SplitError(f"{json_path}: annotations[{i}] names image_id "
                             f"{ann.get('image_id')!r}, which is not in 'images'")
        caps.setdefault(ann["image_id"], []).extend(_captions(ann.get("caption"),
                                                               f"{json_path}: annotations[{i}]"))
    # every listed image inside image_dir is in the gallery, captioned or not
    ids = [k for k in files if inside_root(image_dir, files[k]) is not None]
    paths = [image_dir / files[k] for k in ids]
    return _group([str(files[k]) for k in ids], [caps.get(k, []) for k in ids],
                  name or json_path.stem, str(json_path), lambda r: read_rgb(paths[r]),
                  outside=len(files) - len(ids))


def load_karpathy(json_path: str | os.PathLike, image_root: str | os.PathLike,
                  split: str = "test", name: str | None = None) -> RetrievalSplit:
    """A Karpathy split file (`dataset_coco.json`, `dataset_flickr30k.json`): the images whose
    `split` is `split`, each caption (`sentences[*].raw`) one query. Image paths:
    `image_root/filepath/filename` (COCO) or `image_root/filename` (Flickr30K)."""
    json_path, image_root = Path(json_path), Path(image_root)
    data = _read_json(json_path)
    images = data.get("images")
    if not isinstance(images, list):
        raise SplitError(f"{json_path}: no 'images' list; not a Karpathy split file")
    chosen = [im for im in images if im.get("split") == split]
    if not chosen:
        found = sorted({str(im.get("split")) for im in images})
        raise SplitError(f"{json_path}: no image has split {split!r} (found {found})")
    ids, caps, paths = [], [], []
    for i, im in enumerate(chosen):
        if "filename" not in im or "sentences" not in im:
            raise SplitError(f"{json_path}: image {i} of split {split!r} lacks 'filename' or "
                             "'sentences'")
        if inside_root(image_root, os.path.join(im.get("filepath", ""), im["filename"])) is None:
            continue  # left out unread: counted as outside_root
        ids.append(os.path.join(im.get("filepath", ""), im["filename"]))
        caps.append(_captions(im["sentences"], f"{json_path}: {im['filename']}"))
        paths.append(image_root / im.get("filepath", "") / im["filename"])
    return _group(ids, caps, name or f"{json_path.stem}:{split}", str(json_path),
                  lambda r: read_rgb(paths[r]), outside=len(chosen) - len(ids))


def load_hf_folder(path: str | os.PathLike, split: str | None = None, *,
                   image_column: str | None = None, caption_column: str | None = None,
                   id_column: str | None = None, name: str | None = None) -> RetrievalSplit:
    """A Hugging Face dataset folder written by `save_to_disk` (e.g. a ROCS split)."""
    try:
        import datasets
    except ImportError:
        raise SplitError(f"{path} is a Hugging Face dataset folder; reading it needs the "
                         "`datasets` package: pip install -e \".[eval]\" from the sclaro-jax "
                         "checkout") from None
    path = Path(path)
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise SplitError(f"{path} holds splits {sorted(ds)}; choose one (e.g. "
                                 f"{path}:{sorted(ds)[0]})")
            split = next(iter(ds))
        if split not in ds:
            raise SplitError(f"{path} has no split {split!r}; it has {sorted(ds)}")
        ds = ds[split]
    columns = list(ds.column_names)

    def pick(given, candidates, what, required=True):
        if given is not None:
            if given not in columns:
                raise SplitError(f"{path}: no column {given!r} (columns: {columns})")
            return given
        for c in candidates:
            if c in columns:
                return c
        if required:
            raise SplitError(f"{path}: no {what} column among {columns}; name it "
                             f"(--{what}_column)")
        return None

    img_col = pick(image_column, IMAGE_COLUMNS, "image")
    cap_col = pick(caption_column, CAPTION_COLUMNS, "caption")
    id_col = pick(id_column, ID_COLUMNS, "id", required=False)
    feature = ds.features[img_col]
    is_image = isinstance(feature, datasets.Image)
    if is_image:
        ds = ds.cast_column(img_col, datasets.Image(decode=False))
    where = f"{path}" + (f":{split}" if split else "")
    outside = _outside_rows(ds, img_col, is_image, path)
    rows = [r for r in range(len(ds)) if r not in outside]  # gallery rows: outside ones left out
    captions = [_captions(c, f"{where} row {r}") for r, c in enumerate(ds[cap_col])
                if r not in outside]
    raw_images = ds[img_col] if (id_col is None) else None
    if id_col is not None:
        ids = [str(v) for r, v in enumerate(ds[id_col]) if r not in outside]
    elif is_image:
        ids = [hashlib.sha256(_image_bytes(raw_images[r], where, r, path)).hexdigest()[:20]
               for r in rows]
    else:
        ids = [str(raw_images[r]) for r in rows]

    def load(k: int) -> np.ndarray:
        row = rows[k]
        value = ds[row][img_col]
        if is_image:
            try:
                with bounds.open_image(io.BytesIO(_image_bytes(value, where, row, path)),
                                       f"{where} row {row}") as img:
                    return np.asarray(img.convert("RGB"))
            except bounds.BoundsError as e:
                raise SplitError(str(e)) from None
            except OSError as e:
                raise SplitError(f"{where} row {row}: cannot decode the image: {e}") from None
        full = inside_root(path, value) if isinstance(value, str) else None
        if full is None:
            raise SplitError(f"{where} row {row}: image {value!r} is not a path inside {path}")
        return read_rgb(full)

    return _group(ids, captions, name or (split or path.name), where, load,
                  outside=len(outside))


def _outside_rows(ds, column: str, is_image: bool, root: Path) -> set[int]:
    """The rows whose image is a path (a path column's string, or an Image row without bytes)
    that resolves outside the dataset folder `root`: left out of the gallery unread. Read
    from the arrow column (no image bytes are copied)."""
    import pyarrow.compute as pc

    values = ds.with_format("arrow")[column]
    if is_image:
        stored = pc.fill_null(pc.greater(pc.binary_length(pc.struct_field(values, "bytes")),
                                         0), False).to_pylist()
        paths = pc.struct_field(values, "path").to_pylist()
        paths = [None if has_bytes else p for has_bytes, p in zip(stored, paths)]
    else:
        paths = values.to_pylist()
    return {r for r, p in enumerate(paths) if isinstance(p, str) and p
            and inside_root(root, p) is None}


def _image_bytes(value, where: str, row: int, root: Path) -> bytes:
    """A row's stored bytes, else the file at its path, relative to (and inside) `root`."""
    if value.get("bytes"):
        return value["bytes"]
    path = inside_root(root, value["path"]) if value.get("path") else None
    if path is not None and path.is_file():
        return path.read_bytes()
    raise SplitError(f"{where} row {row}: the image has neither bytes nor a readable path "
                     f"inside {root}")


def _read_json(path: Path) -> dict:
    try:
        data = bounds.read_json(path)
    except FileNotFoundError:
        raise SplitError(f"split file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise SplitError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise SplitError(f"{path}: expected a JSON object at the top level")
    return data


def load_split(spec: str, *, image_root: str | None = None, **hf_columns) -> RetrievalSplit:
    """Load a split from a path, detecting the layout.

    `spec` is `[NAME=]PATH[:SPLIT]`: a `save_to_disk` folder (`:SPLIT` picks one of a
    DatasetDict's splits), a COCO captions JSON (images beside it or under `image_root`) or a
    Karpathy JSON (`:SPLIT` defaults to `test`; images under `image_root`).
    """
    name = None
    if "=" in spec and not os.path.exists(spec):
        name, spec = spec.split("=", 1)
    split = None
    if not os.path.exists(spec) and ":" in spec:
        spec, split = spec.rsplit(":", 1)
    path = Path(spec)
    if not path.exists():
        raise SplitError(f"split not found: {path}")
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return load_hf_folder(path, split, name=name, **hf_columns)
        raise SplitError(f"{path} is a folder without state.json or dataset_dict.json: not a "
                         "dataset saved with datasets' save_to_disk")
    data = _read_json(path)
    if "annotations" in data:
        return load_coco_captions(path, image_root, name=name)
    images = data.get("images")
    if isinstance(images, list) and images and "sentences" in images[0]:
        if image_root is None:
            raise SplitError(f"{path} is a Karpathy split file; pass the image folder "
                             "(--image-root)")
        return load_karpathy(path, image_root, split or "test", name=name)
    raise SplitError(f"{path}: neither a COCO captions file ('images' + 'annotations') nor a "
                     "Karpathy split file ('images' with 'sentences')")
