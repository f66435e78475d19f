"""Evaluate trained ScenarioCLIP / baseline checkpoints: every protocol, one JSON, one table.

    python -m sclaro_jax.eval.suite --workdir WORKDIR [--config configs/scenarioclip.py:demo]
    python -m sclaro_jax.eval.suite --workdir ScenarioCLIP=RUN1 --workdir "w/o KD"=RUN2 \
        --workdir PyramidCLIP=RUN3 --data DATASET --out results/

For each model (a training workdir: its config.json, or `--config`, and its newest checkpoint,
or `--step`; the student, or the EMA teacher with `--teacher`) on `--split` of the dataset
(`--data`, default the run's `config.data.dir`):

- zero-shot retrieval of actions, objects and relations, strict and lenient, by source
  (`sclaro_jax.eval.protocols.zero_shot`), the linear probe (`protocols.probe`), PredCls and
  SGCls (`protocols.scene_graph`);
- relation localisation, frozen and trainable decoders (`sclaro_jax.eval.protocols.localise`);
- figures (`sclaro_jax.eval.protocols.figures`): patch-to-CLS attention overlays of the first
  test images, every model side by side; a t-SNE of the object embeddings per model; training
  curves per run;
- the parameter / FLOPs table (`sclaro_jax.eval.protocols.cost`, appendix Table A1).

Writes OUT/eval.json (every number and setting), OUT/eval.md (the tables) and OUT/figures/*.png
(OUT defaults to the first workdir's `eval/`). The protocols are the registered evaluators
(`sclaro_jax.eval.protocols.registry`), built from a `config.evals` this module writes from its
settings, the same list training runs periodically from the run's own `config.evals`. Callable
from Python too (`evaluate_workdirs`).

To run LAION's CLIP_benchmark on an exported level instead, write the split as a CLIP_benchmark
webdataset with `python -m sclaro_jax.export.wds` (no trained run needed) and evaluate it with
`python -m data_prep.clip_benchmark eval --model_type sclaro ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from sclaro_jax import cli
from sclaro_jax.config import CODE_NOTE, load_config
from sclaro_jax.files import write_text_file

log = logging.getLogger(__name__)

TASKS = ("zero_shot", "linear_probe", "predcls", "sgcls", "localisation")


@dataclasses.dataclass
class Settings:
    split: str = "test"
    train_split: str = "train"
    tasks: tuple = TASKS
    # tasks that must run: one the data cannot support is an error (the command line's
    # --tasks); the others are skipped when it cannot, said in one line each
    required: tuple = ()
    teacher: bool = False
    step: int | None = None
    probe_epochs: int = 6
    probe_lr: float = 2e-5
    probe_tasks: tuple | None = None  # the linear probe's (action, object, relation): all
    min_predicate_instances: int = 5
    localisation_variants: tuple = ("frozen", "trainable")
    localisation_epochs: int = 1
    localisation_max_relations: int | None = None
    figures: bool = True
    figure_images: int = 3
    tsne_max_objects: int = 10000
    cost: bool = True
    batch_size: int = 32
    progress: bool = True


def _data_dir(config, workdir: str, data: str | None) -> str:
    if data:
        return data
    if config is not None and config.data.dir:
        return config.data.dir
    demo = os.path.join(workdir, "demo_data")  # launch/train.py's demo shards
    if os.path.exists(os.path.join(demo, "manifest.json")):
        return demo
    raise FileNotFoundError(f"no dataset: {workdir}'s config has an empty data.dir; pass --data")


def _run_config(workdir: str, config_spec: str | None):
    """`--config` when given, else the run's own config.json."""
    from sclaro_jax.checkpoint import run_config

    return load_config(config_spec) if config_spec else run_config(workdir)


