"""Everything `python -m data_prep annotate` needs to run on a CPU without a download: tiny
random models, demo photographs and VLM replies for them.

`write_demo_models(out_dir)` writes, into `out_dir`:

- `grounding-dino/`: `detect.save_tiny_model`, a random tiny GroundingDINO (transformers classes,
  `save_pretrained` layout) with its processor (image processor and a local word-level
  vocabulary holding every word of the demo annotations);
- `sam_tiny.pth`: `segment.save_tiny_sam`, a random tiny SAM (`--sam-type tiny`);
- `photos/`: the first photographs of the bundled demo (`data_prep/demo/annotations.json`: real
  photographs that scikit-image, scikit-learn and matplotlib ship), copied byte for byte;
- `replies.json`: a `--vlm-replies` file, one reply per photograph written from its hand-written
  annotation (action, objects, relation triplets, caption) in the layout the appendix's prompt
  asks for (`testing.scripted_reply`).

The models are random: their boxes and masks mean nothing. They show the pipeline working (the
stages, caches, resuming, the records it writes), not what it makes of the photographs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

from data_prep.demo import image_path, load_annotations
from data_prep.testing import scripted_reply
from sclaro_jax.files import own_folder, write_replacing

DETECTOR = "grounding-dino"
SAM = "sam_tiny.pth"
PHOTOS = "photos"
REPLIES = "replies.json"
DATASET = "sclaro"  # the printed annotate command's --out, inside out_dir
# A random detector's scores are low: at the paper's 0.25 some photographs lose every box.
THRESHOLD = 0.05


def demo_reply(entry: dict) -> str:
    """The VLM reply of a demo annotation entry: its action, object names, relation triplets
    (subject and object by name) and caption."""
    names = [o["name"] for o in entry["objects"]]
    relations = [(names[r["subject"]], r["predicate"], names[r["object"]])
                 for r in entry["relations"]]
    return scripted_reply(entry["action"], names, relations, entry["caption"])


def write_demo_models(out_dir: str, *, photos: int = 6, overwrite: bool = False,
                      progress: bool = True) -> dict:
    """Write the tiny models, `photos` demo photographs and their replies into `out_dir` (see
    the module docstring); returns {"detector", "sam", "photos", "replies", "dataset": path,
    "count": photographs}. `out_dir` is new or empty, or one demo-models made (marked:
    `sclaro_jax.files.own_folder`; any other folder with files is refused). Refuses
    (FileExistsError) when `out_dir` already holds one of the four unless `overwrite`, which
    replaces those four (links among them removed, never followed) and leaves anything else.
    `progress=False` hides transformers' progress bar while the detector is saved."""
    entries = load_annotations()
    if not 1 <= photos <= len(entries):
        raise ValueError(f"--photos {photos}: the demo has 1 to {len(entries)} photographs")
    paths = layout(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a folder")
    own_folder(out_dir, flag="--out")  # the four below are replaced only in a folder it made
    present = [os.path.basename(p) for p in paths.values() if os.path.lexists(p)]
    if present and not overwrite:
        raise FileExistsError(f"{out_dir} already holds {', '.join(present)} (pass --overwrite "
                              f"to replace them)")
    sources = {e["id"] + os.path.splitext(e["path"])[1]: (e, image_path(e))
               for e in entries[:photos]}  # before anything is removed: each package is there
    for path in paths.values():
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    os.makedirs(paths["photos"])
    replies = {}
    for name, (entry, source) in sources.items():
        data = Path(source).read_bytes()
        write_replacing(os.path.join(paths["photos"], name), lambda f, data=data: f.write(data))
        replies[f"folder/{name}"] = demo_reply(entry)

    from transformers.utils import logging as hf_logging

    from data_prep import detect, segment
    shown = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        detect.save_tiny_model(paths["detector"])
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    segment.save_tiny_sam(paths["sam"])
    write_replacing(paths["replies"], lambda f: f.write(
        json.dumps(replies, indent=1, ensure_ascii=False) + "\n"), text=True)
    return {**paths, "dataset": os.path.join(out_dir, DATASET), "count": len(sources)}


def layout(out_dir: str) -> dict:
    """{"detector", "sam", "photos", "replies": the path of each in `out_dir`}."""
    return {key: os.path.join(out_dir, name) for key, name in (
        ("detector", DETECTOR), ("sam", SAM), ("photos", PHOTOS), ("replies", REPLIES))}


def annotate_command(out_dir: str) -> str:
    """The `python -m data_prep annotate` command line (one line, shell-quoted) that runs on
    what `write_demo_models(out_dir)` wrote."""
    paths = layout(out_dir)
    argv = ["python", "-m", "data_prep", "annotate", "--root", paths["photos"],
            "--out", os.path.join(out_dir, DATASET), "--vlm-replies", paths["replies"],
            "--detector", paths["detector"], "--sam", paths["sam"], "--sam-type", "tiny",
            "--device", "cpu", "--box-threshold", str(THRESHOLD),
            "--text-threshold", str(THRESHOLD)]
    return shlex.join(argv)


def report(out_dir: str, written: dict) -> str:
    """What `write_demo_models` wrote, that the models are random, and the annotate command."""
    rows = ((DETECTOR + "/", "a tiny GroundingDINO and its processor (save_pretrained layout)"),
            (SAM, "a tiny SAM (--sam-type tiny)"),
            (PHOTOS + "/", f"{written['count']} photographs of the bundled demo"),
            (REPLIES, "VLM replies for them (--vlm-replies), from the demo's annotations"))
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(
        [f"wrote to {out_dir}:", *(f"  {name:<{width}}{what}" for name, what in rows),
         "The models are RANDOM: their boxes and masks mean nothing. They are for trying the",
         "pipeline on a CPU, not for making data (the command lowers the box and text thresholds",
         f"to {THRESHOLD}: a random detector scores low).",
         f"Annotate the photographs (the dataset goes to {written['dataset']}):",
         annotate_command(out_dir)])
