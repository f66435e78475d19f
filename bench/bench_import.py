"""Records per second per core: `python -m data_prep import --source psg` against `python -m
data_prep annotate` on the same photographs, and the full PSG import's estimated time.

    python bench/bench_import.py --images 96

The photographs are scikit-image's (`data_prep.testing.SCENES`, cycled) resized to 640x480, COCO's
typical size, written as OpenPSG lays them out: COCO train2017 JPEGs, a panoptic PNG per image
(RGB-encoded segment ids, one box-shaped segment per object of the scene), psg.json (the scene's
objects as thing classes, its relations) and COCO captions (one per image). The import runs
`import_scene_graphs` (the command's code path) with a dict-based stand-in for NLTK's tagger and
lemmatiser (its data is not installed here), at the command's defaults (224 px views, no originals),
twice: one worker (in this process) and one worker per core (forked processes), in blocks of
`--block-size` images; each run's time is split into the blocks (parallel) and the publish (one
process: the blocks' records into the dataset's shards). Annotate runs on the same JPEGs with the
test suite's tiny random models (`data_prep.demo_models`' GroundingDINO and SAM, torch on one
thread) and scripted VLM replies, through `data_prep.annotate.annotate`, models loaded and warmed up
before the clock starts. Each writes one dataset folder. The full PSG estimate (48,749 images): the
blocks at the one-worker rate per core times 16 cores times the parallel efficiency measured here
(the all-cores run against the one-worker run), plus the publish at its measured time per record (it
does not parallelise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PSG_IMAGES = 48_749
SIZE = (640, 480)


def make_psg(tmp: str, n: int) -> tuple[str, str, str]:
    """`n` photographs in OpenPSG's layout under tmp/psg_root, and the same JPEGs in a flat
    folder with scripted replies for annotate: (psg root, photo folder, replies file)."""
    import numpy as np
    from PIL import Image

    from data_prep.testing import SCENES, photograph, rgb_encode, scripted_reply, write_json

    root = Path(tmp) / "psg_root"
    photos = Path(tmp) / "photos"
    for d in (root / "coco" / "train2017", root / "coco" / "panoptic_train2017", photos):
        d.mkdir(parents=True, exist_ok=True)
    names = list(SCENES)
    classes = sorted({o for name in names for o in SCENES[name][1]})
    data, captions, replies = [], [], {}
    for i in range(n):
        name = names[i % len(names)]
        action, objects, relations = SCENES[name]
        img = Image.fromarray(photograph(name)).convert("RGB").resize(SIZE, Image.BILINEAR)
        fname = f"{i + 1:012d}.jpg"
        img.save(root / "coco" / "train2017" / fname, quality=90)
        img.save(photos / fname, quality=90)
        w, h = SIZE
        ids = np.zeros((h, w), np.int64)
        segments = []
        for k, obj in enumerate(objects):  # side by side boxes, a third of the width each
            box = [k * w // len(objects), h // 6, (k + 1) * w // len(objects), h * 5 // 6]
            sid = 1000 * (k + 1) + 7
            ids[box[1]:box[3], box[0]:box[2]] = sid
            segments.append((sid, classes.index(obj), box))
        png = f"panoptic_train2017/{i + 1:012d}.png"
        Image.fromarray(rgb_encode(ids)).save(root / "coco" / png)
        data.append({"file_name": f"train2017/{fname}", "image_id": str(i + 1), "width": w,
                     "height": h, "pan_seg_file_name": png,
                     "segments_info": [{"id": sid, "category_id": c, "iscrowd": 0,
                                        "isthing": 1, "area": 1} for sid, c, _ in segments],
                     "annotations": [{"bbox": box, "bbox_mode": 0, "category_id": c}
                                     for _, c, box in segments],
                     "relations": [[objects.index(s), objects.index(o), 0]
                                   for s, _, o in relations]})
        caption = f"a person {action} with a {objects[0]}"
        captions.append({"id": i + 1, "image_id": i + 1, "caption": caption})
        replies[f"folder/{fname}"] = scripted_reply(action, objects, relations, caption)
    write_json(str(root / "psg" / "psg.json"),
               {"data": data, "thing_classes": classes, "stuff_classes": [],
                "predicate_classes": ["on"], "test_image_ids": []})
    write_json(str(root / "coco" / "annotations" / "captions_train2017.json"),
               {"images": [{"id": i + 1, "file_name": f"{i + 1:012d}.jpg"} for i in range(n)],
                "annotations": captions})
    replies_path = os.path.join(tmp, "replies.json")
    with open(replies_path, "w") as f:
        json.dump(replies, f)
    return str(root), str(photos), replies_path


def bench_import(root: str, out: str, workers: int, block_size: int) -> dict:
    """One import; its wall time split at the moment the dataset writer opens (the publish)."""
    from data_prep.scene_graphs import pipeline
    verbs = {"posing": "VBG", "drinking": "VBG", "sitting": "VBG", "riding": "VBG"}
    rule = (lambda tokens: [(t, verbs.get(t, "NN")) for t in tokens],
            lambda word: word[:-3] if word.endswith("ing") else word)
    opened = []

    class Writer(pipeline.ShardWriter):
        def __init__(self, *a, **k):
            opened.append(time.perf_counter())
            super().__init__(*a, **k)
    real, pipeline.ShardWriter = pipeline.ShardWriter, Writer
    try:
        t0 = time.perf_counter()
        manifest = pipeline.import_scene_graphs("psg", root, out, rule=rule, progress=False,
                                                workers=workers, block_size=block_size)
        t1 = time.perf_counter()
    finally:
        pipeline.ShardWriter = real
    return {"records": manifest["records"], "s": t1 - t0, "blocks_s": opened[0] - t0,
            "publish_s": t1 - opened[0]}


def bench_annotate(photos: str, replies: str, tmp: str) -> tuple[float, int]:
    import numpy as np
    import torch
    from PIL import Image

    from bench_annotate import make_models
    from data_prep import annotate, detect, segment, vlm
    torch.set_num_threads(1)
    det_path, sam_path, sam_type = make_models("tiny", tmp)
    detector = detect.GroundingDetector(det_path, device="cpu", batch_size=2)
    segmenter = segment.SamSegmenter(segment.load_sam(sam_path, sam_type), device="cpu")
    img = Image.open(os.path.join(photos, sorted(os.listdir(photos))[0])).convert("RGB")
    found = detector([img], [["woman", "flag"]])[0]  # warm-up
    segmenter(np.asarray(img), np.asarray([d.box for d in found[:2]] or [[0, 0, 10, 10]]))
    cfg = annotate.AnnotateConfig(
        source="folder", root=photos, out=os.path.join(tmp, "annotated"),
        work=os.path.join(tmp, "work"), vlm_replies=replies, detector=det_path, sam=sam_path,
        sam_type=sam_type, device="cpu", batch_size=2, progress=False)
    models = annotate.Models(vlm=vlm.RepliesFile(replies), detector=detector,
                             segmenter=segmenter)
    t0 = time.perf_counter()
    summary = annotate.annotate(cfg, models=models)
    return time.perf_counter() - t0, summary["kept"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--tmp", default="", help="folder to write the inputs and outputs in")
    args = parser.parse_args()
    tmp = args.tmp or tempfile.mkdtemp(prefix="bench_import_")
    root, photos, replies = make_psg(tmp, args.images)
    load = os.getloadavg()[0]
    cores = os.cpu_count()
    one = bench_import(root, os.path.join(tmp, "imported_1"), 1, args.block_size)
    every = bench_import(root, os.path.join(tmp, f"imported_{cores}"), cores, args.block_size)
    ann_s, ann_n = bench_annotate(photos, replies, tmp)
    print(f"{args.images} photographs at {SIZE[0]}x{SIZE[1]}, blocks of {args.block_size}, "
          f"{cores} cores, load average {load:.1f} at the start")
    print("| command | processes | records | s (blocks + publish) | records/s per core |")
    print("|---|---|---|---|---|")
    for label, run, n in (("import --source psg", one, 1),
                          ("import --source psg", every, cores)):
        print(f"| {label} | {n} | {run['records']} | {run['s']:.2f} ({run['blocks_s']:.2f} + "
              f"{run['publish_s']:.2f}) | {run['records'] / run['s'] / n:.2f} |")
    print(f"| annotate, tiny models, scripted VLM | 1 | {ann_n} | {ann_s:.2f} | "
          f"{ann_n / ann_s:.2f} |")
    per_core = one["records"] / one["blocks_s"]             # blocks, one process
    efficiency = (every["records"] / every["blocks_s"]) / (cores * per_core)
    publish = every["publish_s"] / every["records"]           # seconds per record, serial
    full_1 = PSG_IMAGES / (one["records"] / one["s"])
    full_16 = PSG_IMAGES / (16 * per_core * efficiency) + PSG_IMAGES * publish
    print(f"import (1 process) / annotate: {one['records'] / one['s'] / (ann_n / ann_s):.1f}x; "
          f"parallel efficiency on {cores} cores {efficiency:.2f}; publish "
          f"{1000 * publish:.1f} ms/record")
    print(f"full PSG ({PSG_IMAGES:,} images): one process {full_1 / 3600:.2f} h; 16 cores "
          f"(estimate) {full_16 / 60:.1f} min, of which the publish "
          f"{PSG_IMAGES * publish / 60:.1f} min")


if __name__ == "__main__":
    main()
