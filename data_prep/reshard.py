"""`python -m data_prep reshard`: convert a dataset to training views of one size.

    python -m data_prep reshard --in /data/sclaro --out /data/sclaro-224              # v1 -> v2
    python -m data_prep reshard --in /data/sclaro --out /data/sclaro-336 --image-size 336

Reads a dataset of schema version 1 (originals only) or 2 (training views, with or without the
originals) and writes it as version 2 at `--image-size` (`data_prep.views.with_views`), keeping
the originals the input holds (as `demo` keeps them: localisation and MINER crops need them)
unless `--no-keep-originals`. Views of another size are made from the originals: a
version-2 dataset written without them converts only to its own view size (then it is copied,
views passing through), and the error says so.

The records stream through (one shard read in small chunks at a time, never the dataset in
memory), split by split in shard order; every record keeps its split, and the output has the
input's records per shard (its largest shard), so shard boundaries match. The output is the same
bytes on every run: the manifest's `created` is the input's, and `converted_from` records the
input's `schema_version`, `view_size` and the sha256 of its manifest. Writing goes through
`data_prep.shards.ShardWriter`: an interrupted reshard leaves only a hidden `.writing-*` folder
(no manifest, so no dataset), which the rerun of the same command removes before it writes the
same output an uninterrupted run would.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os

from tqdm import tqdm

from data_prep.shards import ShardWriter, convert_sample
from sclaro_jax.data import schema
from sclaro_jax.data.dataset import open_dataset


def _convert(item: tuple[str, str, bytes], *, view_size: int, keep_originals: bool,
             view_quality: int) -> bytes:
    """One input record -> the output record's bytes (run in the worker processes)."""
    where, split, record = item
    try:
        sample = schema.decode(record)
        if sample.split != split:
            raise schema.RecordError(f"sample {sample.id!r} says split {sample.split!r} but "
                                     f"lies in a {split!r} shard")
        sample, out = convert_sample(sample, record, view_size=view_size,
                                     keep_originals=keep_originals, view_quality=view_quality)
        return out if out is not None else schema.encode(sample)
    except schema.RecordError as e:
        raise type(e)(f"{where}: {e}") from None


def _records(ds, splits):
    for split in splits:
        for where, record in ds.records(split):
            yield where, split, record


def reshard(src: str, out: str, *, image_size: int = schema.DEFAULT_VIEW_SIZE,
            keep_originals: bool | None = None, overwrite: bool = False,
            progress: bool = True, workers: int = 1) -> dict:
    """Write dataset `src` as schema version 2 with `image_size` px views into `out`; returns
    the new manifest. `keep_originals`: None keeps the originals when `src` holds them, True
    requires them, False drops them. ValueError when `out` is `src`;
    `schema.MissingOriginalsError` when the views asked for need originals that `src` does not
    hold.

    `workers` > 1 makes the views in that many processes, a bounded window of records at a
    time, and writes them in input order: the output bytes do not depend on `workers`."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if os.path.realpath(src) == os.path.realpath(out):
        raise ValueError(f"--in and --out are both {os.path.realpath(src)}: reshard writes a new "
                         f"dataset beside the old one; give another --out")
    ds = open_dataset(src)
    m = ds.manifest
    if keep_originals is None:
        keep_originals = ds.has_originals
    if ds.schema_version != 1 and not ds.has_originals and (
            image_size != ds.view_size or keep_originals):
        want = (f"views of {image_size} px are made from them" if image_size != ds.view_size
                else "--keep-originals asks for them")
        raise schema.MissingOriginalsError(
            f"{ds.root} holds {ds.view_size} px training views without the original photographs "
            f"and regions (written without --keep-originals), and {want}. Reshard the dataset "
            f"it was made from (a version-1 dataset, or one written with --keep-originals) "
            f"instead")
    shard_sizes = [s["records"] for sp in m["splits"].values() for s in sp["shards"]]
    same_views = ds.schema_version != 1 and ds.view_size == image_size
    quality = (m.get("view_quality", schema.VIEW_QUALITY) if same_views
               else schema.VIEW_QUALITY)
    writer = ShardWriter(
        out, records_per_shard=max(shard_sizes, default=0) or 1000, overwrite=overwrite,
        split_rule=m.get("split_rule", {}), view_size=image_size, keep_originals=keep_originals,
        view_quality=quality, validate_images=False,
        created=m.get("created"),
        manifest_extra={"converted_from": {
            "schema_version": ds.schema_version, "view_size": m.get("view_size"),
            "manifest_sha256": schema.file_sha256(os.path.join(ds.root, schema.MANIFEST))}})
    convert = functools.partial(_convert, view_size=image_size, keep_originals=keep_originals,
                                view_quality=quality)
    items = _records(ds, [split for split in schema.SPLITS if split in m["splits"]])
    pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else None
    try:
        with writer, tqdm(total=m.get("records"), desc="resharding", unit="record",
                          disable=not progress) as bar:
            while window := list(itertools.islice(items, 16 * workers)):
                converted = (pool.map(convert, window, chunksize=4) if pool
                             else map(convert, window))
                for record in converted:
                    writer.add(record)  # validated by `convert`; counted and written here
                    bar.update(1)
    finally:
        if pool is not None:
            pool.terminate()
    return writer.manifest
