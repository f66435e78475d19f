"""What `data_prep.annotate`'s caches depend on: the run's settings (`WORK/run.json`) and, per
chunk and stage, the *content* of the stage's inputs rather than their paths.

Every cache entry (one per chunk and stage) stores its inputs:

    stage 1 (VLM)            "vlm": with --vlm-replies, the sha256 of the chunk's own replies
                             ([image id, reply or null] per image, so editing one reply redoes
                             only its chunk); with --vlm, the digest of the model folder
    stage 2 (GroundingDINO)  "vlm" and "detector": the digest of the detector folder
    stage 3 (SAM)            "vlm", "detector" and "sam": the digest of the SAM checkpoint

An entry is used only while its inputs equal the current ones; otherwise that stage and the
later ones are redone for the chunk, and the run says which input changed.

Weight digests hash every byte: a file's sha256, or for a folder the sha256 of its sorted
"relative path<TAB>sha256" lines over every regular file under it (symlinks followed, names
starting with "." skipped). Hashing costs seconds per GB, so each file's sha256 is kept in
`WORK/hashes.json` with the file's (size, mtime_ns, ctime_ns, inode) and hashed again only when
one of them differs (any write, copy, rename or `touch` changes the ctime).

`run.json` holds the settings that decide the chunks and the thresholds; a rerun with other
settings is refused, unless the earlier run finished no chunk at all (an aborted first try does
not lock the folder against the corrected command).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os

from sclaro_jax import bounds
from sclaro_jax.files import write_replacing

log = logging.getLogger("data_prep.annotate")

CACHE_VERSION = 2  # 2: entries carry their inputs' content hashes
STAGE_INPUTS = {"vlm": ("vlm",), "detect": ("vlm", "detector"),
                "segment": ("vlm", "detector", "sam")}
STAGE_NAMES = {"vlm": "1-3", "detect": "2-3", "segment": "3"}


def config_key(cfg) -> dict:
    """The settings the caches depend on besides the models' content."""
    return {"version": CACHE_VERSION, "source": cfg.source, "root": os.path.abspath(cfg.root),
            "source_options": [list(kv) for kv in cfg.source_options],
            "sam_type": cfg.sam_type, "batch_size": cfg.batch_size,
            "box_threshold": cfg.box_threshold, "text_threshold": cfg.text_threshold,
            "nms_iou": cfg.nms_iou, "region_quality": cfg.region_quality, "limit": cfg.limit,
            # bf16 changes boxes and masks; named only when on, so earlier run.json files hold
            **({"bf16": True} if getattr(cfg, "bf16", False) else {})}


def check_run_key(work: str, key: dict, has_work: bool) -> None:
    """Write `WORK/run.json`, or refuse a work folder whose finished work used other settings."""
    path = os.path.join(work, "run.json")
    if os.path.exists(path):
        old = bounds.read_json(path)
        if old == key:
            return
        changed = ", ".join(sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k)))
        if has_work:
            raise ValueError(
                f"{work} holds caches of a run with other settings ({changed} differ); pass "
                f"another --work folder or delete it to start over")
        log.warning("%s: an earlier run with other settings (%s) finished no chunk; starting "
                    "over with these settings", work, changed)
    write_replacing(path, lambda f: json.dump(key, f, indent=1, sort_keys=True), text=True)


