"""What a source adapter yields and how its files are read: `SourceItem`, `SourceError`,
`read_image`, and the checks and naming helpers the adapters of `data_prep.sources` share.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import urllib.parse

from PIL import Image

from sclaro_jax.paths import inside_root
from sclaro_jax import bounds

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
KEPT_FORMATS = ("JPEG", "MPO", "PNG")  # MPO: a JPEG with extra frames; readers see the first


class SourceError(ValueError):
    """A source layout or image that cannot be used; the message names the file or item."""


class OutsideRoot(SourceError):
    """An image whose path, named by a data file (or a link in a listed folder), resolves
    outside its root: never opened; counted as `OUTSIDE_ROOT`."""


@dataclasses.dataclass(frozen=True)
class SourceItem:
    id: str  # "<source>/<key>": stable, unique across sources, no whitespace
    source: str  # the adapter's name (data_prep.sources.SOURCES), or the name= option's
    path: str  # absolute path of the image file, the .tar holding it, or the datasets folder
    action: str | None = None  # ground-truth action (MMiT), else None
    caption: str | None = None  # the source's own caption (CC3M), kept for reference
    # an image inside a .tar (webdataset): its member name, data offset and size in bytes
    member: str | None = None
    offset: int | None = None
    size: int | None = None
    # an image in a `datasets` folder (hf): split (None: a single Dataset), image column, row
    split: str | None = None
    column: str | None = None
    row: int | None = None
    # a path that resolves outside its root (`under_root`): that root; `read_bytes` refuses it
    outside_root: str | None = None

    @property
    def where(self) -> str:
        """The file (and the member or row inside it) for messages."""
        if self.offset is not None:
            return f"{self.path} member {self.member}"
        if self.row is not None:
            split = f" split {self.split}" if self.split is not None else ""
            return f"{self.path}{split} row {self.row} column {self.column}"
        return self.path

    def locator(self) -> dict:
        """The optional fields saying where inside `path` the image is, or that `path` lies
        outside its root (JSON-able)."""
        return {f: getattr(self, f) for f in LOCATOR_FIELDS if getattr(self, f) is not None}


LOCATOR_FIELDS = ("member", "offset", "size", "split", "column", "row", "outside_root")


def under_root(root: str, relative) -> tuple[str, str | None]:
    """(path, outside_root) of an image that a data file (or a folder listing) names
    `relative` to `root`: `root/relative`, and None while it resolves inside `root`
    (`sclaro_jax.paths.inside_root`), else `root` (the item is then refused unread)."""
    path = os.path.join(root, str(relative).replace("\0", "\\0"))  # NUL shown, not kept
    return path, (None if inside_root(root, relative) is not None else root)


def read_bytes(item: SourceItem) -> bytes:
    """The stored bytes of the item's image: the file, the tar member's byte range (read in
    place, nothing unpacked), or the `datasets` row's raw image bytes. `OutsideRoot`, with
    nothing opened, for an image whose path resolves outside its root."""
    if item.outside_root is not None:
        raise OutsideRoot(f"{item.path} lies outside {item.outside_root} (a path from the "
                          f"data must stay inside its root); not opened")
    if item.offset is not None:
        with open(item.path, "rb") as f:
            f.seek(item.offset)
            data = f.read(item.size)
        if len(data) != item.size:
            raise OSError(f"the tar is truncated: {len(data)} of the member's {item.size} "
                          f"bytes are there")
        return data
    if item.row is not None:
        return _hf_row_bytes(item)
    with open(item.path, "rb") as f:
        return f.read()


_HF_OPEN: dict = {}  # (folder, split, column) -> the dataset, opened once per process


def _hf_row_bytes(item: SourceItem) -> bytes:
    key = (item.path, item.split, item.column)
    ds = _HF_OPEN.get(key)
    if ds is None:
        import datasets
        ds = datasets.load_from_disk(item.path)
        if item.split is not None:
            ds = ds[item.split]
        ds = ds.select_columns([item.column]).cast_column(item.column,
                                                          datasets.Image(decode=False))
        _HF_OPEN[key] = ds
    value = ds[item.row][item.column]
    if not isinstance(value, dict):
        raise OSError(f"expected an image ({{'bytes', 'path'}}), got {type(value).__name__}")
    if value.get("bytes") is not None:
        return value["bytes"]
    if value.get("path"):  # relative to the datasets folder, and inside it
        path = inside_root(item.path, value["path"])
        if path is None:
            raise OutsideRoot(f"the row's path {value['path']!r} lies outside {item.path} "
                              f"(a path from the data must stay inside its root); not opened")
        with open(path, "rb") as f:
            return f.read()
    raise OSError("the row has neither image bytes nor a path")


def read_image(item: SourceItem) -> tuple[bytes, Image.Image]:
    """The image's bytes for the record and its decoded RGB pixels.

    JPEG and PNG files are returned byte for byte; other formats (BMP, WebP, ...) are re-encoded
    losslessly as PNG. Pixels are kept as stored: EXIF orientation is not applied, exactly as
    `sclaro_jax.data.schema.decode_image` decodes the record later, so boxes and masks computed
    on the returned image match the pixels a reader sees. SourceError naming the item (and the
    tar member or dataset row) if the image is missing or does not decode.
    """
    try:
        data = read_bytes(item)
        img = Image.open(io.BytesIO(data))
        img.load()
        fmt = img.format
        rgb = img if img.mode == "RGB" else img.convert("RGB")
    except OutsideRoot as e:
        raise OutsideRoot(f"{item.id}: {item.where}: {e}") from None
    except Exception as e:  # OSError, PIL.UnidentifiedImageError, DecompressionBombError, ...
        raise SourceError(f"{item.id}: cannot read image {item.where}: "
                          f"{type(e).__name__}: {e}") from None
    if fmt not in KEPT_FORMATS:
        buf = io.BytesIO()
        rgb.save(buf, format="PNG")
        data = buf.getvalue()
    return data, rgb


def id_key(text: str) -> str:
    """A path-like key for an id: '/'-separated, whitespace and other characters
    percent-encoded (injective: '%' itself is encoded)."""
    return urllib.parse.quote(text.replace(os.sep, "/"), safe="/!$&'()*+,:;=@")


def is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def natural_order(name: str) -> list:
    """Sort key that orders 'img_2.jpg' before 'img_10.jpg'."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"([0-9]+)", name))]


def is_index(text: str) -> bool:
    return re.fullmatch(r"[0-9]+", text) is not None


def require_file(title: str, path: str, layout: str) -> str:
    if not os.path.isfile(path):
        raise SourceError(f"{title}: {path} not found; expected {layout}")
    return path


def require_dir(title: str, path: str, layout: str) -> str:
    if not os.path.isdir(path):
        raise SourceError(f"{title}: folder {path} not found; expected {layout}")
    return path


def load_json(title: str, path: str):
    """A source's json file (`bounds.read_json`: over the size limit, or nested too deep, it is
    refused naming the limit); SourceError naming `title` and the file otherwise."""
    try:
        return bounds.read_json(path)
    except bounds.BoundsError as e:
        raise SourceError(f"{title}: {e}") from None
    except (OSError, ValueError) as e:
        raise SourceError(f"{title}: cannot read {path}: {type(e).__name__}: {e}") from None


def middle_frames(n: int, k: int) -> list[int]:
    """Indices of the centre frames of `k` equal segments of `n` frames (all if k >= n)."""
    if k >= n:
        return list(range(n))
    return [(2 * i + 1) * n // (2 * k) for i in range(k)]
