"""Open a SCLARO dataset folder (shards + vocabularies + manifest) for reading.

A dataset is identified by the sha256 of its manifest (`ShardedDataset.identity`), which lists
every file's sha256: a copied or moved folder is the same dataset, a rewritten one is not. The
Grain data source of a split (`ShardedDataset.source`) carries that identity, not the shards'
paths, so a data iterator's saved state resumes wherever the folder now lies.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shlex

from sclaro_jax import bounds
from sclaro_jax.data import schema
from sclaro_jax.paths import inside_root

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset folder that cannot be read; the message names the folder or file."""


class ShardReadError(DatasetError):
    """A record that cannot be read from its shard (a damaged file)."""


# the manifest's import "source" -> `python -m data_prep import --source`'s name for it
IMPORT_SOURCES = {"openpsg": "psg", "vg": "vg"}


class ViewSizeError(DatasetError):
    """A dataset whose stored views are of another size than the model's input."""


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Label lists from the vocabulary files; `index(kind, label)` is -1 for unknown labels."""
    actions: tuple[str, ...]
    objects: tuple[str, ...]
    relations: tuple[str, ...]
    predicates: tuple[str, ...]
    sources: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "_lookup", {
            f.name: {label: i for i, label in enumerate(getattr(self, f.name))}
            for f in dataclasses.fields(self)})

    def index(self, kind: str, label: str) -> int:
        return self._lookup[kind].get(label, -1)


@dataclasses.dataclass(frozen=True)
class ShardedDataset:
    root: str
    manifest: dict
    vocab: Vocab

    def paths(self, split: str) -> list[str]:
        """Shard files of one split, in order."""
        if split not in self.manifest["splits"]:
            raise DatasetError(f"{self.root}: no split {split!r}; the manifest has "
                               f"{sorted(self.manifest['splits'])}")
        return [os.path.join(self.root, s["file"])
                for s in self.manifest["splits"][split]["shards"]]

    @functools.cached_property
    def identity(self) -> str:
        """sha256 of the manifest's bytes: the dataset's content, wherever it lies."""
        with open(os.path.join(self.root, schema.MANIFEST), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def source_id(self, split: str) -> str:
        """`repr` of `source(split)`: `SCLARODataset(<split>@<manifest sha256, 16 hex>)`."""
        return f"SCLARODataset({split}@{self.identity[:16]})"

    def source(self, split: str):
        """The split's records as a Grain data source identified by content, not by path (its
        `repr` is `source_id(split)`)."""
        return shard_source(self.paths(split), self.source_id(split))

    def records(self, split: str, chunk: int = 32):
        """(where, record bytes) of every record of a split, in order, `chunk` records in
        memory at a time; `where` is "<shard path> record <i>" for messages."""
        from array_record.python.array_record_module import ArrayRecordReader

        for path in self.paths(split):
            reader = ArrayRecordReader(path)
            try:
                n = reader.num_records()
                for start in range(0, n, chunk):
                    for i, record in enumerate(reader.read(start, min(n, start + chunk)), start):
                        yield f"{path} record {i}", record
            finally:
                reader.close()

    def samples(self, split: str, *, skip_bad: bool = False, located: bool = False):
        """Every record of a split, decoded (images stay encoded), in order: the one record
        reader of the library and data_prep; with `located`, (where, sample) pairs (`where` as
        `records` gives it, for messages about the sample). A record that does not decode
        raises `DatasetError` naming its shard and index, or is passed over with `skip_bad`."""
        for where, record in self.records(split):
            try:
                sample = schema.decode(record)
            except schema.RecordError as e:
                if skip_bad:
                    continue
                raise DatasetError(f"{where}: {e}") from None
            yield (where, sample) if located else sample

    def check_files(self, split: str | None = None) -> None:
        """The quick check of the shards (of `split`, or of every split) against the manifest
        when a run starts: each file's size (manifests that record it) and record count, read
        from the file's index. A truncated or partly copied shard raises DatasetError naming
        it; `verify` hashes every byte."""
        from array_record.python import array_record_module

        splits = self.manifest["splits"] if split is None else {split: None}
        for name in splits:
            for entry in self.manifest["splits"][name]["shards"]:
                path = os.path.join(self.root, entry["file"])
                size = os.path.getsize(path)
                if "bytes" in entry and size != entry["bytes"]:
                    raise DatasetError(
                        f"{path} is {size} bytes; {schema.MANIFEST} says {entry['bytes']}: the "
                        "file is truncated or was changed after it was written. Copy it again "
                        "from the source dataset (or rebuild the dataset)")
                try:
                    reader = array_record_module.ArrayRecordReader(path)
                    count = reader.num_records()
                    reader.close()
                except Exception as e:  # noqa: BLE001 (Riegeli's errors name no file)
                    raise DatasetError(f"{path} cannot be read as ArrayRecord ({e}); copy it "
                                       "again from the source dataset") from None
                if count != entry["records"]:
                    raise DatasetError(
                        f"{path} holds {count} readable records; {schema.MANIFEST} says "
                        f"{entry['records']}: the file is truncated or corrupt. Copy it again "
                        "from the source dataset (or rebuild the dataset)")

    def num_records(self, split: str) -> int:
        return self.manifest["splits"][split]["records"]

    @property
    def schema_version(self) -> int:
        return int(self.manifest["schema_version"])

    @property
    def view_size(self) -> int:
        """The size of the stored training views (version 1: the reference's 224, the largest
        size its originals are read at on the host)."""
        return int(self.manifest.get("view_size") or schema.LEGACY_VIEW_SIZE)

    @property
    def has_originals(self) -> bool:
        """Whether the records hold the full-size photographs and relation regions."""
        return self.schema_version == 1 or bool(self.manifest.get("originals"))

    def check_view_size(self, image_size: int) -> None:
        """ViewSizeError naming the reshard command unless the dataset serves `image_size` px
        views: a version-2 dataset its stored size; a version-1 dataset (views made from the
        originals on the host, every epoch) sizes up to the reference's 224 px, at which its
        records were made and checked; larger sizes convert to stored views first."""
        image_size = int(image_size)
        if self.schema_version == 1 and image_size <= self.view_size:
            log.info("%s is schema version 1: its views are made from the originals on the "
                     "host; `python -m data_prep reshard` stores them once (faster input)",
                     self.root)
            return
        if image_size == self.view_size:
            return
        kind = (f"schema version 1 (originals, read at up to {self.view_size} px)"
                if self.schema_version == 1 else f"{self.view_size} px training views")
        out = shlex.quote(f"{self.root}-{image_size}")
        imported = self.manifest.get("import") or {}
        if not self.has_originals and imported.get("source") in IMPORT_SOURCES:
            # an import kept no originals to convert: the import itself makes the views
            actions = (imported.get("actions") or {}).get("rule") == "none"
            root = shlex.quote(imported["root"]) if imported.get("root") else "ROOT"
            fix = (f"import it again at that size: python -m data_prep import --source "
                   f"{IMPORT_SOURCES[imported['source']]} --root {root} --out {out} "
                   f"--image-size {image_size}" + (" --no-actions" if actions else ""))
        else:
            fix = (f"convert it: python -m data_prep reshard --in {shlex.quote(self.root)} "
                   f"--out {out} --image-size {image_size}" + (
                       "" if self.has_originals else
                       " (from the dataset it was made from: this one has no originals)"))
        raise ViewSizeError(
            f"{self.root} holds {kind}; the model takes {image_size} px images "
            f"(config.data.image_size): {fix}")

    def verify(self) -> None:
        """Check every shard and vocabulary file against the manifest's sha256."""
        entries = [s for sp in self.manifest["splits"].values() for s in sp["shards"]]
        entries += list(self.manifest["vocab"].values())
        for entry in entries:
            path = os.path.join(self.root, entry["file"])
            if not os.path.exists(path):
                raise DatasetError(f"{path} not found (listed in {schema.MANIFEST})")
            if schema.file_sha256(path) != entry["sha256"]:
                raise DatasetError(f"{path}: sha256 does not match {schema.MANIFEST}; the file "
                                   f"changed after it was written")


