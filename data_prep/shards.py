"""Write SCLARO samples as sharded ArrayRecord files with vocabularies and a manifest.

Layout of a dataset folder (the schema is `sclaro_jax.data.schema`)::

    train-00000-of-00002.array_record   val-00000-of-00001.array_record   test-...
    actions.txt objects.txt relations.txt predicates.txt sources.txt
    manifest.json        # written last: a folder without it is not a dataset

Version. `ShardWriter(view_size=S)` (224 by default) writes schema version 2: every sample is
given its training views at S (`data_prep.views.with_views`; a sample that already has views
of that size passes through), without the original photograph and regions unless
`keep_originals`. `view_size=None` writes the legacy version 1 (originals only). All records of
one dataset share one version, view size and originals policy, and the manifest records them
(`schema_version`, `view_size`, `originals`, `view_quality`, `global_short_side`).

Atomic publish. Everything is written into a hidden folder `.writing-<pid>-*` inside the output
folder and moved into place with `os.replace` only when every sample has been accepted; the
manifest goes last, so an interrupted or refused write leaves no dataset behind. A writer that
was killed (SIGKILL, power loss) leaves only its hidden folder; the next writer into the same
output folder removes it once its process is gone (pid in the name, host and start time in
`owner.json`; a live writer's folder is left alone). On publishing, shard files in the output
folder that the new dataset does not have (`train-00003-of-00005.array_record` of an overwritten
dataset, or of a publish that was killed part-way) are removed. A sample that fails
`schema.validate` (corrupt image, box outside the image, relation index out of range, unknown
schema version) is refused with a `RecordError` naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from typing import Iterable, Iterator

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from tqdm import tqdm

from data_prep import views
from sclaro_jax import bounds
from sclaro_jax.data import schema
from sclaro_jax.files import replacing, write_replacing

log = logging.getLogger("data_prep.shards")

TMP_PREFIX = ".writing-"
OWNER = "owner.json"  # in a writer's temporary folder: pid, host, process start time
_SHARD_NAME = re.compile(r"(train|val|test)-\d{5}-of-\d{5}\.array_record")


def _process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), "Z" for a
    zombie, None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return "Z" if fields[0] in ("Z", "X") else fields[19]


def _writer_alive(folder: str) -> bool:
    """Whether the writer that made the temporary `folder` may still be running. Unknown
    owners (another host, a name without a pid) count as alive: their folders are kept."""
    m = re.fullmatch(re.escape(TMP_PREFIX) + r"(\d+)-.*", os.path.basename(folder))
    if not m:
        return True
    pid, owner = int(m.group(1)), {}
    try:
        owner = bounds.read_json(os.path.join(folder, OWNER))
    except (OSError, ValueError):
        pass  # killed before it wrote owner.json: the pid in the name decides
    if owner.get("host", socket.gethostname()) != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    start = _process_start(pid)
    if start == "Z":
        return False
    return not (start and owner.get("start") and start != owner["start"])  # pid reused


def remove_stale_writers(out_dir: str) -> list[str]:
    """Delete the `.writing-*` folders in `out_dir` whose writer process is gone; returns
    their paths."""
    removed = []
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if name.startswith(TMP_PREFIX) and os.path.isdir(path) and not os.path.islink(path) \
                and not _writer_alive(path):  # a link of that name is never followed
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed %s, left by an interrupted writer", path)
            removed.append(path)
    return removed


def _fsync_write(path: str, text: str) -> None:
    write_replacing(path, lambda f: f.write(text), text=True, fsync=True)


def refuse_a_dataset_in(out_dir: str, overwrite: bool) -> None:
    """`FileExistsError` when `out_dir` already holds a dataset (its manifest) and `overwrite`
    is not set: what a writer checks first, and a job may check before any work."""
    manifest = os.path.join(os.path.abspath(out_dir), schema.MANIFEST)
    if os.path.exists(manifest) and not overwrite:
        raise FileExistsError(f"{manifest} exists: {os.path.abspath(out_dir)} already holds a "
                              f"dataset (pass overwrite=True / --overwrite to replace it)")


def write_records(path: str, records: Iterable[bytes]) -> tuple[str, int]:
    """`records` as one ArrayRecord file at `path`, written whole or not at all (`replacing`,
    fsynced: an annotate or import block); its sha256 and size in bytes."""
    with replacing(path, fsync=True) as tmp:
        writer = ArrayRecordWriter(tmp, "group_size:1")
        for record in records:
            writer.write(record)
        writer.close()
        digest, size = schema.file_sha256(tmp), os.path.getsize(tmp)
    return digest, size


def iter_records(path: str, chunk: int = 32) -> Iterator[tuple[int, bytes]]:
    """(index, record bytes) of one shard file in order, `chunk` records in memory at a time
    (a dataset's records: `ShardedDataset.records` / `.samples`)."""
    reader = ArrayRecordReader(path)
    try:
        n = reader.num_records()
        for start in range(0, n, chunk):
            yield from enumerate(reader.read(start, min(n, start + chunk)), start)
    finally:
        reader.close()


def convert_sample(sample: schema.Sample, record: bytes | None, *, view_size: int | None,
                   keep_originals: bool, view_quality: int, validate_images: bool = True
                   ) -> tuple[schema.Sample, bytes | None]:
    """`sample` validated and in the version / view size / originals policy asked for (a
    `ShardWriter`'s); `record` stays only when nothing changed."""
    size, name = view_size, f"sample {sample.id!r}"
    if sample.view_size == size:  # same version and view size: passes through
        if size is not None and keep_originals and not sample.has_originals:
            raise schema.MissingOriginalsError(
                f"{name} holds {size} px views without the original photograph and "
                f"regions, and this dataset is written with originals (--keep-originals): "
                f"write it without, or convert the dataset the record came from")
        schema.validate(sample, decode_images=validate_images)
        if not keep_originals and (sample.image is not None or any(
                r.region is not None for r in sample.relations)):
            return views.drop_originals(sample), None
        return sample, record
    if size is None:  # version 2 -> version 1: the originals alone
        if not sample.has_originals:
            raise schema.MissingOriginalsError(
                f"{name} holds {sample.view_size} px views and no originals; a version-1 "
                f"dataset needs the full-size photograph and regions: convert the dataset "
                f"it came from, or one written with --keep-originals")
        sample = views.drop_views(sample)
        schema.validate(sample, decode_images=validate_images)
        return sample, None
    # views to make: validate the structure here; with_views decodes every original with
    # its size checked (and refuses a sample without originals, naming it)
    schema.validate(sample, decode_images=False)
    sample = views.with_views(sample, size, keep_originals=keep_originals,
                              quality=view_quality)
    schema.validate(sample, decode_images=False)
    return sample, None


class ShardWriter:
    """Accepts samples (or already-encoded records) one at a time; `close()` publishes them.

        with ShardWriter(out_dir, records_per_shard=1000) as w:
            for sample in samples:
                w.add(sample)

    `view_size` (default `schema.DEFAULT_VIEW_SIZE`, None = legacy version 1), `keep_originals`
    and `view_quality` (JPEG quality of views made here) set what the records hold; `created`
    (an ISO time, default now) and `manifest_extra` (more manifest keys) exist so that a
    conversion can reproduce its output byte for byte. Leaving the `with` block by an exception
    discards everything written so far.
    """

    def __init__(self, out_dir: str, *, records_per_shard: int = 1000, overwrite: bool = False,
                 split_rule: dict | None = None, validate_images: bool = True,
                 view_size: int | None = schema.DEFAULT_VIEW_SIZE, keep_originals: bool = False,
                 view_quality: int = schema.VIEW_QUALITY, created: str | None = None,
                 manifest_extra: dict | None = None):
        if records_per_shard < 1:
            raise ValueError("records_per_shard must be at least 1")
        if view_size is not None and (not isinstance(view_size, (int, np.integer))
                                      or view_size < 1):
            raise ValueError(f"view_size {view_size!r} is not a positive integer (None writes "
                             f"schema version 1)")
        self.out_dir = os.path.abspath(out_dir)
        refuse_a_dataset_in(self.out_dir, overwrite)
        os.makedirs(self.out_dir, exist_ok=True)
        self.overwrite = overwrite
        self.records_per_shard = records_per_shard
        self.split_rule = split_rule or {}
        self.validate_images = validate_images
        self.view_size = None if view_size is None else int(view_size)
        self.keep_originals = bool(keep_originals) or view_size is None
        self.view_quality = int(view_quality)
        self.created = created
        self.manifest_extra = dict(manifest_extra or {})
        remove_stale_writers(self.out_dir)
        self._tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=self.out_dir)
        _fsync_write(os.path.join(self._tmp, OWNER), json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(),
             "start": _process_start(os.getpid())}))
        self._writers: dict[str, ArrayRecordWriter] = {}
        self._shards: dict[str, list[dict]] = collections.defaultdict(list)
        self._ids: set[str] = set()
        self._counts = collections.Counter()
        self._crops = collections.defaultdict(lambda: np.zeros(2, np.int64))
        # split -> (objects, relations) per-image count -> records (the packed layout's plan)
        self._hist = collections.defaultdict(lambda: (collections.Counter(),
                                                      collections.Counter()))
        self._by_source = collections.defaultdict(collections.Counter)
        self._no_action = collections.Counter()
        self._vocab = {k: collections.Counter() for k in schema.VOCAB_FILES}
        self._mask_kinds = collections.Counter()
        self._closed = False

    # ------------------------------------------------------------------ adding
    def _convert(self, sample: schema.Sample, record: bytes | None
                 ) -> tuple[schema.Sample, bytes | None]:
        return convert_sample(sample, record, view_size=self.view_size,
                              keep_originals=self.keep_originals,
                              view_quality=self.view_quality,
                              validate_images=self.validate_images)

    def add(self, sample: schema.Sample | bytes) -> None:
        """Validate, convert and append one sample (a `schema.Sample` or encoded record
        bytes)."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        if isinstance(sample, (bytes, bytearray, memoryview)):
            record = bytes(sample)
            sample = schema.decode(record)  # refuses unknown versions and corrupt payloads
        else:
            record = None
        if sample.id in self._ids:
            raise schema.RecordError(f"sample {sample.id!r}: duplicate id")
        sample, record = self._convert(sample, record)
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
        self._hist[sample.split][0][len(sample.objects)] += 1
        self._hist[sample.split][1][len(sample.relations)] += 1
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
            done = self._shards[split][-1]
            log.info("finished shard %s (%d records)", done["tmp"], done["records"])
        index = len(self._shards[split])
        path = os.path.join(self._tmp, f"{split}-{index:05d}.array_record")
        # group_size:1 keeps every record independently readable: fast random access for Grain.
        self._writers[split] = ArrayRecordWriter(path, "group_size:1")
        self._shards[split].append({"tmp": path, "records": 0})

    # ------------------------------------------------------------------ publishing
    def _manifest_head(self) -> dict:
        manifest = {
            "format": schema.MANIFEST_FORMAT,
            "schema_version": 1 if self.view_size is None else schema.SCHEMA_VERSION,
            "created": self.created or datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
        }
        if self.view_size is not None:
            manifest.update(view_size=self.view_size, originals=self.keep_originals,
                            view_quality=self.view_quality,
                            global_short_side=schema.global_short_side(self.view_size))
        manifest.update(split_rule=self.split_rule, mask_kinds=dict(self._mask_kinds),
                        records=sum(self._counts.values()), splits={}, vocab={})
        return manifest

    def close(self) -> dict:
        """Finish the shards, write vocabularies and the manifest, move them into place."""
        if self._closed:
            raise RuntimeError("ShardWriter is already closed")
        self._closed = True
        for w in self._writers.values():
            w.close()
        files = []
        manifest = self._manifest_head()
        for split in schema.SPLITS:
            shards = self._shards.get(split, [])
            entries = []
            for i, shard in enumerate(shards):
                name = f"{split}-{i:05d}-of-{len(shards):05d}.array_record"
                final = os.path.join(self._tmp, name)
                os.replace(shard["tmp"], final)
                entries.append({"file": name, "records": shard["records"],
                                "bytes": os.path.getsize(final),
                                "sha256": schema.file_sha256(final)})
                files.append(name)
            manifest["splits"][split] = {
                "records": self._counts.get(split, 0),
                "objects": int(self._crops[split][0]),
                "relations": int(self._crops[split][1]),
                "no_action": self._no_action.get(split, 0),
                # records with 0, 1, 2, ... objects (relations): sclaro_jax.data.packing
                "count_histograms": {
                    kind: [hist[n] for n in range(max(hist, default=0) + 1)]
                    for kind, hist in zip(("objects", "relations"), self._hist[split])},
                "by_source": dict(sorted(self._by_source[split].items())),
                "shards": entries,
            }
        for key, filename in schema.VOCAB_FILES.items():
            labels = sorted(self._vocab[key])
            write_replacing(os.path.join(self._tmp, filename),
                            lambda f, labels=labels: f.writelines(f"{x}\n" for x in labels),
                            text=True)
            manifest["vocab"][key] = {
                "file": filename, "size": len(labels),
                "sha256": schema.file_sha256(os.path.join(self._tmp, filename))}
            files.append(filename)
        manifest.update(self.manifest_extra)
        _fsync_write(os.path.join(self._tmp, schema.MANIFEST),
                     json.dumps(manifest, indent=2) + "\n")
        old = os.path.join(self.out_dir, schema.MANIFEST)
        if self.overwrite and os.path.exists(old):
            os.remove(old)  # the folder stops being a dataset before its files change
        # no manifest here now: shard files not of this dataset are leftovers (of an
        # overwritten dataset, or of a publish that was killed part-way)
        for name in os.listdir(self.out_dir):
            if _SHARD_NAME.fullmatch(name) and name not in files:
                os.remove(os.path.join(self.out_dir, name))
        for name in files:
            os.replace(os.path.join(self._tmp, name), os.path.join(self.out_dir, name))
        os.replace(os.path.join(self._tmp, schema.MANIFEST), old)
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
                  overwrite: bool = False, progress: bool = True,
                  view_size: int | None = schema.DEFAULT_VIEW_SIZE, keep_originals: bool = False,
                  view_quality: int = schema.VIEW_QUALITY, created: str | None = None,
                  manifest_extra: dict | None = None) -> dict:
    """Assign the deterministic split over `ids`, then write `samples` (split filled in) with
    a `ShardWriter(view_size=, keep_originals=, view_quality=, created=, manifest_extra=)`.

    `ids` lists every sample id up front (the split needs the whole set); `samples` may be a
    generator, so images never all sit in memory at once.
    """
    ids = list(ids)
    split_of = schema.assign_splits(ids, split_seed, fractions)
    rule = {"method": "sha256(seed:id) rank", "seed": split_seed, "fractions": list(fractions)}
    with ShardWriter(out_dir, records_per_shard=records_per_shard, overwrite=overwrite,
                     split_rule=rule, view_size=view_size, keep_originals=keep_originals,
                     view_quality=view_quality, created=created,
                     manifest_extra=manifest_extra) as writer:
        for sample in tqdm(samples, total=len(ids), desc="writing shards", unit="sample",
                           disable=not progress):
            if sample.id not in split_of:
                raise schema.RecordError(f"sample {sample.id!r} is not among the ids given "
                                         f"for the split")
            writer.add(dataclasses.replace(sample, split=split_of[sample.id]))
    return writer.manifest
