"""A run folder kept true across interruptions, reruns and moves (used by every trainer through
`sclaro_jax.run.loop.run_steps`).

- `GracefulStop`: SIGINT / SIGTERM ask the loop to stop after the current step; the trainer then
  waits for the checkpoint in flight, writes a final one and returns. A second SIGINT raises
  KeyboardInterrupt at once, a second SIGTERM kills the process.
- `unfinished_checkpoints`: orbax writes each checkpoint to `<step>.orbax-checkpoint-tmp*` and
  renames it when complete; such a folder found at start is a checkpoint that never finished.
- `truncate_logs`: on resume at step S, metrics.jsonl, eval.jsonl and the TensorBoard event
  files keep only steps <= S, so the replayed steps appear once.
- (`sclaro_jax.run.lock`: one writer per workdir.)
- `config_changes` / `write_config`: a resumed run's config is compared with the one its steps
  were taken with (config.json); only `SAFE_KEYS` may change unless the caller allows it, and then
  the old config is kept as `config.until-step-<S>.json` with a line in config_changes.jsonl.
  The run's length is not among them: it sets the learning-rate schedule (`LENGTH_KEYS`).
- `check_data_state`: the data iterator's saved state names the dataset by its manifest's
  content hash (`ShardedDataset.source`), so a moved dataset or workdir resumes and another
  dataset is refused by name.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import struct
import sys
import threading

from sclaro_jax import bounds
from sclaro_jax.config import flatten
from sclaro_jax.files import (UnsafePathError, open_new, probe_writable, refuse_shared_folder,
                              write_replacing)

log = logging.getLogger(__name__)

# Config keys (dotted prefixes) that a resumed run may change: how long it runs, how often it
# logs, saves and evaluates, where its data lies (the dataset itself is checked by content), how
# the devices share the work (checkpoints restore onto another layout) and how the step is
# computed (`perf`: the same numbers, the same optimiser state).
# The detector's recipe (configs/detection.py) keeps its length and evaluation at the top level.
SAFE_KEYS = ("log_every", "checkpoint_every", "keep_checkpoints", "checkpoint_async",
             "progress_bar", "compilation_cache", "compile_threads", "evals", "data.dir",
             "sharding", "distributed", "perf", "eval_split", "eval_batch_size",
             "backbone.workdir")
# The keys that set a run's length (ScenarioCLIP: train.*; the detector: top level). The warm-up /
# cosine schedule spans the run's length, so a new length changes the learning rate from the
# resumed step on: a change like any other of the recipe (refused unless allowed, then logged
# with what happens to the schedule).
LENGTH_KEYS = ("train.steps", "train.epochs", "epochs")
TMP_SUFFIX = ".orbax-checkpoint-tmp"
# How Grain's own ArrayRecord source named a dataset in iterator states saved before dataset
# identities (a hash of the shards' absolute paths).
LEGACY_SOURCE = "ArrayRecordDataSource("


class RunError(ValueError):
    """A run that cannot continue as asked; the message says what to do."""


class ConfigDriftError(RunError):
    pass


class DatasetMismatchError(RunError):
    pass


class GracefulStop:
    """Context manager: the first SIGINT / SIGTERM sets `requested` (the signal's name); the
    handlers are restored on exit. Outside the main thread (where signals cannot be caught)
    it does nothing. A SIGINT that the process ignores (started in the background of a
    non-interactive shell) stays ignored."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            current = signal.getsignal(sig)
            if current is signal.SIG_IGN:
                continue
            self._previous[sig] = current
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        self.requested = name
        # the second one acts at once
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.warning("%s received: stopping after the current step and saving a checkpoint "
                    "(send it again to abort at once)", name)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        return False


def unfinished_checkpoints(directory: str, *, remove: bool = True) -> list[str]:
    """The names of the checkpoint folders in `directory` that orbax never finished writing
    (removed with `remove`: orbax cannot use them)."""
    if not os.path.isdir(directory):
        return []
    names = sorted(n for n in os.listdir(directory) if TMP_SUFFIX in n)
    if remove:  # orbax's own folders: a link of that name is removed, never followed
        for name in names:
            path = os.path.join(directory, name)
            if os.path.islink(path) or not os.path.isdir(path):
                os.remove(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
    return names


def _keep_lines(path: str, step: int) -> int:
    """Rewrite a JSON-lines log keeping the rows with "step" <= `step` (and dropping a torn last
    line); returns how many rows were dropped."""
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = bounds.parse_json(line, path)
            except ValueError:  # not JSON, or nested too deep: a torn or foreign row
                dropped += 1
                continue
            if isinstance(row, dict) and row.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        write_replacing(path, lambda f: f.writelines(kept), text=True)
    return dropped


def _event_records(data: bytes):
    """(offset, end) of each complete TFRecord in an event file's bytes: uint64 length, uint32
    length crc, payload, uint32 payload crc. A torn last record is left out."""
    offset = 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        end = offset + 12 + length + 4
        if end > len(data):
            return
        yield offset, end
        offset = end


# Packages tensorboardX imports at its own import time when they are installed, only for what
# sclaro_jax never does: torch to accept torch tensors (sclaro_jax never imports torch), boto3
# to write to s3:// folders (a run's folder is a local path). Each costs seconds at every start
# (boto3 alone: 2.1 s of a 2-step demo run's 11 s, measured); they are hidden while it imports.
TENSORBOARDX_HIDDEN = ("torch", "boto3")


def import_tensorboardx(module: str = "tensorboardX"):
    """`importlib.import_module(module)` (tensorboardX or one of its modules) with the packages
    of `TENSORBOARDX_HIDDEN` hidden (an `import` of one of them raises ImportError, which
    tensorboardX reads as "not installed") unless this process imported them already.
    ImportError without tensorboardX."""
    import importlib

    hidden = [name for name in TENSORBOARDX_HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import name` then raises ImportError
    try:
        return importlib.import_module(module)
    finally:
        for name in hidden:
            del sys.modules[name]


def _truncate_events(path: str, step: int) -> int:
    event_pb2 = import_tensorboardx("tensorboardX.proto.event_pb2")

    with open(path, "rb") as f:
        data = f.read()
    kept, dropped, whole = [], 0, 0
    for start, end in _event_records(data):
        whole = end
        event = event_pb2.Event()
        event.ParseFromString(data[start + 12:end - 4])
        if event.HasField("summary") and event.step > step:
            dropped += 1
        else:
            kept.append(data[start:end])
    if dropped or whole < len(data):  # steps past `step`, or a torn last record
        write_replacing(path, lambda f: f.write(b"".join(kept)))
    return dropped


def truncate_logs(workdir: str, step: int) -> int:
    """Cut WORKDIR's metrics.jsonl, eval.jsonl and TensorBoard event files back to `step` (the
    step a run resumes from); returns the number of rows dropped."""
    dropped = sum(_keep_lines(os.path.join(workdir, name), step)
                  for name in ("metrics.jsonl", "eval.jsonl"))
    events = os.path.join(workdir, "tensorboard")
    if os.path.isdir(events):
        for name in sorted(os.listdir(events)):
            if name.startswith("events.out.tfevents"):
                dropped += _truncate_events(os.path.join(events, name), step)
    if dropped:
        log.info("dropped %d logged rows after step %d (they are replayed now)", dropped, step)
    return dropped


def plain(config) -> dict:
    """A config as plain JSON values (what config.json holds)."""
    return json.loads(config.to_json_best_effort())


def _safe(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in SAFE_KEYS)


def config_changes(workdir: str, config) -> tuple[dict, dict]:
    """(unsafe, safe) differences between WORKDIR/config.json and `config`: dotted key ->
    (saved, now). Both empty when there is no config.json. A key the saved config lacks (one
    added to the code after the run started) counts as safe, with a warning naming it."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return {}, {}
    saved = flatten(bounds.read_json(path))
    now = flatten(plain(config))
    missing = object()
    diff = {k: (saved.get(k, missing), now.get(k, missing)) for k in sorted(saved.keys() | now.keys())
            if saved.get(k, missing) != now.get(k, missing)}
    diff = {k: tuple("(absent)" if v is missing else v for v in pair) for k, pair in diff.items()}
    # keys the run's config.json predates (added to the code since): taken as they are now
    new = {k: v for k, v in diff.items() if v[0] == "(absent)"}
    for k, (_, now_value) in new.items():
        log.warning("the run's config.json predates the config key %s: continuing with %s=%r",
                    k, k, now_value)
    unsafe = {k: v for k, v in diff.items() if not _safe(k) and k not in new}
    safe = {k: v for k, v in diff.items() if _safe(k) or k in new}
    return unsafe, safe


def length_changes(unsafe: dict) -> dict:
    """The changes among `unsafe` that set the run's length (`LENGTH_KEYS`)."""
    return {k: v for k, v in unsafe.items() if k in LENGTH_KEYS}


def refuse_drift(workdir: str, step: int, unsafe: dict) -> None:
    lines = "\n".join(f"  {k}: {saved!r} in the run, {now!r} now"
                      for k, (saved, now) in unsafe.items())
    length = ""
    if length_changes(unsafe):
        length = ("The run's length sets its warm-up / cosine learning-rate schedule: another "
                  f"length re-stretches the schedule from step {step} on (the learning rate "
                  "jumps there).\n")
    raise ConfigDriftError(
        f"{workdir} holds a run at step {step} trained with another config:\n{lines}\n{length}"
        "Rerun with the run's settings to continue it, use another --workdir for a new run, or "
        "pass --allow-config-change to continue with the new settings (both configs are kept).")


def write_config(workdir: str, config, *, step: int, unsafe: dict) -> None:
    """Write WORKDIR/config.json (atomically). With `unsafe` changes allowed at `step`, the
    previous file is kept as config.until-step-<step>.json and the change is appended to
    config_changes.jsonl."""
    path = os.path.join(workdir, "config.json")
    if unsafe and os.path.exists(path):
        os.replace(path, os.path.join(workdir, f"config.until-step-{step}.json"))
        with open_new(os.path.join(workdir, "config_changes.jsonl"), append=True,
                      text=True) as f:
            f.write(json.dumps({"step": step, "changes": {
                k: {"before": a, "after": b} for k, (a, b) in unsafe.items()}}) + "\n")
    write_replacing(path, lambda f: f.write(config.to_json_best_effort(indent=2)), text=True)


def saved_data_state(step_dir: str) -> dict | None:
    """This process's saved Grain iterator state in a checkpoint step folder (None if absent)."""
    folder = os.path.join(step_dir, "data")
    if not os.path.isdir(folder):
        return None
    names = sorted(n for n in os.listdir(folder) if n.startswith("process_"))
    if not names:
        return None
    import jax
    mine = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    return bounds.read_json(os.path.join(folder, mine if mine in names else names[0]))


def check_data_state(workdir: str, step: int, state: dict | None, dataset, workers: int) -> None:
    """Refuse to resume on another dataset (DatasetMismatchError naming both) or another
    worker count. A state saved before dataset identities (its source a hash of absolute
    paths) is restored without the dataset check, with a warning."""
    if state is None:
        return
    saved = str(state.get("data_source", ""))
    current = dataset.source_id("train")
    if saved.startswith(LEGACY_SOURCE):
        log.warning("the checkpoint of step %d predates dataset identities: the dataset in "
                    "%s is not checked against the one the run was trained on", step,
                    dataset.root)
        return
    if saved != current:
        info = read_run_info(workdir)
        where = f" (at {info['dataset']} when the run started)" if info.get("dataset") else ""
        raise DatasetMismatchError(
            f"{workdir} was trained on another dataset: its checkpoint of step {step} reads "
            f"{saved}{where}, and config.data.dir {dataset.root} is {current}. Point "
            "--config.data.dir at the run's dataset (a moved or copied folder is fine), or use "
            "another --workdir for a new run.")
    if int(state.get("worker_count", workers)) != workers:
        raise RunError(
            f"{workdir}: the checkpoint of step {step} was written with config.data.workers="
            f"{state['worker_count']} and the data position is kept per worker process; rerun "
            f"with --config.data.workers={state['worker_count']} (change it in a new run).")


def read_run_info(workdir: str) -> dict:
    path = os.path.join(workdir, "run.json")
    if not os.path.exists(path):
        return {}
    return bounds.read_json(path)


def write_run_info(workdir: str, dataset) -> None:
    """WORKDIR/run.json: where the dataset was and its identity, for the messages above."""
    write_replacing(os.path.join(workdir, "run.json"), lambda f: json.dump(
        {"dataset": dataset.root, "dataset_sha256": dataset.identity}, f, indent=2), text=True)


class PortableIterator:
    """A Grain DataLoader iterator as orbax's PyGrain handler sees it, whose `set_state`
    accepts a state saved before dataset identities (the source rewritten to today's)."""

    def __init__(self, iterator, source_repr: str, workers: int = 0):
        self.iterator = iterator
        self.source_repr = source_repr
        self.workers = workers
        self._fresh = True  # the worker processes start at the first `next`

    def __iter__(self):
        return self

    def __next__(self):
        return self._starting(lambda: next(self.iterator))

    def start(self) -> None:
        """Start the worker processes now (they make the first batches while the caller goes
        on, e.g. waiting for the step's compilation), as the first `next` would."""
        self._starting(self.start_prefetch)

    def _starting(self, action):
        if not (self._fresh and self.workers) or \
                threading.current_thread() is not threading.main_thread():
            return action()
        # Start the worker processes with SIGINT ignored (a disposition they inherit), so Ctrl-C
        # in a terminal, which reaches the whole process group, stops this process gracefully
        # instead of killing its workers with KeyboardInterrupt. SIGINT is blocked meanwhile:
        # one that arrives stays pending and reaches this process's handler once restored.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return action()
        finally:
            self._fresh = False
            signal.signal(signal.SIGINT, previous)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def get_state(self) -> bytes:
        return self.iterator.get_state()

    def set_state(self, state: bytes) -> None:
        data = bounds.parse_json(state, "the data iterator's saved state")
        if str(data.get("data_source", "")).startswith(LEGACY_SOURCE):
            data["data_source"] = self.source_repr
            state = json.dumps(data, indent=4).encode()
        self.iterator.set_state(state)
        self._fresh = True

    def start_prefetch(self) -> None:
        if hasattr(self.iterator, "start_prefetch"):
            self.iterator.start_prefetch()


def check_workdir(workdir: str) -> None:
    """RunError naming WORKDIR unless it is (or can be made) a folder this process can write
    and others cannot (`files.refuse_shared_folder`)."""
    try:
        os.makedirs(workdir, exist_ok=True)
        probe_writable(workdir, ".write-test-")
    except OSError as e:
        raise RunError(f"cannot write to the workdir {workdir} ({e.strerror or e}); pass a "
                       "--workdir in a folder you can write") from None
    try:
        refuse_shared_folder(workdir)
    except UnsafePathError as e:
        raise RunError(f"the workdir {e}") from None
