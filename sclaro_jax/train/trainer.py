"""ScenarioCLIP's trainer: data, model, jitted step, orbax checkpoints with exact resume, metrics.

`train(config, workdir)` reads an `ml_collections` config (`sclaro_jax.configs.scenarioclip`),
opens the run as every task opens one (`run.opening.open_run`: one writer, compilation cache,
checkpoints, config drift, logs cut back to the resumed step) and:
- builds the Grain loader over `config.data.dir` (train split) and the model (`build`; a resumed
  run builds its state's shapes only and restores into them: student, EMA teacher, optimiser
  state, step and the Grain iterator state, so the resumed run is the uninterrupted one;
  `resume` converts checkpoints of the older list-layout optimiser state);
- compiles the step for every batch shape of the run before the first step (`run.ahead`),
  while the checkpoint is restored and the input workers start;
- runs it through the one loop under every trainer, `sclaro_jax.run.run_steps` (state
  donated), which writes `workdir/metrics.jsonl` (step, loss, loss_ca, loss_kd, lr,
  kd_temperature, examples_per_sec, data_wait_fraction, ...) and TensorBoard scalars, shows a
  progress bar, saves every `config.checkpoint_every` steps and at the end (a killed run keeps
  its last complete checkpoint), and stops with `NonFiniteLossError` on a NaN/inf loss, before
  saving anything from that step; warns once when more than 10% of the time goes waiting for
  the input pipeline (`data_wait_fraction`), naming `config.data.workers`.
`sclaro_jax.train.task` is the task `launch/train.py` looks up: `train`, then the evaluators of
`config.evals` on the result.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time

import grain.python as grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from sclaro_jax.checkpoint import build_model
from sclaro_jax.config import RangeError, flatten, recipe_ranges, validate
from sclaro_jax.data import batch as fields
from sclaro_jax.data import packing
from sclaro_jax.data.dataset import open_dataset
from sclaro_jax.data.pipeline import PipelineConfig, make_loader
from sclaro_jax.eval.protocols import registry
from sclaro_jax.files import open_new
from sclaro_jax.perf import PerfConfig
from sclaro_jax.run import Hooks, LoopSpec, run_steps
from sclaro_jax.run import folder, sharding
from sclaro_jax.run.ahead import CompiledSteps, kept_step, state_shapes
from sclaro_jax.run.opening import open_run
from sclaro_jax.run.task import Fitted
from sclaro_jax.train import core, resume

log = logging.getLogger(__name__)


SCHEDULE_KEYS = ("epochs", "steps")  # config.train keys that give TrainConfig.total_steps


def recipe_keys(config) -> list[str]:
    """The keys of `config.train` that are TrainConfig fields; any key that is neither one nor
    epochs / steps is refused (ValueError listing the known keys)."""
    fields = set(core.TrainConfig.__dataclass_fields__) - {"total_steps"}
    unknown = sorted(set(config.train.keys()) - fields - set(SCHEDULE_KEYS))
    if unknown:
        raise ValueError(f"config.train has unknown keys {unknown}; known: "
                         f"{sorted(fields | set(SCHEDULE_KEYS))}")
    return [k for k in config.train.keys() if k in fields]


def train_config(config, steps: int) -> core.TrainConfig:
    """`config.train` as a TrainConfig of `steps` steps (unknown keys refused)."""
    return core.TrainConfig(total_steps=steps, **{k: config.train[k] for k in recipe_keys(config)})


def pipeline_config(config, dataset=None, host_batch: int | None = None,
                    align: int = 1, perf: PerfConfig | None = None) -> PipelineConfig:
    """The input pipeline of `config.data`. With the packed layout (`config.data.layout`, the
    default) the packed sizes are planned for `host_batch` images (default: this host's share
    of `config.data.batch_size`) from the train split's counts of `dataset` (default:
    `config.data.dir`), at most `config.data.max_packed_sizes` of them, each a multiple of
    `align` (the devices a host's slice is split over) and of `config.perf.packed_multiple`
    (`perf`: the run's PerfConfig, when the caller has it)."""
    d = config.data
    layout = check_layout(config)
    packed = None
    if layout == "packed":
        dataset = open_dataset(d.dir) if dataset is None else dataset
        host_batch = host_batch or d.batch_size // jax.process_count()
        packed = packing.plan(*packing.split_histograms(dataset, "train"), host_batch,
                              align=(perf or PerfConfig.from_config(config)).packed_align(align),
                              max_sizes=d.get("max_packed_sizes", 3))
    return PipelineConfig(image_size=d.image_size, max_objects=d.max_objects,
                          max_relations=d.max_relations, text_length=d.text_length,
                          object_view=d.object_view, train=True, layout=layout, packed=packed)


def check_layout(config) -> str:
    """`config.data.layout` ("packed" when absent), refused unless it is a known one."""
    layout = config.data.get("layout", "packed")
    if layout not in packing.LAYOUTS:
        raise ValueError(f"config.data.layout {layout!r} is not one of {packing.LAYOUTS}")
    sizes = config.data.get("max_packed_sizes", packing.MAX_TIERS)
    if not 1 <= sizes <= packing.MAX_TIERS:
        raise ValueError(f"config.data.max_packed_sizes is {sizes}; give 1 to "
                         f"{packing.MAX_TIERS}")
    return layout


def total_steps(config, records: int) -> int:
    """The run's length: `config.train.steps`, else `epochs` over `records` training records.
    A batch larger than the split is refused (RunError naming both)."""
    per_epoch = records // config.data.batch_size
    if per_epoch < 1:
        raise folder.RunError(
            f"batch size {config.data.batch_size} exceeds the {records} training records of "
            f"{config.data.dir}: pass a smaller --config.data.batch_size")
    if config.train.steps:
        return int(config.train.steps)
    return int(config.train.epochs * per_epoch)


def open_training_data(config, *, verify: bool = False):
    """The dataset of `config.data.dir`, its train shards checked against the manifest (sizes
    and record counts; every byte's sha256 with `verify`)."""
    dataset = open_dataset(config.data.dir, verify=verify)
    dataset.check_files("train")
    return dataset


def check_recipe(config) -> PerfConfig:
    """The checks of `config` that need no data: every numeric and path key in its range
    (configs/scenarioclip.py's `RANGES`, `config.validate`: a RangeError naming each key), the
    run's length, unknown config.train keys, the layout, the perf switches. Returns the perf
    switches (`PerfConfig.from_config`)."""
    validate(config, recipe_ranges("scenarioclip"))  # its baselines' too
    steps, epochs = config.train.get("steps", 0), config.train.get("epochs", 0)
    if not (steps or epochs):
        raise RangeError(f"config.train.steps = {steps!r} and config.train.epochs = {epochs!r}: "
                         "one of them must be >= 1 (the run's length)")
    recipe_keys(config)
    check_layout(config)
    train_config(config, 1)
    return PerfConfig.from_config(config)


def _check(config, verify_data: bool):
    """(dataset, the run's total steps) after the checks that come before anything is written
    (`train` has checked the recipe and the workdir first): the data, the batch over the
    hosts."""
    dataset = open_training_data(config, verify=verify_data)
    steps = total_steps(config, dataset.num_records("train"))
    if config.data.batch_size % jax.process_count():
        raise ValueError(f"batch size {config.data.batch_size} is not divisible by the "
                         f"{jax.process_count()} hosts")
    return dataset, steps



def build(config, dataset, tcfg: core.TrainConfig, *, abstract: bool = False,
          perf: PerfConfig | None = None):
    """(graphdef, state, jitted step, mesh, batch shapes, data iterator) of a run; with
    `abstract` the state is shapes and shardings only (a resumed run restores into it: nothing
    is initialised, no pretrained weights are read). `perf`: the run's switches (default:
    `config.perf`'s)."""
    log.info("building the model (%s) and its optimiser state%s ...",
             config.model.get("preset", "?"), " (shapes)" if abstract else "")
    perf = perf or PerfConfig.from_config(config)
    model = build_model(config, abstract=abstract, perf=perf)
    graphdef, state, tx = core.init_state(model, tcfg)
    del model
    mesh = sharding.make_mesh(config.sharding)
    step_fn, state = sharding.jit_step(
        core.make_train_step(graphdef, tx, tcfg, fused_update=perf.fused_update), state, mesh,
        config.sharding, compiler_options=perf.compiler_options())
    step_fn = kept_step(step_fn, ("scenarioclip", graphdef, tcfg, perf, mesh, config.sharding,
                                  state_shapes(state)))
    host_batch = config.data.batch_size // jax.process_count()
    pcfg = pipeline_config(config, dataset, host_batch,
                           align=jax.local_device_count() if mesh is not None else 1, perf=perf)
    sizes = PackedSteps(pcfg, host_batch)
    loader = make_loader(dataset, "train", host_batch, config=pcfg, seed=config.seed,
                         worker_count=config.data.workers)
    it = folder.PortableIterator(iter(loader), dataset.source_id("train"), config.data.workers)
    return graphdef, state, step_fn, mesh, sizes, it


def _save_args(it):
    return lambda state: ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=grain.PyGrainCheckpointSave(it))


def _hooks(config, workdir: str, dataset, graphdef, wait: "DataWait", start: int,
           unsafe: dict, chief: bool) -> Hooks:
    evals = registry.evaluators(config)

    def started():
        if chief:
            folder.write_config(workdir, config, step=start, unsafe=unsafe)
            folder.write_run_info(workdir, dataset)
        wait.waited = 0.0

    return Hooks(started=started,
                 log_fields=lambda wall, done: {"data_wait_fraction": wait.fraction(wall, done)},
                 after_step=lambda done, state: _periodic_eval(evals, graphdef, state, done,
                                                               workdir, chief))


def train(config, workdir: str, *, progress: bool = True, allow_config_change: bool = False,
          verify_data: bool = False, stop_at: int | None = None) -> core.TrainState:
    """Train (or resume) the run in `workdir`; returns the train state at the last step taken
    (`train_graph`: with the graph its params merge into, the step reached and the total)."""
    return train_graph(config, workdir, progress=progress,
                       allow_config_change=allow_config_change, verify_data=verify_data,
                       stop_at=stop_at).state


def train_graph(config, workdir: str, *, progress: bool = True,
                allow_config_change: bool = False, verify_data: bool = False,
                stop_at: int | None = None, checked: bool = False) -> Fitted:
    """Train (or resume) the run in `workdir`: a `run.task.Fitted` of the train state at the
    last step taken, that step, the run's total steps and the student's graph
    (`nnx.merge(fitted.graph, fitted.state.params)` is the trained student).

    SIGINT / SIGTERM (or `stop_at`, a step) stop it after the current step with a checkpoint
    (`folder.GracefulStop`): the returned state's step is then below the total. The run is
    opened as every task opens one (`run.opening.open_run`: the one writer of its workdir; a
    resumed run whose config differs from WORKDIR/config.json in more than `folder.SAFE_KEYS`
    is refused with `folder.ConfigDriftError` unless `allow_config_change`).

    The recipe is checked first (`check_recipe`), before anything is read or written, unless
    `checked` says its caller has made that check (the task's `check`, on the launcher's path).
    """
    perf = PerfConfig.from_config(config) if checked else check_recipe(config)
    dataset, steps = _check(config, verify_data)
    tcfg = train_config(config, steps)
    chief = jax.process_index() == 0
    with open_run(config, workdir, allow_config_change=allow_config_change,
                  chief=chief) as run:
        start = run.start
        if folder.length_changes(run.unsafe):
            _log_schedule_change(config, run.unsafe, tcfg, start, dataset.num_records("train"))
        graphdef, state, jitted, mesh, sizes, it = build(config, dataset, tcfg,
                                                         abstract=bool(start), perf=perf)
        run.checkpoints.save_args = _save_args(it)
        if start:  # another dataset is refused before anything compiles
            step_dir = os.path.join(run.checkpoints.folder, str(start))
            folder.check_data_state(workdir, start, folder.saved_data_state(step_dir), dataset,
                                    config.data.workers)
        # compiled while the checkpoint is restored and the input workers start
        step_fn = CompiledSteps(jitted, state, sizes.specs(), threads=config.get(
            "compile_threads", 0), background=True) if start < steps else None
        if start:
            try:
                state = resume.restore(run.checkpoints.manager, start, state, it, tcfg)
            except BaseException:
                if step_fn is not None:  # a process that ends mid-compile aborts
                    step_fn.settle()
                raise
            log.info("resumed from %s at step %d", workdir, start)
        if start >= steps:
            log.info("%s already holds a checkpoint at step %d of %d: nothing to do", workdir,
                     start, steps)
            return Fitted(state, start, steps, graphdef)
        it.start()
        wait = DataWait(config.data.workers)

        def batch_of(step):
            t_wait = time.perf_counter()
            batch = sizes.agree(next(it), step + 1)
            wait.add(time.perf_counter() - t_wait)
            return sharding.put_batch(batch, mesh)

        spec = LoopSpec(workdir=workdir, start=start, steps=steps, log_every=config.log_every,
                        checkpoint_every=config.checkpoint_every,
                        examples_per_step=config.data.batch_size,
                        progress=progress and config.progress_bar, stop_at=stop_at,
                        hint="lower train.lr or check the data.")
        hooks = _hooks(config, workdir, dataset, graphdef, wait, start, run.unsafe, chief)
        result = run_steps(step_fn, state, batch_of, run.checkpoints, spec, hooks, chief=chief)
        sizes.summary()
        return Fitted(result.state, result.done, steps, graphdef)


def _log_schedule_change(config, unsafe: dict, tcfg: core.TrainConfig, start: int,
                         records: int) -> None:
    """An allowed change of the run's length: the learning rate at the resumed step on the
    run's schedule and on the new one."""
    import ml_collections

    old = ml_collections.ConfigDict(config.to_dict())
    for key in ("steps", "epochs"):
        saved = unsafe.get(f"train.{key}", (None,))[0]
        if saved not in (None, "(absent)"):
            old.train[key] = saved
    before = dataclasses.replace(tcfg, total_steps=total_steps(old, records))
    log.warning("learning rate at step %d: %.4g on the run's schedule of %d steps, %.4g on the "
                "new one of %d steps (warm-up %d steps, then cosine to 0)", start,
                float(core.learning_rate(before)(start)), before.total_steps,
                float(core.learning_rate(tcfg)(start)), tcfg.total_steps,
                max(1, int(tcfg.warmup_fraction * tcfg.total_steps)))


class PackedSteps:
    """The batch shapes of a run (`specs`) and its packed sizes: logs the plan, each size's
    first step and at the end how many steps ran at each size. With many processes, every
    step's batch is grown to the largest tier any process needs (the global batch has one
    shape), and its image indices are moved to the host's place in the global batch."""

    def __init__(self, pcfg: PipelineConfig, host_batch: int):
        self.pcfg = pcfg
        self.sizes = sizes = pcfg.packed
        self.host_batch = host_batch
        self.steps = collections.Counter()
        if sizes is not None:
            log.info("packed crop layout, %d images per host batch: %s (the last holds %d "
                     "objects and %d relations per image: nothing is dropped)", host_batch,
                     sizes.describe(), sizes.max_objects, sizes.max_relations)

    def specs(self) -> list[dict]:
        """The global batch's (shape, dtype) per field for every batch shape of the run: one per
        packed size (one with caps); each process feeds `host_batch` images' worth."""
        scale = jax.process_count()
        return [{name: ((shape[0] * scale,) + shape[1:], dtype)
                 for name, (shape, dtype) in fields.batch_specs(self.host_batch, self.pcfg,
                                                                tier).items()}
                for tier in range(self.sizes.tiers if self.sizes else 1)]

    def agree(self, batch: dict, step: int) -> dict:
        if self.sizes is None:
            return batch
        tier = self.sizes.tier_of(batch)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            needed = int(np.max(multihost_utils.process_allgather(np.int32(tier))))
            if needed > tier:
                batch = packing.grow(batch, self.sizes, needed)
                tier = needed
            batch = packing.offset_segments(batch, jax.process_index() * self.host_batch)
        if tier not in self.steps:
            log.info("step %d is the first at packed size %d: %d object + %d relation slots",
                     step, tier, self.sizes.objects[tier],
                     self.sizes.relations[tier])
        self.steps[tier] += 1
        return batch

    def summary(self) -> None:
        if self.steps:
            log.info("steps per packed size: %s", ", ".join(
                f"{self.sizes.objects[t]} + {self.sizes.relations[t]} slots: {n}"
                for t, n in sorted(self.steps.items())))


class DataWait:
    """`data_wait_fraction`: the share of a logging interval's wall time that the loop spent
    waiting for the next batch from the input pipeline. Warns once when it passes
    `WARN_ABOVE` after the first interval (which holds the workers' start-up)."""

    WARN_ABOVE = 0.10

    def __init__(self, workers: int):
        self.workers = workers
        self.waited = 0.0
        self.intervals = 0
        self.warned = False

    def add(self, seconds: float) -> None:
        self.waited += seconds

    def fraction(self, wall: float, step: int) -> float:
        """The interval's fraction (and a new interval starts)."""
        fraction = min(1.0, self.waited / wall) if wall > 0 else 0.0
        self.waited = 0.0
        self.intervals += 1
        if self.intervals > 1 and fraction > self.WARN_ABOVE and not self.warned:
            self.warned = True
            cores = os.cpu_count() or 1
            if self.workers:
                advice = (f"Give it more worker processes: config.data.workers is {self.workers} "
                          f"and this machine has {cores} cores.")
            else:
                advice = ("Batches are made in this process (config.data.workers is 0, the "
                          "demo configs' choice for a tiny model); for real runs pass "
                          f"--config.data.workers=N, up to this machine's {cores} cores.")
            log.warning(
                "the input pipeline is holding training back: %.0f%% of the time up to step "
                "%d went waiting for batches (data_wait_fraction %.2f). %s", 100 * fraction,
                step, fraction, advice)
        return fraction


def _numbers(results: dict, most: int = 12) -> str:
    """'a.b 0.512, c 3' of the numbers in a (nested) results dict, the first `most` of them."""
    flat = {k: v for k, v in flatten(results).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
    shown = ", ".join(f"{k} {v:.4g}" for k, v in list(flat.items())[:most])
    return shown + (f", ... ({len(flat) - most} more in eval.jsonl)" if len(flat) > most else "")


def _periodic_eval(evals, graphdef, state, step: int, workdir: str, chief: bool = True) -> None:
    """Run the evaluators due at `step` on the student; one JSON line per evaluator
    {"step", "evaluator", "split", "results"} appended to WORKDIR/eval.jsonl."""
    due = [ev for ev in evals if ev.every and step % ev.every == 0]
    if not due:
        return
    if jax.process_count() > 1:  # the parameters may span processes: gather them (collective)
        from jax.experimental import multihost_utils
        params = multihost_utils.process_allgather(state.params, tiled=True)
    else:
        params = jax.device_get(state.params)
    if not chief:  # process 0 evaluates on the gathered copy and writes
        return
    model = nnx.merge(graphdef, params)
    with open_new(os.path.join(workdir, "eval.jsonl"), append=True, text=True) as f:
        for ev in due:
            results = dict(ev.run(model))
            f.write(json.dumps({"step": step, "evaluator": ev.name, "split": ev.split,
                                "results": results}) + "\n")
            log.info("eval %s at step %d on %s: %s", ev.name, step, ev.split,
                     _numbers(results))
