"""`python -m data_prep import`: OpenPSG and Visual Genome, in their released layouts (written
here: psg.json, real photographs as JPEGs, COCO panoptic PNGs with RGB-encoded segment ids, COCO
captions; VG's json files), into records whose objects, boxes, triplets, focused regions,
action words and splits equal values worked out here independently; bad input counted."""

import hashlib
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from data_prep import focus
from data_prep.__main__ import main
from data_prep.scene_graphs import import_scene_graphs
from data_prep.shards import TMP_PREFIX
from sclaro_jax.data import schema
from sclaro_jax.data.dataset import open_dataset

# A dict-based stand-in for nltk.pos_tag and the WordNet verb lemmatiser (nltk's data is not
# installed here): the words of the captions below that are verbs, and their lemmas.
VERBS = {"holding": "VBG", "is": "VBZ", "sits": "VBZ", "standing": "VBG", "riding": "VBG"}
LEMMAS = {"holding": "hold", "sits": "sit", "standing": "stand", "riding": "ride"}
RULE = (lambda tokens: [(t, VERBS.get(t.lower(), "NN")) for t in tokens],
        lambda word: LEMMAS[word])

THINGS, STUFF = ["person", "cat", "traffic light"], ["wall-other-merged", "door-stuff"]
NAMES = ["person", "cat", "traffic light", "wall", "door"]  # as words
PREDICATES = ["on", "holding", "in front of"]


def photo(name, size):
    import skimage.data
    return np.asarray(Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
                      .resize(size, Image.BILINEAR))


def jpeg(pixels):
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def write_json(path, doc):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)


