"""Embeddings of a SCLARO split for the ScenarioCLIP evaluators (docs/design.md, section 3).

    emb = embed_dataset(model, "/data/sclaro", "test", image_size=224, cache_dir="/tmp/emb")

Views are training's eval-mode views (`sclaro_jax.data.pipeline.sample_views` with
`train=False`). Version-2 records (stored views): global = Resize + CenterCrop of the stored
`train_image`; object and relation = the stored S x S views (with ``object_view="canvas"``
the reference's black-canvas object views, made from the `train_image`); union boxes (PredCls /
SGCls) = Resize + CenterCrop of the union of the subject's and object's boxes cut from the
full-size photograph when the records keep the originals, else from the `train_image` with the
boxes scaled to it. Version-1 records: global = Resize + CenterCrop of the photograph; object =
the box crop (`augment.region_view`, or the black canvas) + Resize + CenterCrop; relation = the
focused-region image, Resize + CenterCrop; union boxes cut from the photograph. All uint8,
CLIP-normalised inside jit (`ops.normalize`, as the train step does). The stored views must be
of the requested `image_size` (a `DatasetError` naming the record and the reshard command
otherwise). Texts are CLIP-BPE tokenised, 32 tokens by default
as in training (the text tower is causal and pools at EOT, so padding length does not change an
embedding; only texts longer than 30 BPE tokens are cut). Unlike training, no cap on objects /
relations per image: every one is evaluated. Every embedding is the level's Linear + LayerNorm
head output, L2-normalised (`ops.l2_normalize`), float32; its pre-normalisation L2 norm is kept
too (`SplitEmbeddings.raw`). The encoding stack (jitted towers, fixed-size batches) is
`sclaro_jax.eval.encoders`'s, shared with MINER's encoders.

`ScenarioEvaluator` is the base of the registered ScenarioCLIP evaluators (`zero_shot`,
`linear_probe`, `predcls`, `sgcls`): it holds the embedding options and embeds the split it runs
on.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from sclaro_jax.data import augment, schema
from sclaro_jax.data.dataset import DatasetError, ShardedDataset, open_dataset
from sclaro_jax.data.pipeline import OBJECT_VIEWS, PipelineConfig, sample_views
from sclaro_jax.files import write_replacing
from sclaro_jax.eval.encoders import Batcher, towers
from sclaro_jax.eval.protocols import metrics, registry

log = logging.getLogger(__name__)

CACHE_VERSION = 1
DEFAULT_TEXT_LENGTH = 32
SCORE_ELEMENTS = 1 << 24  # query chunk size x classes per score block (64 MiB of float32)


# --------------------------------------------------------------------------- encoding

def _pair_fn(model, level: str, kind: str) -> Callable:
    image_fn, text_fn = towers(model.pair(level))
    return image_fn if kind == "image" else text_fn


def _embed_dim(model) -> int:
    return int(model.pair("global").vision_head.linear.out_features)


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from sclaro_jax.data.tokenizer import ClipTokenizer
    return ClipTokenizer()


def encode_texts(model, level: str, texts: Sequence[str], *, batch_size: int = 256,
                 text_length: int = DEFAULT_TEXT_LENGTH, progress: bool = False,
                 return_norms: bool = False):
    """Texts -> float32 [N, D]: `level`'s text encoder, head output L2-normalised; fixed-size
    jitted batches. With `return_norms`, also the pre-normalisation norms [N]."""
    texts = list(texts)
    batcher = Batcher(_pair_fn(model, level, "text"), batch_size)
    tok = _tokenizer()
    steps = range(0, len(texts), batch_size)
    for start in tqdm(steps, desc=f"encode {level} texts", unit="batch", disable=not progress,
                      leave=False):
        batcher.push(np.asarray(tok(texts[start:start + batch_size], length=text_length),
                                np.int32))
    emb, norm = batcher.result(_embed_dim(model))
    return (emb, norm) if return_norms else emb


def model_fingerprint(model) -> str:
    """sha256 (16 hex digits) of the model's class, parameter paths, shapes, dtypes and values:
    student and EMA-teacher weights of one checkpoint get different fingerprints."""
    h = hashlib.sha256(type(model).__name__.encode())
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    for path, value in leaves:
        value = np.asarray(value)
        h.update(f"{jax.tree_util.keystr(path)}:{value.shape}:{value.dtype}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- embeddings

_STR_FIELDS = ("image_ids", "sources", "actions", "object_names", "relation_texts",
               "relation_predicates", "relation_subject_names", "relation_object_names")
_INT_FIELDS = ("object_image", "relation_image", "relation_subject", "relation_object")
_EMB_FIELDS = ("global", "object", "relation", "union")


@dataclasses.dataclass
class SplitEmbeddings:
    """Everything the evaluators need from one split, in record order.

    Per image [I]: `image_ids`, `sources`, `actions`, `global_emb` (global pair).
    Per object [O] (all images' objects, image by image): `object_image` (index into the
    images), `object_names`, `object_emb` (object pair on the object view).
    Per relation [R]: `relation_image`, `relation_subject` / `relation_object` (indices into
    the objects arrays), `relation_texts` ("subject predicate object"), `relation_predicates`,
    `relation_subject_names`, `relation_object_names`, `relation_emb` (relation pair on the
    focused-region image) and `union_emb` (relation pair on the union of the subject and object
    boxes, for PredCls / SGCls).
    Each `*_emb` is L2-normalised float32 [N, D]; `*_norm` [N] is its norm before normalising
    (`raw(level)` gives the head output back).
    """
    split: str
    image_size: int
    object_view: str
    key: str
    image_ids: np.ndarray
    sources: np.ndarray
    actions: np.ndarray
    global_emb: np.ndarray
    global_norm: np.ndarray
    object_image: np.ndarray
    object_names: np.ndarray
    object_emb: np.ndarray
    object_norm: np.ndarray
    relation_image: np.ndarray
    relation_subject: np.ndarray
    relation_object: np.ndarray
    relation_texts: np.ndarray
    relation_predicates: np.ndarray
    relation_subject_names: np.ndarray
    relation_object_names: np.ndarray
    relation_emb: np.ndarray
    relation_norm: np.ndarray
    union_emb: np.ndarray
    union_norm: np.ndarray

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    def raw(self, level: str) -> np.ndarray:
        """The head output before L2 normalisation: level in global/object/relation/union."""
        if level not in _EMB_FIELDS:
            raise ValueError(f"level {level!r} is not one of {_EMB_FIELDS}")
        return getattr(self, f"{level}_emb") * getattr(self, f"{level}_norm")[:, None]

    def save(self, path: str) -> None:
        """Write an npz (atomically: a temporary file, then rename)."""
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        write_replacing(path, lambda f: np.savez(f, **arrays))

    @classmethod
    def load(cls, path: str) -> "SplitEmbeddings":
        with np.load(path, allow_pickle=False) as z:
            kw = {f.name: z[f.name] for f in dataclasses.fields(cls)}
        for name in ("split", "object_view", "key"):
            kw[name] = str(kw[name])
        kw["image_size"] = int(kw["image_size"])
        return cls(**kw)


def _union_box(a, b) -> tuple[float, float, float, float]:
    return (min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]))


def _record_views(record: bytes, where: str, config: PipelineConfig
                  ) -> tuple[schema.Sample, dict]:
    """One record -> (sample, uint8 views of its four streams): the input pipeline's eval
    views of every object and relation, plus each relation's union-of-boxes view."""
    try:
        sample = schema.decode(record)
        schema.validate(sample, decode_images=False)
        img, _, views = sample_views(sample, config)
        unions = _union_views(sample, img, config.image_size)
    except schema.RecordError as e:
        raise DatasetError(f"{where}: {e}") from None
    return sample, {"global": views["image"][None], "object": views["objects"],
                    "relation": views["relations"], "union": unions}


