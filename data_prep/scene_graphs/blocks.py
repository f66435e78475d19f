"""The import's work folder: one finished block of images = one ArrayRecord file of its records
plus a JSON marker, each written atomically, so a killed import keeps every block it finished.

    <work>/blocks/000012.array_record, 000012.json   block 12: its records, then its marker

A marker holds the block's image ids, its tallies (`pipeline.Counts` as a dict), the key, the
shard's size and sha256. A block counts as finished only when its marker names the same ids and
key and its shard has the recorded size and checksum; anything else is redone. The key is the
sha256 of what decides a block's records: the source, the dataset files read (path, size,
modification time), the action rule, the view size, the originals policy and the JPEG
qualities; the blocks of another key are redone (and said so), never mixed in.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

from sclaro_jax import bounds
from sclaro_jax.data.schema import file_sha256
from sclaro_jax.files import write_replacing

BLOCKS = "blocks"
MARKER_VERSION = 1


def run_key(settings: dict, files: list[str]) -> str:
    """sha256 of `settings` and of each file's path, size and modification time."""
    stats = []
    for path in files:
        st = os.stat(path)
        stats.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    text = json.dumps({"settings": settings, "files": stats}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def paths(work: str, k: int) -> tuple[str, str]:
    base = os.path.join(work, BLOCKS, f"{k:06d}")
    return base + ".array_record", base + ".json"


def write(work: str, k: int, ids: list[str], records: list[bytes], counts: dict,
          key: str) -> dict:
    """Block `k`'s shard, then its marker, each written to a temporary name and moved into
    place; returns the marker."""
    from data_prep.shards import write_records
    shard, marker_path = paths(work, k)
    os.makedirs(os.path.dirname(shard), exist_ok=True)
    digest, size = write_records(shard, records)
    marker = {"version": MARKER_VERSION, "block": k, "ids": list(ids), "key": key,
              "records": len(records), "bytes": size, "sha256": digest, "counts": counts}
    write_replacing(marker_path, lambda f: json.dump(marker, f, sort_keys=True), text=True,
                    fsync=True)
    return marker


def clear_partial(work: str) -> None:
    """Remove the temporary files of block writes that a kill interrupted."""
    for name in glob.glob(os.path.join(work, BLOCKS, "*.tmp-*")):
        try:
            os.remove(name)
        except FileNotFoundError:
            pass


def finished(work: str, blocks: list[list[str]], key: str) -> tuple[dict, int]:
    """{k: marker} of the blocks (lists of image ids) finished with this key, and how many
    blocks on disk were made from other inputs (they are redone)."""
    done, other = {}, 0
    for k, ids in enumerate(blocks):
        shard, marker_path = paths(work, k)
        try:
            marker = bounds.read_json(marker_path)
        except (OSError, ValueError):
            continue
        if marker.get("version") != MARKER_VERSION or marker.get("ids") != ids:
            continue
        if marker.get("key") != key:
            other += 1
            continue
        try:
            if os.path.getsize(shard) != marker["bytes"] or file_sha256(shard) != \
                    marker["sha256"]:
                continue
        except OSError:
            continue
        done[k] = marker
    return done, other

