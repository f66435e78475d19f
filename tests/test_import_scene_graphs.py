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
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_prep import focus
from data_prep.__main__ import main
from data_prep.scene_graphs.pipeline import import_scene_graphs
from data_prep.testing import rgb_encode, write_json
from sclaro_jax.data import schema
from sclaro_jax.data.dataset import open_dataset

ROOT = Path(__file__).resolve().parents[1]

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


# image id -> (photograph, size, [(segment id, category, (x0, y0, x1, y1))], relations)
PSG_IMAGES = {
    "1": ("astronaut", (96, 80), [(3226956, 0, (10, 8, 50, 70)), (65793, 4, (0, 0, 96, 80)),
                                  (8421504, 3, (60, 10, 90, 40))],
          [[0, 1, 0], [0, 2, 2], [2, 9, 1]]),   # [2, 9, ...]: past the object list
    "2": ("chelsea", (80, 64), [(1234567, 1, (20, 16, 70, 60)), (300, 3, (0, 0, 80, 16)),
                                (777777, 2, (0, 0, 10, 10))],
          [[0, 1, 0], [2, 0, 2]]),   # segment 777777 is not in the PNG: an empty mask
    "3": ("coffee", (96, 64), [(5, 0, (30, 20, 60, 50)), (6, 3, (0, 0, 96, 20))],
          [[0, 1, 2], [1, 0, 7]]),   # predicate 7: past predicate_classes
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
    return write_psg_root(tmp_path_factory.mktemp("openpsg"))


def write_psg_root(root):
    """An OpenPSG download folder in the released layout under `root` (psg/psg.json, COCO's
    train2017 JPEGs, panoptic PNGs and captions json) holding `PSG_IMAGES`; returns `root`."""
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
    # two worker processes, blocks of two images (the kill test below: one process)
    manifest = import_scene_graphs("psg", str(psg_root), str(out), rule=RULE, image_size=32,
                                   keep_originals=True, records_per_shard=2, progress=False,
                                   workers=2, block_size=2)
    assert not os.path.exists(f"{out}.work")   # removed once the dataset is written
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
                    if o < len(segments) and p < len(PREDICATES) and (ids == segments[s][0]).any()
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
    assert summary["relations_dropped"] == {"empty_mask": 1, "index_out_of_range": 2}
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


# --------------------------------------------------------------------------- Visual Genome

def vg_object(object_id, box, name, key="names"):
    x, y, w, h = box
    return {"object_id": object_id, "x": x, "y": y, "w": w, "h": h,
            key: [name] if key == "names" else name}


@pytest.fixture(scope="module")
def vg_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vg")
    (root / "VG_100K").mkdir()
    (root / "VG_100K_2").mkdir()
    (root / "VG_100K" / "10.jpg").write_bytes(jpeg(photo("astronaut", (96, 72))))
    (root / "VG_100K_2" / "11.jpg").write_bytes(jpeg(photo("chelsea", (80, 64))))
    url = "https://cs.stanford.edu/people/rak248/VG_100K/{}.jpg"
    write_json(str(root / "image_data.json"), [
        {"image_id": 10, "url": url.format(10), "width": 96, "height": 72},
        {"id": 11, "width": 80, "height": 64},          # no url: found in VG_100K_2
        {"image_id": 12, "url": url.format(12), "width": 50, "height": 50}])   # missing
    write_json(str(root / "objects_v1_4.json"), [   # a version's name
        {"image_id": 10, "objects": [vg_object(100, (5, 6, 40, 50), "Man"),
                                     vg_object(101, (50, 10, 40, 30), "horse"),
                                     vg_object(102, (60, 50, 20, 10), "  Big  Hat ")]},
        {"image_id": 11, "objects": [vg_object(200, (20, 10, 30, 25), "cat", key="name")]},
        {"image_id": 12, "objects": [vg_object(300, (0, 0, 10, 10), "dog")]}])
    write_json(str(root / "relationships.json"), [
        {"image_id": 10, "relationships": [
            {"predicate": "RIDING", "subject": {"object_id": 100}, "object": {"object_id": 101}},
            {"predicate": "wears", "subject": {"object_id": 100},     # object not in objects
             "object": vg_object(103, (10, 0, 20, 10), "cap", key="name")},
            {"predicate": "near", "subject": {"object_id": 999}, "object": {"object_id": 101}}]},
        {"image_id": 11, "relationships": [   # the table's box reaches past the photograph
            {"predicate": "on", "subject": {"object_id": 200},
             "object": vg_object(201, (0, 40, 80, 100), "table")}]},
        {"image_id": 12, "relationships": [
            {"predicate": "on", "subject": {"object_id": 300}, "object": {"object_id": 300}}]}])
    write_json(str(root / "region_descriptions.json"), [
        {"id": 10, "regions": [{"phrase": "a man riding a horse", "image_id": 10}]},
        {"id": 11, "regions": [{"phrase": "cat on a table", "image_id": 11},
                               {"phrase": "a table", "image_id": 11}]},
        {"id": 12, "regions": [{"phrase": "a dog", "image_id": 12}]}])
    return root


def centre_box_mask(box, width, height):
    """The test's own box mask: the pixels whose centres lie inside the box."""
    yy, xx = np.mgrid[:height, :width] + 0.5
    x0, y0, x1, y1 = box
    return (xx >= x0) & (xx < x1) & (yy >= y0) & (yy < y1)


def test_vg_records_equal_values_worked_out_independently(vg_root, tmp_path):
    manifest = import_scene_graphs("vg", str(vg_root), str(tmp_path / "vg"), rule=RULE,
                                   image_size=32, keep_originals=True, progress=False)
    got = {i: schema.decode(r) for i, (_, r) in records(tmp_path / "vg").items()}
    assert sorted(got) == ["vg/10", "vg/11"]
    expected = {
        "vg/10": ([("man", (5, 6, 45, 56)), ("horse", (50, 10, 90, 40)),
                   ("big hat", (60, 50, 80, 60)), ("cap", (10, 0, 30, 10))],
                  [(0, "riding", 1), (0, "wears", 3)], "ride", "a man riding a horse",
                  "VG_100K/10.jpg"),
        "vg/11": ([("cat", (20, 10, 50, 35)), ("table", (0, 40, 80, 64))],   # clipped
                  [(0, "on", 1)], "", "cat on a table", "VG_100K_2/11.jpg")}
    for image_id, (objects, relations, action, caption, path) in expected.items():
        sample = got[image_id]
        digest = hashlib.sha256(f"vg:{image_id[3:]}".encode()).hexdigest()
        assert sample.split == ("test" if int(digest[:8], 16) < 0.2 * 2 ** 32 else "train")
        assert (sample.source, sample.mask_kind, sample.action, sample.caption) == (
            "vg", "box", action, caption)
        assert sample.image == (vg_root / path).read_bytes()
        assert [(o.name, o.box) for o in sample.objects] == [
            (n, tuple(map(float, b))) for n, b in objects]
        assert [(r.subject, r.predicate, r.object, r.text) for r in sample.relations] == [
            (s, p, o, f"{objects[s][0]} {p} {objects[o][0]}") for s, p, o in relations]
        rgb = np.asarray(Image.open(vg_root / path).convert("RGB"))
        h, w = rgb.shape[:2]
        for r in sample.relations:
            region = focus.focused_region(rgb, centre_box_mask(objects[r.subject][1], w, h),
                                          centre_box_mask(objects[r.object][1], w, h))
            assert r.region == jpeg(region)
    summary = manifest["import"]
    assert summary["skipped"] == {"missing_image": 1}
    assert summary["relations_dropped"] == {"index_out_of_range": 1}
    assert manifest["split_rule"]["test_fraction"] == 0.2


# --------------------------------------------------------------------------- bad input, CLI

def test_cli_imports_vg_without_action_words(vg_root, tmp_path, capsys):
    out = tmp_path / "vg"
    assert main(["import", "--source", "vg", "--root", str(vg_root), "--out", str(out),
                 "--no-actions", "--image-size", "32", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "3 images: 2 kept" in printed and "skipped: missing_image 1" in printed
    assert "relations dropped: index_out_of_range 1" in printed
    assert "action words: 0 of 2 images (0.0%) (--no-actions)" in printed
    assert {schema.decode(r).action for _, r in records(out).values()} == {""}


@pytest.mark.parametrize("source,name", [("psg", "psg/psg.json"), ("vg", "relationships.json")])
def test_a_truncated_json_is_one_error_line_naming_it(source, name, psg_root, vg_root,
                                                      tmp_path, capsys):
    import shutil
    root = tmp_path / "root"
    shutil.copytree(psg_root if source == "psg" else vg_root, root)
    text = (root / name).read_text()
    (root / name).write_text(text[:len(text) // 2])
    assert main(["import", "--source", source, "--root", str(root), "--out",
                 str(tmp_path / "out"), "--no-actions", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(root / name) in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.work").exists()


def test_missing_nltk_data_names_every_download(psg_root, tmp_path, capsys, monkeypatch):
    import nltk
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "no_nltk_data")])
    assert main(["import", "--source", "psg", "--root", str(psg_root), "--out",
                 str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("error:") == 1
    for what in ("python -m nltk.downloader averaged_perceptron_tagger_eng",
                 "python -m nltk.downloader wordnet", "--no-actions"):
        assert what in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.work").exists()


KILLED_IMPORT = """
import json, os, signal, sys
from data_prep.scene_graphs import pipeline
verbs, lemmas = json.loads(sys.argv[3])
rule = (lambda tokens: [(t, verbs.get(t.lower(), "NN")) for t in tokens], lemmas.__getitem__)
real, calls = pipeline.make_sample, []
def make_sample(*args, **kwargs):
    calls.append(1)
    if len(calls) == 4:   # block 0 (images 1, 2) finished, block 1 half done
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
pipeline.make_sample = make_sample
pipeline.import_scene_graphs("psg", sys.argv[1], sys.argv[2], rule=rule, image_size=32,
                             keep_originals=True, records_per_shard=2, progress=False,
                             block_size=2)
"""


def test_rerun_after_a_killed_import_resumes_with_the_same_records(psg_root, psg_out, tmp_path,
                                                                   monkeypatch, capsys):
    from data_prep.scene_graphs import pipeline
    out = tmp_path / "data"
    killed = [sys.executable, "-c", KILLED_IMPORT, str(psg_root), str(out),
              json.dumps([VERBS, LEMMAS])]
    run = subprocess.run(killed, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert not out.exists()                     # nothing published
    blocks = sorted(os.listdir(f"{out}.work/blocks"))
    assert blocks == ["000000.array_record", "000000.json"], blocks   # what the kill kept
    # another command on that work folder (no action words): the block is redone
    calls = []
    real = pipeline.make_sample
    monkeypatch.setattr(pipeline, "make_sample", lambda g, *a, **k: calls.append(g.id) or
                        real(g, *a, **k))
    kw = dict(image_size=32, keep_originals=True, records_per_shard=2, progress=False,
              block_size=2)
    import_scene_graphs("psg", str(psg_root), str(tmp_path / "other"), with_actions=False,
                        work=f"{out}.work", **kw)
    assert "1 blocks in" in capsys.readouterr().err and len(calls) == 5
    # the same command after a kill: block 0 is kept, blocks 1 and 2 are done
    assert subprocess.run(killed, cwd=ROOT, timeout=300).returncode == -signal.SIGKILL
    calls.clear()
    manifest = import_scene_graphs("psg", str(psg_root), str(out), rule=RULE, **kw)
    assert "1 of 3 blocks already done" in capsys.readouterr().err
    assert calls == ["openpsg/3", "openpsg/4", "openpsg/5"]
    assert not os.path.exists(f"{out}.work")
    # one process after a kill == two worker processes without (psg_out)
    assert records(out) == records(psg_out[0])
    assert manifest["import"] == psg_out[1]["import"]


def test_ctrl_c_keeps_the_finished_blocks_and_says_so(psg_root, tmp_path, monkeypatch, capsys):
    from data_prep.scene_graphs import pipeline
    real, calls = pipeline.make_sample, []

    def make_sample(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(pipeline, "make_sample", make_sample)
    out = tmp_path / "out"
    assert main(["import", "--source", "psg", "--root", str(psg_root), "--out", str(out),
                 "--no-actions", "--no-progress", "--workers", "1", "--block-size", "2"]) == 130
    err = capsys.readouterr().err
    assert f"1 of 3 blocks are kept in {out}.work: rerun the same command to resume" in err
    assert "Traceback" not in err and not out.exists()
    assert sorted(os.listdir(f"{out}.work/blocks")) == ["000000.array_record", "000000.json"]


def test_curate_runs_on_an_import_unchanged(psg_out, tmp_path):
    from data_prep.curate import NeedsLabels, curate
    with pytest.raises(NeedsLabels):   # the first pass: clusters written for labelling
        curate(str(psg_out[0]), str(tmp_path / "curated"), clusters=str(tmp_path / "c.json"),
               tagger=lambda tokens: [(t, "NN") for t in tokens], action_lemmatizer="porter",
               progress=False)
    doc = json.loads((tmp_path / "c.json").read_text())
    result = curate(str(psg_out[0]), str(tmp_path / "curated"), clusters=str(tmp_path / "c.json"),
                    tagger=lambda tokens: [(t, "NN") for t in tokens], accept_suggested=True,
                    action_lemmatizer="porter", progress=False)
    assert result["records"] == 3, doc


def test_a_panoptic_png_of_another_size_is_a_counted_skip_and_limit_counts(psg_root, tmp_path):
    import shutil
    root = tmp_path / "root"
    shutil.copytree(psg_root, root)
    Image.new("RGB", (8, 8)).save(root / "coco" / "panoptic_train2017" / "000000000003.png")
    manifest = import_scene_graphs("psg", str(root), str(tmp_path / "out"), rule=RULE,
                                   image_size=32, limit=3, progress=False)
    assert (manifest["import"]["images"], manifest["import"]["skipped"]) == (
        3, {"bad_panoptic_png": 1})
    assert manifest["records"] == 2


def test_cli_uses_nltks_tagger_and_wordnet_verb_lemmas(psg_root, tmp_path, monkeypatch, capsys):
    import nltk
    import nltk.stem

    class FakeWordNet:   # WordNet's answer for the verbs of the captions, read as verbs
        def lemmatize(self, word, pos):
            return LEMMAS[word] if pos == "v" else word
    monkeypatch.setattr(nltk.data, "find", lambda resource: resource)
    monkeypatch.setattr(nltk, "pos_tag", RULE[0])
    monkeypatch.setattr(nltk.stem, "WordNetLemmatizer", FakeWordNet)
    out = tmp_path / "out"
    assert main(["import", "--source", "psg", "--root", str(psg_root), "--out", str(out),
                 "--image-size", "32", "--no-progress"]) == 0
    assert "action words: 2 of 3 images (66.7%)" in capsys.readouterr().out
    assert {i: schema.decode(r).action for i, (_, r) in records(out).items()} == {
        "openpsg/1": "hold", "openpsg/2": "sit", "openpsg/3": ""}


def test_a_dataset_in_out_is_refused_before_reading(psg_out, tmp_path, capsys):
    assert main(["import", "--source", "vg", "--root", str(tmp_path / "absent"), "--out",
                 str(psg_out[0]), "--no-actions", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "already holds a dataset" in err
