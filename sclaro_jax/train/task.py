"""ScenarioCLIP and its baselines (PyramidCLIP, ScenarioCLIP w/o KD) as a task
(`sclaro_jax.run.task`): `launch/train.py` trains a run with `trainer.train_graph`, then
evaluates its newest student with the evaluators its config names (`config.evals`,
`sclaro_jax.eval`'s registry: the same ones training runs every `every` steps), into
WORKDIR/results.json and WORKDIR/results.md. The whole protocol suite is
`python -m sclaro_jax.eval.suite`.
"""

from __future__ import annotations

import json
import os
import shlex

import jax
from flax import nnx

from sclaro_jax.config import flatten
from sclaro_jax.data.dataset import open_dataset
from sclaro_jax.files import write_replacing
from sclaro_jax.models import clip
from sclaro_jax.run.task import Evaluated, Fitted
from sclaro_jax.train import trainer


def summary_table(found: dict) -> str:
    """An evaluator's numbers as one Markdown table: a row per key path but its last part (e.g.
    "object.strict.all"), a column per last part ("top1", "top5", ...); the per-source
    breakdowns and the counts are left to results.json."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in flatten(found).items():
        row, _, column = key.rpartition(".")
        if (isinstance(value, (int, float)) and not isinstance(value, bool)
                and ".by_source." not in f".{row}." and column not in ("n", "classes")):
            rows.setdefault(row or "-", {})[column] = value
    columns = list(dict.fromkeys(c for cells in rows.values() for c in cells))
    lines = ["| | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {row} | " + " | ".join(f"{cells[c]:.4g}" if c in cells else "-"
                                          for c in columns) + " |"
              for row, cells in rows.items()]
    return "\n".join(lines)


def fitted_student(config, fitted: Fitted | None, step: int):
    """`fitted`'s student as an nnx model, when it is the model `load_checkpoint` would give for
    checkpoint `step`: the fit ended at that step in this one process, and it trained with the
    attention a checkpoint is evaluated with (`config.perf`'s attention and fused q/k/v
    switches at their defaults; `build_model(perf=False)`). None otherwise."""
    from sclaro_jax.models.layers import AttentionOptions
    from sclaro_jax.perf import PerfConfig

    if (fitted is None or fitted.graph is None or fitted.step != step
            or jax.process_count() > 1
            or PerfConfig.from_config(config).attention_options() != AttentionOptions()):
        return None
    return nnx.merge(fitted.graph, jax.device_get(fitted.state.params))


class ScenarioCLIP:
    name = "scenarioclip"

    def check(self, config) -> None:
        """`trainer.check_recipe`: each key in its range (`config.validate` over
        configs/scenarioclip.py's RANGES), unknown train keys, the layout, the perf switches;
        then, when `config.data.dir` holds a dataset, its view size against
        `config.data.image_size` (`ShardedDataset.check_view_size`: a `ViewSizeError` naming
        both sizes and the command that makes views of the model's size), before any model is
        built."""
        trainer.check_recipe(config)
        clip.preset_at(config.model.preset, config.data.image_size)  # tiny: a whole patch grid
        data_dir = config.data.dir
        if data_dir and os.path.isfile(os.path.join(data_dir, "manifest.json")):
            open_dataset(data_dir).check_view_size(config.data.image_size)

    def demo_view_size(self, config) -> int | None:
        """The demo configs: the tiny preset at a demo's batch; their views at the config's
        image size."""
        demo = config.model.preset == "tiny" and config.data.batch_size <= 16
        return config.data.image_size if demo else None

    def fit(self, config, workdir: str, *, progress: bool = True,
            allow_config_change: bool = False, verify_data: bool = False,
            stop_at: int | None = None) -> Fitted:
        """`trainer.train_graph`, the recipe taken as checked (`check`, the launcher's first
        call): where the run ended, its total steps and the graph, from the training itself."""
        return trainer.train_graph(config, workdir, progress=progress,
                                   allow_config_change=allow_config_change,
                                   verify_data=verify_data, stop_at=stop_at, checked=True)

    def evaluate(self, config, workdir: str, *, progress: bool = True, step: int | None = None,
                 fitted: Fitted | None = None) -> Evaluated:
        """Every evaluator of `config.evals` on the student of the newest checkpoint (or of
        `step`; a damaged one is refused, naming a complete step to pass): `fitted`'s student
        as it is in memory where that is the same model (`fitted_student`), else read from the
        checkpoint."""
        from sclaro_jax.checkpoint import check_run, load_checkpoint
        from sclaro_jax.eval.protocols import registry

        evaluators = registry.evaluators(config)
        model = None
        if fitted is not None:  # which checkpoint is evaluated decides whether it is fitted's
            step = check_run(workdir, step)
            model = fitted_student(config, fitted, step)
        if model is None:  # load_checkpoint makes the same check of the run
            model, step = load_checkpoint(workdir, step, config=config)
        results = {"step": step, "evaluators": {}}
        tables = []
        for ev in evaluators:
            found = dict(ev.run(model))
            results["evaluators"][ev.name] = {"split": ev.split, "results": found}
            tables.append(f"{ev.name} ({ev.split}):\n\n{summary_table(found)}")
        table = "\n\n".join(tables) or "(config.evals names no evaluator)"
        path = os.path.join(workdir, "results.md")
        write_replacing(os.path.join(workdir, "results.json"),
                        lambda f: json.dump(results, f, indent=2, default=str), text=True)
        write_replacing(path, lambda f: f.write(
            f"ScenarioCLIP run {workdir}, step {step}\n\n{table}\n"), text=True)
        w = shlex.quote(workdir)
        next_steps = (f"next: every protocol: python -m sclaro_jax.eval.suite --workdir {w}   "
                      f"(tables in {os.path.join(workdir, 'eval', 'eval.md')})\n"
                      f"      export one level for PyTorch: python -m sclaro_jax.train.export "
                      f"--workdir {w} --level object --out "
                      f"{shlex.quote(os.path.join(workdir, 'export_object'))}")
        return Evaluated(results, table, path, next_steps)


TASK = ScenarioCLIP()