def _test_images(data_dir: str, split: str, count: int) -> list[np.ndarray]:
    """The first `count` full-size photographs of a split (the attention overlays);
    `schema.MissingOriginalsError` naming the dataset when its records do not keep them."""
    from sclaro_jax import bounds
    from sclaro_jax.data import schema
    from sclaro_jax.eval.protocols.embedding import read_samples

    out = []
    for sample, _ in zip(read_samples(data_dir, split), range(count)):
        try:
            data = schema.original_image(sample)
        except schema.MissingOriginalsError as e:
            raise schema.MissingOriginalsError(
                f"{data_dir}: the attention-overlay figures need the full-size photographs "
                f"(or pass --no-figures): {e}") from None
        with bounds.open_image(io.BytesIO(data), f"{data_dir}: sample {sample.id!r}") as img:
            out.append(np.asarray(img.convert("RGB")))
    return out


def _first_sample(ds, split: str):
    """The first record of a split, decoded; None when it has none."""
    from sclaro_jax.data import schema

    for _, record in ds.records(split, chunk=1):
        return schema.decode(record)
    return None


def unsupported(data_dir: str, settings: "Settings") -> dict[str, str]:
    """{what: why} for each protocol (or part of one) that the dataset cannot support, read from
    its manifest, vocabulary and first records (no model): "linear_probe.action" when it has
    no action labels, "localisation" without full-size photographs or stored masks, figures'
    "attention_overlays" without photographs."""
    from sclaro_jax.data.dataset import open_dataset

    ds = open_dataset(data_dir)
    out: dict[str, str] = {}
    imported = ds.manifest.get("import") or {}
    train = settings.train_split
    if "linear_probe" in settings.tasks:
        if not ds.manifest["splits"].get(train, {}).get("records"):
            out["linear_probe"] = f"the {train} split has no records"
        elif not ds.vocab.actions:
            no_actions = (imported.get("actions") or {}).get("rule") == "none"
            out["linear_probe.action"] = (
                f"the {train} split has no action labels"
                + (" (imported with --no-actions)" if no_actions else ""))
    if "localisation" in settings.tasks:
        kinds = sorted(ds.manifest.get("mask_kinds") or {})
        if not ds.has_originals:
            out["localisation"] = ("the dataset keeps no full-size photographs (import or "
                                   "reshard it with --keep-originals)")
        elif not ds.manifest["splits"].get(train, {}).get("records"):
            out["localisation"] = f"the {train} split has no records"
        elif "sam" in kinds:
            out["localisation"] = ("its records' masks (mask_kind sam) are not stored in "
                                   "them; from Python, pass localise's mask_fn")
        elif "panoptic" in kinds:
            first = _first_sample(ds, settings.split)
            if first is not None and first.mask_kind == "panoptic" and first.panoptic is None:
                out["localisation"] = ("its panoptic records hold no segment masks (imported "
                                       "before they were kept): import it again with "
                                       "--keep-originals")
    if settings.figures and not ds.has_originals:
        out["attention_overlays"] = ("the dataset keeps no full-size photographs (import or "
                                     "reshard it with --keep-originals)")
    return out


