"""Write SCLARO samples as sharded ArrayRecord files with vocabularies and a manifest.

Layout of a dataset folder (the schema is `sclaro_jax.data.schema`)::

    train-00000-of-00002.array_record   val-00000-of-00001.array_record   test-...
    actions.txt objects.txt relations.txt predicates.txt sources.txt
    manifest.json        # written last: a folder without it is not a dataset

Everything is written into a hidden temporary folder inside the output folder and moved into
place with `os.replace` only when every sample has been accepted, so an interrupted or refused
write leaves the output folder as it was. A sample that fails `schema.validate` (corrupt image,
box outside the image, relation index out of range, unknown schema version) is refused with a
`RecordError` naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import os
import shutil
import tempfile
from typing import Iterable

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from tqdm import tqdm

from sclaro_jax.data import schema


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Accepts samples (or already-encoded records) one at a time; `close()` publishes them.

        with ShardWriter(out_dir, records_per_shard=1000) as w:
            for sample in samples:
                w.add(sample)

    Leaving the `with` block by an exception discards everything written so far.
    """

    def __init__(self, out_dir: str, *, records_per_shard: int = 1000, overwrite: bool = False,
                 split_rule: dict | None = None, validate_images: bool = True):
        if records_per_shard < 1:
            raise ValueError("records_per_shard must be at least 1")
        self.out_dir = os.path.abspath(out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        manifest = os.path.join(self.out_dir, schema.MANIFEST)
        if os.path.exists(manifest) and not overwrite:
            raise FileExistsError(f"{manifest} exists: {self.out_dir} already holds a dataset "
                                  f"(pass overwrite=True / --overwrite to replace it)")
        self.overwrite = overwrite
        self.records_per_shard = records_per_shard
        self.split_rule = split_rule or {}
        self.validate_images = validate_images
        self._tmp = tempfile.mkdtemp(prefix=".writing-", dir=self.out_dir)
        self._writers: dict[str, ArrayRecordWriter] = {}
        self._shards: dict[str, list[dict]] = collections.defaultdict(list)
        self._ids: set[str] = set()
        self._counts = collections.Counter()
        self._crops = collections.defaultdict(lambda: np.zeros(2, np.int64))
        self._by_source = collections.defaultdict(collections.Counter)
        self._no_action = collections.Counter()
        self._vocab = {k: collections.Counter() for k in schema.VOCAB_FILES}
        self._mask_kinds = collections.Counter()
        self._closed = False

    # ------------------------------------------------------------------ adding
    def add(self, sample: schema.Sample | bytes) -> None:
        """Validate and append one sample (a `schema.Sample` or encoded record bytes)."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        if isinstance(sample, (bytes, bytearray, memoryview)):
            record = bytes(sample)
            sample = schema.decode(record)  # refuses unknown versions and corrupt payloads
        else:
            record = None
        schema.validate(sample, decode_images=self.validate_images)
        if sample.id in self._ids:
            raise schema.RecordError(f"sample {sample.id!r}: duplicate id")
        if record is None:
            record = schema.encode(sample)
        shards = self._shards[sample.split]
        if sample.split not in self._writers or shards[-1]["records"] >= self.records_per_shard:
            self._open_shard(sample.split)
        self._writers[sample.split].write(record)
        shards[-1]["records"] += 1
        self._ids.add(sample.id)
        self._counts[sample.split] += 1
        self._crops[sample.split] += (len(sample.objects), len(sample.relations))
        self._by_source[sample.split][sample.source] += 1
        self._mask_kinds[sample.mask_kind] += 1
        if sample.action:  # "" = no action: kept, but not a class
            self._vocab["actions"][sample.action] += 1
        else:
            self._no_action[sample.split] += 1
        self._vocab["sources"][sample.source] += 1
        for o in sample.objects:
            self._vocab["objects"][o.name] += 1
        for r in sample.relations:
            self._vocab["relations"][r.text] += 1
            self._vocab["predicates"][r.predicate] += 1

    def _open_shard(self, split: str) -> None:
        if split in self._writers:
            self._writers[split].close()
        index = len(self._shards[split])
        path = os.path.join(self._tmp, f"{split}-{index:05d}.array_record")
        # group_size:1 keeps every record independently readable: fast random access for Grain.
        self._writers[split] = ArrayRecordWriter(path, "group_size:1")
        self._shards[split].append({"tmp": path, "records": 0})

    # ------------------------------------------------------------------ publishing
    def close(self) -> dict:
        """Finish the shards, write vocabularies and the manifest, move them into place."""
        if self._closed:
            raise RuntimeError("ShardWriter is already closed")
        self._closed = True
        for w in self._writers.values():
            w.close()
        files = []
        manifest = {
            "format": schema.MANIFEST_FORMAT,
            "schema_version": schema.SCHEMA_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "split_rule": self.split_rule,
            "mask_kinds": dict(self._mask_kinds),
            "records": sum(self._counts.values()),
            "splits": {},
            "vocab": {},
        }
        for split in schema.SPLITS:
            shards = self._shards.get(split, [])
            entries = []
            for i, shard in enumerate(shards):
                name = f"{split}-{i:05d}-of-{len(shards):05d}.array_record"
                final = os.path.join(self._tmp, name)
                os.replace(shard["tmp"], final)
                entries.append({"file": name, "records": shard["records"],
                                "sha256": schema.file_sha256(final)})
                files.append(name)
            manifest["splits"][split] = {
                "records": self._counts.get(split, 0),
                "objects": int(self._crops[split][0]),
                "relations": int(self._crops[split][1]),
                "no_action": self._no_action.get(split, 0),
                "by_source": dict(sorted(self._by_source[split].items())),
                "shards": entries,
            }
        for key, filename in schema.VOCAB_FILES.items():
            labels = sorted(self._vocab[key])
            with open(os.path.join(self._tmp, filename), "w", encoding="utf-8") as f:
                f.writelines(label + "\n" for label in labels)
            manifest["vocab"][key] = {
                "file": filename, "size": len(labels),
                "sha256": schema.file_sha256(os.path.join(self._tmp, filename))}
            files.append(filename)
        old = os.path.join(self.out_dir, schema.MANIFEST)
        if self.overwrite and os.path.exists(old):
            os.remove(old)  # the folder stops being a dataset before its files change
            for name in os.listdir(self.out_dir):
                if name.endswith(".array_record"):
                    os.remove(os.path.join(self.out_dir, name))
        for name in files:
            os.replace(os.path.join(self._tmp, name), os.path.join(self.out_dir, name))
        _write_atomic(old, json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(self._tmp, ignore_errors=True)
        return manifest

    def abort(self) -> None:
        self._closed = True
        for w in self._writers.values():
            try:
                w.close()
            except Exception:
                pass
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.manifest = self.close()
        else:
            self.abort()
        return False


def write_dataset(samples: Iterable[schema.Sample], out_dir: str, *, ids: Iterable[str],
                  split_seed: int = 42, fractions=(0.7, 0.1, 0.2), records_per_shard: int = 1000,
                  overwrite: bool = False, progress: bool = True) -> dict:
    """Assign the deterministic split over `ids`, then write `samples` (split filled in).

    `ids` lists every sample id up front (the split needs the whole set); `samples` may be a
    generator, so images never all sit in memory at once.
    """
    ids = list(ids)
    split_of = schema.assign_splits(ids, split_seed, fractions)
    rule = {"method": "sha256(seed:id) rank", "seed": split_seed, "fractions": list(fractions)}
    with ShardWriter(out_dir, records_per_shard=records_per_shard, overwrite=overwrite,
                     split_rule=rule) as writer:
        for sample in tqdm(samples, total=len(ids), desc="writing shards", unit="sample",
                           disable=not progress):
            if sample.id not in split_of:
                raise schema.RecordError(f"sample {sample.id!r} is not among the ids given "
                                         f"for the split")
            writer.add(dataclasses.replace(sample, split=split_of[sample.id]))
    return writer.manifest

