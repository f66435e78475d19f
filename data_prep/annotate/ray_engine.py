"""`python -m data_prep annotate --engine ray`: the three stages as a Ray Data pipeline.

The source becomes a Ray dataset with one row per image (block, id, path, ...) and one Ray block
per annotation block (the same fixed chunks of `--batch-size` images as `--engine local`). Each
stage is a `map_batches` over an actor class that loads its model once per actor and runs the stage
function of `data_prep.annotate.stages` on one whole block at a time:

    vlm      stage 1 (reads the images, asks the VLM, parses and triages the replies)
    detector stage 2 (GroundingDINO on the images that kept objects and relations)
    sam      stage 3 (SAM masks, focused regions, the encoded records)

Stages run concurrently and stream: while SAM works on block 3, GroundingDINO can be on block 4 and
the VLM on block 5, with Ray's backpressure bounding what waits between them. Each stage has its
own pool of actors (`--stage-concurrency detector=2`) and its own GPU share (`--vlm-gpus 1
--detector-gpus 0.5 --sam-gpus 0.5` lets GroundingDINO and SAM share one GPU).

`BlockSink`, a Ray `Datasink`, writes each block's ArrayRecord shard and marker under the block's
own name (`WORK/blocks/NNNNNN.*`), so a retried task replaces its own files and never duplicates a
record. A block whose stage raises, or whose actor dies, is retried (`--retries`, default 2) by
Ray; the driver writes the dataset, manifest and vocabularies only after every block has landed. A
rerun (with either engine) skips the finished blocks.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import signal
import time

import numpy as np

from data_prep.annotate import stages
from data_prep.annotate.ray_start import start_ray
from data_prep.source_items import SourceItem
from sclaro_jax.files import open_new

log = logging.getLogger("data_prep.annotate")

# stage key (as in data_prep.annotate.keys) -> the name users give it, its GPU setting
STAGES = {"vlm": ("vlm", "vlm_gpus"), "detect": ("detector", "detector_gpus"),
          "segment": ("sam", "sam_gpus")}
STAGE_NAMES = {"vlm": "vlm", "detector": "detect", "detect": "detect", "sam": "segment",
               "segment": "segment"}
STAGE_LABELS = {"vlm": "vlm", "detect": "detector", "segment": "sam", "write": "write"}
SINK_CPUS = 0.25  # a block write is light: leave the CPUs to the stage actors
MIN_AUTO_CPUS = 0.25  # --stage-cpus auto never gives an actor less than this
INSTALL = 'pip install -e ".[cluster]" from the sclaro-jax checkout (Ray Data)'


def check_ray() -> None:
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"--engine ray needs Ray Data, which is not installed ({e}): "
                           f"{INSTALL}") from None


def parse_concurrency(specs) -> dict:
    """('detector=2', 'sam=1') or ('2',) -> {stage key: actors}."""
    out = {}
    for spec in specs:
        name, sep, value = str(spec).partition("=")
        if not sep:
            name, value = "", name
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--stage-concurrency {spec!r}: expected STAGE=N with N >= 1 (or "
                             f"N for every stage); stages: vlm, detector, sam")
        if not name:
            out.update({k: n for k in STAGES})
        elif name in STAGE_NAMES:
            out[STAGE_NAMES[name]] = n
        else:
            raise ValueError(f"--stage-concurrency {spec!r}: unknown stage {name!r}; stages: "
                             f"vlm, detector, sam")
    return out


# --------------------------------------------------------------------------- rows


def _rows(batch) -> list[dict]:
    cols = {k: list(v) for k, v in batch.items()}
    n = len(next(iter(cols.values()))) if cols else 0
    return [{k: _plain(v[i]) for k, v in cols.items()} for i in range(n)]


def _plain(v):
    return v.item() if isinstance(v, np.generic) else v


def _columns(rows: list[dict]) -> dict:
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            out[key] = np.asarray(values, np.int64)
        elif all(isinstance(v, float) for v in values):
            out[key] = np.asarray(values, np.float64)
        else:
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
            out[key] = arr
    return out


def _by_block(rows: list[dict]) -> list[tuple[int, list[dict]]]:
    groups: dict[int, list[dict]] = collections.OrderedDict()
    for r in rows:
        groups.setdefault(r["block"], []).append(r)
    return list(groups.items())


def _item(r: dict) -> SourceItem:
    return SourceItem(id=r["id"], source=r["source"], path=r["path"],
                      action=r["action"] or None, caption=r["caption"] or None,
                      **json.loads(r["locator"]))


def source_frames(run) -> list:
    """One pandas DataFrame (one Ray block) per block still to do."""
    import pandas as pd
    frames = []
    for k, chunk in run.todo():
        inputs = json.dumps(run.inputs.of("segment", k), sort_keys=True)
        frames.append(pd.DataFrame({
            "block": np.full(len(chunk), k, np.int64),
            "n": np.full(len(chunk), len(chunk), np.int64),
            "id": [it.id for it in chunk], "source": [it.source for it in chunk],
            "path": [it.path for it in chunk], "action": [it.action or "" for it in chunk],
            "caption": [it.caption or "" for it in chunk],
            "locator": [json.dumps(it.locator()) for it in chunk],  # a tar member, a row
            "inputs": [inputs] * len(chunk)}))
    return frames


# --------------------------------------------------------------------------- faults (tests)


def maybe_fault(cfg, stage: str, k: int) -> None:
    """Inject the configured fault for (stage, block) once: raise, or SIGKILL this process. A
    flag file in the work folder makes the retried task go through."""
    for st, block, kind in cfg.faults:
        if st != stage or block != k:
            continue
        folder = os.path.join(cfg.work_dir, "faults")
        os.makedirs(folder, exist_ok=True)
        try:
            open_new(os.path.join(folder, f"{stage}-{k}-{kind}")).close()
        except FileExistsError:
            continue
        log.warning("injecting a fault (%s) into stage %s, block %d", kind, stage, k)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault in stage {stage}, block {k}")


def retrying(cfg, stage: str, k: int, attempt_block):
    """attempt_block() for block k, tried again up to `cfg.retries` times when it raises; then
    the error stops the run, naming stage and block."""
    for attempt in range(cfg.retries + 1):
        try:
            maybe_fault(cfg, stage, k)
            return attempt_block()
        except Exception as e:
            if attempt == cfg.retries:
                raise RuntimeError(f"stage {STAGE_LABELS.get(stage, stage)}, block {k}: "
                                   f"{type(e).__name__}: {e} (tried {cfg.retries + 1} "
                                   f"times)") from e
            log.warning("stage %s, block %d: %s: %s; retrying (%d of %d)",
                        STAGE_LABELS.get(stage, stage), k, type(e).__name__, e, attempt + 1,
                        cfg.retries)


# --------------------------------------------------------------------------- stage actors


def _worker_setup(cfg, stage: str) -> str:
    """Logging, torch threads and the device of a stage actor. The VLM stage reading its
    replies from a file (`--vlm-replies`) runs no model: its actor never imports torch."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if stage == "vlm" and cfg.vlm_replies:
        return "cpu"
    import ray
    import torch
    gpus = ray.get_gpu_ids()
    device = cfg.device or ("cuda" if gpus and torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(max(1, int(cfg.stage_cpus)))
    return device


class _Stage:
    stage = ""

    def __init__(self, cfg):
        self.cfg = cfg
        self.model = stages.STAGE_LOADERS[self.stage](cfg, _worker_setup(cfg, self.stage))

    def __call__(self, batch) -> dict:
        out = []
        for k, rows in _by_block(_rows(batch)):
            t0 = time.perf_counter()
            chunk = [_item(r) for r in rows]
            rows, n = retrying(self.cfg, self.stage, k,  # each try on its own copy of the rows
                               lambda: self.block(chunk, [dict(r) for r in rows]))
            seconds = time.perf_counter() - t0
            for r in rows:
                r[f"t_{self.stage}"] = float(seconds)
                r[f"n_{self.stage}"] = int(n)
            out.extend(rows)
        return _columns(out)

    def block(self, chunk: list, rows: list[dict]) -> tuple[list[dict], int]:
        raise NotImplementedError

    @staticmethod
    def images(chunk: list, ids) -> dict:
        """The images of `ids`, which stage 1 read; a file that stopped reading is an error
        (the block is retried)."""
        from data_prep import sources
        want = [it for it in chunk if it.id in ids]
        out = {}
        for it in want:
            out[it.id] = sources.read_image(it)  # SourceError: the block is retried
        return out


class VLMStage(_Stage):
    stage = "vlm"

    def block(self, chunk, rows):
        started = time.time()
        images = stages.load_images(chunk)
        results = stages.run_vlm(self.model, chunk, images, self.cfg.vlm_replies)
        status, parsed = stages.triage(chunk, images, results)
        for it, r in zip(chunk, rows):
            r["vlm"] = json.dumps(results[it.id]) if it.id in results else ""
            r["state"], r["reason"] = status.get(it.id, ["", ""])
            r["parsed"] = json.dumps(parsed[it.id]) if it.id in parsed else ""
            r["started"] = started
        return rows, sum(not isinstance(v, Exception) for v in images.values())


class DetectStage(_Stage):
    stage = "detect"

    def block(self, chunk, rows):
        parsed = {r["id"]: json.loads(r["parsed"]) for r in rows if not r["state"]}
        todo = [it.id for it in chunk if it.id in parsed]
        found = stages.run_detect(self.model, todo, self.images(chunk, parsed), parsed)
        for r in rows:
            r["dets"] = json.dumps(found[r["id"]]) if r["id"] in found else ""
        return rows, len(todo)


class SegmentStage(_Stage):
    stage = "segment"

    def block(self, chunk, rows):
        status = {r["id"]: [r["state"], r["reason"]] for r in rows if r["state"]}
        parsed = {r["id"]: json.loads(r["parsed"]) for r in rows if not r["state"]}
        dets = {r["id"]: json.loads(r["dets"]) for r in rows if r["dets"]}
        images = self.images(chunk, {i for i in parsed if dets.get(i)})
        records, status, dropped, n_seg = stages.run_segment(
            self.model, chunk, images, parsed, dets, status, self.cfg.region_quality)
        kept = iter(records)
        for r in rows:
            r["state"], r["reason"] = status[r["id"]]
            r["record"] = next(kept) if r["state"] == "kept" else b""
            r["dropped"] = json.dumps(dict(dropped))
            del r["parsed"], r["dets"]
        return rows, n_seg


ACTORS = {"vlm": VLMStage, "detect": DetectStage, "segment": SegmentStage}


# --------------------------------------------------------------------------- the sink


try:
    from ray.data import Datasink as _Datasink
except ImportError:  # without Ray installed, --engine ray stops in check_ray first
    _Datasink = object


class BlockSink(_Datasink):
    """Writes each block's shard and marker (`annotate_stages.write_block`) under the block's
    own name; a retried write replaces them."""

    def __init__(self, cfg, run_id: str):
        self.cfg = cfg
        self.run_id = run_id

    def get_name(self) -> str:
        return "AnnotationBlocks"

    def write(self, blocks, ctx) -> list[int]:
        import pyarrow as pa
        rows = []
        for block in blocks:
            table = block if isinstance(block, pa.Table) else pa.Table.from_pandas(block)
            rows.extend(table.to_pylist())
        written = []
        for k, rs in _by_block(rows):
            if len(rs) != rs[0]["n"]:
                raise RuntimeError(f"block {k} reached the writer with {len(rs)} of its "
                                   f"{rs[0]['n']} images")
            retrying(self.cfg, "write", k, lambda: self._write(k, rs))
            written.append(k)
        return written

    def _write(self, k: int, rs: list[dict]) -> None:
        results = {r["id"]: json.loads(r["vlm"]) for r in rs if r["vlm"]}
        stages.write_block(
            self.cfg.work_dir, k, [r["id"] for r in rs],
            [r["record"] for r in rs if r["state"] == "kept"],
            {r["id"]: [r["state"], r["reason"]] for r in rs}, json.loads(rs[0]["inputs"]),
            notes=stages.parse_notes(results),
            dropped=collections.Counter(json.loads(rs[0]["dropped"])),
            stage_seconds={s: rs[0][f"t_{s}"] for s in ACTORS},
            stage_images={s: rs[0][f"n_{s}"] for s in ACTORS}, run=self.run_id, engine="ray",
            started=min(r["started"] for r in rs))


# --------------------------------------------------------------------------- the driver


def _resources(cfg) -> tuple[dict, dict, float]:
    """(actors per stage, GPUs per actor of each stage, CPUs per actor), checked."""
    import ray
    actors = {k: 1 for k in STAGES}
    actors.update(dict(cfg.stage_concurrency))
    total = ray.cluster_resources()
    have_gpus, have_cpus = total.get("GPU", 0), total.get("CPU", 0)
    gpus = {}
    for k, (name, field) in STAGES.items():
        g = float(getattr(cfg, field))
        if g < 0:
            raise ValueError(f"--{field.replace('_', '-')} must be >= 0, got {g}")
        gpus[k] = 0.0 if cfg.device == "cpu" else g
    if any(gpus.values()) and not have_gpus:
        if cfg.device == "cuda":
            raise ValueError("--device cuda, but the Ray cluster has no GPU")
        log.warning("the Ray cluster has no GPU: the stage actors run on the CPU")
        gpus = {k: 0.0 for k in gpus}
    for k, g in gpus.items():
        if g > have_gpus and have_gpus:
            raise ValueError(f"--{STAGES[k][1].replace('_', '-')} {g}: one actor needs more "
                             f"GPUs than the cluster's {have_gpus:g}")
    n_actors = sum(actors[k] for k in STAGES)
    pools = ", ".join(f"{STAGES[k][0]} {actors[k]}" for k in STAGES)
    if (cpus := auto_stage_cpus(have_cpus, n_actors, cfg.stage_cpus)) is None:
        raise ValueError(
            f"--stage-cpus auto: the Ray cluster's {have_cpus:g} CPUs cannot hold {n_actors} "
            f"stage actors ({pools}) of at least {MIN_AUTO_CPUS:g} CPUs each plus {SINK_CPUS} "
            f"for writing: lower --stage-concurrency, pass a smaller --stage-cpus, or run on a "
            f"machine (or --ray-address cluster) with more CPUs")
    if cpus <= 0:
        raise ValueError(f"--stage-cpus must be > 0 (or auto), got {cpus:g}")
    if (need_cpus := n_actors * cpus + SINK_CPUS) > have_cpus + 1e-9:
        raise ValueError(
            f"the stage actors need {need_cpus:g} CPUs ({pools} actors x --stage-cpus "
            f"{cpus:g}, plus {SINK_CPUS} for writing) but the Ray cluster has {have_cpus:g}: "
            f"lower --stage-cpus or --stage-concurrency")
    if (need_gpus := sum(actors[k] * gpus[k] for k in STAGES)) > have_gpus + 1e-9:
        log.warning("the stage actors ask for %g GPUs and the cluster has %g: some actors wait "
                    "for a GPU (lower --stage-concurrency or the --*-gpus fractions)",
                    need_gpus, have_gpus)
    return actors, gpus, cpus


def auto_stage_cpus(have_cpus: float, n_actors: int, setting="auto") -> float | None:
    """CPUs per stage actor: a number `setting`, or for `auto` the cluster's less the writer's,
    shared, at most 1 each (floored to 0.01); None if that is under MIN_AUTO_CPUS."""
    if setting != "auto":
        return float(setting)
    share = min(1.0, int((have_cpus - SINK_CPUS) / max(1, n_actors) * 100) / 100)
    return share if share >= MIN_AUTO_CPUS else None


def run(run_state) -> dict:
    """Annotate the blocks `run_state` (a `data_prep.annotate.Run`) has left, then finish."""
    import ray
    cfg = run_state.cfg
    todo = run_state.todo()
    started = False
    if todo:
        if not ray.is_initialized():
            try:
                start_ray(cfg.ray_address)
            except Exception as e:  # ConnectionError, a timeout, ...
                where = (f"the Ray cluster at --ray-address {cfg.ray_address}"
                         if cfg.ray_address else "Ray on this machine")
                raise RuntimeError(f"cannot start or reach {where}: {type(e).__name__}: {e} "
                                   f"(start one with `ray start --head`, or leave "
                                   f"--ray-address out to start Ray here)") from None
            started = True
        try:
            _pipeline(run_state, cfg, todo)
        finally:
            if started:
                ray.shutdown()
    for line in run_state.scan_blocks():  # the blocks the pipeline wrote
        log.warning("%s", line)
    return run_state.finish()


def _pipeline(run_state, cfg, todo) -> None:
    import ray
    from ray.data import DataContext
    actors, gpus, cpus = _resources(cfg)
    cfg = dataclasses.replace(cfg, stage_cpus=cpus)  # the actors' torch threads follow it
    ctx = DataContext.get_current()
    ctx.target_max_block_size = None  # never split a block: the sink writes whole blocks
    ctx.enable_progress_bars = cfg.progress
    ctx.print_on_execution_start = False
    log.warning("annotating %d blocks (%d images) with Ray: %s", len(todo),
                sum(len(c) for _, c in todo),
                ", ".join(f"{STAGES[k][0]} {actors[k]} actor{'s' * (actors[k] != 1)}"
                          f" x {cpus:g} CPU{f' + {gpus[k]:g} GPU' if gpus[k] else ''}"
                          for k in STAGES))
    ds = ray.data.from_pandas(source_frames(run_state))
    for k, actor in ACTORS.items():
        # an actor that dies is restarted and its block retried by Ray; a stage that raises is
        # retried in the actor (`retrying`)
        ds = ds.map_batches(actor, fn_constructor_args=(cfg,), batch_size=None,
                            compute=ray.data.ActorPoolStrategy(size=actors[k]),
                            num_cpus=cpus, num_gpus=gpus[k])
    ds.write_datasink(BlockSink(cfg, run_state.run_id), ray_remote_args={"num_cpus": SINK_CPUS})
