"""Experiment configs, loaded one way: `load_config("NAME[:variant]")` for a recipe of the
package (`sclaro_jax.configs`: scenarioclip, scenarioclip_nokd, pyramidclip, detection), or
`load_config("path/to/file.py[:variant]")` for a config file (the checkout's configs/*.py name
the same recipes). A config defines `get_config(variant=None) -> ml_collections.ConfigDict`.
launch/train.py and the evaluation commands load their `--config` here; a task checks its keys
when a run starts (`sclaro_jax.run.task`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

import ml_collections

RECIPES = "sclaro_jax.configs"


def recipes() -> list[str]:
    """The names of the package's recipes."""
    package = importlib.import_module(RECIPES)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                  if not m.name.startswith("_"))


def load_config(spec: str) -> ml_collections.ConfigDict:
    """`NAME[:variant]` (a recipe of the package) or `path/to/config.py[:variant]` (a file) ->
    its `get_config(variant)` ConfigDict (variant None when not given). A file's grandparent
    folder (the repository root for configs/) goes on sys.path, so a user's config files can
    import each other as `configs.x`."""
    path, _, variant = spec.partition(":")
    if path.endswith(".py") or os.sep in path or "/" in path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path} (from --config {spec!r}); "
                                    f"or name a recipe: {', '.join(recipes())}")
        module = _load_module(path)
    elif path in recipes():
        module = importlib.import_module(f"{RECIPES}.{path}")
    else:
        raise FileNotFoundError(f"config file not found: {path} (from --config {spec!r}): "
                                f"no recipe of that name either; recipes: "
                                f"{', '.join(recipes())}")
    if not hasattr(module, "get_config"):
        raise AttributeError(f"{path} defines no get_config(variant)")
    return module.get_config(variant or None)


def _load_module(path: str):
    root = str(Path(path).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    module_spec = importlib.util.spec_from_file_location(f"_sclaro_config_{Path(path).stem}",
                                                         path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def list_configs() -> list[str]:
    """One line per recipe and variant it declares (`VARIANTS`, variant -> description, ""
    for none): "NAME[:variant]  description"."""
    lines = []
    for name in recipes():
        module = importlib.import_module(f"{RECIPES}.{name}")
        doc = (module.__doc__ or "").strip().splitlines()
        for variant, text in getattr(module, "VARIANTS", {"": ""}).items():
            spec = f"{name}:{variant}" if variant else name
            lines.append(f"  {spec:<24} {text if variant else (doc[0] if doc else text)}")
    return lines


def flatten(tree, prefix: str = "") -> dict:
    """A config (`ConfigDict`, or the plain nested dicts of its config.json) as dotted leaf
    key -> value ("train.lr" -> 2e-05)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_override_keys(config: ml_collections.ConfigDict, argv: list[str]) -> None:
    """KeyError naming an unknown `--config.x.y=V` key of `argv` and the closest known ones."""
    import difflib

    known = list(flatten(config))
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config."):].split("=", 1)[0]
        if key in known or any(k.startswith(key + ".") for k in known):
            continue
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise KeyError(f"unknown config key {key!r} (in {arg}){hint}")


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> None:
    """Apply "KEY=VALUE" overrides (dotted keys, as `--config.KEY=VALUE` on launch/train.py)
    in place: the value is read as JSON and converted to the key's current type (a string key
    takes the text as it is). ValueError naming an unknown key (and the known ones there) or a
    value of the wrong kind."""
    import json

    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config.{item}: expected KEY=VALUE")
        parent = config
        parts = key.split(".")
        for part in parts[:-1]:
            if part not in parent:
                raise ValueError(f"--config.{item}: unknown key {key!r}")
            parent = parent[part]
        if parts[-1] not in parent:
            known = sorted(k for k in parent.keys())
            raise ValueError(f"--config.{item}: unknown key {key!r}; known here: {known}")
        old = parent[parts[-1]]
        try:
            parent[parts[-1]] = type(old)(json.loads(value)) if not isinstance(old, str) \
                else value
        except (ValueError, TypeError) as e:
            raise ValueError(f"--config.{item}: {e}") from None
