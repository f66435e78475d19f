"""`python -m data_prep annotate`: images -> SCLARO records, the three stages of appendix A.

    Stage 1  VLM (Ovis-Gemma 9B by default): action, objects (<= 10), relation triplets, caption
             (`data_prep.vlm`); Multi-Moments in Time's ground-truth action replaces the VLM's.
    Stage 2  GroundingDINO: boxes for the stage-1 objects, thresholds 0.25 / 0.25, NMS at IoU 0.4
             (`data_prep.detect`). Images whose VLM reply has no objects or no relations are
             excluded before this stage; a reply without an action is kept with action ""
             (appendix: such images keep valid objects and relations).
    Stage 3  SAM: one mask per box; per relation the closest subject/object instance pair by
             box-centre distance and its focused-region image (`data_prep.segment`).

Resumable. Work goes in fixed chunks of `batch_size` images (the same chunks on every run, so a
model always sees the same batches). Each stage appends one line per finished chunk to its cache
in the work folder (`vlm.jsonl`, `detect.jsonl`), flushed and fsynced; stage 3 appends the
finished records to `records.log` (length + CRC32 framed) and every decision to `status.jsonl`.
A run that is killed loses at most the chunk in flight; rerunning the same command reads the
caches, skips every stage result already written (no image is sent to a model twice once its
result is on disk) and carries on. A torn last line or record is detected and cut off. Cache
entries are keyed by content (`data_prep.annotate_keys`): an edited reply or changed weights
redo the stages they feed, and the run says so. When all
images are done the records are written as shards with `data_prep.shards.write_dataset` (schema
version 2 with `image_size` px training views; the originals only with `keep_originals`, while
the work folder's records.log always holds them, so a rerun with another `--image-size` only
rewrites the shards), and `summary.json` counts kept / excluded / failed images by reason.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from typing import Callable, Iterable

import numpy as np
from PIL import Image
from tqdm import tqdm

from data_prep.annotate_keys import (HashMemo, StageInputs, check_run_key, config_key,
                                     replies_for)
from data_prep.durable_logs import JsonLog, RecordLog
from sclaro_jax.data import schema

log = logging.getLogger("data_prep.annotate")


@dataclasses.dataclass(frozen=True)
class AnnotateConfig:
    source: str  # a data_prep.sources kind: folder, mmit, cc3m, openpsg, pvsg, kitti2015
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


def check_model_flags(cfg: AnnotateConfig) -> None:
    missing = [flag for flag, value in (("--vlm", cfg.vlm or cfg.vlm_replies),
                                        ("--detector", cfg.detector), ("--sam", cfg.sam))
               if not value]
    if missing:
        raise ValueError(
            f"annotate needs local model weights; missing {', '.join(missing)} (no model hub is "
            f"reachable: pass --vlm DIR (an image-text-to-text model folder, e.g. Ovis-Gemma 9B) "
            f"or --vlm-replies FILE, --detector DIR (grounding-dino-base saved with "
            f"save_pretrained) and --sam FILE (sam_vit_h_4b8939.pth))")


def load_models(cfg: AnnotateConfig) -> Models:
    """The configured models; a clear error for each one not given or not found."""
    import torch

    from data_prep import detect, segment, vlm
    check_model_flags(cfg)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.vlm_replies:
        stage1 = vlm.RepliesFile(cfg.vlm_replies)
    else:
        stage1 = vlm.TransformersVLM(cfg.vlm, device=device, batch_size=cfg.batch_size,
                                     trust_remote_code=cfg.vlm_trust_remote_code)
    return Models(
        vlm=stage1,
        detector=detect.GroundingDetector(cfg.detector, device=device,
                                          box_threshold=cfg.box_threshold,
                                          text_threshold=cfg.text_threshold,
                                          nms_iou=cfg.nms_iou, batch_size=cfg.batch_size),
        segmenter=segment.SamSegmenter(segment.load_sam(cfg.sam, cfg.sam_type, device),
                                       device=device))


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


class Annotator:
    """Runs the three stages over a list of `sources.SourceItem`s with durable caches."""

    def __init__(self, cfg: AnnotateConfig, models: Models, items: list):
        self.cfg = cfg
        self.models = models
        self.items = items
        ids = [it.id for it in items]
        dup = [i for i, c in collections.Counter(ids).items() if c > 1]
        if dup:
            raise ValueError(f"source yields duplicate image ids, e.g. {dup[:3]}")
        replies = replies_for(cfg, models.vlm, ids)
        work = cfg.work_dir
        os.makedirs(work, exist_ok=True)
        self.vlm_log = JsonLog(os.path.join(work, "vlm.jsonl"))
        self.detect_log = JsonLog(os.path.join(work, "detect.jsonl"))
        self.status_log = JsonLog(os.path.join(work, "status.jsonl"))
        self.records = RecordLog(os.path.join(work, "records.log"))
        check_run_key(work, config_key(cfg), has_work=any(
            f.entries for f in (self.vlm_log, self.detect_log, self.status_log))
            or bool(self.records.index))
        self.chunks = list(_chunks(items, cfg.batch_size))
        self.inputs = StageInputs(cfg, self.chunks, replies,
                                  HashMemo(os.path.join(work, "hashes.json")))
        self.vlm_done = self.inputs.fresh("vlm", self.vlm_log.entries)
        self.detect_done = self.inputs.fresh("detect", self.detect_log.entries)
        self.status_done = self.inputs.fresh("segment", self.status_log.entries)
        for line in self.inputs.report():
            log.warning("%s", line)
        self.summary = Summary(images=len(items))

    def close(self) -> None:
        for f in (self.vlm_log, self.detect_log, self.status_log, self.records):
            f.close()

    # -- stages ------------------------------------------------------------------------------

    def _load(self, chunk: list) -> dict:
        from data_prep import sources
        images = {}
        for it in chunk:
            try:
                images[it.id] = sources.read_image(it)
            except sources.SourceError as e:
                log.warning("%s", e)
                images[it.id] = e
        return images

    def _stage_vlm(self, k: int, chunk: list, images: dict) -> dict:
        if k in self.vlm_done:
            return self.vlm_done[k]
        from data_prep import vlm
        ok = [it for it in chunk if not isinstance(images[it.id], Exception)]
        t0 = time.perf_counter()
        inputs = ok if getattr(self.models.vlm, "wants_items", False) else \
            [images[it.id][1] for it in ok]
        replies = list(self.models.vlm(inputs)) if ok else []
        if len(replies) != len(ok):
            raise RuntimeError(f"the VLM returned {len(replies)} replies for {len(ok)} images")
        results = {}
        for it, reply in zip(ok, replies):
            if reply is None:  # --vlm-replies has none for it
                log.warning("image %s: no reply in --vlm-replies %s; excluded (vlm_no_reply)",
                            it.id, self.cfg.vlm_replies)
                results[it.id] = {"reply": None, "error": "no_reply"}
                continue
            try:
                parsed = vlm.parse_response(reply)
                parsed["relations"] = [list(r) for r in parsed["relations"]]
                results[it.id] = {"reply": reply, "parse": parsed}
            except vlm.ParseError as e:
                log.warning("image %s: VLM reply rejected (%s): %s", it.id, e.reason, e)
                results[it.id] = {"reply": reply, "error": e.reason}
        self.summary.stage_seconds["vlm"] += time.perf_counter() - t0
        self.summary.stage_images["vlm"] += len(ok)
        entry = {"chunk": k, "ids": [it.id for it in chunk], "results": results,
                 "inputs": self.inputs.of("vlm", k)}
        self.vlm_log.append(entry)
        self.vlm_done[k] = entry
        return entry

    def _stage_detect(self, k: int, todo: list, images: dict, parsed: dict) -> dict:
        if k in self.detect_done:
            return self.detect_done[k]
        t0 = time.perf_counter()
        found = self.models.detector([images[i][1] for i in todo],
                                     [parsed[i]["objects"] for i in todo]) if todo else []
        results = {i: [[*map(float, d.box), float(d.score), d.label] for d in dets]
                   for i, dets in zip(todo, found)}
        self.summary.stage_seconds["detect"] += time.perf_counter() - t0
        self.summary.stage_images["detect"] += len(todo)
        entry = {"chunk": k, "results": results, "inputs": self.inputs.of("detect", k)}
        self.detect_log.append(entry)
        return entry

    def _stage_segment(self, item, data: bytes, img: Image.Image, parsed: dict,
                       dets: list) -> tuple[schema.Sample | None, str, list[str]]:
        """The record of one image, or None with the reason it is excluded."""
        from data_prep import segment
        from data_prep.demo import encode_jpeg
        rgb = np.asarray(img.convert("RGB"))
        boxes = np.asarray([d[:4] for d in dets], np.float64).reshape(-1, 4)
        labels = [d[5] for d in dets]
        masks = self.models.segmenter(rgb, boxes)
        # relation names spelled as in the object list (detections carry those spellings)
        spelling = {o.lower(): o for o in parsed["objects"]}
        relations = [(spelling.get(a.lower(), a), p, spelling.get(b.lower(), b))
                     for a, p, b in parsed["relations"]]
        regions, dropped = segment.relation_regions(rgb, boxes, labels, masks, relations)
        reasons = [d.reason for d in dropped]
        if not regions:
            return None, "no_grounded_relations", reasons
        objects = tuple(schema.Object(labels[i], tuple(float(v) for v in boxes[i]))
                        for i in range(len(labels)))
        relations = tuple(
            schema.Relation(r.subject, r.predicate, r.object,
                            schema.triplet_text(labels[r.subject], r.predicate,
                                                labels[r.object]),
                            encode_jpeg(r.region, self.cfg.region_quality))
            for r in regions)
        action = item.action if item.action else parsed["action"]
        sample = schema.Sample(
            id=item.id, source=item.source, split="train", image=data, width=img.width,
            height=img.height, action=action, caption=parsed["caption"], objects=objects,
            relations=relations, mask_kind="sam")
        return sample, "", reasons

    # -- driver ------------------------------------------------------------------------------

    def run(self) -> dict:
        already = sum(len(self.status_done[k]["status"]) for k, _ in self.chunks
                      if k in self.status_done)
        self.summary.from_cache = already
        bar = tqdm(total=len(self.items), initial=already, desc="annotating", unit="image",
                   disable=not self.cfg.progress)
        for k, chunk in self.chunks:
            if k in self.status_done:
                continue
            self._run_chunk(k, chunk)
            bar.update(len(chunk))
        bar.close()
        return self._finish()

    def _run_chunk(self, k: int, chunk: list) -> None:
        images = self._load(chunk)
        status: dict[str, list] = {}
        for it in chunk:
            if isinstance(images[it.id], Exception):
                status[it.id] = ["failed", "unreadable_image"]
        vlm_entry = self._stage_vlm(k, chunk, images)
        parsed = {}
        for it in chunk:
            if it.id in status:
                continue
            res = vlm_entry["results"].get(it.id)
            if res is None or "error" in res:
                status[it.id] = ["excluded", "vlm_" + (res or {}).get("error", "no_reply")]
                continue
            p = {**res["parse"], "action": it.action or res["parse"]["action"]}  # MMiT: truth
            if not p["objects"]:
                status[it.id] = ["excluded", "no_objects"]
            elif not p["relations"]:
                status[it.id] = ["excluded", "no_relations"]
            else:  # no action: kept with action "" (appendix: its objects and relations hold)
                parsed[it.id] = p
        todo = [it.id for it in chunk if it.id in parsed]
        det_entry = self._stage_detect(k, todo, images, parsed)
        records = []
        t0 = time.perf_counter()
        n_seg = 0
        for it in chunk:
            if it.id in status:
                continue
            dets = det_entry["results"].get(it.id, [])
            if not dets:
                status[it.id] = ["excluded", "no_detections"]
                continue
            data, img = images[it.id]
            n_seg += 1
            sample, reason, dropped = self._stage_segment(it, data, img, parsed[it.id], dets)
            self.summary.dropped_relations.update(dropped)
            if sample is None:
                status[it.id] = ["excluded", reason]
                continue
            try:
                schema.validate(sample)
            except schema.RecordError as e:
                log.warning("%s", e)
                status[it.id] = ["failed", "invalid_record"]
                continue
            records.append(schema.encode(sample))
            status[it.id] = ["kept", ""]
        self.summary.stage_seconds["segment"] += time.perf_counter() - t0
        self.summary.stage_images["segment"] += n_seg
        # records first, then the status line that marks the chunk done: a kill between the
        # two redoes stage 3 of this chunk and the duplicate records are ignored (same bytes).
        self.records.append_many(records)
        entry = {"chunk": k, "status": status, "inputs": self.inputs.of("segment", k)}
        self.status_log.append(entry)
        self.status_done[k] = entry

    def _finish(self) -> dict:
        from data_prep.shards import write_dataset
        kept_ids = set()
        for entry in self.status_done.values():
            for image_id, (state, reason) in entry["status"].items():
                if state == "kept":
                    kept_ids.add(image_id)
                elif state == "excluded":
                    self.summary.excluded[reason] += 1
                else:
                    self.summary.failed[reason] += 1
        for entry in self.vlm_done.values():
            for res in entry["results"].values():
                self.summary.parse_notes.update(res.get("parse", {}).get("notes", []))
        where = {}  # id -> (offset, length) in the record log; a repeated chunk's copy wins
        for entry, rec in zip(self.records.index, self.records):
            image_id = schema.decode(rec).id
            if image_id in kept_ids:
                where[image_id] = entry
        missing = kept_ids - set(where)
        if missing:
            raise RuntimeError(f"{self.records.path}: records of {len(missing)} kept images are "
                               f"missing (e.g. {sorted(missing)[:3]}); delete the work folder "
                               f"and rerun")
        self.summary.kept = len(where)
        ids = sorted(where)
        manifest = None
        if ids:  # streamed from the log in id order, one record at a time
            manifest = write_dataset((schema.decode(self.records.read(where[i])) for i in ids),
                                     self.cfg.out, ids=ids, split_seed=self.cfg.split_seed,
                                     records_per_shard=self.cfg.records_per_shard,
                                     overwrite=self.cfg.overwrite, progress=self.cfg.progress,
                                     view_size=self.cfg.image_size,
                                     keep_originals=self.cfg.keep_originals)
        summary = self.summary.as_dict()
        summary["records"] = manifest["records"] if manifest else 0
        with open(os.path.join(self.cfg.work_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
        return summary


def annotate(cfg: AnnotateConfig, models: Models | None = None, items: list | None = None
             ) -> dict:
    """Run (or resume) the pipeline; returns the summary (also WORK/summary.json)."""
    if models is None:
        check_model_flags(cfg)
    if items is None:
        from data_prep import sources
        try:
            items = list(sources.iter_source(cfg.source, cfg.root, **dict(cfg.source_options)))
        except TypeError as e:  # an option the adapter does not take
            raise ValueError(f"{cfg.source} source: {e} (see data_prep.sources for its "
                             f"options)") from None
    if cfg.limit:
        items = items[:cfg.limit]
    if not items:
        raise ValueError(f"{cfg.source} source at {cfg.root} holds no images")
    models = models or load_models(cfg)
    runner = Annotator(cfg, models, items)
    try:
        return runner.run()
    finally:
        runner.close()


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
