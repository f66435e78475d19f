"""Grain input pipeline: SCLARO ArrayRecord shards -> static-shape ScenarioCLIP batches.

    ds = open_dataset("/data/sclaro")
    loader = make_loader(ds, "train", batch_size=128, seed=42, worker_count=8)
    it = iter(loader)
    batch = next(it)             # dict of numpy arrays, the same shapes every step
    state = it.get_state()       # bytes; `it.set_state(state)` resumes exactly there

Per sample (one record), on the host: geometry only. The sample's augmentation parameters
(`augment.sample_params`: every view's draws as the reference makes them, from one stream per
sample drawn with Grain's per-record rng from the seed and the record's position). Version-2
records (stored views): the global view is RandomResizedCrop (train) or Resize + CenterCrop
(eval) of the stored `train_image`; the object and relation views are the stored S x S JPEGs,
decoded by `collate` straight into the batch (`sclaro_jax.data.decode`: simplejpeg when
installed, else PIL). Version-1 records (originals): every view made from the photograph and the
focused regions (box crops or the reference's black-canvas paste, Resize + CenterCrop), as
before views were stored. The photometric part (ColorJitter, GaussianBlur) is applied on the
accelerator: each example carries its draw as the `batch.PHOTOMETRIC` fields (identity when not
training). Texts are tokenised with the CLIP BPE (action word, object names, "subject predicate
object"), memoised per worker.

Static shapes (`sclaro_jax.data.batch`), in one of two crop layouts (`PipelineConfig.layout`):
- "caps" (the default here; evaluators, notebooks): objects [B, max_objects, S, S, 3] and
  relations [B, max_relations, ...] with boolean masks; objects/relations beyond the caps are
  dropped and counted (`dropped_objects`, `dropped_relations`; the train step logs their batch
  sums);
- "packed" (the trainer's default, `sclaro_jax.data.packing`): per level every crop of the
  batch in one buffer [K, S, S, 3] with the image index of each crop (`*_segments`) and a mask;
  K is the smallest of at most three sizes planned from the split's counts that holds the
  batch, so no crop is dropped and little is padding.
The padding of both is measured by bench/bench_padding.py.

Pixels come out as uint8 (normalise on the accelerator with `normalize`, i.e.
`sclaro_jax.ops.normalize`; a quarter of the host-to-device bytes) or, for evaluation and
benchmarks (`train=False` only: the photometric augmentation needs uint8), with
`pixels="float32"`, CLIP-normalised on the host (padding slots are then 0.0).

An image whose action is "" (the VLM gave none; the appendix keeps such images) has
`has_action=False`, `action_label=-1` and all-zero action tokens: it still feeds the object and
relation levels and the vision distillation terms, but not the global contrastive loss or the
text distillation terms, whose student is the action text.

Bad records never stop a run: a record that does not decode (a stored view included), is of
another schema version, has views of another size, or has a box outside its image or a
relation index out of range becomes an example with
`valid=False` and `bad_record=1` (masked out of every loss and summed into the metrics), and the
worker logs a warning naming the record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Sequence

import grain.python as grain
import numpy as np

from sclaro_jax import ops
from sclaro_jax.data import augment, batch as fields, decode, packing, schema
from sclaro_jax.data.collate import Collate, StoredViews, collate, empty_example  # noqa: F401
from sclaro_jax.data.dataset import ShardedDataset, Vocab, open_dataset
from sclaro_jax.data.sampler import GlobalBatchSampler

log = logging.getLogger(__name__)

OBJECT_VIEWS = ("crop", "canvas")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    image_size: int = 224
    max_objects: int = 10  # the VLM prompt asks for at most 10 objects per image
    max_relations: int = 8
    # Text length: CLIP's text tower is causal and pools at the EOT token, so padding length
    # does not change any embedding; 32 tokens hold every label we have seen (77 = CLIP's max).
    text_length: int = 32
    train: bool = True  # RandomResizedCrop (train) or deterministic Resize + CenterCrop (eval)
    object_view: str = "crop"  # "crop" (the paper) or "canvas" (the reference code)
    pixels: str = "uint8"  # "uint8" or, with train=False only, "float32" (CLIP-normalised)
    fast_decode: bool = True  # v1: JPEG relation regions decoded at reduced scale (>= size)
    decoder: str = "auto"  # JPEG decoder (`decode.BACKENDS`): simplejpeg when installed
    # Crop layout (`packing.LAYOUTS`): "caps" ([B, max_objects] / [B, max_relations]) or
    # "packed" (every crop of the batch in one buffer per level; max_objects / max_relations
    # are then unused: the sizes' own per-image maxima apply). `make_loader` plans `packed`
    # from the split's count histograms when it is None.
    layout: str = "caps"
    packed: packing.PackedSizes | None = None

    def __post_init__(self):
        if self.layout not in packing.LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {packing.LAYOUTS}")
        if self.packed is not None and self.layout != "packed":
            raise ValueError("PipelineConfig: packed sizes given with layout='caps'")
        if self.object_view not in OBJECT_VIEWS:
            raise ValueError(f"object_view {self.object_view!r} is not one of {OBJECT_VIEWS}")
        if self.pixels not in ("uint8", "float32"):
            raise ValueError(f"pixels {self.pixels!r} is not 'uint8' or 'float32'")
        if self.pixels == "float32" and self.train:
            raise ValueError(
                "pixels='float32' with train=True: photometric augmentation runs on the "
                "accelerator on uint8 pixels (sclaro_jax.data.photometric), so training "
                "batches are uint8 (normalise inside the step with `normalize`); float32 "
                "host normalisation is for evaluation (train=False)")
        if min(self.max_objects, self.max_relations) < 1 or self.text_length < 3:
            raise ValueError("max_objects, max_relations must be >= 1 and text_length >= 3")
        decode.backend_name(self.decoder)  # ValueError naming an unknown / missing decoder


def sample_key(sample_id: str) -> int:
    """A non-negative int64 naming a sample in batches (first 63 bits of sha256 of its id)."""
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "little") >> 1


class _TextTable:
    """Token ids per label string, memoised; the tokenizer is built lazily in each worker."""

    def __init__(self, length: int):
        self.length = length
        self._tok = None
        self._cache: dict[str, np.ndarray] = {}

    def __getstate__(self):
        return {"length": self.length, "_tok": None, "_cache": {}}

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if missing:
            if self._tok is None:
                from sclaro_jax.data.tokenizer import ClipTokenizer
                self._tok = ClipTokenizer()
            for t, ids in zip(missing, self._tok(missing, length=self.length)):
                self._cache[t] = ids
        if not texts:
            return np.zeros((0, self.length), np.int32)
        return np.stack([self._cache[t] for t in texts])


def _taken(sample: schema.Sample, config: PipelineConfig) -> tuple[tuple, tuple]:
    """The objects and relations of `sample` that its example carries (those past the level's
    per-image cap are dropped and counted)."""
    caps = fields.level_caps(config)
    return sample.objects[:caps["object"]], sample.relations[:caps["relation"]]


def sample_views(sample: schema.Sample, config: PipelineConfig,
                 rng: np.random.Generator | None = None):
    """A decoded record -> (image, params, {"image": global view [S, S, 3], "objects":
    [O, S, S, 3], "relations": [R, S, S, 3]}): uint8 views at `config.image_size` of the first
    `max_objects` objects and `max_relations` relations, the global view randomly cropped with
    `rng` when `config.train`. Geometry only: the photometric part of `params` is applied on the
    accelerator (`augment.photometric_fields`).

    Version-2 records: object and relation views are the stored ones (decoded, already S x S);
    the global view is RandomResizedCrop (train) or Resize + CenterCrop (eval) of the stored
    `train_image`; with ``object_view="canvas"`` the reference's black-canvas object views are
    made from the `train_image` with the boxes scaled to it (its shorter side is >= S, so this
    still only downsamples). Version-1 records: every view made from the originals (the
    photograph, the relation regions), as before views were stored.

    `image` is the PIL image the global view was made from (v2: the `train_image`, v1: the
    photograph) and `params` the `augment.SampleParams` (crop drawn on that image's size), for
    callers that make more views of the same image (the evaluators' union boxes). Raises
    `schema.RecordError` for an undecodable image or views of another size than S."""
    if not sample.has_views:
        return _original_views(sample, config, rng)
    img, params, views = _stored_views(sample, config, rng)
    return img, params, {k: v.decode(config.image_size) if isinstance(v, StoredViews) else v
                         for k, v in views.items()}


def _stored_views(sample: schema.Sample, config: PipelineConfig, rng):
    """`sample_views` of a version-2 record, with the stored views left as `StoredViews`."""
    size, where, backend = config.image_size, f"sample {sample.id!r}", config.decoder
    if sample.view_size != size:
        raise schema.RecordError(
            f"{where}: its stored views are {sample.view_size} px and the pipeline's image_size "
            f"is {size}: convert the dataset with `python -m data_prep reshard --image-size "
            f"{size}` (dataset.check_view_size names the command)")
    width, height = schema.train_image_size(sample.width, sample.height, sample.view_size)
    params = augment.sample_params(rng, width, height, train=config.train)
    img = decode.decode_image(sample.train_image, f"{where}: train_image", size=(width, height),
                              backend=backend)
    objects, relations = _taken(sample, config)
    photo = (sample.width, sample.height)
    if config.object_view == "crop":
        obj_views = StoredViews([o.view for o in objects],
                                [f"{where}: object {k} ({o.name!r}) view"
                                 for k, o in enumerate(objects)], backend)
    else:
        sx, sy = width / sample.width, height / sample.height
        obj_views = np.empty((len(objects), size, size, 3), np.uint8)
        for k, o in enumerate(objects):
            obj_views[k] = augment.canvas_view(img, augment.scale_box(o.box, sx, sy), size, photo)
    rel_views = StoredViews([r.view for r in relations],
                            [f"{where}: relation {k} ({r.text!r}) view"
                             for k, r in enumerate(relations)], backend)
    return img, params, {"image": augment.global_view(img, params, size, photo),
                         "objects": obj_views, "relations": rel_views}


def _original_views(sample: schema.Sample, config: PipelineConfig, rng):
    img = schema.decode_image(schema.original_image(sample), f"sample {sample.id!r}: image",
                              size=(sample.width, sample.height))
    params = augment.sample_params(rng, *img.size, train=config.train)
    size = config.image_size
    objects, relations = _taken(sample, config)
    view = augment.region_view if config.object_view == "crop" else augment.canvas_view
    obj_pixels = np.zeros((len(objects), size, size, 3), np.uint8)
    for k, o in enumerate(objects):
        obj_pixels[k] = view(img, o.box, size)
    rel_pixels = np.zeros((len(relations), size, size, 3), np.uint8)
    for k, r in enumerate(relations):
        region = schema.decode_image(r.region, f"sample {sample.id!r}: relation {k} region",
                                     size=img.size,
                                     min_side=size if config.fast_decode else None)
        rel_pixels[k] = augment.region_view(region, None, size)
    return img, params, {"image": augment.global_view(img, params, size),
                         "objects": obj_pixels, "relations": rel_pixels}


class SampleTransform(grain.RandomMapTransform):
    """Record bytes -> one example with variable-length object/relation views (arrays, or a
    version-2 record's `StoredViews`, which `collate` decodes into the batch) and the sample's
    photometric draw (`augment.photometric_fields`)."""

    def __init__(self, config: PipelineConfig, vocab: Vocab):
        self.config = config
        self.vocab = vocab
        self.text = _TextTable(config.text_length)

    def random_map(self, record: bytes, rng: np.random.Generator) -> dict:
        try:
            return self._example(record, rng)
        except schema.RecordError as e:
            log.warning("skipping a bad record: %s", e)
            return empty_example(self.config)

    def _example(self, record: bytes, rng: np.random.Generator) -> dict:
        c = self.config
        sample = schema.decode(record)
        schema.validate(sample, decode_images=False)
        if sample.has_views:  # stored views stay encoded until collate decodes them
            _, params, views = _stored_views(sample, c, rng)
        else:
            _, params, views = _original_views(sample, c, rng)
        objects, relations = _taken(sample, c)
        objects_field, relations_field = fields.LEVEL_FIELDS["object"], fields.LEVEL_FIELDS["relation"]
        return {
            fields.IMAGE: views["image"],
            fields.ACTION_TOKENS: self.text([sample.action])[0] if sample.action else
            np.zeros((c.text_length,), np.int32),
            fields.ACTION_LABEL: np.int32(self.vocab.index("actions", sample.action)),  # "": -1
            fields.HAS_ACTION: np.bool_(bool(sample.action)),
            objects_field.pixels: views["objects"],
            objects_field.tokens: self.text([o.name for o in objects]),
            objects_field.labels: np.array([self.vocab.index("objects", o.name)
                                            for o in objects], np.int32),
            relations_field.pixels: views["relations"],
            relations_field.tokens: self.text([r.text for r in relations]),
            relations_field.labels: np.array([self.vocab.index("relations", r.text)
                                              for r in relations], np.int32),
            fields.SOURCE: np.int32(self.vocab.index("sources", sample.source)),
            fields.SAMPLE_KEY: np.int64(sample_key(sample.id)),
            fields.VALID: np.bool_(True),
            fields.BAD_RECORD: np.int32(0),
            fields.DROPPED_OBJECTS: np.int32(len(sample.objects) - len(objects)),
            fields.DROPPED_RELATIONS: np.int32(len(sample.relations) - len(relations)),
            **augment.photometric_fields(params),
        }


def make_loader(dataset: ShardedDataset | str, split: str, batch_size: int, *,
                config: PipelineConfig = PipelineConfig(), seed: int = 0,
                shuffle: bool | None = None, num_epochs: int | None = None,
                worker_count: int = 0, worker_buffer_size: int = 2, read_threads: int = 1,
                read_buffer: int = 16,
                shard_options: grain.ShardOptions | None = None) -> grain.DataLoader:
    """A Grain DataLoader over one split; iterate it for batches, checkpoint its iterator.

    `batch_size` is per host. Host `shard_options.shard_index` of `shard_count` (by default
    `jax.process_index()` of `jax.process_count()`) reads its slice of every global batch
    (`sampler.GlobalBatchSampler`: the global batches do not depend on the number of hosts).
    `shuffle` defaults to True for "train". `num_epochs=None` repeats forever. Augmentation
    randomness is derived from `seed` and the record's position, so it is reproducible and
    restored with the iterator state.

    `worker_count` processes make the batches (0: this process), each keeping
    `worker_buffer_size` batches ready (in shared memory: a batch of 128 with 8 + 8 views at
    224 px is 330 MB, so 15 workers hold up to 10 GB); in each, `read_threads` threads read records ahead, at most
    `read_buffer` of them (`grain.ReadOptions`; Grain's own default of 16 threads and 500
    records costs CPU per batch, the prefetch queue being scanned for every record, and
    memory: 500 records of 8 + 8 views are ~230 MB per worker). bench/bench_input.py --tune
    measures these. The dataset's views must be `config.image_size` px
    (`ShardedDataset.check_view_size`: a `ViewSizeError` naming the reshard command
    otherwise). With `config.layout="packed"` and no `config.packed`, the packed sizes are
    planned for `batch_size` from the split's count histograms (`packing.plan`).
    """
    if isinstance(dataset, str):
        dataset = open_dataset(dataset)
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    dataset.check_view_size(config.image_size)
    if fields.packed_layout(config) and config.packed is None:
        config = dataclasses.replace(config, packed=packing.plan(
            *packing.split_histograms(dataset, split), batch_size))
        log.info("packed crop layout for %r at batch %d: %s", split, batch_size,
                 config.packed.describe())
    elif fields.packed_layout(config) and config.packed.batch_size != batch_size:
        raise ValueError(f"packed sizes planned for batch {config.packed.batch_size}, the "
                         f"loader's batch is {batch_size}")
    source = dataset.source(split)
    if shard_options is None:
        shard_options = grain.ShardByJaxProcess(drop_remainder=True)
    if len(source) < shard_options.shard_count:
        raise ValueError(f"split {split!r} of {dataset.root} has {len(source)} records, fewer "
                         f"than the {shard_options.shard_count} hosts reading it")
    if worker_count > 0:
        from absl import flags
        if not flags.FLAGS.is_parsed():  # Grain's worker processes read absl flags
            flags.FLAGS.mark_as_parsed()
    sampler = GlobalBatchSampler(  # the same global batches on any number of hosts
        len(source), shard_options, batch_size, worker_count, num_epochs=num_epochs, seed=seed,
        shuffle=(split == "train") if shuffle is None else shuffle)
    operations = [SampleTransform(config, dataset.vocab),
                  grain.Batch(batch_size, drop_remainder=True, batch_fn=Collate(config))]
    return grain.DataLoader(
        data_source=source, sampler=sampler, operations=operations,
        worker_count=worker_count, worker_buffer_size=worker_buffer_size,
        shard_options=shard_options,
        read_options=grain.ReadOptions(num_threads=read_threads,
                                       prefetch_buffer_size=read_buffer))


normalize = ops.normalize  # uint8 -> CLIP-normalised float32, inside jit too (docs/data.md uses it)
