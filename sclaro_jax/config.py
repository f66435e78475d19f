"""Experiment configs, loaded one way: `load_config("NAME[:variant]")` for a recipe of the
package (`sclaro_jax.configs`: scenarioclip, scenarioclip_nokd, pyramidclip, detection), or
`load_config("path/to/file.py[:variant]")` for a config file (the checkout's configs/*.py name
the same recipes). A config defines `get_config(variant=None) -> ml_collections.ConfigDict`.
launch/train.py and the evaluation commands load their `--config` here; a task checks its keys
when a run starts (`sclaro_jax.run.task`).

Configs are Python, as big_vision's and ml_collections' are: loading a config file runs it, with
the user's permissions, like running a script (`CODE_NOTE`, in every `--config` help). A file
is executed from its path with nothing added to `sys.path`, so loading it never makes a module
that merely sits near it (a `tqdm.py` in /tmp beside a config folder) importable in place of
an installed one: a config imports the installed `sclaro_jax` (the recipes,
`sclaro_jax.configs.NAME`) and installed packages, as the checkout's configs/*.py do.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pkgutil
from pathlib import Path

import ml_collections

RECIPES = "sclaro_jax.configs"
CODE_NOTE = ("a config file is Python that runs when it is loaded, like a script: pass only "
             "files you trust")


def recipes() -> list[str]:
    """The names of the package's recipes."""
    package = importlib.import_module(RECIPES)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                  if not m.name.startswith("_"))


def load_config(spec: str) -> ml_collections.ConfigDict:
    """`NAME[:variant]` (a recipe of the package) or `path/to/config.py[:variant]` (a file) ->
    its `get_config(variant)` ConfigDict (variant None when not given). A file runs as
    Python, from its path, with nothing added to sys.path (module docstring)."""
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
    for arg in argv:
        if arg.startswith("--config."):
            check_key(config, arg[len("--config."):].split("=", 1)[0], arg)


def check_key(config: ml_collections.ConfigDict, key: str, arg: str) -> None:
    """KeyError for a dotted `key` that `config` does not have, naming `arg` (the command-line
    text that gave it) and the closest known keys."""
    import difflib

    known = list(flatten(config))
    if key in known or any(k.startswith(key + ".") for k in known):
        return
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise KeyError(f"unknown config key {key!r} (in {arg}){hint}")


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the `--config.KEY=VALUE` and `--config.KEY VALUE` overrides of a command line, in
    order, as "KEY=VALUE" ("KEY" for one without a value: `apply_overrides` refuses it); the
    command line without them). Up to a bare `--`."""
    rest, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg.startswith("--config."):
            key, sep, value = arg[len("--config."):].partition("=")
            if not sep and i + 1 < len(argv):
                value, sep, i = argv[i + 1], "=", i + 1
            overrides.append(f"{key}{sep}{value}")
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


# A switch's values on the command line (any case): absl's launcher took these, every command
# takes them.
BOOL_TEXT = {"true": True, "1": True, "false": False, "0": False}


def override_value(old, value: str, key: str):
    """`value`, the text of `--config.KEY=VALUE`, read as the type of the key's current value
    `old`: a string as it is; a switch from `BOOL_TEXT`; a number, tuple or list as JSON (or a
    Python literal: `.5`, `(1, 2)`); without a type (None), JSON or else the text. ValueError
    (or TypeError) for a value of another kind; BoundsError for JSON nested too deep."""
    import ast

    from sclaro_jax.bounds import parse_json

    if isinstance(old, str):
        return value
    if isinstance(old, bool):
        return BOOL_TEXT[value.strip().lower()]  # KeyError: not a switch's value
    try:
        parsed = parse_json(value, f"--config.{key}")
    except ValueError:
        if old is None:
            return value
        parsed = ast.literal_eval(value.strip())  # ValueError / SyntaxError
    if old is None:
        return parsed
    if isinstance(old, (int, float)) and (
            isinstance(parsed, bool) or not isinstance(parsed, (int, float))
            or (isinstance(old, int) and parsed != int(parsed))):
        raise TypeError
    return type(old)(parsed)


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> None:
    """Apply "KEY=VALUE" overrides (dotted keys, `--config.KEY=VALUE` on every command that
    takes a recipe) in place, in order: the value is read as the key's current type
    (`override_value`: a switch takes True/true/1, False/false/0; a string key the text as it
    is). KeyError naming an unknown key and the closest known ones (`check_key`); ValueError
    for a value of the wrong kind, naming the key's type and value."""
    from sclaro_jax.bounds import BoundsError

    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config.{item}: expected KEY=VALUE")
        check_key(config, key, f"--config.{item}")
        parent = config
        parts = key.split(".")
        for part in parts[:-1]:
            parent = parent[part]
        old = parent[parts[-1]]
        try:
            parent[parts[-1]] = override_value(old, value, key)
        except BoundsError:
            raise
        except (ValueError, TypeError, KeyError, SyntaxError, OverflowError, MemoryError,
                RecursionError):
            switch = "; a switch is True, true, 1, False, false or 0" if isinstance(old, bool) \
                else ""
            raise ValueError(f"--config.{item}: config.{key} takes {type(old).__name__} values "
                             f"(the recipe's is {old!r}), not {value!r}{switch}") from None


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a training run wrote to WORKDIR/config.json (read without jax: the launcher's
    --eval-only reads it before it loads anything heavy)."""
    import json

    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"workdir {workdir} does not exist: pass the folder a run's "
                                "launch/train.py --workdir wrote")
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir} is not a training workdir "
                                "(or pass the run's config)")
    with open(path, encoding="utf-8") as f:
        return ml_collections.ConfigDict(json.load(f))


# --------------------------------------------------------------------------------------------
# Ranges: what each numeric and path field of a recipe may hold, declared beside the field
# (a recipe module's RANGES, or `ranged` dataclass fields) and checked in one place, `validate`,
# by every task's `check` before anything runs.
# --------------------------------------------------------------------------------------------

RANGE = "range"  # the dataclasses.field metadata key of a field's Range


class RangeError(ValueError):
    """Config values outside their declared ranges (one line naming each key, value and
    range)."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric field may hold: bounds `ge` (>=), `gt` (>), `le` (<=), `lt` (<),
    None for none; a tuple's elements each. `path=True`: a path field instead (a string; with
    `exists`, one that must exist when it is not empty). `note`: what a special value means."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    path: bool = False
    exists: bool = False
    note: str = ""

    def text(self) -> str:
        parts = [f"{op} {bound:g}" for op, bound in ((">=", self.ge), (">", self.gt),
                                                     ("<=", self.le), ("<", self.lt))
                 if bound is not None]
        return " and ".join(parts) or "a number"

    def problem(self, value) -> str | None:
        """Why `value` is outside this range, or None."""
        if self.path:
            if not isinstance(value, str):
                return f"must be a path (a string), got {type(value).__name__}"
            if self.exists and value and not os.path.exists(value):
                return "no such file or folder" + (f" ({self.note})" if self.note else "")
            return None
        each = isinstance(value, (tuple, list))
        for v in value if each else (value,):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return f"must be {self.text()}, got {type(v).__name__}"
            if not self.inside(v):  # NaN too
                return (f"{'each ' if each else ''}must be {self.text()}"
                        + (f" ({self.note})" if self.note else ""))
        return None

    def inside(self, v: float) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))


