"""The three annotation stages as functions of one block (a fixed chunk of `batch_size` images),
and the block files both engines write. `data_prep.annotate` (`--engine local`, one process)
and `data_prep.annotate.ray_engine` (`--engine ray`, a Ray Data pipeline) call the same
functions, so their records are the same bytes.

A finished block is two files in `WORK/blocks/`:

    NNNNNN.array_record   the block's kept records (schema version 1 with the originals, in
                          source order), one ArrayRecord shard
    NNNNNN.json           its marker: every image's decision (kept / excluded / failed and the
                          reason), the stage inputs it was made from (content hashes, see
                          `data_prep.annotate.keys`), the shard's size and sha256, the VLM repairs
                          and dropped relations, and the stage seconds it took

Each file is written under a temporary name and renamed into place, the shard first. A block
counts as done only when its marker names the current inputs and the shard on disk has the
recorded size and checksum, so a rerun (by either engine) skips exactly the finished blocks, and
a retried or repeated block replaces its own two files: a record is never written twice.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time

import numpy as np
from PIL import Image

from data_prep.source_items import OutsideRoot
from sclaro_jax import bounds
from sclaro_jax.data import schema
from sclaro_jax.files import write_replacing
from sclaro_jax.paths import OUTSIDE_ROOT

log = logging.getLogger("data_prep.annotate")

BLOCKS = "blocks"
MARKER_VERSION = 1


# --------------------------------------------------------------------------- the models


def pick_device(cfg) -> str:
    import torch
    return cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")


def load_vlm(cfg, device: str):
    from data_prep import vlm
    if cfg.vlm_replies:
        return vlm.RepliesFile(cfg.vlm_replies)
    return vlm.TransformersVLM(cfg.vlm, device=device, batch_size=cfg.batch_size,
                               trust_remote_code=cfg.vlm_trust_remote_code,
                               static_cache=cfg.vlm_static_cache)


def load_detector(cfg, device: str):
    from data_prep import detect
    return detect.GroundingDetector(cfg.detector, device=device,
                                    box_threshold=cfg.box_threshold,
                                    text_threshold=cfg.text_threshold, nms_iou=cfg.nms_iou,
                                    batch_size=cfg.batch_size, text_once=cfg.detector_text_once,
                                    bf16=cfg.bf16)


def load_segmenter(cfg, device: str):
    from data_prep import segment
    return segment.SamSegmenter(segment.load_sam(cfg.sam, cfg.sam_type, device), device=device,
                                sdpa=cfg.sam_sdpa, compile=cfg.sam_compile, bf16=cfg.bf16)


STAGE_LOADERS = {"vlm": load_vlm, "detect": load_detector, "segment": load_segmenter}


# --------------------------------------------------------------------------- the stages


def load_images(chunk: list) -> dict:
    """id -> (bytes, RGB image), or the SourceError of an unreadable file (logged)."""
    from data_prep import sources
    images = {}
    for it in chunk:
        try:
            images[it.id] = sources.read_image(it)
        except sources.SourceError as e:
            log.warning("%s", e)
            images[it.id] = e
    return images


def run_vlm(vlm_model, chunk: list, images: dict, replies_file: str = "") -> dict:
    """Stage 1 for the readable images of a chunk: id -> {"reply", "parse"} or
    {"reply", "error": reason}."""
    from data_prep import vlm
    ok = [it for it in chunk if not isinstance(images[it.id], Exception)]
    inputs = ok if getattr(vlm_model, "wants_items", False) else [images[it.id][1] for it in ok]
    replies = list(vlm_model(inputs)) if ok else []
    if len(replies) != len(ok):
        raise RuntimeError(f"the VLM returned {len(replies)} replies for {len(ok)} images")
    results = {}
    for it, reply in zip(ok, replies):
        if reply is None:  # --vlm-replies has none for it
            log.warning("image %s: no reply in --vlm-replies %s; excluded (vlm_no_reply)",
                        it.id, replies_file)
            results[it.id] = {"reply": None, "error": "no_reply"}
            continue
        try:
            parsed = vlm.parse_response(reply)
            parsed["relations"] = [list(r) for r in parsed["relations"]]
            results[it.id] = {"reply": reply, "parse": parsed}
        except vlm.ParseError as e:
            log.warning("image %s: VLM reply rejected (%s): %s", it.id, e.reason, e)
            results[it.id] = {"reply": reply, "error": e.reason}
    return results


def triage(chunk: list, images: dict, vlm_results: dict) -> tuple[dict, dict]:
    """The decisions stage 1 makes: (status {id: [state, reason]} of the images that stop
    here, parsed {id: reply fields} of those that go on to detection)."""
    status, parsed = {}, {}
    for it in chunk:
        if isinstance(images[it.id], Exception):  # a path outside its root was never opened
            status[it.id] = ["failed", OUTSIDE_ROOT if isinstance(images[it.id], OutsideRoot)
                             else "unreadable_image"]
            continue
        res = vlm_results.get(it.id)
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
    return status, parsed


def run_detect(detector, todo: list, images: dict, parsed: dict) -> dict:
    """Stage 2: id -> [[x0, y0, x1, y1, score, label], ...] for the images in `todo`."""
    found = detector([images[i][1] for i in todo], [parsed[i]["objects"] for i in todo]) \
        if todo else []
    return {i: [[*map(float, d.box), float(d.score), d.label] for d in dets]
            for i, dets in zip(todo, found)}


def segment_image(segmenter, item, data: bytes, img: Image.Image, parsed: dict, dets: list,
                  region_quality: int) -> tuple[schema.Sample | None, str, list[str]]:
    """Stage 3 for one image: its record, or None with the reason it is excluded; and the
    reasons of the relations dropped."""
    from data_prep import segment
    from sclaro_jax.data.images import encode_jpeg
    rgb = np.asarray(img.convert("RGB"))
    boxes = np.asarray([d[:4] for d in dets], np.float64).reshape(-1, 4)
    labels = [d[5] for d in dets]
    masks = segmenter(rgb, boxes)
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
                        schema.triplet_text(labels[r.subject], r.predicate, labels[r.object]),
                        encode_jpeg(r.region, region_quality))
        for r in regions)
    action = item.action if item.action else parsed["action"]
    sample = schema.Sample(
        id=item.id, source=item.source, split="train", image=data, width=img.width,
        height=img.height, action=action, caption=parsed["caption"], objects=objects,
        relations=relations, mask_kind="sam")
    return sample, "", reasons


def run_segment(segmenter, chunk: list, images: dict, parsed: dict, detections: dict,
                status: dict, region_quality: int) -> tuple[list[bytes], dict, collections.Counter,
                                                            int]:
    """Stage 3 for a chunk: (encoded records in chunk order, the completed status, dropped
    relations by reason, images segmented). `status` holds the earlier stages' decisions."""
    status = dict(status)
    records, dropped_all = [], collections.Counter()
    n_seg = 0
    for it in chunk:
        if it.id in status:
            continue
        dets = detections.get(it.id, [])
        if not dets:
            status[it.id] = ["excluded", "no_detections"]
            continue
        data, img = images[it.id]
        n_seg += 1
        sample, reason, dropped = segment_image(segmenter, it, data, img, parsed[it.id], dets,
                                                region_quality)
        dropped_all.update(dropped)
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
    return records, {it.id: status[it.id] for it in chunk}, dropped_all, n_seg