def _union_views(sample: schema.Sample, img, size: int) -> np.ndarray:
    """uint8 [R, S, S, 3]: Resize + CenterCrop of the union of each relation's subject and
    object boxes, cut from the full-size photograph when the record holds it (version 1, or
    version 2 written with originals), else from the stored `train_image` (`img`, the image
    `sample_views` made the global view from) with the boxes scaled to it; a small union box
    is then upsampled from fewer pixels than the photograph had."""
    if img.size != (sample.width, sample.height) and sample.image is not None:
        img = schema.decode_image(sample.image, f"sample {sample.id!r}: image",
                                  size=(sample.width, sample.height))
    sx, sy = img.size[0] / sample.width, img.size[1] / sample.height
    unions = np.zeros((len(sample.relations), size, size, 3), np.uint8)
    for k, r in enumerate(sample.relations):
        box = _union_box(sample.objects[r.subject].box, sample.objects[r.object].box)
        unions[k] = augment.region_view(img, augment.scale_box(box, sx, sy), size)
    return unions


def read_samples(data_dir: str | ShardedDataset, split: str) -> Iterator[schema.Sample]:
    """Every record of a split, decoded (images stay encoded), in order; a `DatasetError`
    naming the shard and record for one that does not decode (`ShardedDataset.samples`)."""
    ds = open_dataset(data_dir) if isinstance(data_dir, str) else data_dir
    return ds.samples(split)