@functools.cache
def _shard_source_class():
    # Grain (and with it absl's logging handler on the root logger) is imported only when a
    # source is made, so reading a manifest keeps command lines' own logging set-up working.
    import grain.python as grain

    class ShardSource(grain.ArrayRecordDataSource):
        """`grain.ArrayRecordDataSource` whose `repr` (which Grain stores in an iterator's
        state and checks on restore) is the dataset's content identity instead of a hash of
        absolute paths."""

        def __init__(self, paths, identity: str):
            super().__init__(paths)
            self.identity = identity

        def __repr__(self) -> str:
            return self.identity

        def __reduce__(self):  # picklable for Grain's worker processes (a local class)
            return shard_source, (self._paths, self.identity)

        def __getitem__(self, record_key):
            try:
                return super().__getitem__(record_key)
            except Exception as e:  # noqa: BLE001 (named and re-raised)
                raise self._read_error(record_key, e) from e

        def __getitems__(self, record_keys):
            try:
                return super().__getitems__(record_keys)
            except Exception as e:  # noqa: BLE001 (named and re-raised)
                for key in record_keys:  # which record: read them one at a time
                    try:
                        super().__getitem__(key)
                    except Exception as one:  # noqa: BLE001
                        raise self._read_error(key, one) from e
                raise

        def _read_error(self, record_key, error: Exception) -> Exception:
            """A failed read as ShardReadError naming the shard and record (errors in the
            arguments, such as a key out of range, stay as they are)."""
            try:
                shard, position = self._reader_idx_and_position(record_key)
            except Exception:  # noqa: BLE001
                return error
            return ShardReadError(
                f"cannot read record {position} of shard {self._paths[shard]}: {error}. The "
                "shard is damaged; --verify-data checks every shard's sha256 against the "
                "manifest (rewrite or restore the shards it names).")

    return ShardSource