def replies_for(cfg, stage1, ids: list) -> dict | None:
    """The --vlm-replies file's {id: reply} (None without one); refused when it answers none
    of the images (its ids are then not this source's)."""
    if not cfg.vlm_replies:
        return None
    from data_prep import vlm
    replies = getattr(stage1, "replies", None)
    replies = replies if isinstance(replies, dict) else vlm.RepliesFile(cfg.vlm_replies).replies
    known = set(ids)
    unknown = [i for i in replies if i not in known]
    if len(unknown) == len(replies):
        has = f"it has {unknown[0]!r}" if unknown else "it is empty"
        raise ValueError(
            f"--vlm-replies {cfg.vlm_replies}: none of its {len(replies)} image ids is an "
            f"image of the {cfg.source} source in {cfg.root} ({has}, the source has "
            f"{ids[0]!r}); key each reply by its image id, "
            f"{vlm.REPLY_IDS.get(cfg.source, '<source>/<key>')}")
    if unknown:
        log.warning("--vlm-replies %s: %d replies are for no image of the source (e.g. %r); "
                    "ignored", cfg.vlm_replies, len(unknown), unknown[0])
    return replies


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class HashMemo:
    """sha256 of weight files and folders, remembered in a JSON file by path and stat."""

    def __init__(self, path: str):
        self.path = path
        self.memo: dict = {}
        self.dirty = False
        try:
            self.memo = bounds.read_json(path)
        except (OSError, ValueError):
            self.memo = {}

    def file(self, path: str) -> str:
        st = os.stat(path)
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        key = os.path.abspath(path)
        hit = self.memo.get(key)
        if isinstance(hit, list) and hit[:4] == stamp:
            return hit[4]
        digest = sha256_file(path)
        self.memo[key] = stamp + [digest]
        self.dirty = True
        return digest

    def weights(self, path: str) -> str:
        """The digest of a weight file or of every file in a model folder."""
        if os.path.isfile(path):
            return self.file(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such model file or folder")
        lines = []
        for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                if not name.startswith(".") and os.path.isfile(full):
                    lines.append(f"{os.path.relpath(full, path)}\t{self.file(full)}\n")
        return hashlib.sha256("".join(sorted(lines)).encode("utf-8")).hexdigest()

    def save(self) -> None:
        if self.dirty:
            write_replacing(self.path, lambda f: json.dump(self.memo, f, indent=1,
                                                            sort_keys=True), text=True)
            self.dirty = False


def replies_digest(replies: dict, ids: list) -> str:
    blob = json.dumps([[i, replies.get(i)] for i in ids], ensure_ascii=False)
    return "replies:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


class StageInputs:
    """The current inputs of every chunk's stages, and which cached entries still hold."""

    def __init__(self, cfg, chunks: list, replies: dict | None, memo: HashMemo):
        self.cfg = cfg
        self.sizes = {k: len(chunk) for k, chunk in chunks}
        digest = {name: memo.weights(path) if path else ""
                  for name, path in (("detector", cfg.detector), ("sam", cfg.sam))}
        vlm_model = "model:" + memo.weights(cfg.vlm) if cfg.vlm and replies is None else ""
        self.inputs = {k: {"vlm": (replies_digest(replies, [it.id for it in chunk])
                                   if replies is not None else vlm_model), **digest}
                       for k, chunk in chunks}
        memo.save()
        self.stale: collections.Counter = collections.Counter()  # (stage, field) -> chunks

    def of(self, stage: str, k: int) -> dict:
        return {f: self.inputs[k][f] for f in STAGE_INPUTS[stage]}

    def fresh(self, stage: str, entries: list[dict]) -> dict:
        """chunk -> its newest entry of `stage` whose inputs are the current ones; notes the
        chunks whose newest entry is stale."""
        newest = {e["chunk"]: e for e in entries if e["chunk"] in self.inputs}
        out = {}
        for k, e in newest.items():
            now = self.of(stage, k)
            if e.get("inputs") == now:
                out[k] = e
            else:
                old = e.get("inputs") or {}
                field = next((f for f in STAGE_INPUTS[stage] if old.get(f) != now[f]), "vlm")
                self.stale[stage, field, k] = 1
        return out

    def report(self) -> list[str]:
        """One line per (first stale stage, changed input): what is redone and why."""
        first: dict[int, tuple[str, str]] = {}
        for stage, field, k in sorted(self.stale, key=lambda s: list(STAGE_INPUTS).index(s[0])):
            first.setdefault(k, (stage, field))
        groups = collections.defaultdict(list)
        for k, what in first.items():
            groups[what].append(k)
        lines = []
        for (stage, field), ks in sorted(groups.items(), key=lambda g: min(g[1])):
            images = sum(self.sizes[k] for k in ks)
            lines.append(f"recomputing stage{'s' if '-' in STAGE_NAMES[stage] else ''} "
                         f"{STAGE_NAMES[stage]} of {len(ks)} chunk{'s' * (len(ks) != 1)} "
                         f"({images} image{'s' * (images != 1)}): {self._why(field)} since "
                         f"they were cached")
        return lines

    def _why(self, field: str) -> str:
        cfg = self.cfg
        if field == "vlm":
            return (f"their replies in {cfg.vlm_replies} changed" if cfg.vlm_replies else
                    f"the VLM weights in {cfg.vlm or '(given model)'} changed")
        path = cfg.detector if field == "detector" else cfg.sam
        name = "GroundingDINO" if field == "detector" else "SAM"
        return f"the {name} weights {path or '(given model)'} changed"
