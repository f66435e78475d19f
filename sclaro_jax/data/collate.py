"""Examples -> one batch: the caps layout ([B, N] per crop level) or the packed layout (every
crop of the batch in one buffer of a planned size; `sclaro_jax.data.packing`).

Stored views (`StoredViews`, a version-2 record's JPEGs) are decoded straight into the batch's
own rows, in either layout: the pixels are written once. `Collate` is Grain's batch function; in
Grain's worker processes it allocates the pixel arrays in shared memory.
"""

from __future__ import annotations

import logging
from typing import Sequence

import grain.python as grain
import numpy as np

from sclaro_jax import ops
from sclaro_jax.data import augment, batch as fields, decode, packing, schema

log = logging.getLogger("sclaro_jax.data.pipeline")


class StoredViews:
    """One crop level's stored S x S views of a version-2 sample, still encoded: `decode_into`
    decodes them straight into an array's first len(self) rows (`collate` passes the batch's
    own rows, so the pixels are written once)."""

    __slots__ = ("data", "whats", "backend")

    def __init__(self, data: Sequence[bytes], whats: Sequence[str], backend: str):
        self.data, self.whats, self.backend = data, whats, backend

    def __len__(self) -> int:
        return len(self.data)

    def decode_into(self, out: np.ndarray) -> np.ndarray:
        for k, (data, what) in enumerate(zip(self.data, self.whats)):
            decode.decode_array(data, what, out=out[k], backend=self.backend)
        return out

    def decode(self, size: int) -> np.ndarray:
        """uint8 [len(self), size, size, 3]."""
        return self.decode_into(np.empty((len(self), size, size, 3), np.uint8))


def empty_example(config) -> dict:
    """The example a bad record becomes: no objects or relations, valid=False, bad_record=1."""
    size, length = config.image_size, config.text_length
    example = {name: np.zeros((), dtype) for name, dtype in fields.PER_IMAGE}
    example.update({fields.IMAGE: np.zeros((size, size, 3), np.uint8),
                    fields.ACTION_TOKENS: np.zeros((length,), np.int32),
                    fields.ACTION_LABEL: np.int32(-1), fields.SOURCE: np.int32(-1),
                    fields.SAMPLE_KEY: np.int64(-1), fields.BAD_RECORD: np.int32(1)})
    example.update(augment.photometric_fields(augment.SampleParams(None, None, None)))
    for level in fields.CROP_LEVELS:
        f = fields.LEVEL_FIELDS[level]
        example[f.pixels] = np.zeros((0, size, size, 3), np.uint8)
        example[f.tokens] = np.zeros((0, length), np.int32)
        example[f.labels] = np.zeros((0,), np.int32)
    return example


def _put(dst: np.ndarray, src) -> None:
    """Write views (an array, or `StoredViews` decoded in place) into the batch's rows; float32
    batches get them CLIP-normalised (`ops.normalize`), one view at a time while it is in cache
    (padding stays 0.0, i.e. the mean colour)."""
    if dst.dtype == np.uint8:
        if isinstance(src, StoredViews):
            src.decode_into(dst)
        else:
            dst[...] = src
        return
    if isinstance(src, StoredViews):
        src = src.decode(dst.shape[-2])
    for d, x in zip(dst.reshape(-1, *dst.shape[-3:]), src.reshape(-1, *src.shape[-3:])):
        d[...] = ops.normalize(x)


def _crop_rows(batch: dict, level: str, i: int, start: int, n: int, packed: bool) -> np.ndarray:
    """The rows of the batch's `level` pixels that example `i`'s n crops go to."""
    pixels = batch[fields.LEVEL_FIELDS[level].pixels]
    return pixels[start:start + n] if packed else pixels[i, :n]


def _per_image(batch: dict, examples: Sequence[dict]) -> None:
    batch.update({name: np.stack([e[name] for e in examples]) for name, _ in fields.PER_IMAGE})
    batch[fields.ACTION_TOKENS] = np.stack([e[fields.ACTION_TOKENS] for e in examples])
    for name, dtype, _ in fields.PHOTOMETRIC:
        batch[name] = np.stack([e[name] for e in examples]).astype(dtype, copy=False)