def shard_source(paths, identity: str):
    """A Grain data source over `paths` whose `repr` is `identity`."""
    return _shard_source_class()(paths, identity)


def open_dataset(root: str, *, verify: bool = False) -> ShardedDataset:
    """Read `root/manifest.json` and the vocabularies; DatasetError naming what is wrong."""
    root = os.path.abspath(root)
    path = os.path.join(root, schema.MANIFEST)
    if not os.path.exists(path):
        raise DatasetError(
            f"{path} not found: {root} " + ("is not" if os.path.isdir(root) else
                                            "does not exist, so it is not")
            + f" a SCLARO dataset folder (the shards and {schema.MANIFEST} that `python -m "
            f"data_prep` writes). Pass such a folder: your images annotated with `python -m "
            f"data_prep annotate --root IMAGES --out DIR` (or a dataset that `curate` or "
            f"`reshard` wrote from one), or the bundled demo, `python -m data_prep demo --out "
            f"DIR`")
    try:
        manifest = bounds.read_json(path)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("format") != schema.MANIFEST_FORMAT:
        raise DatasetError(f"{path}: format {manifest.get('format')!r} is not "
                           f"{schema.MANIFEST_FORMAT!r}")
    version = manifest.get("schema_version")
    if version not in schema.READABLE_VERSIONS:
        raise schema.SchemaVersionError(
            f"{path}: shards written with SCLARO schema version {version}; this code reads "
            f"versions {schema.READABLE_VERSIONS}. Rewrite them with this version of "
            f"`python -m data_prep`.")
    labels = {}
    for key, filename in schema.VOCAB_FILES.items():
        vpath = os.path.join(root, filename)
        if not os.path.exists(vpath):
            raise DatasetError(f"{vpath} not found (vocabulary listed in {path})")
        labels[key] = tuple(schema.read_vocab(vpath))
    named = [s["file"] for split in manifest["splits"]
             for s in manifest["splits"][split]["shards"]]
    vocab = [v["file"] for v in (manifest.get("vocab") or {}).values()
             if isinstance(v, dict) and "file" in v]
    outside = [f for f in named + vocab if inside_root(root, f) is None]
    if outside:  # never opened: a dataset's files lie in its folder
        raise DatasetError(f"{path} names the file {outside[0]!r}, which resolves outside "
                           f"{root}; a dataset's shards and vocabularies must lie in its folder")
    missing = [p for p in (os.path.join(root, f) for f in named) if not os.path.exists(p)]
    if missing:
        raise DatasetError(f"shards listed in {path} are missing: {missing[:3]}")
    ds = ShardedDataset(root, manifest, Vocab(**labels))
    if verify:
        ds.verify()
    return ds
