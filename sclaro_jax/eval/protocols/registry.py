"""Evaluators by name, built from a config, run on a model: one list for training and the suite.

    config.evals.zero_shot = dict(every=1000, split="val")
    config.evals.linear_probe = dict(every=0, split="test", epochs=6)

`evaluators(config)` builds one `Evaluator` per entry of `config.evals` (the key is the
registered name, or `type=` names it, so one evaluator can appear twice with other settings);
`every` is how often the trainer runs it (0: only when asked, e.g. by the suite). Each evaluator
gets the run's dataset folder and image size, and its entry's other keys as options;
`run(model)` yields `(key, value)` pairs (JSON-serialisable). Building one does no work: data
is read when it runs.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator

EVALUATORS: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make an `Evaluator` subclass available to configs under `name`."""
    def wrap(cls: type) -> type:
        if name in EVALUATORS:
            raise ValueError(f"an evaluator named {name!r} is registered already")
        EVALUATORS[name] = cls
        cls.kind = name
        return cls
    return wrap


class Evaluator:
    """One evaluation. Subclasses take their options as keyword arguments and implement `run`."""

    kind = ""

    def __init__(self, *, name: str, every: int = 0, data_dir: str = "", image_size: int = 224,
                 split: str = "val", **options):
        if options:
            raise TypeError(f"evaluator {name!r} ({self.kind}) has no options "
                            f"{sorted(options)}")
        self.name, self.every, self.split = name, int(every), split
        self.data_dir, self.image_size = data_dir, image_size

    def run(self, model) -> Iterator[tuple[str, Any]]:
        raise NotImplementedError


def evaluators(config) -> list[Evaluator]:
    """The evaluators `config.evals` lists, in its order (none when it has no `evals`)."""
    out = []
    for name, entry in (config.get("evals") or {}).items():
        entry = dict(entry)
        kind = entry.pop("type", name)
        _load(kind)
        if kind not in EVALUATORS:
            raise ValueError(f"config.evals.{name}: unknown evaluator {kind!r}; known: "
                             f"{sorted(set(EVALUATORS) | set(BUILTIN))}")
        out.append(EVALUATORS[kind](name=name, data_dir=config.data.dir,
                                    image_size=config.data.image_size, **entry))
    return out


# Where the built-in evaluators live: imported by name when a config asks for one (as big_vision
# does), so this module imports none of them and they can all import it.
BUILTIN = {"zero_shot": "sclaro_jax.eval.protocols.zero_shot",
           "linear_probe": "sclaro_jax.eval.protocols.probe",
           "predcls": "sclaro_jax.eval.protocols.scene_graph",
           "sgcls": "sclaro_jax.eval.protocols.scene_graph",
           "localisation": "sclaro_jax.eval.protocols.localise"}


def _load(kind: str) -> None:
    if kind not in EVALUATORS and kind in BUILTIN:
        importlib.import_module(BUILTIN[kind])