def _plan(workdirs: dict[str, str], settings: "Settings", data: str | None,
          config: str | None) -> tuple["Settings", dict[str, str]]:
    """(the settings without what the data cannot support, {what: why} of that): `unsupported`
    over the workdirs' datasets, each said in one line; ValueError for an unknown task or one
    asked for by name (`settings.required`) that cannot run."""
    unknown = [t for t in settings.tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; known: {TASKS}")
    skipped: dict[str, str] = {}
    for name, workdir in workdirs.items():
        for what, why in unsupported(_data_dir(_run_config(workdir, config), workdir, data),
                                     settings).items():
            if what.partition(".")[0] in settings.required:
                raise ValueError(f"{SKIP_NAMES[what]}: cannot run on {name}'s data: {why} "
                                 f"(leave {what.partition('.')[0]} out of --tasks)")
            skipped.setdefault(what, why)
    for what, why in skipped.items():
        log.warning("%s: skipped, %s", SKIP_NAMES[what], why)
    return dataclasses.replace(
        settings, tasks=tuple(t for t in settings.tasks if t not in skipped),
        probe_tasks=("object", "relation") if "linear_probe.action" in skipped
        else settings.probe_tasks), skipped


SKIP_NAMES = {"linear_probe": "linear probe", "linear_probe.action": "linear probe (action)",
              "localisation": "localisation", "attention_overlays": "attention-overlay figure"}


def suite_evals(settings: "Settings", cache_dir: str, fingerprint: str) -> dict:
    """The `config.evals` entries of the settings' tasks (every=0: run when asked)."""
    shared = dict(every=0, split=settings.split, train_split=settings.train_split)
    scen = dict(shared, batch_size=settings.batch_size, cache_dir=cache_dir,
                fingerprint=fingerprint, progress=settings.progress)
    probe = dict(scen, epochs=settings.probe_epochs, lr=settings.probe_lr)
    if settings.probe_tasks is not None:
        probe["tasks"] = tuple(settings.probe_tasks)
    entries = {"zero_shot": scen, "linear_probe": probe,
               "predcls": dict(scen, min_instances=settings.min_predicate_instances),
               "sgcls": dict(scen, min_instances=settings.min_predicate_instances),
               "localisation": dict(shared, variants=settings.localisation_variants,
                                    epochs=settings.localisation_epochs,
                                    max_relations=settings.localisation_max_relations)}
    return {task: entries[task] for task in settings.tasks}


def _figures(settings: Settings):
    """The figures' module where `settings.figures`, else None; without its packages (the
    `demo` extra's matplotlib, scikit-learn) a `cli.MissingExtra` naming them."""
    if not settings.figures:
        return None
    cli.need("matplotlib", "demo", "drawing the figures", otherwise="pass --no-figures")
    cli.need("sklearn.manifold", "demo", "the t-SNE figure", package="scikit-learn",
             otherwise="pass --no-figures")
    from sclaro_jax.eval.protocols import figures
    return figures


def evaluate_workdirs(workdirs: dict[str, str], out: str, settings: Settings = Settings(), *,
                      data: str | None = None, config: str | None = None) -> dict:
    """Evaluate each named workdir; write OUT/eval.json, OUT/eval.md, OUT/figures/*.png and
    return the JSON record."""
    from sclaro_jax.checkpoint import load_checkpoint
    from sclaro_jax.eval.protocols import cost, embedding, metrics, registry, report, scenario

    figures = _figures(settings)  # their packages, before any work

    settings, skipped = _plan(workdirs, settings, data, config)  # before any model is loaded
    out_dir = Path(out)
    (out_dir / "figures").mkdir(parents=True, exist_ok=True)
    cache = str(out_dir / "cache")
    record: dict = {"settings": dataclasses.asdict(settings), "models": {}, "figures": {},
                    "skipped": {SKIP_NAMES[k]: v for k, v in skipped.items()}}
    tables = ["## Skipped\n\n" + "\n".join(f"- {SKIP_NAMES[k]}: {v}" for k, v in skipped.items())
              ] if skipped else []
    models, data_dirs, image_sizes = {}, {}, {}
    for name, workdir in workdirs.items():
        cfg = _run_config(workdir, config)
        image_sizes[name] = int(cfg.data.image_size)
        data_dir = _data_dir(cfg, workdir, data)
        log.info("%s: loading the checkpoint of %s ...", name, workdir)
        model, step = load_checkpoint(workdir, settings.step, teacher=settings.teacher,
                                      config=cfg)
        models[name], data_dirs[name] = model, data_dir
        t0 = time.perf_counter()
        fingerprint = embedding.model_fingerprint(model)
        cfg = cfg.copy_and_resolve_references()
        cfg.data.dir = data_dir
        cfg.evals = suite_evals(settings, cache, fingerprint)
        embed = functools.partial(embedding.embed_dataset, model, data_dir,
                                  image_size=image_sizes[name], batch_size=settings.batch_size,
                                  cache_dir=cache, fingerprint=fingerprint)
        result = {"workdir": os.path.abspath(workdir), "step": step,
                  "weights": "teacher" if settings.teacher else "student"}
        if any(t in scenario.TASKS for t in settings.tasks):
            log.info("%s (step %d): embedding the %s split of %s (cached in %s) ...", name,
                     step, settings.split, data_dir, cache)
            result.update(scenario.header(
                os.path.abspath(data_dir), embed(settings.split, progress=settings.progress),
                settings.train_split, {"image_size": image_sizes[name], "object_view": "crop",
                                       "ks": list(metrics.DEFAULT_KS),
                                       "text_length": embedding.DEFAULT_TEXT_LENGTH,
                                       "min_predicate_instances":
                                           settings.min_predicate_instances,
                                       "probe_epochs": settings.probe_epochs,
                                       "probe_lr": settings.probe_lr,
                                       "model": type(model).__name__}))
        for ev in registry.evaluators(cfg):
            log.info("%s: %s on %s ...", name, ev.name, ev.split)
            result[ev.name] = dict(ev.run(model))
        result["seconds"] = round(time.perf_counter() - t0, 2)
        record["models"][name] = result
        title = f"## {name} ({result['weights']}, step {step})\n\n"
        body = report.markdown_tables(result) if "settings" in result else ""
        if "localisation" in result:
            body += "\n" + report.localisation_table(result["localisation"])
        tables.append(title + body)
        if settings.figures:
            log.info("%s: figures ...", name)
            record["figures"].update(_model_figures(name, workdir, embed, settings, out_dir))
    if settings.figures and models and "attention_overlays" not in skipped:
        first = next(iter(data_dirs.values()))
        images = _test_images(first, settings.split, settings.figure_images)
        if images:
            path = out_dir / "figures" / "attention_overlays.png"
            figures.attention_overlays(models, images, str(path),
                                       next(iter(image_sizes.values())))
            record["figures"]["attention_overlays"] = str(path)
    if settings.cost and models:
        table, rows = cost.cost_table(models)
        record["cost"] = rows
        tables.append("## Parameters and FLOPs (appendix Table A1)\n\n" + table)
    if record["figures"]:
        tables.append("## Figures\n\n" + "\n".join(
            f"- {k}: `{os.path.relpath(v, out_dir)}`" for k, v in record["figures"].items()))
    write_text_file(out_dir / "eval.json", json.dumps(record, indent=1, default=_jsonable))
    write_text_file(out_dir / "eval.md", "\n\n".join(tables) + "\n")
    return record


def _model_figures(name: str, workdir: str, embed, settings: Settings, out_dir: Path) -> dict:
    """One model's figures (training curves from its metrics.jsonl, t-SNE of its object
    embeddings): figure key -> path."""
    from sclaro_jax.eval.protocols import figures

    out = {}
    curves = out_dir / "figures" / f"training_curves_{_slug(name)}.png"
    metrics_file = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics_file):
        figures.training_curves(metrics_file, str(curves))
        out[f"training_curves/{name}"] = str(curves)
    emb = embed(settings.split, progress=False)
    n = min(len(emb.object_names), settings.tsne_max_objects)
    if n >= 3:
        tsne = out_dir / "figures" / f"tsne_objects_{_slug(name)}.png"
        figures.tsne_plot(np.asarray(emb.object_emb)[:n], list(emb.object_names)[:n],
                          str(tsne), title=f"{name}: object embeddings ({n})")
        out[f"tsne/{name}"] = str(tsne)
    return out


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _parser() -> argparse.ArgumentParser:
    p = cli.parser(
        "python -m sclaro_jax.eval.suite",
        "Evaluate ScenarioCLIP / baseline checkpoints: zero-shot retrieval, linear "
        "probe, PredCls / SGCls, relation localisation, figures, parameters / FLOPs.")
    p.add_argument("--workdir", action="append", required=True, metavar="[NAME=]DIR",
                   help="training workdir to evaluate (repeatable; NAME labels its column)")
    p.add_argument("--config", help="config file[:variant] that built the runs (default: each "
                                    f"workdir's config.json); {CODE_NOTE}")
    p.add_argument("--data", help="dataset folder (default: the run's config.data.dir)")
    p.add_argument("--split", default="test", help="split to evaluate")
    p.add_argument("--train-split", default="train", help="split for the probe / SGCls vocab")
    p.add_argument("--tasks", default=None,
                   help=f"comma-separated from {', '.join(TASKS)} (default: every one the "
                        "dataset supports; those it cannot, e.g. the action probe without "
                        "action labels or localisation without the photographs, are skipped "
                        "with one line each; a task named here that cannot run is an error)")
    p.add_argument("--teacher", action="store_true", help="evaluate the EMA teacher weights")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--probe-epochs", type=int, default=6, help="linear-probe epochs")
    p.add_argument("--probe-lr", type=float, default=2e-5, help="linear-probe learning rate")
    p.add_argument("--min-predicate-instances", type=int, default=5,
                   help="PredCls / SGCls: predicates with fewer test instances are left out")
    p.add_argument("--localisation-variants", default="frozen,trainable",
                   help="comma-separated localisation heads: frozen, trainable")
    p.add_argument("--localisation-epochs", type=int, default=1,
                   help="training epochs of the localisation head")
    p.add_argument("--localisation-max-relations", type=int, default=None,
                   help="evaluate localisation on at most this many relations (default: all)")
    p.add_argument("--no-figures", action="store_true", help="skip the figures")
    p.add_argument("--figure-images", type=int, default=3, help="images per figure")
    p.add_argument("--tsne-max-objects", type=int, default=10000,
                   help="at most this many object embeddings in the t-SNE figure")
    p.add_argument("--no-cost", action="store_true", help="skip the parameter / FLOPs table")
    p.add_argument("--batch-size", type=int, default=32, help="examples per encoder call")
    p.add_argument("--out", type=cli.writable, help="output folder (default: FIRST_WORKDIR/eval)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


class _Stderr(logging.StreamHandler):
    """A handler on whatever `sys.stderr` is when a line is written."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not log.handlers:  # a command line: say what each phase is doing, on stderr
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    workdirs: dict[str, str] = {}
    for spec in args.workdir:
        name, sep, path = spec.partition("=")
        if not sep or os.path.exists(spec):
            name, path = Path(spec).name, spec
        if not os.path.isdir(path):
            print(f"error: workdir not found: {cli.printable(path)}", file=sys.stderr)
            return 2
        workdirs[name] = path
    tasks = (TASKS if args.tasks is None else
             tuple(t.strip() for t in args.tasks.split(",") if t.strip()))
    settings = Settings(
        split=args.split, train_split=args.train_split,
        tasks=tasks, required=tasks if args.tasks is not None else (),
        teacher=args.teacher, step=args.step, probe_epochs=args.probe_epochs,
        probe_lr=args.probe_lr, min_predicate_instances=args.min_predicate_instances,
        localisation_variants=tuple(v.strip() for v in args.localisation_variants.split(",")
                                    if v.strip()),
        localisation_epochs=args.localisation_epochs,
        localisation_max_relations=args.localisation_max_relations,
        figures=not args.no_figures, figure_images=args.figure_images,
        tsne_max_objects=args.tsne_max_objects, cost=not args.no_cost,
        batch_size=args.batch_size, progress=not args.no_progress)
    out = args.out or os.path.join(next(iter(workdirs.values())), "eval")
    try:
        evaluate_workdirs(workdirs, out, settings, data=args.data, config=args.config)
    except cli.USER_ERRORS as e:
        return cli.fail(e)
    print((Path(out) / "eval.md").read_text())
    print(f"wrote {out}/eval.json, {out}/eval.md and {out}/figures/")
    return 0


if __name__ == "__main__":
    from sclaro_jax.heap import freeze_for_process
    freeze_for_process()  # a command's process: its imports are not scanned again
    raise SystemExit(main())
