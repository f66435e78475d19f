"""ScenarioCLIP evaluators over a trained model and a SCLARO dataset folder (DESIGN.md section 3,
appendix "linear probing", "PredCls", "SGCls", Table A2).

    model, step = load_checkpoint(workdir, teacher=False)   # or teacher=True: the EMA teacher
    result = evaluate_scenario(model, "/data/sclaro", cache_dir="/tmp/emb")
    print(markdown_tables(result))

Views are training's eval-mode views (`sclaro_jax.data.pipeline` with `train=False`):
global = Resize + CenterCrop of the image; object = the box crop (`augment.region_view`, or the
reference's black canvas with ``object_view="canvas"``) + Resize + CenterCrop; relation = the
stored focused-region image, Resize + CenterCrop; all uint8, CLIP-normalised inside jit
(`augment.normalize_jnp`, as the train step does). Texts are CLIP-BPE tokenised, 32 tokens by
default as in training (the text tower is causal and pools at EOT, so padding length does not
change an embedding; only texts longer than 30 BPE tokens are cut). Unlike training, no cap on
objects / relations per image: every one is evaluated. Every embedding is the level's
Linear + LayerNorm head output, L2-normalised, float32; its pre-normalisation L2 norm is kept
too (`SplitEmbeddings.raw`).

Protocols (all numbers are percentages; the tie rule of every ranking is `metrics`'s: equal
scores are ordered by lower class index):

- Zero-shot (`zero_shot`): every class string of the dataset folder's vocabulary file
  (`actions.txt`, `objects.txt`, `relations.txt`) encoded by that level's text encoder, no
  template; queries ranked by cosine similarity. Action: each test image's global embedding vs
  all actions. Object: each object crop (object pair) vs all object names. Relation: each
  relation's focused-region image (relation pair) vs all relation triplets. Top-1/5/10 accuracy,
  strict (the query's own label) and, for objects and relations, lenient (a hit when any top-k
  label is one of the labels of the query's image, as the reference counts); overall and per
  source dataset (Table A2).
- Linear probe (`linear_probe`): frozen encoders; a Linear(D -> C) on the train split's
  embeddings, C = the classes present in the train split for that task (action / object /
  relation); `epochs` 6, AdamW lr 2e-5 (betas 0.9/0.999, eps 1e-8) weight decay 5e-4 on weight
  and bias (torch's single parameter group), batch 128 shuffled per epoch (the last, smaller
  batch averages over its own examples), mean cross-entropy; torch's nn.Linear initialisation.
  Top-1/5/10 on the test split; test labels absent from the train split can never be predicted
  and count as misses (reported as `unseen_test`).
- PredCls (`predcls`): predicate vocabulary P = predicates with >= `min_instances` (5) test
  relation instances; relations with another predicate are left out. For each relation, the
  relation image encoder embeds the union of the subject and object boxes (cropped from the
  image, Resize + CenterCrop: `SplitEmbeddings.union_emb`); the relation text encoder embeds
  "subject predicate object" for every predicate in P with the ground-truth names; predicates
  are ranked by cosine; mean Recall@1/5/10 over predicates (and the micro R@K).
- SGCls (`sgcls`): object vocabulary = the object names of the train split; each test object
  crop is classified (top-1) against their object-pair text embeddings; the predicted names
  replace the ground truth in the prompts; predicates ranked as in PredCls. mR@K counts a hit
  when the true predicate is in the top K (the appendix's wording); `graph_mR@K` additionally
  requires both objects to be classified correctly (the scene-graph convention of Xu et al.).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from sclaro_jax.data import augment, schema
from sclaro_jax.data.dataset import DatasetError, ShardedDataset, Vocab, open_dataset
from sclaro_jax.eval import metrics, registry

log = logging.getLogger(__name__)

CACHE_VERSION = 1
TASKS = ("zero_shot", "linear_probe", "predcls", "sgcls")
OBJECT_VIEWS = ("crop", "canvas")
DEFAULT_TEXT_LENGTH = 32
_SCORE_ELEMENTS = 1 << 24  # query chunk size x classes per score block (64 MiB of float32)


# --------------------------------------------------------------------------- encoding

def _l2_with_norm(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = x.astype(jnp.float32)
    n = jnp.linalg.norm(x, axis=-1)
    return x / jnp.maximum(n, 1e-12)[..., None], n


@functools.partial(jax.jit, static_argnums=0)
def _image_fn(graphdef, state, pixels):
    pair = nnx.merge(graphdef, state)
    return _l2_with_norm(pair.encode_image(augment.normalize_jnp(pixels)))


@functools.partial(jax.jit, static_argnums=0)
def _text_fn(graphdef, state, ids):
    pair = nnx.merge(graphdef, state)
    return _l2_with_norm(pair.encode_text(ids))


class _Batcher:
    """Feeds arrays to a jitted encoder in fixed-size batches (the last one zero-padded), so it
    compiles once per shape; `result()` -> (L2-normalised [N, D], norms [N])."""

    def __init__(self, fn: Callable, batch_size: int):
        self.fn, self.batch_size = fn, batch_size
        self.pending: list[np.ndarray] = []
        self.count = 0
        self.out: list[tuple] = []

    def push(self, x: np.ndarray) -> None:
        if len(x):
            self.pending.append(x)
            self.count += len(x)
        while self.count >= self.batch_size:
            self._run(self.batch_size)

    def _run(self, n: int) -> None:
        x = np.concatenate(self.pending)
        batch, rest = x[:n], x[n:]
        if n < self.batch_size:
            batch = np.concatenate([batch, np.zeros((self.batch_size - n,) + batch.shape[1:],
                                                   batch.dtype)])
        emb, norm = self.fn(batch)
        self.out.append((emb, norm, n))  # device arrays: the host keeps preparing views
        self.pending = [rest] if len(rest) else []
        self.count = len(rest)

    def result(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        if self.count:
            self._run(self.count)
        if not self.out:
            return np.zeros((0, dim), np.float32), np.zeros((0,), np.float32)
        emb = np.concatenate([np.asarray(e)[:n] for e, _, n in self.out]).astype(np.float32)
        norm = np.concatenate([np.asarray(m)[:n] for _, m, n in self.out]).astype(np.float32)
        return emb, norm


def _pair_fn(model, level: str, kind: str) -> Callable:
    graphdef, state = nnx.split(model.pair(level))
    fn = _image_fn if kind == "image" else _text_fn
    return lambda x: fn(graphdef, state, x)


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
    batcher = _Batcher(_pair_fn(model, level, "text"), batch_size)
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
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)

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


def _record_views(record: bytes, where: str, size: int, object_view: str,
                  fast_decode: bool) -> tuple[schema.Sample, dict]:
    """One record -> (sample, uint8 views of its four streams)."""
    try:
        sample = schema.decode(record)
        schema.validate(sample, decode_images=False)
        img = schema.decode_image(sample.image, f"{where} ({sample.id!r}): image",
                                  size=(sample.width, sample.height))
    except schema.RecordError as e:
        raise DatasetError(f"{where}: {e}") from None
    params = augment.sample_params(None, *img.size, train=False)
    view = augment.region_view if object_view == "crop" else augment.canvas_view
    objects = np.zeros((len(sample.objects), size, size, 3), np.uint8)
    for k, o in enumerate(sample.objects):
        objects[k] = view(img, o.box, params, size)
    relations = np.zeros((len(sample.relations), size, size, 3), np.uint8)
    unions = np.zeros_like(relations)
    for k, r in enumerate(sample.relations):
        try:
            region = schema.decode_image(
                r.region, f"{where} ({sample.id!r}): relation {k} region", size=img.size,
                min_side=size if fast_decode else None)
        except schema.RecordError as e:
            raise DatasetError(str(e)) from None
        relations[k] = augment.region_view(region, None, params, size)
        box = _union_box(sample.objects[r.subject].box, sample.objects[r.object].box)
        unions[k] = augment.region_view(img, box, params, size)
    return sample, {"global": augment.global_view(img, params, size)[None],
                    "object": objects, "relation": relations, "union": unions}


def _read_records(ds: ShardedDataset, split: str):
    """(where, record bytes) for every record of a split, in order."""
    import grain.python as grain

    for path in ds.paths(split):
        source = grain.ArrayRecordDataSource([path])
        for i in range(len(source)):
            yield f"{path} record {i}", source[i]


def split_labels(data_dir: str | ShardedDataset, split: str) -> dict[str, list[str]]:
    """Labels of a split without decoding any image: {"actions", "objects", "relations",
    "predicates", "sources"} lists with one entry per image / object / relation."""
    ds = open_dataset(data_dir) if isinstance(data_dir, str) else data_dir
    out: dict[str, list[str]] = {k: [] for k in ("actions", "objects", "relations",
                                                  "predicates", "sources")}
    for where, record in _read_records(ds, split):
        try:
            s = schema.decode(record)
        except schema.RecordError as e:
            raise DatasetError(f"{where}: {e}") from None
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
    batchers = {level: _Batcher(_pair_fn(model, "relation" if level == "union" else level,
                                         "image"), batch_size) for level in _EMB_FIELDS}
    meta: dict[str, list] = {k: [] for k in _STR_FIELDS + _INT_FIELDS}
    bar = tqdm(total=ds.num_records(split), desc=f"embed {split}", unit="img",
               disable=not progress)
    build = functools.partial(_record_views, size=image_size, object_view=object_view,
                              fast_decode=fast_decode)
    records = _read_records(ds, split)
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


# --------------------------------------------------------------------------- zero-shot

def _label_indices(names: Iterable[str], vocab: Vocab, kind: str, root: str) -> np.ndarray:
    idx = np.asarray([vocab.index(kind, n) for n in names], np.int64)
    bad = np.flatnonzero(idx < 0)
    if bad.size:
        missing = sorted({list(names)[i] for i in bad[:5]})
        raise DatasetError(f"{os.path.join(root, schema.VOCAB_FILES[kind])}: labels of the "
                           f"split are not in the vocabulary, e.g. {missing}")
    return idx


def _chunked_hits(queries: np.ndarray, classes: np.ndarray, labels: np.ndarray | None,
                  allowed: Sequence | None, ks: Sequence[int]) -> dict[int, np.ndarray]:
    """Cosine scores queries @ classes.T in query chunks -> strict (labels) or lenient
    (allowed) top-k hits."""
    n = len(queries)
    rows = max(1, _SCORE_ELEMENTS // max(1, len(classes)))
    out = {k: np.zeros(n, bool) for k in ks}
    for start in range(0, n, rows):
        s = queries[start:start + rows] @ classes.T
        if allowed is None:
            h = metrics.topk_hits(s, labels[start:start + rows], ks)
        else:
            h = metrics.lenient_topk_hits(s, allowed[start:start + rows], ks)
        for k in ks:
            out[k][start:start + rows] = h[k]
    return out


def _report(hits: dict[int, np.ndarray], groups: np.ndarray) -> dict:
    return {"all": metrics.summarise(hits), "by_source": metrics.summarise_by_group(hits, groups)}


def zero_shot(model, emb: SplitEmbeddings, vocab: Vocab, *, root: str = "",
              ks: Sequence[int] = metrics.DEFAULT_KS, text_batch_size: int = 256,
              text_length: int = DEFAULT_TEXT_LENGTH, progress: bool = False) -> dict:
    """Zero-shot retrieval of actions, objects and relations (module docstring). Returns
    {"action": {"classes", "strict"}, "object" / "relation": {"classes", "strict", "lenient"}},
    each form {"all": {"n", "top1", ...}, "by_source": {source: {...}}}."""
    ks = tuple(ks)
    out = {}
    acted = np.flatnonzero(emb.actions != "")  # images without an action have no class
    tasks = (("action", "global", "actions", emb.global_emb[acted], emb.actions[acted], acted),
             ("object", "object", "objects", emb.object_emb, emb.object_names, emb.object_image),
             ("relation", "relation", "relations", emb.relation_emb, emb.relation_texts,
              emb.relation_image))
    for task, level, kind, queries, names, image in tasks:
        class_names = getattr(vocab, kind)
        labels = _label_indices(names, vocab, kind, root)
        text = encode_texts(model, level, class_names, batch_size=text_batch_size,
                            text_length=text_length, progress=progress)
        groups = emb.sources[image] if len(image) else np.zeros(0, str)
        res = {"classes": len(class_names),
               "strict": _report(_chunked_hits(queries, text, labels, None, ks), groups)}
        if task != "action":  # one action per image: lenient == strict
            per_image: dict[int, set] = {}
            for i, y in zip(image.tolist(), labels.tolist()):
                per_image.setdefault(i, set()).add(y)
            allowed = [per_image[i] for i in image.tolist()]
            res["lenient"] = _report(_chunked_hits(queries, text, None, allowed, ks), groups)
        out[task] = res
    return out


# --------------------------------------------------------------------------- linear probe

def linear_probe(train_x: np.ndarray, train_y: Sequence, test_x: np.ndarray, test_y: Sequence,
                 *, epochs: int = 6, lr: float = 2e-5, weight_decay: float = 5e-4,
                 batch_size: int = 128, ks: Sequence[int] = metrics.DEFAULT_KS,
                 seed: int = 0) -> dict:
    """Train Linear(D -> C) on frozen features (module docstring) and report test top-k.

    `train_y` / `test_y` are labels of any sortable kind (class names); C = the sorted distinct
    train labels. Returns {"classes": C, "n_train", "unseen_test", "n", "top1", ...}.
    """
    train_x = np.asarray(train_x, np.float32)
    test_x = np.asarray(test_x, np.float32)
    train_y, test_y = np.asarray(train_y), np.asarray(test_y)
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise ValueError("features and labels differ in length")
    if len(train_x) == 0:
        raise ValueError("linear probe: the train split has no examples for this task")
    classes = np.unique(train_y)
    c, d = len(classes), train_x.shape[1]
    y_train = np.searchsorted(classes, train_y).astype(np.int32)
    seen, y_test = metrics.restrict_to_classes(test_y, classes)

    rng = np.random.default_rng(seed)
    bound = 1.0 / math.sqrt(d)  # torch nn.Linear: U(-1/sqrt(in), 1/sqrt(in)) for both
    params = {"w": jnp.asarray(rng.uniform(-bound, bound, (d, c)), jnp.float32),
              "b": jnp.asarray(rng.uniform(-bound, bound, (c,)), jnp.float32)}
    tx = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
    opt_state = tx.init(params)
    x_dev, y_dev = jnp.asarray(train_x), jnp.asarray(y_train)

    @jax.jit  # the features are arguments, not closed-over constants baked into the program
    def step(params, opt_state, x_all, y_all, idx, mask):
        def loss_fn(p):
            logits = x_all[idx] @ p["w"] + p["b"]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y_all[idx])
            return jnp.sum(ce * mask) / jnp.sum(mask)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    n = len(train_x)
    for _ in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            mask = np.zeros(batch_size, np.float32)
            mask[:len(idx)] = 1
            idx = np.concatenate([idx, np.zeros(batch_size - len(idx), idx.dtype)])
            params, opt_state, _ = step(params, opt_state, x_dev, y_dev, idx, mask)

    logits = test_x @ np.asarray(params["w"]) + np.asarray(params["b"])
    ks = tuple(ks)
    hits = {k: np.zeros(len(test_x), bool) for k in ks}
    if seen.any():
        h = metrics.topk_hits(logits[seen], y_test[seen], ks)
        for k in ks:
            hits[k][seen] = h[k]
    return {"classes": int(c), "n_train": int(n), "unseen_test": int((~seen).sum()),
            **metrics.summarise(hits)}


def probe_tasks(train: SplitEmbeddings, test: SplitEmbeddings, *, features: str = "raw",
                **kwargs) -> dict:
    """`linear_probe` for action (global), object and relation (focused region) embeddings.
    `features`: "raw" (the frozen encoder's head output) or "l2" (L2-normalised)."""
    if features not in ("raw", "l2"):
        raise ValueError(f"features {features!r} is not 'raw' or 'l2'")

    def x(e: SplitEmbeddings, level: str) -> np.ndarray:
        return e.raw(level) if features == "raw" else getattr(e, f"{level}_emb")

    out = {}
    for task, level, labels in (("action", "global", "actions"),
                                ("object", "object", "object_names"),
                                ("relation", "relation", "relation_texts")):
        xs, ys = [], []
        for e in (train, test):
            x_e, y_e = x(e, level), getattr(e, labels)
            if task == "action":  # images without an action have no class
                x_e, y_e = x_e[y_e != ""], y_e[y_e != ""]
            xs.append(x_e)
            ys.append(y_e)
        out[task] = linear_probe(xs[0], ys[0], xs[1], ys[1], **kwargs)
    return out


# --------------------------------------------------------------------------- PredCls / SGCls

def predicate_ranks(model, union_emb: np.ndarray, subject_names: Sequence[str],
                    object_names: Sequence[str], true_predicates: np.ndarray,
                    predicates: Sequence[str], *, text_batch_size: int = 256,
                    text_length: int = DEFAULT_TEXT_LENGTH, block_texts: int = 16384,
                    progress: bool = False) -> np.ndarray:
    """int64 [R]: rank (0 = best, `metrics` tie rule) of each relation's true predicate (index
    into `predicates`) when the relation text encoder embeds "subject p object" for every p in
    `predicates` and they are scored by cosine against `union_emb`. Prompts are built once per
    distinct (subject, object) pair, encoded `block_texts` at a time."""
    r = len(union_emb)
    ranks = np.zeros(r, np.int64)
    if r == 0:
        return ranks
    pairs: dict[tuple[str, str], list[int]] = {}
    for i, (s, o) in enumerate(zip(subject_names, object_names)):
        pairs.setdefault((str(s), str(o)), []).append(i)
    items = list(pairs.items())
    per_block = max(1, block_texts // max(1, len(predicates)))
    blocks = range(0, len(items), per_block)
    for start in tqdm(blocks, desc="predicate prompts", unit="block", disable=not progress,
                      leave=False):
        block = items[start:start + per_block]
        prompts = [schema.triplet_text(s, p, o) for (s, o), _ in block for p in predicates]
        text = encode_texts(model, "relation", prompts, batch_size=text_batch_size,
                            text_length=text_length)
        text = text.reshape(len(block), len(predicates), -1)
        for j, (_, rows) in enumerate(block):
            rows = np.asarray(rows)
            scores = union_emb[rows] @ text[j].T
            ranks[rows] = metrics.true_class_rank(scores, true_predicates[rows])
    return ranks


def _predicate_vocab(emb: SplitEmbeddings, min_instances: int):
    predicates = metrics.frequent_classes(emb.relation_predicates, min_instances)
    keep, labels = metrics.restrict_to_classes(emb.relation_predicates, predicates)
    return [str(p) for p in predicates], keep, labels


def _recall_report(ranks: np.ndarray, labels: np.ndarray, ks, predicates, keep,
                   extra_hit: np.ndarray | None = None) -> dict:
    hits = {k: ranks < k for k in ks}
    out = {"predicates": len(predicates), "relations_total": int(len(keep)),
           **metrics.mean_recall_at_k(None, labels, ks, hits=hits)}
    if extra_hit is not None:
        graph = metrics.mean_recall_at_k(None, labels, ks,
                                         hits={k: h & extra_hit for k, h in hits.items()})
        out.update({f"graph_{k}": v for k, v in graph.items() if k.startswith(("mR@", "R@"))})
    return out


def predcls(model, emb: SplitEmbeddings, *, min_instances: int = 5,
            ks: Sequence[int] = metrics.DEFAULT_KS, text_batch_size: int = 256,
            text_length: int = DEFAULT_TEXT_LENGTH, progress: bool = False) -> dict:
    """PredCls (module docstring): {"predicates", "relations_total", "n" (relations kept),
    "classes", "mR@K", "R@K"}."""
    ks = tuple(ks)
    predicates, keep, labels = _predicate_vocab(emb, min_instances)
    ranks = predicate_ranks(model, emb.union_emb[keep], emb.relation_subject_names[keep],
                            emb.relation_object_names[keep], labels[keep], predicates,
                            text_batch_size=text_batch_size, text_length=text_length,
                            progress=progress)
    return {"min_instances": min_instances,
            **_recall_report(ranks, labels[keep], ks, predicates, keep)}


def sgcls(model, emb: SplitEmbeddings, object_vocab: Sequence[str], *, min_instances: int = 5,
          ks: Sequence[int] = metrics.DEFAULT_KS, text_batch_size: int = 256,
          text_length: int = DEFAULT_TEXT_LENGTH, progress: bool = False) -> dict:
    """SGCls (module docstring). `object_vocab`: the train split's object names (deduplicated
    and sorted here). Adds "object_top1" (object classification accuracy, %) and the
    `graph_mR@K` / `graph_R@K` variant to PredCls's keys."""
    ks = tuple(ks)
    vocab = sorted(set(str(v) for v in object_vocab))
    if not vocab:
        raise ValueError("SGCls: the object vocabulary (train split object names) is empty")
    text = encode_texts(model, "object", vocab, batch_size=text_batch_size,
                        text_length=text_length, progress=progress)
    pred = np.zeros(len(emb.object_emb), np.int64)
    rows = max(1, _SCORE_ELEMENTS // len(vocab))
    for start in range(0, len(pred), rows):
        pred[start:start + rows] = metrics.topk_predictions(
            emb.object_emb[start:start + rows] @ text.T, 1)[:, 0]
    names = np.asarray(vocab, dtype=str)[pred] if len(pred) else np.zeros(0, str)
    correct = names == emb.object_names
    predicates, keep, labels = _predicate_vocab(emb, min_instances)
    subj, obj = emb.relation_subject[keep], emb.relation_object[keep]
    ranks = predicate_ranks(model, emb.union_emb[keep], names[subj], names[obj], labels[keep],
                            predicates, text_batch_size=text_batch_size,
                            text_length=text_length, progress=progress)
    return {"min_instances": min_instances, "object_classes": len(vocab),
            "object_top1": float(100.0 * correct.mean()) if len(correct) else None,
            **_recall_report(ranks, labels[keep], ks, predicates, keep,
                             extra_hit=correct[subj] & correct[obj])}


# --------------------------------------------------------------------------- all together

def evaluate_scenario(model, data_dir: str, *, split: str = "test", train_split: str = "train",
                      tasks: Sequence[str] = TASKS, image_size: int | None = None,
                      batch_size: int = 32, text_batch_size: int = 256,
                      text_length: int = DEFAULT_TEXT_LENGTH, object_view: str = "crop",
                      ks: Sequence[int] = metrics.DEFAULT_KS, min_predicate_instances: int = 5,
                      probe_epochs: int = 6, probe_lr: float = 2e-5,
                      probe_weight_decay: float = 5e-4, probe_batch_size: int = 128,
                      probe_features: str = "raw", seed: int = 0, cache_dir: str | None = None,
                      fingerprint: str | None = None, workers: int = 4,
                      progress: bool = True) -> dict:
    """Run the evaluators in `tasks` (any of TASKS) on `split` of the dataset folder `data_dir`
    and return a JSON-serialisable dict (percentages; protocols in the module docstring):

        {"dataset", "split", "train_split", "num_images", "num_objects", "num_relations",
         "settings": {...}, "zero_shot": ..., "linear_probe": ..., "predcls": ..., "sgcls": ...}

    `model` is a ScenarioCLIP or PyramidCLIP (student or EMA teacher: `load_checkpoint(workdir,
    teacher=...)`). `image_size` defaults to the global vision tower's. The train split is
    embedded only for the linear probe, and only its labels are read for SGCls. `cache_dir`
    caches the split embeddings (`embed_dataset`); `fingerprint` overrides the model fingerprint
    used in the cache key (hashing a large model's weights takes a few seconds).
    """
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; known: {TASKS}")
    ds = open_dataset(data_dir)
    if image_size is None:
        image_size = int(model.pair("global").config.vision.image_size)
    if cache_dir and fingerprint is None:
        fingerprint = model_fingerprint(model)
    ks = tuple(ks)
    embed = functools.partial(embed_dataset, model, ds, image_size=image_size,
                              batch_size=batch_size, cache_dir=cache_dir, progress=progress,
                              object_view=object_view, workers=workers, fingerprint=fingerprint)
    text_kw = dict(text_batch_size=text_batch_size, text_length=text_length, progress=progress)
    test = embed(split)
    result: dict = {
        "dataset": ds.root, "split": split, "train_split": train_split,
        "num_images": test.num_images, "num_objects": int(len(test.object_names)),
        "num_relations": int(len(test.relation_texts)),
        "settings": {"image_size": image_size, "object_view": object_view, "ks": list(ks),
                     "text_length": text_length, "min_predicate_instances":
                         min_predicate_instances, "probe_epochs": probe_epochs,
                     "probe_lr": probe_lr, "probe_weight_decay": probe_weight_decay,
                     "probe_batch_size": probe_batch_size, "probe_features": probe_features,
                     "seed": seed, "model": type(model).__name__},
    }
    if "zero_shot" in tasks:
        result["zero_shot"] = zero_shot(model, test, ds.vocab, root=ds.root, ks=ks, **text_kw)
    if "linear_probe" in tasks:
        train = embed(train_split)
        result["linear_probe"] = probe_tasks(
            train, test, features=probe_features, epochs=probe_epochs, lr=probe_lr,
            weight_decay=probe_weight_decay, batch_size=probe_batch_size, ks=ks, seed=seed)
    if "predcls" in tasks:
        result["predcls"] = predcls(model, test, min_instances=min_predicate_instances, ks=ks,
                                    **text_kw)
    if "sgcls" in tasks:
        names = split_labels(ds, train_split)["objects"]
        result["sgcls"] = sgcls(model, test, names, min_instances=min_predicate_instances,
                                ks=ks, **text_kw)
    return result


# --------------------------------------------------------------------------- markdown

def _fmt(v) -> str:
    return "—" if v is None else f"{v:.2f}"


def markdown_tables(result: dict) -> str:
    """The result of `evaluate_scenario` as Markdown tables: zero-shot (strict / lenient),
    zero-shot top-1 by source dataset (appendix Table A2 layout), linear probe, PredCls and
    SGCls."""
    ks = result.get("settings", {}).get("ks", list(metrics.DEFAULT_KS))
    top = [f"top{k}" for k in ks]
    parts = [f"Evaluation of {result.get('settings', {}).get('model', 'model')} on "
             f"{result.get('split')} ({result.get('num_images')} images, "
             f"{result.get('num_objects')} objects, {result.get('num_relations')} relations)"]
    zs = result.get("zero_shot")
    if zs:
        lines = ["| Task | Form | Classes | N | " + " | ".join(f"Top-{k}" for k in ks) + " |",
                 "|---|---|---:|---:|" + "---:|" * len(ks)]
        for task in ("action", "object", "relation"):
            for form in ("strict", "lenient"):
                if form in zs.get(task, {}):
                    a = zs[task][form]["all"]
                    lines.append(f"| {task} | {form} | {zs[task]['classes']} | {a['n']} | "
                                 + " | ".join(_fmt(a.get(t)) for t in top) + " |")
        parts.append("### Zero-shot retrieval\n\n" + "\n".join(lines))
        sources = sorted({s for t in zs.values() for s in t["strict"]["by_source"]})
        head = ["Source"] + [f"{t.capitalize()} {form} Top-{k}"
                             for t in ("action", "object", "relation")
                             for form in (("strict",) if t == "action" else
                                          ("strict", "lenient"))
                             for k in ks]
        lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for s in sources:
            row = [s]
            for t in ("action", "object", "relation"):
                for form in (("strict",) if t == "action" else ("strict", "lenient")):
                    g = zs[t][form]["by_source"].get(s, {})
                    row += [_fmt(g.get(x)) for x in top]
            lines.append("| " + " | ".join(row) + " |")
        parts.append("### Zero-shot retrieval by source (Table A2 layout)\n\n" + "\n".join(lines))
    lp = result.get("linear_probe")
    if lp:
        lines = ["| Task | Classes (train) | N test | Unseen in train | "
                 + " | ".join(f"Top-{k}" for k in ks) + " |",
                 "|---|---:|---:|---:|" + "---:|" * len(ks)]
        for task, r in lp.items():
            lines.append(f"| {task} | {r['classes']} | {r['n']} | {r['unseen_test']} | "
                         + " | ".join(_fmt(r.get(t)) for t in top) + " |")
        parts.append("### Linear probe\n\n" + "\n".join(lines))
    rows = [(name, result[name]) for name in ("predcls", "sgcls") if result.get(name)]
    if rows:
        lines = ["| Protocol | Predicates | Relations kept / total | "
                 + " | ".join(f"mR@{k}" for k in ks) + " | "
                 + " | ".join(f"R@{k}" for k in ks) + " |",
                 "|---|---:|---:|" + "---:|" * (2 * len(ks))]
        for name, r in rows:
            lines.append(f"| {name} | {r['predicates']} | {r['n']} / {r['relations_total']} | "
                         + " | ".join(_fmt(r.get(f"mR@{k}")) for k in ks) + " | "
                         + " | ".join(_fmt(r.get(f"R@{k}")) for k in ks) + " |")
            if name == "sgcls":
                lines.append(f"| sgcls (objects correct) | {r['predicates']} | {r['n']} / "
                             f"{r['relations_total']} | "
                             + " | ".join(_fmt(r.get(f"graph_mR@{k}")) for k in ks) + " | "
                             + " | ".join(_fmt(r.get(f"graph_R@{k}")) for k in ks) + " |")
        text = "### PredCls / SGCls\n\n" + "\n".join(lines)
        if result.get("sgcls"):
            text += (f"\n\nSGCls object classification top-1: "
                     f"{_fmt(result['sgcls']['object_top1'])} "
                     f"({result['sgcls']['object_classes']} train object classes)")
        parts.append(text)
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------- registry

class _ScenarioTask(registry.Evaluator):
    """One of TASKS on a split of the run's dataset, through `evaluate_scenario`."""

    def __init__(self, **options):
        known = {"name", "every", "data_dir", "image_size", "split"}
        self.options = {k: options.pop(k) for k in list(options) if k not in known}
        super().__init__(**options)

    def run(self, model):
        result = evaluate_scenario(model, self.data_dir, split=self.split, tasks=(self.kind,),
                                   image_size=self.image_size, progress=False, **self.options)
        yield from result[self.kind].items()


for _task in TASKS:
    registry.register(_task)(type(f"{_task.title().replace('_', '')}Evaluator",
                                  (_ScenarioTask,), {}))