def split_labels(data_dir: str | ShardedDataset, split: str) -> dict[str, list[str]]:
    """Labels of a split without decoding any image: {"actions", "objects", "relations",
    "predicates", "sources"} lists with one entry per image / object / relation."""
    out: dict[str, list[str]] = {k: [] for k in ("actions", "objects", "relations",
                                                  "predicates", "sources")}
    for s in read_samples(data_dir, split):
        out["actions"].append(s.action)
        out["sources"].append(s.source)
        out["objects"] += [o.name for o in s.objects]
        out["relations"] += [r.text for r in s.relations]
        out["predicates"] += [r.predicate for r in s.relations]
    return out


def _cache_key(fingerprint: str, ds: ShardedDataset, split: str, image_size: int,
               object_view: str, fast_decode: bool) -> str:
    shards = [s["sha256"] for s in ds.manifest["splits"][split]["shards"]]
    what = json.dumps({"v": CACHE_VERSION, "model": fingerprint, "split": split,
                       "shards": shards, "size": image_size, "object_view": object_view,
                       "fast_decode": fast_decode}, sort_keys=True)
    return hashlib.sha256(what.encode()).hexdigest()[:20]


def embed_dataset(model, data_dir: str | ShardedDataset, split: str, *, image_size: int,
                  batch_size: int = 32, cache_dir: str | None = None, progress: bool = True,
                  object_view: str = "crop", fast_decode: bool = True, workers: int = 4,
                  fingerprint: str | None = None) -> SplitEmbeddings:
    """Embed every record of `split` (see `SplitEmbeddings`; views as in the module docstring).

    Images, object crops, relation regions and union boxes go through their pair's jitted image
    encoder in fixed batches of `batch_size` (the last one zero-padded), so each compiles once.
    `workers` threads decode records and build views. With `cache_dir`, the result is stored as
    `scenario-<split>-<key>.npz`, key = sha256 of the model fingerprint (`model_fingerprint`,
    or `fingerprint` if given), the split's shard checksums and the view settings; a later call
    with the same key loads it instead of encoding.
    """
    if object_view not in OBJECT_VIEWS:
        raise ValueError(f"object_view {object_view!r} is not one of {OBJECT_VIEWS}")
    ds = open_dataset(data_dir) if isinstance(data_dir, str) else data_dir
    ds.paths(split)  # DatasetError naming the folder if the split does not exist
    key = ""
    path = None
    if cache_dir:
        key = _cache_key(fingerprint or model_fingerprint(model), ds, split, image_size,
                         object_view, fast_decode)
        path = os.path.join(cache_dir, f"scenario-{split}-{key}.npz")
        if os.path.exists(path):
            log.info("embeddings of %s/%s from %s", ds.root, split, path)
            return SplitEmbeddings.load(path)
    batchers = {level: Batcher(_pair_fn(model, "relation" if level == "union" else level,
                                         "image"), batch_size) for level in _EMB_FIELDS}
    meta: dict[str, list] = {k: [] for k in _STR_FIELDS + _INT_FIELDS}
    bar = tqdm(total=ds.num_records(split), desc=f"embed {split}", unit="img",
               disable=not progress)
    every = 1 << 62  # no cap on objects / relations per image
    config = PipelineConfig(image_size=image_size, train=False, object_view=object_view,
                            fast_decode=fast_decode, max_objects=every, max_relations=every)
    build = functools.partial(_record_views, config=config)
    records = ds.records(split)
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        while True:
            chunk = [r for _, r in zip(range(4 * max(1, workers)), records)]
            if not chunk:
                break
            for sample, views in pool.map(lambda wr: build(wr[1], wr[0]), chunk):
                image = len(meta["image_ids"])
                first = len(meta["object_names"])
                meta["image_ids"].append(sample.id)
                meta["sources"].append(sample.source)
                meta["actions"].append(sample.action)
                meta["object_names"] += [o.name for o in sample.objects]
                meta["object_image"] += [image] * len(sample.objects)
                for r in sample.relations:
                    meta["relation_image"].append(image)
                    meta["relation_subject"].append(first + r.subject)
                    meta["relation_object"].append(first + r.object)
                    meta["relation_texts"].append(r.text)
                    meta["relation_predicates"].append(r.predicate)
                    meta["relation_subject_names"].append(sample.objects[r.subject].name)
                    meta["relation_object_names"].append(sample.objects[r.object].name)
                for level, batcher in batchers.items():
                    batcher.push(views[level])
                bar.update(1)
    bar.close()
    dim = _embed_dim(model)
    arrays = {}
    for level, batcher in batchers.items():
        arrays[f"{level}_emb"], arrays[f"{level}_norm"] = batcher.result(dim)
    for k in _STR_FIELDS:
        arrays[k] = np.asarray(meta[k], dtype=str)
    for k in _INT_FIELDS:
        arrays[k] = np.asarray(meta[k], dtype=np.int64)
    emb = SplitEmbeddings(split=split, image_size=image_size, object_view=object_view, key=key,
                          **arrays)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        emb.save(path)
    return emb