def ranged(default=dataclasses.MISSING, **bounds):
    """A dataclass field with `default` (none: a required field) and its Range
    (`Range(**bounds)`) in its metadata."""
    return dataclasses.field(default=default, metadata={RANGE: Range(**bounds)})


def field_ranges(cls, prefix: str) -> dict[str, Range]:
    """{prefix + field name: Range} of a dataclass's `ranged` fields."""
    return {prefix + f.name: f.metadata[RANGE] for f in dataclasses.fields(cls)
            if RANGE in f.metadata}


def recipe_ranges(name: str) -> dict[str, Range]:
    """The `RANGES` of the package's recipe `name` (loaded by name, as `load_config` loads a
    recipe: the library imports no recipe); a task validates its configs against them."""
    return importlib.import_module(f"{RECIPES}.{name}").RANGES


def _matches(key: str, pattern: str) -> bool:
    """A dotted key against a declared one; "*" stands for one part ("evals.*.every")."""
    parts, wanted = key.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(w in ("*", p) for p, w in zip(parts, wanted))


def range_of(key: str, ranges: dict[str, Range]) -> Range | None:
    if key in ranges:
        return ranges[key]
    return next((r for pattern, r in ranges.items() if "*" in pattern
                 and _matches(key, pattern)), None)


def _raise_problems(items) -> None:
    """RangeError naming each (dotted key, value, Range) whose value is outside its range."""
    problems = [f"config.{key} = {value!r}: {why}" for key, value, declared in items
                if declared is not None and (why := declared.problem(value))]
    if problems:
        raise RangeError("; ".join(problems))


def validate(config, ranges: dict[str, Range]) -> None:
    """RangeError naming every leaf of `config` outside its range in `ranges` (dotted key ->
    Range; "*" for one part), e.g. "config.data.batch_size = 0: must be >= 1"."""
    _raise_problems((key, value, range_of(key, ranges))
                    for key, value in flatten(config).items())


def check_fields(obj, prefix: str) -> None:
    """`validate` for a dataclass built from a config section (`prefix`, e.g. "train."): its
    `ranged` fields, so a recipe built in code is held to the same ranges."""
    _raise_problems((prefix + f.name, getattr(obj, f.name), f.metadata.get(RANGE))
                    for f in dataclasses.fields(obj))


def is_numeric(value) -> bool:
    """A number or a non-empty tuple / list of numbers (bools are switches, not numbers)."""
    values = value if isinstance(value, (tuple, list)) and value else (value,)
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def unranged(config, ranges: dict[str, Range]) -> list[str]:
    """The numeric leaves of `config` without a declared range (every one must have one)."""
    return [key for key, value in flatten(config).items()
            if is_numeric(value) and range_of(key, ranges) is None]
