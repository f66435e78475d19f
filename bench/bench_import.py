"""Records per second per core: `python -m data_prep import --source psg` against `python -m
data_prep annotate` on the same photographs, and the full PSG import's estimated time.

    python bench/bench_import.py --images 24

The photographs are scikit-image's (`data_prep.testing.SCENES`, cycled) resized to 640x480,
COCO's typical size, written as OpenPSG lays them out: COCO train2017 JPEGs, a panoptic PNG
per image (RGB-encoded segment ids, one box-shaped segment per object of the scene), psg.json
(the scene's objects as thing classes, its relations) and COCO captions (one per image). The
import runs in this process (`import_scene_graphs`, the command's code path, one core) with a
dict-based stand-in for NLTK's tagger and lemmatiser (its data is not installed here), at the
command's defaults (224 px views, no originals). Annotate runs on the same JPEGs with the test
suite's tiny random models (`data_prep.demo_models`' GroundingDINO and SAM, torch on one
thread) and scripted VLM replies, through `data_prep.annotate.annotate`, models loaded and
warmed up before the clock starts. Both write one dataset folder each. The full PSG estimate:
48,749 images at the measured rate, one process (the command today), and over 16 cores, i.e.
the rate x 16: what an import split 16 ways would take (the command has no such split yet).
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


def bench_import(root: str, out: str) -> tuple[float, int]:
    from data_prep.scene_graphs.pipeline import import_scene_graphs
    verbs = {"posing": "VBG", "drinking": "VBG", "sitting": "VBG", "riding": "VBG"}
    rule = (lambda tokens: [(t, verbs.get(t, "NN")) for t in tokens],
            lambda word: word[:-3] if word.endswith("ing") else word)
    t0 = time.perf_counter()
    manifest = import_scene_graphs("psg", root, out, rule=rule, progress=False)
    return time.perf_counter() - t0, manifest["records"]


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
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--tmp", default="", help="folder to write the inputs and outputs in")
    args = parser.parse_args()
    tmp = args.tmp or tempfile.mkdtemp(prefix="bench_import_")
    root, photos, replies = make_psg(tmp, args.images)
    load = os.getloadavg()[0]
    imp_s, imp_n = bench_import(root, os.path.join(tmp, "imported"))
    ann_s, ann_n = bench_annotate(photos, replies, tmp)
    print(f"{args.images} photographs at {SIZE[0]}x{SIZE[1]}, {os.cpu_count()} cores, "
          f"load average {load:.1f} at the start")
    print("| command | cores | records | s | records/s per core |")
    print("|---|---|---|---|---|")
    for label, s, n, cores in (("import --source psg", imp_s, imp_n, 1),
                               ("annotate, tiny models, scripted VLM", ann_s, ann_n, 1)):
        print(f"| {label} | {cores} | {n} | {s:.2f} | {n / s / cores:.2f} |")
    rate = imp_n / imp_s
    print(f"import / annotate: {rate / (ann_n / ann_s):.1f}x; full PSG ({PSG_IMAGES:,} images) "
          f"in one process (the command): {PSG_IMAGES / rate / 3600:.2f} h; over 16 cores "
          f"(split 16 ways): {PSG_IMAGES / (16 * rate) / 60:.1f} min")


if __name__ == "__main__":
    main()