# --------------------------------------------------------------------------- evaluator base

class ScenarioEvaluator(registry.Evaluator):
    """A ScenarioCLIP evaluator on a split of a SCLARO dataset folder: `run(model)` embeds the
    split (`embed_dataset`) and yields the items of `evaluate(model, embeddings)`.

    Options (besides the registry's): `batch_size` (images per encoder call), `text_batch_size`,
    `text_length`, `object_view`, `ks`, `cache_dir` / `fingerprint` (`embed_dataset`'s cache),
    `workers`, `train_split` (the split the linear probe trains on and SGCls takes its object
    vocabulary from), `progress`. `image_size` 0 means the global vision tower's."""

    def __init__(self, *, batch_size: int = 32, text_batch_size: int = 256,
                 text_length: int = DEFAULT_TEXT_LENGTH, object_view: str = "crop",
                 ks: Sequence[int] = metrics.DEFAULT_KS, cache_dir: str | None = None,
                 fingerprint: str | None = None, workers: int = 4, train_split: str = "train",
                 progress: bool = False, **common):
        super().__init__(**common)
        if object_view not in OBJECT_VIEWS:
            raise ValueError(f"evaluator {self.name!r}: object_view {object_view!r} is not one "
                             f"of {OBJECT_VIEWS}")
        self.batch_size, self.workers, self.progress = batch_size, workers, progress
        self.object_view, self.ks, self.train_split = object_view, tuple(ks), train_split
        self.cache_dir, self.fingerprint = cache_dir, fingerprint
        self.text_kw = dict(text_batch_size=text_batch_size, text_length=text_length,
                            progress=progress)

    def embed(self, model, split: str) -> SplitEmbeddings:
        size = self.image_size or int(model.pair("global").config.vision.image_size)
        return embed_dataset(model, self.data_dir, split, image_size=size,
                             batch_size=self.batch_size, cache_dir=self.cache_dir,
                             progress=self.progress, object_view=self.object_view,
                             workers=self.workers, fingerprint=self.fingerprint)

    def evaluate(self, model, test: SplitEmbeddings) -> dict:
        raise NotImplementedError

    def run(self, model) -> Iterator[tuple[str, Any]]:
        yield from self.evaluate(model, self.embed(model, self.split)).items()