def _allocate(examples, config, allocate) -> tuple[dict, dict]:
    """(batch with zero-filled pixel arrays, level -> start row of every example's crops: in
    the packed buffer, or 0 with caps, where each example has its own row)."""
    b, size = len(examples), config.image_size
    dtype = np.float32 if config.pixels == "float32" else np.uint8
    batch = {fields.IMAGE: allocate((b, size, size, 3), dtype)}
    counts = {level: np.array([len(e[fields.LEVEL_FIELDS[level].labels]) for e in examples], np.int64)
              for level in fields.CROP_LEVELS}
    if not fields.packed_layout(config):
        for level, cap in fields.level_caps(config).items():
            batch[fields.LEVEL_FIELDS[level].pixels] = allocate((b, cap, size, size, 3), dtype)
        return batch, {level: np.zeros(b, np.int64) for level in counts}
    sizes = config.packed
    tier = sizes.tier(*(int(counts[level].sum()) for level in fields.CROP_LEVELS))
    for level in fields.CROP_LEVELS:
        batch[fields.LEVEL_FIELDS[level].pixels] = allocate((sizes.slots(level, tier), size, size, 3),
                                                      dtype)
    return batch, {level: np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
                   for level, n in counts.items()}


def _decode_all(batch: dict, examples: list, starts: dict, packed: bool) -> int | None:
    """Decode every example's views into the batch; the index of the first example whose view
    does not decode (None when all did)."""
    for i, e in enumerate(examples):
        try:
            _put(batch[fields.IMAGE][i], e[fields.IMAGE])
            for level in fields.CROP_LEVELS:
                f = fields.LEVEL_FIELDS[level]
                n = len(e[f.labels])
                _put(_crop_rows(batch, level, i, int(starts[level][i]), n, packed), e[f.pixels])
        except schema.RecordError as err:
            log.warning("skipping a bad record: %s", err)
            return i
    return None


def collate(examples: Sequence[dict], config, *, allocate=np.zeros) -> dict:
    """Examples -> one batch with the shapes of `sclaro_jax.data.batch.batch_shapes`
    (`config` a PipelineConfig; packed: the tier that holds the batch's crops).

    Stored views (`StoredViews`) are decoded straight into the batch; an example whose view
    does not decode becomes `empty_example` (valid=False, bad_record=1; a warning names it).
    `allocate(shape, dtype)` makes the zero-filled pixel arrays (`Collate` passes Grain's
    shared memory in worker processes)."""
    examples = list(examples)
    packed = fields.packed_layout(config)
    while True:
        batch, starts = _allocate(examples, config, allocate)
        bad = _decode_all(batch, examples, starts, packed)
        if bad is None:
            break
        # the bad example's crops leave the batch: lay the batch out again without them
        examples[bad] = empty_example(config)
    _per_image(batch, examples)
    b, length = len(examples), config.text_length
    for level, cap in fields.level_caps(config).items():
        f = fields.LEVEL_FIELDS[level]
        rows = len(batch[f.pixels]) if packed else cap
        shape = (rows,) if packed else (b, cap)
        tokens = np.zeros(shape + (length,), np.int32)
        labels = np.full(shape, -1, np.int32)
        mask = np.zeros(shape, bool)
        segments = np.full(shape, packing.PAD_SEGMENT, np.int32)
        for i, e in enumerate(examples):
            n, start = len(e[f.labels]), int(starts[level][i])
            at = np.s_[start:start + n] if packed else np.s_[i, :n]
            tokens[at] = e[f.tokens]
            labels[at] = e[f.labels]
            mask[at] = True
            segments[at] = i
        batch.update({f.tokens: tokens, f.labels: labels, f.mask: mask})
        if packed:
            batch[f.segments] = segments
    return batch


class Collate:
    """`collate` as Grain's batch function. In Grain's worker processes Grain asks it
    (`enable_shared_memory_output`) to allocate the pixel arrays in shared memory, so a batch
    reaches the training process without being copied again."""

    def __init__(self, config):
        self.config = config
        self.shared = False

    def enable_shared_memory_output(self) -> None:
        self.shared = True

    def __call__(self, examples: Sequence[dict]) -> dict:
        return collate(examples, self.config,
                       allocate=grain.SharedMemoryArray if self.shared else np.zeros)
