"""Whether a run's checkpoints are complete: the one check every reader of a run goes through
(export, the evaluators, detection's backbones, a trainer's resume).

A checkpoint `checkpoints/<step>/` is complete when its folder is not empty, its orbax metadata
(`_CHECKPOINT_METADATA`, each item's `_METADATA` / JSON files) parses and, for an item
written as OCDBT (`manifest.ocdbt`), every data file its B-tree refers to is there and at least
as long as the bytes referred to (read from the tree's nodes, not the data: cheap). A damaged
one is named (`DamagedRunError`: the step, the file, what is wrong) with the newest complete
step to use instead.
"""

from __future__ import annotations

import json
import os
import re
import sys

from sclaro_jax import bounds
from sclaro_jax.run.folder import TMP_SUFFIX, RunError


class DamagedRunError(RunError):
    """A run's checkpoint that cannot be read (a truncated or missing file, an empty folder),
    or a run with no checkpoint at all: the message names it and the step to use instead."""


_LOCATION = re.compile(r"(btreenode|value):([^:'\"]*):(d/[0-9a-f]+):(\d+):(\d+)")


def steps(folder: str) -> list[int]:
    """The checkpoint steps in a checkpoints folder (its integer-named folders), ascending."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(n) for n in os.listdir(folder)
                  if n.isdigit() and TMP_SUFFIX not in n
                  and os.path.isdir(os.path.join(folder, n)))


def _json_problem(path: str, rel: str) -> str | None:
    try:
        bounds.read_json(path)
    except FileNotFoundError:
        return f"{rel}: missing"
    except bounds.BoundsError as e:
        return f"{rel}: {str(e).partition(': ')[2]}"
    except (OSError, ValueError) as e:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        return f"{rel}: {'empty' if not size else 'unreadable'} ({type(e).__name__})"
    return None


def _ocdbt_problem(item: str, rel: str) -> str | None:
    """What is wrong with the OCDBT store in folder `item` (None: every data file its tree
    refers to is there and long enough)."""
    import tensorstore as ts

    need: dict[str, int] = {}
    try:
        kv = ts.KvStore.open({"driver": "file", "path": item + os.sep}).result()
        manifest = ts.ocdbt.dump(kv).result()
        versions = manifest.get("versions") or []
        if not versions:
            return f"{rel}/manifest.ocdbt: holds no version"
        todo = [versions[-1]["root"]["location"]]
        while todo:
            location = todo.pop()
            for kind, prefix, name, offset, length in _LOCATION.findall(location):
                path = prefix + name
                need[path] = max(need.get(path, 0), int(offset) + int(length))
                if kind == "btreenode":
                    size = _size(os.path.join(item, path))
                    if size < need[path]:
                        return _short(rel, path, size, need[path])
                    node = json.dumps(ts.ocdbt.dump(kv, location).result(), default=str)
                    todo += [m.group(0) for m in _LOCATION.finditer(node)]
    except Exception as e:  # noqa: BLE001 (named in the message)
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{rel}: its OCDBT store cannot be read ({text[:200]})"
    for path, n in sorted(need.items()):
        size = _size(os.path.join(item, path))
        if size < n:
            return _short(rel, path, size, n)
    return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _short(rel: str, path: str, size: int, need: int) -> str:
    if size < 0:
        return f"{rel}/{path}: missing"
    return f"{rel}/{path}: truncated, {size} of at least {need} bytes"


def problem(step_dir: str) -> str | None:
    """What is wrong with the checkpoint folder `step_dir` (a file and what is wrong with it),
    or None when it is complete."""
    try:
        names = sorted(os.listdir(step_dir))
    except OSError as e:
        return f"cannot be listed ({e.strerror or e})"
    if not names:
        return "an empty folder"
    if "_CHECKPOINT_METADATA" in names:  # (older orbax wrote none)
        bad = _json_problem(os.path.join(step_dir, "_CHECKPOINT_METADATA"),
                            "_CHECKPOINT_METADATA")
        if bad:
            return bad
    for name in names:
        item = os.path.join(step_dir, name)
        if not os.path.isdir(item):
            continue
        files = sorted(os.listdir(item))
        if not files:
            return f"{name}/: an empty folder"
        if "manifest.ocdbt" in files:
            bad = (_json_problem(os.path.join(item, "_METADATA"), f"{name}/_METADATA")
                   or _ocdbt_problem(item, name))
        else:
            bad = next((b for f in files if f.endswith(".json")
                        for b in [_json_problem(os.path.join(item, f), f"{name}/{f}")] if b),
                       None)
        if bad:
            return bad
    return None


def newest_complete(folder: str, below: int | None = None) -> int | None:
    """The newest complete checkpoint's step in a checkpoints folder (below step `below`)."""
    for step in reversed(steps(folder)):
        if (below is None or step < below) and problem(os.path.join(folder, str(step))) is None:
            return step
    return None


