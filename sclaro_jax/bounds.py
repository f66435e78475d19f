"""Bounds before bytes: what every reader of a file from elsewhere (a dataset's json, an image,
a label) checks before it allocates, and how text from such a file is shown (docs/data.md,
"Bounds on inputs").

- Images (`check_pixels`, `open_image`): at most `max_pixels()` pixels, read from the header
  before any decoder allocates. The one setting is Pillow's own, `PIL.Image.MAX_IMAGE_PIXELS`:
  the bound is twice it (178,956,970 pixels by default), where Pillow itself raises
  `DecompressionBombError`; setting it to None turns the bound off, as it does Pillow's.
- JSON (`read_json`, `parse_json`): a file over `json_limit()` bytes is refused, naming the
  limit, before it is read (environment variable SCLARO_MAX_JSON_BYTES, default 4 GiB: the
  largest released scene-graph jsons are under 1 GiB); so is a document nested deeper than
  Python's parser goes (a RecursionError otherwise).
- Labels (`label_problem`): an object, predicate or action name longer than `label_limit()`
  characters (SCLARO_MAX_LABEL_CHARS, default 256) or holding a control character cannot enter
  a vocabulary: importers skip and count it, and a vocabulary file holding one is refused.
- Text (`printable`): control characters from data (ESC, BEL, NUL, the right-to-left override
  U+202E, every other Unicode Cc / Cf character, line and paragraph separators) are escaped
  wherever such text reaches a terminal or a report.

Every refusal is a `BoundsError` (a ValueError: one `error:` line from a command).
"""

from __future__ import annotations

import json
import os
import unicodedata

JSON_LIMIT_VARIABLE = "SCLARO_MAX_JSON_BYTES"
LABEL_LIMIT_VARIABLE = "SCLARO_MAX_LABEL_CHARS"
DEFAULT_JSON_LIMIT = 4 << 30
DEFAULT_LABEL_LIMIT = 256
# Unicode categories escaped in output and refused in labels: controls (Cc: NUL, BEL, ESC, ...),
# format characters (Cf: U+202E and the other bidirectional overrides, zero-width ones),
# surrogates (Cs: unpaired halves, which no UTF-8 file can hold), line / paragraph separators.
CONTROL_CATEGORIES = ("Cc", "Cf", "Cs", "Zl", "Zp")


class BoundsError(ValueError):
    """An input past a bound (pixels, bytes, nesting, label length); the message names the
    file or item, the bound and how to change it."""


def _setting(variable: str, default: int) -> int:
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise BoundsError(f"{variable}={text!r} is not a whole number of at least 1")
    return value


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------

def max_pixels() -> int | None:
    """The most pixels an image may have: twice `PIL.Image.MAX_IMAGE_PIXELS`, read now (None
    when it is None: no bound)."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    return None if limit is None else 2 * int(limit)


def check_pixels(width: int, height: int, what: str) -> None:
    """BoundsError naming `what` when a `width` x `height` image (its header's size) is over
    `max_pixels()`: called before anything is decoded."""
    limit = max_pixels()
    if limit is not None and int(width) * int(height) > limit:
        raise BoundsError(
            f"{what}: {width}x{height} is {int(width) * int(height):,} pixels, over the "
            f"{limit:,} pixel limit (2 x PIL.Image.MAX_IMAGE_PIXELS, where Pillow refuses a "
            "decompression bomb): not decoded")


def open_image(source, what: str):
    """`PIL.Image.open(source)` (a path or a binary file: the header is read, no pixels) after
    `check_pixels` of the header's size; a BoundsError naming `what` in place of Pillow's
    DecompressionBombError."""
    from PIL import Image

    try:
        img = Image.open(source)
    except Image.DecompressionBombError as e:  # Pillow's own check, at twice its limit
        raise BoundsError(f"{what}: {e} Not decoded.") from None
    try:
        check_pixels(*img.size, what)
    except BoundsError:
        img.close()
        raise
    return img


# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------

def json_limit() -> int:
    """The most bytes a json file may have: SCLARO_MAX_JSON_BYTES, default 4 GiB."""
    return _setting(JSON_LIMIT_VARIABLE, DEFAULT_JSON_LIMIT)


def parse_json(text: str | bytes, where: str):
    """`json.loads(text)`; a BoundsError naming `where` for a document nested deeper than the
    parser goes (json.JSONDecodeError, a ValueError, for one that is not JSON)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise BoundsError(f"{where}: JSON nested too deep to read (deeper than Python's "
                          "parser goes); no file or value this project reads nests so deep"
                          ) from None


def read_json(path: str | os.PathLike, *, limit: int | None = None):
    """The JSON document in file `path`, read as UTF-8 after its size is checked against
    `limit` bytes (default `json_limit()`): BoundsError naming the file and the limit (and
    `parse_json`'s for deep nesting); OSError / json.JSONDecodeError as `open` / `json.load`."""
    limit = json_limit() if limit is None else limit
    where = os.fspath(path)
    with open(where, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise BoundsError(
                f"{where}: {size:,} bytes, over the {limit:,} byte limit of a json file "
                f"this project reads (raise it with the environment variable "
                f"{JSON_LIMIT_VARIABLE}=BYTES)")
        data = bytearray()
        while chunk := f.read(min(1 << 24, limit + 1 - len(data))):
            data += chunk  # in pieces: a special file's size says nothing, and it may grow
            if len(data) > limit:
                raise BoundsError(f"{where}: over the {limit:,} byte limit of a json file "
                                  f"this project reads ({JSON_LIMIT_VARIABLE})")
    return parse_json(data.decode("utf-8"), where)


# --------------------------------------------------------------------------------------------
# Labels and text
# --------------------------------------------------------------------------------------------

def label_limit() -> int:
    """The most characters a label may have: SCLARO_MAX_LABEL_CHARS, default 256."""
    return _setting(LABEL_LIMIT_VARIABLE, DEFAULT_LABEL_LIMIT)


def has_control(text: str) -> bool:
    """Whether `text` holds a character of `CONTROL_CATEGORIES`."""
    return any(unicodedata.category(c) in CONTROL_CATEGORIES for c in text)


def label_problem(label: str, limit: int | None = None) -> str | None:
    """Why `label` cannot enter a vocabulary, as a counter key: "long_label" (over `limit`
    characters, default `label_limit()`) or "control_characters"; None when it can."""
    if len(label) > (label_limit() if limit is None else limit):
        return "long_label"
    if has_control(label):
        return "control_characters"
    return None


def printable(text) -> str:
    """`str(text)` with every character of `CONTROL_CATEGORIES` escaped as Python writes it
    (`\\x1b`, `\\u202e`, `\\n`), so data cannot move a terminal's cursor, ring its bell, reverse
    the text after it or add lines to a one-line message or a table row."""
    text = str(text)
    if not has_control(text):
        return text
    return "".join(c.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(c) in CONTROL_CATEGORIES else c for c in text)
