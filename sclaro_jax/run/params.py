"""Parameter names and the optimiser groups chosen by them, for every trainer's optax optimiser.

A parameter's name is its dict keys joined by "/" ("global_pair/vision_model/encoder/layers/0/
..."); `label_params` gives each parameter the label of the first (regex, label) rule whose
regex is found in its name (`re.search`), else the default (a label, or a function of the name
and the array). The labels feed `optax.multi_transform` (or a trainer's own grouping).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax

PyTree = Any


def param_name(key_path) -> str:
    """A parameter's name: its dict keys joined by "/"."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)


def label_params(params: PyTree, rules: Sequence[tuple[str, str]],
                 default: str | Callable[[str, Any], str]) -> PyTree:
    """The label of every parameter of `params` (a pytree of the same structure): the label of
    the first rule (regex, label) whose regex matches somewhere in the parameter's name, else
    `default` (a label, or `default(name, value)`). A rule with an empty regex never matches."""
    compiled = [(re.compile(pattern), label) for pattern, label in rules if pattern]

    def label(key_path, value):
        name = param_name(key_path)
        for pattern, tag in compiled:
            if pattern.search(name):
                return tag
        return default(name, value) if callable(default) else default
    return jax.tree_util.tree_map_with_path(label, params)
