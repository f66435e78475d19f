"""Tasks: what a config trains and how its run is evaluated, looked up by `config.trainer`.

Each task (ScenarioCLIP and its baselines, `sclaro_jax.train.task`; the detector,
`sclaro_jax.detection.task`) is one object with the same four methods, so `launch/train.py`
and the evaluation commands look a task up instead of branching on it:

- `check(config)`: every check that needs no data and writes nothing (every numeric and path
  key in its declared range, `sclaro_jax.config.validate` over the recipe's `RANGES`; unknown
  keys, switches, the packages the task needs); ValueError naming the key. The command that
  starts a task (`launch/train.py`, `python -m sclaro_jax.eval.detect`) calls it once, before
  anything is read or written; `fit` and `evaluate` do not repeat it.
- `demo_view_size(config)`: None when `config` is not one of the task's demo configs (a demo
  config with an empty `data.dir` trains on the bundled demo, written first by the launcher);
  otherwise the image size of the demo's stored views (0: the originals).
- `fit(config, workdir, *, progress, allow_config_change, verify_data, stop_at) -> Fitted`:
  train, or resume from the newest checkpoint (`run.opening.open_run`).
- `evaluate(config, workdir, *, progress, step=None, fitted=None) -> Evaluated`: the task's
  evaluation of the run's newest checkpoint (or `step`'s; a damaged one is refused naming a
  complete step, `checkpoint.check_run`), written into the workdir (its results file and
  table). `fitted`:
  the `fit` that just ended in this process; where its state is that checkpoint's, the task may
  evaluate it in memory (the same numbers) instead of restoring it.

The registry names modules, not objects, so the run layer imports no task: a task module is
imported when a config asks for it (as big_vision loads its models by name).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Protocol

# config.trainer -> the module whose TASK implements it
TASKS = {"scenarioclip": "sclaro_jax.train.task", "detection": "sclaro_jax.detection.task"}
METHODS = ("check", "demo_view_size", "fit", "evaluate")


@dataclasses.dataclass
class Fitted:
    """Where a `fit` ended: the state, the step reached and the run's total steps (a stop,
    SIGINT / SIGTERM or `stop_at`, leaves step < steps); `graph`, where the task keeps it, is
    what the state's parameters merge into, so that `evaluate(..., fitted=)` evaluates the
    trained model as it is in memory instead of building it again and reading it back."""
    state: Any
    step: int
    steps: int
    graph: Any = None


@dataclasses.dataclass
class Evaluated:
    """A task's evaluation of a run: its results (JSON-able), the Markdown table, where both
    were written, and what a user may do next with the run (commands, one a line)."""
    results: dict
    table: str
    path: str
    next: str = ""


class Task(Protocol):
    name: str

    def check(self, config) -> None: ...

    def demo_view_size(self, config) -> int | None: ...

    def fit(self, config, workdir: str, *, progress: bool = True,
            allow_config_change: bool = False, verify_data: bool = False,
            stop_at: int | None = None) -> Fitted: ...

    def evaluate(self, config, workdir: str, *, progress: bool = True, step: int | None = None,
                 fitted: Fitted | None = None) -> Evaluated: ...


def get(name: str) -> Task:
    """The task registered as `name` (ValueError listing the known ones)."""
    if name not in TASKS:
        raise ValueError(f"config.trainer {name!r} is not a task; known: {sorted(TASKS)}")
    return importlib.import_module(TASKS[name]).TASK


def of(config) -> Task:
    """The task of `config` (`config.trainer`, "scenarioclip" where a config has none)."""
    return get(config.get("trainer", "scenarioclip"))
