"""Gallery embeddings (global view + crops) and query embeddings, computed once and cached.

`embed_split(encoder, split, crops)` decodes each gallery image once, makes its global view and
its crop views (`sclaro_jax.miner.crop_boxes`, each crop resized and preprocessed like the global
view, as MINER does), encodes them in fixed-size batches, and stores the result as float16 in
`cache_dir/<key>/`: one file per part of `part_size` images, written atomically, so an
interrupted run resumes from the last finished part (the files: `sclaro_jax.miner.index.cache`,
which also reads them for an index build). The key hashes the encoder's fingerprint
(model files, dtype), the split's fingerprint (image ids, captions) and the crop settings, so a
change in any of them computes anew.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from sclaro_jax import miner
from sclaro_jax.eval.encoders import Encoder
from sclaro_jax.eval.retrieval.data import RetrievalSplit
from sclaro_jax.miner.index import cache
from sclaro_jax.miner.index.cache import CACHE_VERSION

@dataclasses.dataclass(frozen=True)
class CropSpec:
    """Which crops each gallery image gets (`miner.crop_boxes` arguments)."""

    kind: str = "fixed5"
    ratio: float = 0.6
    n: int | None = None  # only for kind="random" (default 5)
    seed: int = 0
    shape: str = "aspect"  # the MINER authors' rule; "square": their earlier one

    def boxes(self, width: int, height: int, index: int = 0) -> np.ndarray:
        seed = self.seed * 1_000_003 + index  # random crops differ per image, reproducibly
        return np.asarray(miner.crop_boxes(width, height, self.kind, self.ratio, n=self.n,
                                           seed=seed, shape=self.shape))

    @property
    def rule(self) -> str:
        """The crop rule in words, as the cache's meta.json records it."""
        from sclaro_jax.miner.crops import RULES
        return RULES[self.shape]

    @property
    def count(self) -> int:
        return len(self.boxes(100, 100))


@dataclasses.dataclass
class GalleryEmbeddings:
    images: np.ndarray  # float16 [G, D], L2-normalised global views
    crops: np.ndarray | None  # float16 [G, R, D], or None without crops
    texts: np.ndarray  # float32 [Q, D]


def _views(encoder: Encoder, image: np.ndarray, crops: CropSpec | None, index: int) -> np.ndarray:
    views = [encoder.view(image)]
    if crops is not None:
        h, w = image.shape[:2]
        for crop in miner.crop_images(image, crops.boxes(w, h, index)):
            views.append(encoder.view(np.ascontiguousarray(crop)))
    return np.stack(views)


def cache_key(encoder: Encoder, split: RetrievalSplit, crops: CropSpec | None) -> str:
    what = json.dumps({"v": CACHE_VERSION, "encoder": encoder.fingerprint,
                       "split": split.fingerprint(),
                       "crops": None if crops is None else dataclasses.asdict(crops)},
                      sort_keys=True)
    return hashlib.sha256(what.encode()).hexdigest()[:20]


def embed_split(encoder: Encoder, split: RetrievalSplit, crops: CropSpec | None = CropSpec(),
                *, cache_dir: str | os.PathLike | None = None, part_size: int = 256,
                progress: bool = True, workers: int | None = None) -> GalleryEmbeddings:
    """Embed a split's gallery (global + crops) and its queries; cached when `cache_dir` is set.

    Image decoding and view resizing run in a thread pool (`workers`, default the CPU count);
    the encoder runs its fixed-size jitted batches.
    """
    folder = None
    if cache_dir is not None:
        folder = cache.open_folder(
            Path(cache_dir) / cache_key(encoder, split, crops),
            {"encoder": encoder.name, "split": split.name, "source": split.source,
             "images": split.num_images, "queries": len(split.queries),
             "crops": None if crops is None else dataclasses.asdict(crops),
             "crop_rule": None if crops is None else crops.rule})
    num_parts = -(-split.num_images // part_size)
    parts = []
    pool = concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1)
    bar = tqdm(total=split.num_images, desc=f"embed {split.name}", unit="img",
               disable=not progress)
    try:
        for p in range(num_parts):
            lo, hi = p * part_size, min((p + 1) * part_size, split.num_images)
            path = None if folder is None else cache.part_path(folder, p, num_parts)
            if path is not None and path.exists():
                parts.append(np.load(path))
                bar.update(hi - lo)
                continue
            views = list(pool.map(lambda i: _views(encoder, split.load_image(i), crops, i),
                                  range(lo, hi)))
            per_image = views[0].shape[0]
            emb = encoder.encode_views(np.concatenate(views))
            part = emb.reshape(hi - lo, per_image, -1).astype(np.float16)
            if path is not None:
                cache.save(path, part)
            parts.append(part)
            bar.update(hi - lo)
    finally:
        bar.close()
        pool.shutdown()
    gallery = np.concatenate(parts)
    texts_path = None if folder is None else cache.queries_path(folder)
    if texts_path is not None and texts_path.exists():
        texts = np.load(texts_path)
    else:
        texts = encoder.encode_texts(split.queries).astype(np.float32)
        if texts_path is not None:
            cache.save(texts_path, texts)
    return GalleryEmbeddings(np.ascontiguousarray(gallery[:, 0]),
                           np.ascontiguousarray(gallery[:, 1:]) if crops is not None else None,
                           texts)
