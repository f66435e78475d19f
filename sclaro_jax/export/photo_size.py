"""The photograph's size in a downscaled JPEG: `tag_photo_size` writes it into the JPEG as one
more comment segment (`sclaro-photo-size=WxH`, `PHOTO_SIZE_TAG`), and `photo_size_of` reads it
back from the decoded PIL image. `sclaro_jax.export.wds` tags the `train_image` copies it writes;
`data_prep.clip_benchmark`'s transform takes its view from the photograph's box when it finds the
tag (`sclaro_jax.data.augment.resize_centre_crop`).

Standard library only: the CLIP_benchmark loader imports this in a PyTorch venv without JAX or
this project's other dependencies (docs/exports.md).
"""

from __future__ import annotations

import re

PHOTO_SIZE_TAG = b"sclaro-photo-size="
_TAG_RE = re.compile(rb"sclaro-photo-size=(\d+)x(\d+)")


def tag_photo_size(jpeg: bytes, width: int, height: int) -> bytes:
    """The JPEG with a comment segment `sclaro-photo-size=WxH` just before its scan (SOS), so
    that it is the last comment, the one PIL keeps in `info["comment"]`; the entropy-coded
    data, and so the pixels, unchanged. ValueError for bytes whose header does not parse."""
    if jpeg[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG")
    pos = 2
    while True:
        if pos + 4 > len(jpeg) or jpeg[pos] != 0xFF:
            raise ValueError("a JPEG whose header segments do not parse")
        if jpeg[pos + 1] == 0xDA:  # start of scan
            break
        pos += 2 + int.from_bytes(jpeg[pos + 2:pos + 4], "big")
    body = PHOTO_SIZE_TAG + f"{int(width)}x{int(height)}".encode()
    segment = b"\xff\xfe" + (len(body) + 2).to_bytes(2, "big") + body
    return jpeg[:pos] + segment + jpeg[pos:]


def photo_size_of(img) -> tuple[int, int] | None:
    """(width, height) of the photograph a decoded PIL image is a downscaled copy of, from its
    `tag_photo_size` comment; None for an image without one."""
    comment = getattr(img, "info", {}).get("comment")
    if isinstance(comment, str):
        comment = comment.encode("latin-1", "ignore")
    match = _TAG_RE.fullmatch(comment) if isinstance(comment, bytes) else None
    return (int(match.group(1)), int(match.group(2))) if match else None
