"""The batch contract: the field names of a ScenarioCLIP batch and their shapes.

`sclaro_jax.data.pipeline.collate` writes these fields, the train step reads them, and tests and
benchmarks build batches from `batch_shapes`; every one of them names the fields through this
module. Per image (leading axis B): `image` [B, S, S, 3] (uint8, or float32 CLIP-normalised),
`action_tokens` [B, L], `action_label`, `has_action`, `source`, `sample_key`, `valid`,
`bad_record`, `dropped_objects`, `dropped_relations`, and the photometric augmentation's
parameters, drawn on the host and applied on the accelerator (`PHOTOMETRIC`): `jitter` [B]
(apply ColorJitter to the global view), `jitter_order` [B, 4] (op indices in application
order: 0 brightness, 1 contrast, 2 saturation, 3 hue), `jitter_factors` [B, 4] (factor per op
index; hue is a shift in [-0.5, 0.5]), `blur_sigma` [B] (GaussianBlur sigma of the global view;
0 = none); `crop_jitter` [B] and `crop_jitter_order` [B, 4] (the one decision and order of all
the sample's object crops and relation regions), `object_jitter_factors` and
`relation_jitter_factors` [B, 4] (their factors at each level's strengths).
Per crop level (objects, relations), in one of two layouts (`packing.LAYOUTS`):
- "caps" (N the level's per-image cap): pixels [B, N, S, S, 3], tokens [B, N, L], labels [B, N]
  (-1 = padding) and a bool mask [B, N];
- "packed" (`sclaro_jax.data.packing`; K the batch's planned size): the crops of all images
  in one buffer, pixels [K, S, S, 3], tokens [K, L], labels [K], mask [K] and segments [K]
  (the image index of each crop, -1 for padding).
"""

from __future__ import annotations

import dataclasses

import numpy as np

IMAGE = "image"
ACTION_TOKENS = "action_tokens"
ACTION_LABEL = "action_label"
HAS_ACTION = "has_action"
SOURCE = "source"
SAMPLE_KEY = "sample_key"
VALID = "valid"
BAD_RECORD = "bad_record"
DROPPED_OBJECTS = "dropped_objects"
DROPPED_RELATIONS = "dropped_relations"
JITTER = "jitter"
JITTER_ORDER = "jitter_order"
JITTER_FACTORS = "jitter_factors"
BLUR_SIGMA = "blur_sigma"
CROP_JITTER = "crop_jitter"
CROP_JITTER_ORDER = "crop_jitter_order"
OBJECT_JITTER_FACTORS = "object_jitter_factors"
RELATION_JITTER_FACTORS = "relation_jitter_factors"


@dataclasses.dataclass(frozen=True)
class LevelFields:
    """The batch fields of one level (`mask` is None for the global level: its rows are the
    images, masked by `valid` and `has_action`)."""
    pixels: str
    tokens: str
    labels: str
    mask: str | None = None
    dropped: str | None = None
    segments: str | None = None  # packed layout: the image index of each crop


LEVEL_FIELDS = {
    "global": LevelFields(IMAGE, ACTION_TOKENS, ACTION_LABEL),
    "object": LevelFields("objects", "object_tokens", "object_labels", "object_mask",
                          DROPPED_OBJECTS, "object_segments"),
    "relation": LevelFields("relations", "relation_tokens", "relation_labels", "relation_mask",
                            DROPPED_RELATIONS, "relation_segments"),
}
CROP_LEVELS = ("object", "relation")

# (field, dtype) of the per-image scalars, in the order collate stacks them.
PER_IMAGE = ((ACTION_LABEL, np.int32), (HAS_ACTION, np.bool_), (SOURCE, np.int32),
             (SAMPLE_KEY, np.int64), (VALID, np.bool_), (BAD_RECORD, np.int32),
             (DROPPED_OBJECTS, np.int32), (DROPPED_RELATIONS, np.int32))