def instead(folder: str, step: int, *, flag: str | None = "--step") -> str:
    """'the newest complete checkpoint is step 20: pass --step 20' (or that there is none;
    without a `flag` to pass, move the damaged folder aside)."""
    good = newest_complete(folder, below=None)
    if good is None or good == step:
        good = newest_complete(folder, below=step)
    if good is None:
        return "no other checkpoint of the run is complete: train it again"
    if flag is None:
        return (f"the newest complete checkpoint is step {good}: move the folder {step} aside "
                "to use it")
    return f"the newest complete checkpoint is step {good}: pass {flag} {good}"


def check_steps(folder: str, step: int | None = None, *, flag: str | None = "--step") -> int:
    """The step to read in the checkpoints folder `folder`: `step`, or the newest. Raises
    DamagedRunError when the folder is missing, holds no checkpoint (or not `step`), or the
    chosen checkpoint is damaged: the message names the step, the file and what is wrong, and
    which complete step to pass with `flag` instead."""
    found = steps(folder)
    if not os.path.isdir(folder) or not found:
        raise DamagedRunError(f"no checkpoint in {folder}: the run has not saved one yet (it "
                              "saves every config.checkpoint_every steps and at its end); train "
                              "it further or pass another workdir")
    if step is not None and step not in found:
        raise DamagedRunError(f"no checkpoint of step {step} in {folder}; it has steps "
                              f"{found}: pass one of them, or no step for the newest")
    chosen = found[-1] if step is None else step
    bad = problem(os.path.join(folder, str(chosen)))
    if bad:
        raise DamagedRunError(f"{os.path.join(folder, str(chosen))} is damaged ({bad}); "
                              f"{instead(folder, chosen, flag=flag)}")
    return chosen


def restore_failed(folder: str, step: int, error: BaseException, *,
                   flag: str | None = "--step") -> DamagedRunError:
    """The DamagedRunError for a checkpoint that passed `problem` but whose restore failed
    (`error`: damaged bytes within files of the right size), with the step to use instead. The
    'Event loop is closed' reports of the failed read's callbacks are kept out of stderr."""
    quiet_event_loop()
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return DamagedRunError(f"{os.path.join(folder, str(step))} is damaged (restoring it fails: "
                           f"{text[:200]}); {instead(folder, step, flag=flag)}")


def quiet_hook(previous):
    """A `sys.unraisablehook` that drops the 'Event loop is closed' RuntimeErrors (TensorStore's
    callbacks into an orbax read or write that already failed, hundreds of them) and passes
    the rest on to `previous` (kept as its `.previous`)."""
    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and \
                "Event loop is closed" in str(unraisable.exc_value):
            return
        previous(unraisable)
    hook.previous = previous
    return hook


def quiet_event_loop() -> None:
    """From now on, drop the 'Event loop is closed' reports of a failed orbax read or write
    that arrive as unraisable errors when the process ends (`quiet_hook`)."""
    if getattr(sys.unraisablehook, "quiet_event_loop", False):
        return
    hook = quiet_hook(sys.unraisablehook)
    hook.quiet_event_loop = True
    sys.unraisablehook = hook


def set_aside_damaged(folder: str, *, move: bool = True) -> list[tuple[int, str, str]]:
    """The damaged checkpoints above the newest complete one in a checkpoints folder, as
    (step, what is wrong, where it goes), newest first; with `move` each is renamed to
    `<step>.damaged` (kept for a look, out of orbax's sight) so that a resumed run continues
    from the newest complete one and can save those steps again."""
    out = []
    for step in reversed(steps(folder)):
        path = os.path.join(folder, str(step))
        bad = problem(path)
        if bad is None:
            break
        target, n = f"{path}.damaged", 1
        while os.path.exists(target):
            n += 1
            target = f"{path}.damaged{n}"
        if move:
            os.replace(path, target)
        out.append((step, bad, target))
    return out