def rgb_encode(ids):
    """COCO panoptic's encoding of segment ids: id = R + 256 G + 256^2 B."""
    return np.stack([ids % 256, ids // 256 % 256, ids // 65536], -1).astype(np.uint8)


# image id -> (photograph, size, [(segment id, category, (x0, y0, x1, y1))], relations)
PSG_IMAGES = {
    "1": ("astronaut", (96, 80), [(3226956, 0, (10, 8, 50, 70)), (65793, 4, (0, 0, 96, 80)),
                                  (8421504, 3, (60, 10, 90, 40))],
          [[0, 1, 0], [0, 2, 2], [2, 9, 1]]),   # [2, 9, ...]: past the object list
    "2": ("chelsea", (80, 64), [(1234567, 1, (20, 16, 70, 60)), (300, 3, (0, 0, 80, 16)),
                                (777777, 2, (0, 0, 10, 10))],
          [[0, 1, 0], [2, 0, 2]]),   # segment 777777 is not in the PNG: an empty mask
    "3": ("coffee", (96, 64), [(5, 0, (30, 20, 60, 50)), (6, 3, (0, 0, 96, 20))], [[0, 1, 2]]),
    "4": ("astronaut", (64, 64), [(7, 0, (0, 0, 32, 32)), (8, 3, (32, 32, 64, 64))],
          [[0, 1, 0]]),     # its photograph is missing
    "5": ("coffee", (64, 48), [(9, 0, (0, 0, 32, 32)), (10, 3, (32, 0, 64, 48))],
          [[0, 1, 0]]),     # no caption
}
# caption id -> (image id, caption); listed out of id order on purpose
CAPTIONS = {12: ("1", "A woman is holding a helmet."), 5: ("1", "A woman in a spacesuit ."),
            7: ("2", "A cat sits on a red table"), 8: ("2", "A cat standing on a table"),
            9: ("3", "A cup of coffee on a saucer"), 10: ("3", "Coffee and a spoon"),
            11: ("4", "A man riding a horse")}


def segment_map(size, segments):
    """Segment ids of the pixels: each segment's box filled, largest first (0 = void)."""
    ids = np.zeros(size[::-1], np.int64)
    for sid, _, (x0, y0, x1, y1) in sorted(segments, key=lambda s: -(s[2][2] - s[2][0]) *
                                           (s[2][3] - s[2][1])):
        if sid != 777777:
            ids[y0:y1, x0:x1] = sid   # later segments paint over earlier ones
    return ids


@pytest.fixture(scope="module")
def psg_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("openpsg")
    data = []
    for image_id, (name, size, segments, relations) in PSG_IMAGES.items():
        file_name = f"train2017/{int(image_id):012d}.jpg"
        if image_id != "4":
            (root / "coco" / "train2017").mkdir(parents=True, exist_ok=True)
            (root / "coco" / file_name).write_bytes(jpeg(photo(name, size)))
        png = root / "coco" / f"panoptic_train2017/{int(image_id):012d}.png"
        png.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb_encode(segment_map(size, segments))).save(png)
        data.append({"file_name": file_name, "image_id": image_id, "width": size[0],
                     "height": size[1], "pan_seg_file_name": str(png.relative_to(root / "coco")),
                     "segments_info": [{"id": sid, "category_id": c, "iscrowd": 0,
                                        "isthing": int(c < 3), "area": 1}
                                       for sid, c, _ in segments],
                     "annotations": [{"bbox": list(box), "bbox_mode": 0, "category_id": c}
                                     for _, c, box in segments],
                     "relations": relations})
    write_json(str(root / "psg" / "psg.json"),
               {"data": data, "thing_classes": THINGS, "stuff_classes": STUFF,
                "predicate_classes": PREDICATES, "test_image_ids": ["2"]})
    write_json(str(root / "coco" / "annotations" / "captions_train2017.json"),
               {"images": [{"id": int(i), "file_name": f"{int(i):012d}.jpg"}
                           for i in PSG_IMAGES],
                "annotations": [{"id": k, "image_id": int(i), "caption": c}
                                for k, (i, c) in CAPTIONS.items()]})
    return root


def records(folder):
    """{id: (split, record bytes)} of a dataset folder."""
    ds = open_dataset(str(folder))
    return {schema.decode(r).id: (split, r) for split in schema.SPLITS
            for _, r in ds.records(split)}


@pytest.fixture(scope="module")
def psg_out(psg_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("psg_out") / "data"
    manifest = import_scene_graphs("psg", str(psg_root), str(out), rule=RULE, image_size=32,
                                   keep_originals=True, records_per_shard=2, progress=False)
    return out, manifest


def decode_panoptic(path):
    """The test's own decoding of a panoptic PNG: id = R + 256 G + 256^2 B, in numpy."""
    rgb = np.asarray(Image.open(path).convert("RGB")).astype(np.int64)
    return rgb[..., 0] + rgb[..., 1] * 256 + rgb[..., 2] * 256 ** 2


def test_psg_records_equal_values_worked_out_independently(psg_root, psg_out):
    out, manifest = psg_out
    got = {i: schema.decode(r) for i, (_, r) in records(out).items()}
    assert sorted(got) == ["openpsg/1", "openpsg/2", "openpsg/3"]
    assert {i: s.split for i, s in got.items()} == {
        "openpsg/1": "train", "openpsg/2": "test", "openpsg/3": "train"}  # PSG's test ids
    assert {i: (s.action, s.caption) for i, s in got.items()} == {
        "openpsg/1": ("hold", "A woman is holding a helmet."),   # caption 5 has no verb
        "openpsg/2": ("sit", "A cat sits on a red table"),
        "openpsg/3": ("", "A cup of coffee on a saucer")}
    for image_id in ("1", "2", "3"):
        sample = got[f"openpsg/{image_id}"]
        _, size, segments, relations = PSG_IMAGES[image_id]
        assert (sample.source, sample.mask_kind, sample.width, sample.height) == (
            "openpsg", "panoptic", *size)
        path = psg_root / "coco" / f"train2017/{int(image_id):012d}.jpg"
        assert sample.image == path.read_bytes()
        assert [(o.name, o.box) for o in sample.objects] == [
            (NAMES[c], tuple(map(float, box))) for _, c, box in segments]
        ids = decode_panoptic(psg_root / "coco" / f"panoptic_train2017/{int(image_id):012d}.png")
        rgb = np.asarray(Image.open(path).convert("RGB"))
        expected = [(s, PREDICATES[p], o) for s, o, p in relations
                    if o < len(segments) and (ids == segments[s][0]).any()
                    and (ids == segments[o][0]).any()]
        assert [(r.subject, r.predicate, r.object, r.text) for r in sample.relations] == [
            (s, p, o, f"{NAMES[segments[s][1]]} {p} {NAMES[segments[o][1]]}")
            for s, p, o in expected]
        for r in sample.relations:
            region = focus.focused_region(rgb, ids == segments[r.subject][0],
                                          ids == segments[r.object][0])
            assert r.region == jpeg(region)
    summary = manifest["import"]
    assert summary["skipped"] == {"missing_image": 1, "no_caption": 1}
    assert summary["relations_dropped"] == {"empty_mask": 1, "index_out_of_range": 1}
    assert (summary["images"], summary["kept"], summary["actions"]["with_action"]) == (5, 3, 2)
    assert manifest["split_rule"]["method"] == "dataset"
    assert manifest["mask_kinds"] == {"panoptic": 3}
    assert manifest["splits"]["test"]["records"] == 1 and manifest["splits"]["val"]["records"] == 0


def test_psg_class_names_as_words():
    from data_prep.scene_graphs.psg import class_words
    assert [class_words(n) for n in ("sky-other-merged", "door-stuff", "wall-brick",
                                     "traffic light", "food-other-merged", "playingfield")] == [
        "sky", "door", "wall brick", "traffic light", "food", "playingfield"]


def test_action_rule_on_a_known_caption_list():
    from data_prep.scene_graphs.actions import action_and_caption, words
    assert words("A man's dog, riding-on a wave.") == ["A", "man's", "dog", "riding", "on",
                                                        "a", "wave"]
    assert action_and_caption(["Two dogs.", "There is a man riding a horse"], *RULE) == (
        "ride", "There is a man riding a horse")
    assert action_and_caption(["A kitchen.", "A stove"], *RULE) == ("", "A kitchen.")
    assert action_and_caption([], *RULE) == ("", "")
