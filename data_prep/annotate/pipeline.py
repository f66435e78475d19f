"""`python -m data_prep annotate`: images -> SCLARO records, the three stages of appendix A.

    Stage 1  VLM (Ovis-Gemma 9B by default): action, objects (<= 10), relation triplets, caption
             (`data_prep.vlm`); Multi-Moments in Time's ground-truth action replaces the VLM's.
    Stage 2  GroundingDINO: boxes for the stage-1 objects, thresholds 0.25 / 0.25, NMS at IoU 0.4
             (`data_prep.detect`). Images whose VLM reply has no objects or no relations are
             excluded before this stage; a reply without an action is kept with action ""
             (appendix: such images keep valid objects and relations).
    Stage 3  SAM: one mask per box; per relation the closest subject/object instance pair by
             box-centre distance and its focused-region image (`data_prep.segment`).

Two engines run the same stage code (`data_prep.annotate.stages`): `--engine local` (the
default) runs the stages one after another in this process; `--engine ray` runs them as a Ray
Data pipeline with a pool of actors per stage (`data_prep.annotate.ray_engine`), on one
multi-GPU node or a Ray cluster. Both write the same records and the same summary.

Resumable. Work goes in fixed blocks of `batch_size` images (the same blocks on every run, so a
model always sees the same batches). A finished block is one ArrayRecord shard of its records
plus a marker with every image's decision and the shard's checksum (`WORK/blocks/`, see
`data_prep.annotate.stages`); a rerun with the same work folder skips the finished blocks,
whichever engine wrote them. The local engine also caches stages 1 and 2 per block
(`vlm.jsonl`, `detect.jsonl`, fsynced JSON lines; a torn last line is cut off), so a killed run
loses at most the block in flight and no image is sent to a model twice once its result is on
disk. Cache entries are keyed by content (`data_prep.annotate.keys`): an edited reply or changed
weights redo the stages they feed, and the run says so. When every block has landed the
records are written as shards with `data_prep.shards.write_dataset` (schema version 2 with
`image_size` px training views; the originals only with `keep_originals`, while the block
shards always hold them, so a rerun with another `--image-size` only rewrites the dataset), and
`summary.json` counts kept / excluded / failed images by reason.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
import uuid
from typing import Callable, Iterable

from tqdm import tqdm

from data_prep.annotate import stages
from data_prep.annotate.stages import (load_detector, load_segmenter, load_vlm,
                                       pick_device)
from data_prep.annotate.keys import (HashMemo, StageInputs, check_run_key, config_key,
                                     replies_for)
from data_prep.durable_logs import JsonLog
from sclaro_jax.data import schema
from sclaro_jax.files import own_folder, write_replacing

log = logging.getLogger("data_prep.annotate")


@dataclasses.dataclass(frozen=True)
class AnnotateConfig:
    source: str  # a data_prep.sources kind: folder, mmit, cc3m, openpsg, pvsg, kitti2015,
    #              webdataset, hf
    root: str  # the source's root folder
    out: str  # dataset folder to write
    source_options: tuple = ()  # (key, value) pairs for data_prep.sources.iter_source
    work: str = ""  # caches (default: OUT + ".work")
    vlm: str = ""  # local folder of an image-text-to-text model
    vlm_replies: str = ""  # or a JSON file {image id: reply} of replies obtained elsewhere
    vlm_trust_remote_code: bool = False
    detector: str = ""  # local folder of a GroundingDINO model (save_pretrained layout)
    sam: str = ""  # SAM checkpoint file
    sam_type: str = "vit_h"
    device: str = ""  # "" = cuda when available, else cpu
    batch_size: int = 8
    box_threshold: float = 0.25
    text_threshold: float = 0.25
    nms_iou: float = 0.4
    region_quality: int = 95  # JPEG quality of the focused-region images
    limit: int = 0  # annotate only the first N images of the source (0 = all)
    split_seed: int = 42
    records_per_shard: int = 1000
    image_size: int | None = schema.DEFAULT_VIEW_SIZE  # view size of the shards (None: v1)
    keep_originals: bool = False  # also store the full-size photographs and regions
    overwrite: bool = False
    progress: bool = True
    # --engine ray (data_prep.annotate.ray_engine); none of these change the records
    engine: str = "local"  # local | ray
    ray_address: str = ""  # "" = start Ray on this machine; "auto" or HOST:PORT = a cluster
    vlm_gpus: float = 1.0  # GPUs per stage actor (fractions share a GPU)
    detector_gpus: float = 0.5
    sam_gpus: float = 0.5
    stage_cpus: float | str = "auto"  # CPUs per stage actor; auto: the cluster's, shared
    stage_concurrency: tuple = ()  # (stage, actors) pairs; a stage not named gets 1
    retries: int = 2  # attempts after the first for a block that raises or whose actor dies
    faults: tuple = ()  # testing only: (stage, block, "raise" | "kill") injected once each
    # speed switches (`data_prep.annotate.cli`'s "speed" group): the first four give the
    # records of the default path (the same boxes and tokens; SDPA / compiled SAM the same
    # masks to float rounding); bf16 changes them by bf16 rounding, so it is in run.json
    detector_text_once: bool = False  # GroundingDINO's text encoder once per distinct prompt
    sam_sdpa: bool = False  # SAM's image-encoder attention through scaled_dot_product_attention
    sam_compile: bool = False  # torch.compile of SAM's image encoder
    vlm_static_cache: bool = False  # static KV cache in the VLM's greedy generate
    bf16: bool = False  # GroundingDINO and SAM under torch.autocast(bfloat16)

    @property
    def work_dir(self) -> str:
        return self.work or self.out.rstrip("/") + ".work"


# --------------------------------------------------------------------------- models


@dataclasses.dataclass
class Models:
    """The three stage models. `vlm(images) -> replies`; `detector(images, objects) ->
    [[Detection]]`; `segmenter(image array, boxes) -> bool masks [N, H, W]`."""
    vlm: Callable
    detector: Callable
    segmenter: Callable


MODEL_FLAGS = (("--vlm", "vlm", "an image-text-to-text model folder, e.g. Ovis-Gemma 9B"),
               ("--vlm-replies", "vlm_replies", "a JSON file {image id: reply text}"),
               ("--detector", "detector", "grounding-dino-base saved with save_pretrained"),
               ("--sam", "sam", "sam_vit_h_4b8939.pth"))


def check_model_flags(cfg: AnnotateConfig) -> None:
    """Every model flag given, and each path there: checked before any work starts."""
    missing = [flag for flag, value in (("--vlm", cfg.vlm or cfg.vlm_replies),
                                        ("--detector", cfg.detector), ("--sam", cfg.sam))
               if not value]
    if missing:
        raise ValueError(
            f"annotate needs local model weights; missing {', '.join(missing)} (no model hub is "
            f"reachable: pass --vlm DIR (an image-text-to-text model folder, e.g. Ovis-Gemma 9B) "
            f"or --vlm-replies FILE, --detector DIR (grounding-dino-base saved with "
            f"save_pretrained) and --sam FILE (sam_vit_h_4b8939.pth))")
    for flag, field, what in MODEL_FLAGS:
        path = getattr(cfg, field)
        if path and not os.path.exists(path):
            raise FileNotFoundError(f"{flag} {path}: no such file or folder; pass {flag} with "
                                    f"the path of {what}")


def load_models(cfg: AnnotateConfig) -> Models:
    """The configured models; a clear error for each one not given or not found."""
    check_model_flags(cfg)
    device = pick_device(cfg)
    return Models(vlm=load_vlm(cfg, device), detector=load_detector(cfg, device),
                  segmenter=load_segmenter(cfg, device))


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Summary:
    images: int = 0
    kept: int = 0
    from_cache: int = 0  # images of chunks whose every stage was cached
    excluded: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    parse_notes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    dropped_relations: collections.Counter = dataclasses.field(
        default_factory=collections.Counter)
    stage_seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    stage_images: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict:
        return {
            "images": self.images, "kept": self.kept, "images_from_cache": self.from_cache,
            "excluded": dict(sorted(self.excluded.items())),
            "failed": dict(sorted(self.failed.items())),
            "vlm_parse_recoveries": dict(sorted(self.parse_notes.items())),
            "relations_dropped": dict(sorted(self.dropped_relations.items())),
            "stage_seconds_this_run": {k: round(v, 3) for k, v in self.stage_seconds.items()},
            "stage_images_this_run": dict(self.stage_images),
        }


def _chunks(items: list, size: int) -> Iterable[tuple[int, list]]:
    for k in range(0, len(items), size):
        yield k // size, items[k:k + size]


class Run:
    """What both engines share for one invocation: the items in fixed chunks, the work folder
    (settings in run.json, content hashes of the stage inputs, the local engine's stage caches)
    and the blocks already finished by either engine."""

    def __init__(self, cfg: AnnotateConfig, items: list, stage1=None):
        self.cfg = cfg
        self.items = items
        ids = [it.id for it in items]
        dup = [i for i, c in collections.Counter(ids).items() if c > 1]
        if dup:
            raise ValueError(f"source yields duplicate image ids, e.g. {dup[:3]}")
        replies = replies_for(cfg, stage1, ids)
        work = cfg.work_dir
        own_folder(work, flag="--work")  # made and marked, or an earlier run's
        self.run_id = uuid.uuid4().hex
        self.vlm_log = JsonLog(os.path.join(work, "vlm.jsonl"))
        self.detect_log = JsonLog(os.path.join(work, "detect.jsonl"))
        blocks_dir = os.path.join(work, stages.BLOCKS)
        has_blocks = os.path.isdir(blocks_dir) and any(
            n.endswith(".json") for n in os.listdir(blocks_dir))
        check_run_key(work, config_key(cfg), has_work=has_blocks or any(
            f.entries for f in (self.vlm_log, self.detect_log)))
        gone = stages.clear_partial_blocks(work)
        if gone:
            log.warning("%s: removed %d files of block writes that were interrupted", work, gone)
        self.chunks = list(_chunks(items, cfg.batch_size))
        self.memo = HashMemo(os.path.join(work, "hashes.json"))
        self.inputs = StageInputs(cfg, self.chunks, replies, self.memo)
        problems = self.scan_blocks()
        self.vlm_done = self.inputs.fresh("vlm", self.vlm_log.entries)
        self.detect_done = self.inputs.fresh("detect", self.detect_log.entries)
        for line in problems + self.inputs.report():
            log.warning("%s", line)
        self.cached_images = sum(len(self.done[k]["ids"]) for k in self.done)

    def scan_blocks(self) -> list[str]:
        """Set `done` (chunk -> marker) to the blocks on disk that are complete and were made
        from the current inputs; returns a line per block found damaged."""
        intact, problems = stages.finished_blocks(self.cfg.work_dir, self.chunks, self.memo)
        self.done = self.inputs.fresh("segment", intact)  # notes the blocks of other inputs
        return problems

    def todo(self) -> list[tuple[int, list]]:
        return [(k, chunk) for k, chunk in self.chunks if k not in self.done]

    def close(self) -> None:
        for f in (self.vlm_log, self.detect_log):
            f.close()

    def finish(self) -> dict:
        """The summary of every block, and the dataset written from the block shards in id
        order (only now, when every block has landed)."""
        from data_prep.shards import write_dataset
        cfg = self.cfg
        missing = [k for k, _ in self.chunks if k not in self.done]
        if missing:
            raise RuntimeError(f"{cfg.work_dir}: {len(missing)} blocks did not finish (e.g. "
                               f"block {missing[0]}); rerun the same command to complete them")
        summary = Summary(images=len(self.items), from_cache=self.cached_images)
        where = {}  # kept id -> (block, index in its shard)
        for k, _ in self.chunks:
            marker = self.done[k]
            kept = [i for i in marker["ids"] if marker["status"][i][0] == "kept"]
            if len(kept) != marker["records"]:
                raise RuntimeError(f"{stages.block_paths(cfg.work_dir, k)[1]}: "
                                   f"{len(kept)} images kept but {marker['records']} records; "
                                   f"delete it and rerun")
            for n, image_id in enumerate(kept):
                where[image_id] = (k, n)
            for image_id in marker["ids"]:
                state, reason = marker["status"][image_id]
                if state == "excluded":
                    summary.excluded[reason] += 1
                elif state == "failed":
                    summary.failed[reason] += 1
            summary.parse_notes.update(marker["parse_notes"])
            summary.dropped_relations.update(marker["relations_dropped"])
            if marker["run"] == self.run_id:
                summary.stage_seconds.update(marker["stage_seconds"])
                summary.stage_images.update(marker["stage_images"])
        summary.kept = len(where)
        ids = sorted(where)
        manifest = None
        if ids:  # streamed from the block shards in id order, one record at a time
            reader = stages.BlockRecords(cfg.work_dir)

            def samples():
                for i in ids:
                    sample = schema.decode(reader.read(*where[i]))
                    if sample.id != i:
                        raise RuntimeError(f"block {where[i][0]}: record {where[i][1]} is "
                                           f"{sample.id}, its marker says {i}; delete "
                                           f"{stages.block_paths(cfg.work_dir, where[i][0])[1]}"
                                           f" and rerun")
                    yield sample
            try:
                manifest = write_dataset(samples(), cfg.out, ids=ids,
                                         split_seed=cfg.split_seed,
                                         records_per_shard=cfg.records_per_shard,
                                         overwrite=cfg.overwrite, progress=cfg.progress,
                                         view_size=cfg.image_size,
                                         keep_originals=cfg.keep_originals)
            finally:
                reader.close()
        out = summary.as_dict()
        out["records"] = manifest["records"] if manifest else 0
        write_replacing(os.path.join(cfg.work_dir, "summary.json"),
                        lambda f: json.dump(out, f, indent=1, sort_keys=True), text=True)
        return out


class Annotator:
    """`--engine local`: the three stages over the chunks one after another in this process.
    Stages 1 and 2 also keep per-chunk caches (`vlm.jsonl`, `detect.jsonl`), so a rerun after
    new SAM weights, say, does not ask the VLM again."""

    def __init__(self, run: Run, models: Models):
        self.run_state = run
        self.cfg = run.cfg
        self.models = models
        self.inputs = run.inputs
        self.vlm_done = run.vlm_done
        self.detect_done = run.detect_done

    # -- stages with their caches ------------------------------------------------------------

    def _stage_vlm(self, k: int, chunk: list, images: dict) -> tuple[dict, dict]:
        if k in self.vlm_done:
            return self.vlm_done[k], {}
        results, seconds = stages.timed(stages.run_vlm, self.models.vlm, chunk, images,
                                        self.cfg.vlm_replies)
        n = sum(not isinstance(images[it.id], Exception) for it in chunk)
        entry = {"chunk": k, "ids": [it.id for it in chunk], "results": results,
                 "inputs": self.inputs.of("vlm", k)}
        self.run_state.vlm_log.append(entry)
        self.vlm_done[k] = entry
        return entry, {"vlm": (seconds, n)}

    def _stage_detect(self, k: int, todo: list, images: dict, parsed: dict) -> tuple[dict, dict]:
        if k in self.detect_done:
            return self.detect_done[k], {}
        results, seconds = stages.timed(stages.run_detect, self.models.detector, todo, images,
                                        parsed)
        entry = {"chunk": k, "results": results, "inputs": self.inputs.of("detect", k)}
        self.run_state.detect_log.append(entry)
        self.detect_done[k] = entry
        return entry, {"detect": (seconds, len(todo))}

    # -- driver ------------------------------------------------------------------------------

    def run(self) -> dict:
        run = self.run_state
        bar = tqdm(total=len(run.items), initial=run.cached_images, desc="annotating",
                   unit="image", disable=not self.cfg.progress)
        for k, chunk in run.todo():
            run.done[k] = self._run_chunk(k, chunk)
            bar.update(len(chunk))
        bar.close()
        return run.finish()

    def _run_chunk(self, k: int, chunk: list) -> dict:
        started = time.time()
        images = stages.load_images(chunk)
        vlm_entry, timing = self._stage_vlm(k, chunk, images)
        status, parsed = stages.triage(chunk, images, vlm_entry["results"])
        todo = [it.id for it in chunk if it.id in parsed]
        det_entry, more = self._stage_detect(k, todo, images, parsed)
        timing.update(more)
        (records, status, dropped, n_seg), seconds = stages.timed(
            stages.run_segment, self.models.segmenter, chunk, images, parsed,
            det_entry["results"], status, self.cfg.region_quality)
        timing["segment"] = (seconds, n_seg)
        return stages.write_block(
            self.cfg.work_dir, k, [it.id for it in chunk], records, status,
            self.inputs.of("segment", k), notes=stages.parse_notes(vlm_entry["results"]),
            dropped=dropped, stage_seconds={s: t for s, (t, _) in timing.items()},
            stage_images={s: n for s, (_, n) in timing.items()}, run=self.run_state.run_id,
            engine="local", started=started)


def source_items(cfg: AnnotateConfig) -> list:
    """Every item of the configured source, in the source's order."""
    from data_prep import sources
    try:
        return list(sources.iter_source(cfg.source, cfg.root, **dict(cfg.source_options)))
    except TypeError as e:  # an option the adapter does not take
        raise ValueError(f"{cfg.source} source: {e} (see data_prep.sources for its "
                         f"options)") from None


def annotate(cfg: AnnotateConfig, models: Models | None = None, items: list | None = None
             ) -> dict:
    """Run (or resume) the pipeline with `cfg.engine`; returns the summary (also
    WORK/summary.json). `models` (local engine only) replaces the configured ones."""
    if cfg.engine not in ("local", "ray"):
        raise ValueError(f"unknown engine {cfg.engine!r}; choose local or ray")
    if cfg.engine == "ray":
        if models is not None:
            raise ValueError("the ray engine loads the configured models in its stage actors; "
                             "models= is for engine='local'")
        from data_prep.annotate import ray_engine as annotate_ray
        annotate_ray.check_ray()
    if models is None:
        check_model_flags(cfg)
    if items is None:
        items = source_items(cfg)
    if cfg.limit:
        items = items[:cfg.limit]
    if not items:
        raise ValueError(f"{cfg.source} source at {cfg.root} holds no images")
    own_folder(cfg.work_dir, flag="--work")  # before any model loads (`Run` resumes in it)
    if cfg.engine == "ray":
        run = Run(cfg, items)
        try:
            return annotate_ray.run(run)
        finally:
            run.close()
    models = models or load_models(cfg)
    run = Run(cfg, items, models.vlm)
    try:
        return Annotator(run, models).run()
    finally:
        run.close()


def format_summary(summary: dict) -> str:
    lines = [f"{summary['images']} images: {summary['kept']} kept, "
             f"{sum(summary['excluded'].values())} excluded, "
             f"{sum(summary['failed'].values())} failed; {summary['images_from_cache']} "
             f"images from cache, {summary['images'] - summary['images_from_cache']} "
             f"annotated this run"]
    for title, key in (("excluded", "excluded"), ("failed", "failed"),
                       ("relations dropped", "relations_dropped"),
                       ("VLM replies repaired", "vlm_parse_recoveries")):
        if summary[key]:
            lines.append(f"  {title}: " + ", ".join(f"{k} {v}" for k, v in summary[key].items()))
    return "\n".join(lines)