# (field, dtype, shape after B) of the photometric augmentation parameters; an example without
# augmentation has jitter=False, the identity order, factors (1, 1, 1, 0) and blur_sigma=0
# (and the same for the crop levels' fields).
PHOTOMETRIC = ((JITTER, np.bool_, ()), (JITTER_ORDER, np.int32, (4,)),
               (JITTER_FACTORS, np.float32, (4,)), (BLUR_SIGMA, np.float32, ()),
               (CROP_JITTER, np.bool_, ()), (CROP_JITTER_ORDER, np.int32, (4,)),
               (OBJECT_JITTER_FACTORS, np.float32, (4,)),
               (RELATION_JITTER_FACTORS, np.float32, (4,)))
IDENTITY_PHOTOMETRIC = {JITTER: np.bool_(False), JITTER_ORDER: np.arange(4, dtype=np.int32),
                        JITTER_FACTORS: np.array([1, 1, 1, 0], np.float32),
                        BLUR_SIGMA: np.float32(0), CROP_JITTER: np.bool_(False),
                        CROP_JITTER_ORDER: np.arange(4, dtype=np.int32),
                        OBJECT_JITTER_FACTORS: np.array([1, 1, 1, 0], np.float32),
                        RELATION_JITTER_FACTORS: np.array([1, 1, 1, 0], np.float32)}


def packed_layout(config) -> bool:
    """Whether a PipelineConfig makes packed batches."""
    return getattr(config, "layout", "caps") == "packed"


def level_caps(config) -> dict[str, int]:
    """Crop level -> the most crops one image gives: `max_objects` / `max_relations` of a
    PipelineConfig, or with the packed layout its sizes' largest per-image counts."""
    if packed_layout(config):
        if config.packed is None:
            raise ValueError("layout='packed' without its sizes: make_loader plans them from "
                             "the split (sclaro_jax.data.packing.plan)")
        return config.packed.caps()
    return {"object": config.max_objects, "relation": config.max_relations}


def batch_shapes(batch_size: int, config, tier: int = 0) -> dict[str, tuple]:
    """The shape of every field of a batch for a PipelineConfig (image_size, text_length,
    max_objects, max_relations; layout and packed sizes): the same every step with caps, one
    set per `tier` of the packed sizes."""
    b, size, length = batch_size, config.image_size, config.text_length
    shapes = {name: (b,) for name, _ in PER_IMAGE}
    shapes[IMAGE] = (b, size, size, 3)
    shapes[ACTION_TOKENS] = (b, length)
    for name, _, tail in PHOTOMETRIC:
        shapes[name] = (b, *tail)
    for level, cap in level_caps(config).items():
        f = LEVEL_FIELDS[level]
        if packed_layout(config):
            k = config.packed.slots(level, tier)
            shapes.update({f.pixels: (k, size, size, 3), f.tokens: (k, length), f.labels: (k,),
                           f.mask: (k,), f.segments: (k,)})
            continue
        shapes[f.pixels] = (b, cap, size, size, 3)
        shapes[f.tokens] = (b, cap, length)
        shapes[f.labels] = (b, cap)
        shapes[f.mask] = (b, cap)
    return shapes


def batch_specs(batch_size: int, config, tier: int = 0) -> dict[str, tuple[tuple, np.dtype]]:
    """Field -> (shape, dtype) of a batch of `batch_shapes`: what `collate` writes, so a step
    can be compiled for every batch it will see before the first one exists."""
    dtypes = {name: np.dtype(dtype) for name, dtype in PER_IMAGE}
    dtypes.update({name: np.dtype(dtype) for name, dtype, _ in PHOTOMETRIC})
    pixels = np.dtype(np.float32 if getattr(config, "pixels", "uint8") == "float32" else np.uint8)
    for f in LEVEL_FIELDS.values():
        dtypes[f.pixels], dtypes[f.tokens] = pixels, np.dtype(np.int32)
        dtypes.setdefault(f.labels, np.dtype(np.int32))
        if f.mask:
            dtypes[f.mask], dtypes[f.segments] = np.dtype(np.bool_), np.dtype(np.int32)
    return {name: (shape, dtypes[name])
            for name, shape in batch_shapes(batch_size, config, tier).items()}