def parse_notes(vlm_results: dict) -> collections.Counter:
    notes = collections.Counter()
    for res in vlm_results.values():
        notes.update(res.get("parse", {}).get("notes", []))
    return notes


# --------------------------------------------------------------------------- block files


def block_paths(work: str, k: int) -> tuple[str, str]:
    base = os.path.join(work, BLOCKS, f"{k:06d}")
    return base + ".array_record", base + ".json"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_block(work: str, k: int, ids: list, records: list[bytes], status: dict,
                inputs: dict, *, notes: dict, dropped: dict, stage_seconds: dict,
                stage_images: dict, run: str, engine: str, started: float) -> dict:
    """Write block `k`'s shard, then its marker, each atomically; returns the marker.
    `started`: when the block's first stage began (epoch seconds; with "landed", the time of
    writing, it shows how blocks move through a run)."""
    from data_prep.shards import write_records
    folder = os.path.join(work, BLOCKS)
    os.makedirs(folder, exist_ok=True)
    shard, marker_path = block_paths(work, k)
    digest, size = write_records(shard, records)
    marker = {"version": MARKER_VERSION, "chunk": k, "ids": list(ids), "status": status,
              "inputs": inputs, "records": len(records), "bytes": size, "sha256": digest,
              "parse_notes": dict(sorted(notes.items())),
              "relations_dropped": dict(sorted(dropped.items())),
              "stage_seconds": {s: round(v, 4) for s, v in stage_seconds.items()},
              "stage_images": dict(stage_images), "run": run, "engine": engine,
              "started": round(started, 3), "landed": round(time.time(), 3)}
    write_replacing(marker_path, lambda f: json.dump(marker, f, sort_keys=True), text=True,
                    fsync=True)
    _fsync_dir(folder)
    return marker


