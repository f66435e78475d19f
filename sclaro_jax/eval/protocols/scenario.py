"""Every ScenarioCLIP protocol on one split, from Python (docs/design.md, section 3, appendix
"linear probing", "PredCls", "SGCls", Table A2).

    model, step = load_checkpoint(workdir, teacher=False)   # sclaro_jax.checkpoint
    result = evaluate_scenario(model, "/data/sclaro", cache_dir="/tmp/emb")
    print(report.markdown_tables(result))

The protocols are the registered evaluators (`sclaro_jax.eval.protocols.registry`), one module
each: `zero_shot` (`protocols.zero_shot`), `linear_probe` (`protocols.probe`), `predcls` and
`sgcls` (`protocols.scene_graph`); the split's views and embeddings are `protocols.embedding`'s.
Here the test split is embedded once and every evaluator asked for scores it.
"""

from __future__ import annotations

from typing import Sequence

from sclaro_jax.data.dataset import open_dataset
from sclaro_jax.eval.protocols import metrics, probe, registry, scene_graph, zero_shot  # noqa: F401
from sclaro_jax.eval.protocols.embedding import (DEFAULT_TEXT_LENGTH, SplitEmbeddings,
                                                 embed_dataset, model_fingerprint)

TASKS = ("zero_shot", "linear_probe", "predcls", "sgcls")


def header(ds_root: str, test: SplitEmbeddings, train_split: str, settings: dict) -> dict:
    """The result's description of what was evaluated (`report.markdown_tables`'s title)."""
    return {"dataset": ds_root, "split": test.split, "train_split": train_split,
            "num_images": test.num_images, "num_objects": int(len(test.object_names)),
            "num_relations": int(len(test.relation_texts)), "settings": settings}


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
    and return a JSON-serialisable dict (percentages; protocols in each evaluator's module):

        {"dataset", "split", "train_split", "num_images", "num_objects", "num_relations",
         "settings": {...}, "zero_shot": ..., "linear_probe": ..., "predcls": ..., "sgcls": ...}

    `model` is a ScenarioCLIP or PyramidCLIP (student or EMA teacher: `load_checkpoint(workdir,
    teacher=...)`). `image_size` defaults to the global vision tower's. The train split is
    embedded only for the linear probe, and only its labels are read for SGCls. `cache_dir`
    caches the split embeddings (`embedding.embed_dataset`); `fingerprint` overrides the model
    fingerprint used in the cache key (hashing a large model's weights takes a while).
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
    common = dict(data_dir=ds.root, image_size=image_size, split=split, batch_size=batch_size,
                  text_batch_size=text_batch_size, text_length=text_length,
                  object_view=object_view, ks=ks, cache_dir=cache_dir, fingerprint=fingerprint,
                  workers=workers, train_split=train_split, progress=progress)
    options = {"linear_probe": dict(epochs=probe_epochs, lr=probe_lr,
                                    weight_decay=probe_weight_decay,
                                    probe_batch_size=probe_batch_size, features=probe_features,
                                    seed=seed),
               "predcls": dict(min_instances=min_predicate_instances),
               "sgcls": dict(min_instances=min_predicate_instances)}
    evaluators = [registry.EVALUATORS[t](name=t, **common, **options.get(t, {})) for t in tasks]
    test = embed_dataset(model, ds, split, image_size=image_size, batch_size=batch_size,
                         cache_dir=cache_dir, progress=progress, object_view=object_view,
                         workers=workers, fingerprint=fingerprint)
    settings = {"image_size": image_size, "object_view": object_view, "ks": list(ks),
                "text_length": text_length, "min_predicate_instances": min_predicate_instances,
                "probe_epochs": probe_epochs, "probe_lr": probe_lr,
                "probe_weight_decay": probe_weight_decay, "probe_batch_size": probe_batch_size,
                "probe_features": probe_features, "seed": seed, "model": type(model).__name__}
    result = header(ds.root, test, train_split, settings)
    for ev in evaluators:
        result[ev.name] = ev.evaluate(model, test)
    return result