def clear_partial_blocks(work: str) -> int:
    """Remove the temporary files of block writes that were interrupted; returns how many."""
    folder = os.path.join(work, BLOCKS)
    if not os.path.isdir(folder):
        return 0
    gone = 0
    for name in os.listdir(folder):
        if ".tmp-" in name:
            try:
                os.remove(os.path.join(folder, name))
                gone += 1
            except FileNotFoundError:
                pass
    return gone


def finished_blocks(work: str, chunks: list, memo) -> tuple[list[dict], list[str]]:
    """The markers of the blocks whose files are complete (marker for these images, shard of the
    recorded size and checksum), and one line per block whose files are not and why. Whether a
    marker was made from the current inputs is `StageInputs.fresh("segment", markers)`'s to say.
    `memo` is a `data_prep.annotate.keys.HashMemo`: a shard is hashed again only when its stat
    changed."""
    intact, notes = [], []
    for k, chunk in chunks:
        shard, marker_path = block_paths(work, k)
        if not os.path.exists(marker_path):
            continue
        try:
            marker = bounds.read_json(marker_path)
        except (OSError, ValueError) as e:
            notes.append(f"block {k}: its marker {marker_path} is unreadable ({e}); redone")
            continue
        if marker.get("version") != MARKER_VERSION or marker.get("chunk") != k or \
                marker.get("ids") != [it.id for it in chunk]:
            notes.append(f"block {k}: its marker {marker_path} is for other images; redone")
            continue
        try:
            size = os.path.getsize(shard)
        except OSError:
            notes.append(f"block {k}: its shard {shard} is missing; redone")
            continue
        if size != marker["bytes"] or memo.file(shard) != marker["sha256"]:
            notes.append(f"block {k}: its shard {shard} does not match the checksum in its "
                         f"marker; redone")
            continue
        intact.append(marker)
    memo.save()
    return intact, notes


class BlockRecords:
    """Random access to the kept records of finished blocks: `read(k, i)` is record i of block
    k's shard. Keeps the most recently used readers open."""

    def __init__(self, work: str, keep_open: int = 32):
        self.work = work
        self.keep_open = keep_open
        self.readers: collections.OrderedDict = collections.OrderedDict()

    def read(self, k: int, i: int) -> bytes:
        from array_record.python.array_record_module import ArrayRecordReader
        reader = self.readers.pop(k, None)
        if reader is None:
            reader = ArrayRecordReader(block_paths(self.work, k)[0])
            if len(self.readers) >= self.keep_open:
                self.readers.popitem(last=False)[1].close()
        self.readers[k] = reader
        return reader.read([i])[0]

    def all(self, k: int) -> list[bytes]:
        from array_record.python.array_record_module import ArrayRecordReader
        reader = ArrayRecordReader(block_paths(self.work, k)[0])
        try:
            return list(reader.read_all()) if reader.num_records() else []
        finally:
            reader.close()

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()


def timed(fn, *args):
    """(fn(*args), seconds)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
