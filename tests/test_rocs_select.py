"""ROCS construction's selection steps (`data_prep.rocs.selection`) on a COCO instances file for
the demo photographs plus synthetic cluttered images (44 in all), against expectations worked
out by hand below; the instances file's errors; Figure 3's numbers."""

import json

import numpy as np
import pytest

from conftest import ROOT
from data_prep.rocs import selection as rs
from data_prep.demo import load_annotations

# Synthetic cluttered images (id: [(class, count), ...]); 100 x 100 px.
SYNTHETIC = {
    100: [("person", 29), ("cup", 1)],                      # 30 objects
    101: [("car", 20), ("dog", 1), ("cat", 1), ("tree", 3)],  # 25
    102: [("sheep", 25)],                                   # 25, no rare class
    103: [("book", 18), ("lamp", 1), ("clock", 1)],          # 20
    104: [("bird", 19), ("kite", 1)],                        # 20
    105: [("chair", 20)],                                   # 20: a tie at the cut, higher id
}
SYNTHETIC.update({106 + k: [("box", 1 + k % 9)] for k in range(24)})  # 1-9 objects each
# 14 demo photographs (at most 7 objects each) + 30 synthetic = 44 images: top 10% = ceil(4.4) = 5
# by object count: 100 (30), 101 (25), 102 (25), then two of the three with 20, lower id first.
HIGH_CLUTTER = [100, 101, 102, 103, 104]
RARE = {100: ["cup"], 101: ["dog", "cat"], 102: [], 103: ["lamp", "clock"], 104: ["kite"]}
# The share of the image each rare instance's mask covers; the rule keeps <= 5%.
MASK_SHARE = {"cup": 0.01, "dog": 0.2, "cat": 0.05, "lamp": 0.06, "clock": 0.001, "kite": 0.5}
KEPT = {100: ["cup"], 101: ["cat"], 103: ["clock"]}  # 102: no rare object; 104: kite too large


def _instances_file(tmp_path):
    images, annotations, categories = [], [], {}

    def add(image_id, name, box_xywh):
        cid = categories.setdefault(name, len(categories) + 1)
        annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                            "category_id": cid, "bbox": box_xywh, "iscrowd": 0})

    for i, entry in enumerate(load_annotations()):
        images.append({"id": i + 1, "file_name": entry["path"], "width": int(entry["width"]),
                       "height": int(entry["height"])})
        for obj in entry["objects"]:
            x0, y0, x1, y1 = obj["box"]
            add(i + 1, obj["name"], [x0, y0, x1 - x0, y1 - y0])
    for image_id, classes in SYNTHETIC.items():
        images.append({"id": image_id, "file_name": f"synthetic/{image_id}.png", "width": 100,
                       "height": 100})
        k = 0
        for name, count in classes:
            for _ in range(count):
                add(image_id, name, [k % 10 * 10, k // 10 * 10, 4 + k % 3, 5])
                k += 1
    # a crowd box is not an object
    annotations.append({"id": 9999, "image_id": 106, "category_id": 1, "bbox": [0, 0, 50, 50],
                        "iscrowd": 1})
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": [
        {"id": c, "name": n} for n, c in categories.items()]}))
    return path


@pytest.fixture
def images(tmp_path):
    return rs.read_instances(_instances_file(tmp_path))


def _mask(share, size=100):
    mask = np.zeros((size, size), bool)
    mask.reshape(-1)[:round(share * size * size)] = True
    return mask


def test_read_instances(images):
    assert len(images) == 44
    demo = load_annotations()
    assert [len(im.instances) for im in images[:14]] == [len(e["objects"]) for e in demo]
    x0, y0, x1, y1 = demo[0]["objects"][0]["box"]
    assert images[0].instances[0].box == (x0, y0, x1, y1)  # back from [x, y, w, h]
    assert images[0].instances[0].category == demo[0]["objects"][0]["name"]
    by_id = {im.id: im for im in images}
    assert len(by_id[106].instances) == 1  # its crowd box skipped


def test_selection_steps_match_the_hand_computed_expectation(images):
    clutter = rs.high_clutter(images, 0.1)
    assert [im.id for im in clutter] == HIGH_CLUTTER
    assert {im.id: [i.category for i in rs.rare_instances(im)] for im in clutter} == RARE
    kept = {}
    for im in clutter:
        names = [i.category for i in rs.rare_instances(im)
                 if rs.small_enough(rs.mask_fraction(_mask(MASK_SHARE[i.category])), 0.05)]
        if names:
            kept[im.id] = names
    assert kept == KEPT
    assert [im.id for im in rs.high_clutter(images, 0.25)][:5] == HIGH_CLUTTER
    assert len(rs.high_clutter(images, 0.25)) == 11  # ceil(0.25 x 44)
    with pytest.raises(ValueError, match="top_fraction"):
        rs.high_clutter(images, 0.0)


def test_mask_fraction_and_the_area_rule():
    assert rs.mask_fraction(_mask(0.05)) == 0.05
    assert rs.small_enough(0.05) and not rs.small_enough(0.0501)


@pytest.mark.parametrize("caption, name, named", [
    ("A man holds a red cup on the table.", "cup", True),
    ("Two cups and a saucer", "cup", True),
    ("An open cupboard", "cup", False),
    ("Two Teddy Bears sit on a bed", "teddy bear", True),
    ("a teddy on a bed with a bear poster", "teddy bear", False),
    ("the puppies sleep", "puppy", True),
    ("a  traffic\nlight at dusk", "traffic light", True),
    ("boxes on a shelf", "box", True),
    ("", "cup", False),
])
def test_caption_names_the_object(caption, name, named):
    assert rs.caption_names(caption, name) is named


def test_figure_stats(images):
    clutter = rs.high_clutter(images, 0.1)
    rare = [(im, i) for im in clutter for i in rs.rare_instances(im)]
    stats = rs.figure_stats(clutter, rare)
    assert stats["images"] == 5 and stats["objects_per_image_mean"] == (30 + 25 + 25 + 20 + 20) / 5
    assert stats["objects_per_image_median"] == 25
    assert stats["classes_per_image_mean"] == (2 + 4 + 1 + 3 + 2) / 5
    assert stats["classes"] == 12 and stats["rare_objects"] == 6
    # every synthetic box is 4-6 x 5 px of 10,000: all rare objects are under 1% of the image
    areas = sorted(i.box_area / 10000 for _, i in rare)
    assert stats["rare_box_area_median"] == pytest.approx(np.median(areas))
    assert stats["rare_under_1pct"] == 1.0


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("images"), "'images' is missing or not a list"),
    (lambda d: d["annotations"][2].pop("bbox"), "annotations[2].bbox is None; expected [x, y"),
    (lambda d: d["annotations"][3].update(bbox=[1, 2, -3, 4]),
     "annotations[3].bbox is [1, 2, -3, 4]"),
    (lambda d: d["annotations"][0].update(category_id=777),
     "annotations[0].category_id 777 is not the id of any category"),
    (lambda d: d["annotations"][1].update(image_id=555),
     "annotations[1].image_id 555 is not the id of any image"),
    (lambda d: d["images"][4].pop("width"), "images[4].width is missing"),
    (lambda d: d["categories"][0].update(name=3), "categories[0].name is 3; expected"),
])
def test_malformed_instances_name_the_file_and_field(tmp_path, edit, message):
    path = _instances_file(tmp_path)
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))
    with pytest.raises(rs.InstancesError) as e:
        rs.read_instances(path)
    assert str(path) in str(e.value) and message in str(e.value), str(e.value)


def test_unreadable_instances_files(tmp_path):
    with pytest.raises(rs.InstancesError, match="no such instances file"):
        rs.read_instances(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(rs.InstancesError, match="not a JSON file"):
        rs.read_instances(tmp_path / "bad.json")


# ------------------------------------------------------------- captions and the output folder
from data_prep.rocs import caption as rc  # noqa: E402


def _asker(replies):
    """ask(image, prompt, system) answering from `replies` in turn; records the prompts."""
    calls = []

    def ask(image, prompt, system):
        calls.append((system, prompt))
        return replies[len(calls) - 1] if len(calls) <= len(replies) else None
    return ask, calls


def test_caption_prompts_are_the_papers():
    """MINER appendix J.1: a system prompt for one neutral, factual MS COCO-style sentence of
    roughly 10-18 words naming the highlighted object, without extra adjectives, lists,
    chained clauses or meta phrases; a user prompt for one such sentence of roughly 8-16 words
    that clearly includes the rare class (the paper's placeholder "{rare class}")."""
    system = " ".join(rc.SYSTEM_PROMPT.split())
    for phrase in ("one neutral, factual MS COCO-style sentence", "roughly 10-18 words",
                   "naturally names the highlighted object", "extra adjectives, lists, "
                   "chained clauses and meta phrases"):
        assert phrase in system, phrase
    assert "{rare class}" not in system and "two sentences" not in system
    assert rc.USER_PROMPT == ("Write one natural, neutral MS COCO-style sentence of roughly "
                              "8-16 words that clearly includes the {rare class}.")
    assert rc.caption_prompt("traffic light") == rc.USER_PROMPT.replace("{rare class}",
                                                                        "traffic light")
    assert rc.CAPTION_WORDS == (8, 18)
    ask, calls = _asker(["A kitchen counter with a red cup next to the sink."])
    rc.recaption(ask, None, "cup")
    assert calls == [(rc.SYSTEM_PROMPT, rc.caption_prompt("cup"))]


@pytest.mark.parametrize("caption,words", [
    ("A man's red-and-white hat, on a table.", 7), ("", 0), ("Two dogs -- one cat.", 4)])
def test_caption_words(caption, words):
    assert rc.caption_words(caption) == words


def test_recaption_retries_once_then_drops_with_its_reason():
    ask, calls = _asker(["A kitchen with a red cup on the counter."])
    got = rc.recaption(ask, None, "cup")
    assert (got.caption, got.reason, got.attempts) == (
        "A kitchen with a red cup on the counter.", None, 1)
    # no object named, then named: kept at the second attempt
    ask, calls = _asker(["A busy kitchen with people cooking at the stove.",
                         '{"caption": "A busy kitchen with two cups on the counter."}'])
    got = rc.recaption(ask, None, "cup")
    assert (got.caption, got.reason, got.attempts) == (
        "A busy kitchen with two cups on the counter.", None, 2)
    assert "did not mention the cup" in calls[1][1] and "previous" not in calls[0][1]
    ask, calls = _asker(["A busy kitchen with people cooking at the stove.",
                         "Caption: a kitchen with a cupboard and a stove by the window."])
    got = rc.recaption(ask, None, "cup")
    assert (got.caption, got.reason, got.attempts) == (None, rc.MISSING_OBJECT, 2)
    assert got.replies == ("A busy kitchen with people cooking at the stove.",
                           "Caption: a kitchen with a cupboard and a stove by the window.")
    ask, _ = _asker([])
    assert rc.recaption(ask, None, "cup").reason == rc.NO_REPLY


def test_captions_outside_the_word_range_are_retried_then_dropped():
    long = ("A crowded kitchen with a red cup, a kettle, plates, bowls, knives, spoons and "
            "forks on the wide wooden counter near the window.")
    assert rc.caption_words(long) == 23
    ask, calls = _asker(["A red cup.", long])
    got = rc.recaption(ask, None, "cup")
    assert (got.caption, got.reason, got.attempts) == (None, "caption_words:23 (8-18)", 2)
    assert rc.reason_kind(got.reason) == rc.WORD_COUNT
    assert "Your previous caption had 3 words: write one sentence of 8 to 18 words" in calls[1][1]
    ask, calls = _asker(["A red cup.", "A red cup on a kitchen counter by the window."])
    got = rc.recaption(ask, None, "cup")
    assert (got.caption, got.reason, got.attempts) == (
        "A red cup on a kitchen counter by the window.", None, 2)
    # the range is a parameter; both ends are accepted
    ask, _ = _asker(["A red cup."])
    assert rc.recaption(ask, None, "cup", words=(3, 3)).caption == "A red cup."
    ask, _ = _asker(["A red cup.", "A red cup."])
    assert rc.recaption(ask, None, "cup", words=(4, 30)).reason == "caption_words:3 (4-30)"
    # the object is checked first: a short reply that names nothing is missing its object
    ask, _ = _asker(["A kitchen.", "A kitchen."])
    assert rc.recaption(ask, None, "cup").reason == rc.MISSING_OBJECT
    with pytest.raises(ValueError, match="expected 0 < LO <= HI"):
        rc.recaption(ask, None, "cup", words=(9, 8))


def test_caption_replies_file(tmp_path):
    path = tmp_path / "replies.json"
    path.write_text(json.dumps({"7/3": "a dog", "7/3/retry": "a cat sitting next to a dog on "
                                "the sofa", "8/1": "a cup on a table next to the open window"}))
    ask = rc.CaptionReplies(path)
    assert rc.recaption(ask, (7, 3), "cat").caption == "a cat sitting next to a dog on the sofa"
    assert rc.recaption(ask, (8, 1), "cup").caption == "a cup on a table next to the open window"
    assert rc.recaption(ask, (9, 9), "cup").reason == rc.NO_REPLY
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        rc.CaptionReplies(path)


@pytest.mark.slow
def test_written_split_opens_in_the_rocs_evaluator(tmp_path, tiny_hf):
    from data_prep.demo import image_path
    from sclaro_jax.eval import rocs
    from sclaro_jax.eval.retrieval.data import load_split

    rows = []
    for entry in load_annotations()[:6]:
        for obj in entry["objects"][:2]:
            rows.append({"image": image_path(entry), "image_id": entry["id"],
                         "caption": f"{entry['caption']} There is a {obj['name']}.",
                         "object": obj["name"], "box": obj["box"]})
    folder = rc.write_rocs(tmp_path / "rocs", rows)
    split = load_split(str(folder))
    assert split.num_images == 6 and len(split.queries) == len(rows)
    assert [split.image_ids[g] for g in split.gt] == [r["image_id"] for r in rows]
    out = tmp_path / "out"
    assert rocs.main(["--model", str(tiny_hf[0]), "--split", f"mine={folder}", "--out",
                      str(out), "--no_progress", "--k", "3"]) == 0
    results = json.loads((out / "results.json").read_text())["results"]["mine"]
    assert {"Global", "MINER"} <= set(results) and any("CSLS" in k or "csls" in k
                                                       for k in results)
    with pytest.raises(ValueError, match="nothing to write"):
        rc.write_rocs(tmp_path / "empty", [])


# ------------------------------------------------------------------------- end to end
def _synthetic_images(image_dir):
    rng = np.random.default_rng(0)
    for image_id in SYNTHETIC:
        path = image_dir / "synthetic" / f"{image_id}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        from PIL import Image
        Image.fromarray(rng.integers(0, 256, (100, 100, 3), dtype=np.uint8)).save(path)


def _by_class_segmenter():
    """A stand-in for SAM whose mask for a rare instance covers MASK_SHARE of the image; it is
    called once per high-clutter image that has rare instances, in the subset's order."""
    calls = iter([names for _, names in RARE.items() if names])

    def segment(pixels, boxes):
        names = next(calls)
        assert len(names) == len(boxes)
        return np.stack([_mask(MASK_SHARE[n]) for n in names])
    return segment


@pytest.mark.slow
def test_build_rocs_end_to_end_with_scripted_replies(tmp_path, images, tiny_hf):
    from data_prep.rocs import build_rocs
    from sclaro_jax.eval import rocs

    _synthetic_images(tmp_path / "img")
    ids = {(im.id, i.category): i.id for im in images for i in im.instances}
    replies = {f"100/{ids[100, 'cup']}": "A crowd of people, one holding a cup.",
               f"101/{ids[101, 'cat']}": "Cars parked along a street.",
               f"101/{ids[101, 'cat']}/retry": "Cars parked along a street and a cat.",
               f"103/{ids[103, 'clock']}": "Shelves of books.",
               f"103/{ids[103, 'clock']}/retry": "Shelves full of books."}
    (tmp_path / "replies.json").write_text(json.dumps(replies))
    summary = build_rocs(images, tmp_path / "img", _by_class_segmenter(),
                         rc.CaptionReplies(tmp_path / "replies.json"), tmp_path / "out",
                         ask_with_ids=True, progress=False)
    assert summary["high_clutter"] == 5 and summary["kept_captions"] == 2
    drops = summary["dropped"]
    assert [d["image_id"] for d in drops["no_rare_object"]] == [102]
    assert sorted(d["object"] for d in drops["mask_too_large"]) == ["dog", "kite", "lamp"]
    assert [(d["object"], d["reason"], len(d["replies"])) for d in drops[rc.MISSING_OBJECT]] == [
        ("clock", rc.MISSING_OBJECT, 2)]
    assert drops[rc.WORD_COUNT] == [] and summary["caption_words"] == [8, 18]
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["high_clutter"]["rare_objects"] == 6 and stats["rocs"]["rare_objects"] == 2
    assert stats["rocs"]["images"] == 2 and stats["all"]["images"] == 44
    out = tmp_path / "eval"
    assert rocs.main(["--model", str(tiny_hf[0]), "--split", f"r={tmp_path / 'out' / 'rocs'}",
                      "--out", str(out), "--no_progress", "--k", "1"]) == 0
    assert json.loads((out / "results.json").read_text())["splits"]["r"]["images"] == 2


def test_build_rocs_with_the_tiny_sam(tmp_path, images):
    """The real segment-anything path: a tiny random SAM's masks through SamSegmenter."""
    from data_prep.rocs import build_rocs
    from data_prep.segment import SamSegmenter, build_tiny_sam

    _synthetic_images(tmp_path / "img")
    def ask(image, prompt, system):
        assert system == rc.SYSTEM_PROMPT
        name = prompt.split("clearly includes the ")[1].split(".")[0]
        return f"A cluttered scene with many things and a {name} in it."
    summary = build_rocs(images, tmp_path / "img", SamSegmenter(build_tiny_sam()), ask,
                         tmp_path / "out", max_mask_area=1.0, progress=False)
    assert summary["kept_captions"] == 6  # every rare object: no mask rule, named captions
    from sclaro_jax.eval.retrieval.data import load_split
    split = load_split(str(tmp_path / "out" / "rocs"))
    assert split.num_images == 4 and len(split.queries) == 6


def test_build_rocs_drops_images_outside_the_images_folder_unread(tmp_path, images):
    """An instances file_name that climbs out of the images folder, and an image there that
    is a link out of it: both dropped as outside_root before the selection, never read (their
    bytes are in no file written), the others go through as usual."""
    import dataclasses
    import os

    from data_prep.rocs import build_rocs

    _synthetic_images(tmp_path / "img")
    private = tmp_path / "users_files"
    private.mkdir()
    for image_id in (100, 101):
        os.replace(tmp_path / "img" / "synthetic" / f"{image_id}.png", private / f"{image_id}.png")
    (tmp_path / "img" / "synthetic" / "101.png").symlink_to(private / "101.png")
    images = [dataclasses.replace(im, file_name="../users_files/100.png") if im.id == 100
              else im for im in images]

    def ask(image, prompt, system):
        name = prompt.split("clearly includes the ")[1].split(".")[0]
        return f"A cluttered scene with many things and a {name} in it."
    summary = build_rocs(images, tmp_path / "img",
                         lambda pixels, boxes: np.stack([_mask(0.001) for _ in boxes]), ask,
                         tmp_path / "out", progress=False)
    assert summary["dropped"]["outside_root"] == [
        {"image_id": 100, "file_name": "../users_files/100.png"},
        {"image_id": 101, "file_name": "synthetic/101.png"}]
    assert summary["kept_captions"] > 0
    written = b"".join(p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file())
    for image_id in (100, 101):
        assert (private / f"{image_id}.png").read_bytes() not in written


# ------------------------------------------------------------------ the command, SIGKILL
KILL_AT_CAPTIONS = r'''
import os, signal, sys
import data_prep.rocs.caption as rc
rc.recaption = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # dies as stage 2 starts
from data_prep.__main__ import main
sys.exit(main(sys.argv[1:]))
'''


def _rocs_cli(tmp_path, images, out):
    from data_prep.segment import save_tiny_sam

    if not (tmp_path / "img").exists():
        _synthetic_images(tmp_path / "img")
        save_tiny_sam(str(tmp_path / "sam.pth"))
        replies = {}
        for im in images:
            for inst in rs.rare_instances(im):
                replies[f"{im.id}/{inst.id}"] = (f"A cluttered scene with many things and a "
                                                 f"{inst.category} in it.")
        (tmp_path / "replies.json").write_text(json.dumps(replies))
        _instances_file(tmp_path)
    return ["rocs", "--images", str(tmp_path / "img"), "--instances",
            str(tmp_path / "instances.json"), "--out", str(out), "--sam", str(tmp_path / "sam.pth"),
            "--sam-type", "tiny", "--max-mask-area", "1.0", "--vlm-replies",
            str(tmp_path / "replies.json"), "--device", "cpu", "--no-progress"]


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_cli_killed_after_the_masks_resumes_without_recomputing(tmp_path, images, capsys):
    import subprocess
    import sys

    from data_prep.__main__ import main

    whole = _rocs_cli(tmp_path, images, tmp_path / "whole")
    assert main(whole) == 0
    assert "computed 4 images' masks and 6 captions" in capsys.readouterr().out
    argv = _rocs_cli(tmp_path, images, tmp_path / "killed")
    proc = subprocess.run([sys.executable, "-c", KILL_AT_CAPTIONS, *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -9, proc.stderr[-2000:]
    work = tmp_path / "killed" / "work"
    assert len(list((work / "masks").glob("*.json"))) == 4 and not (work / "captions").exists()
    assert main(argv) == 0
    assert "computed 0 images' masks and 6 captions" in capsys.readouterr().out
    out = lambda d: {k: v for k, v in _files(d).items() if not k.startswith("work/")}  # noqa: E731
    assert out(tmp_path / "killed") == out(tmp_path / "whole")  # byte for byte
    assert main(argv) == 0
    assert "computed 0 images' masks and 0 captions" in capsys.readouterr().out
    assert (tmp_path / "whole" / "stats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_output_evaluates_in_eval_rocs(tmp_path, images, tiny_hf):
    """Tiny SAM + scripted replies -> Global, Global+CSLS and MINER on the written split."""
    from data_prep.__main__ import main
    from sclaro_jax.eval import rocs

    assert main(_rocs_cli(tmp_path, images, tmp_path / "out")) == 0
    out = tmp_path / "eval"
    assert rocs.main(["--model", str(tiny_hf[0]), "--split", f"r={tmp_path / 'out' / 'rocs'}",
                      "--out", str(out), "--no_progress", "--k", "2"]) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["splits"]["r"]["images"] == 4 and record["splits"]["r"]["queries"] == 6
    assert {"Global", "Global+CSLS", "MINER"} <= set(record["results"]["r"])


def test_cli_errors_name_what_is_wrong(tmp_path, images, capsys):
    from data_prep.__main__ import main

    argv = _rocs_cli(tmp_path, images, tmp_path / "out")
    no_vlm = [a for a in argv if a != str(tmp_path / "replies.json") and a != "--vlm-replies"]
    assert main(no_vlm) == 2
    assert "error: pass one of --vlm DIR" in capsys.readouterr().err
    no_sam = [str(tmp_path / "nope.pth") if a == str(tmp_path / "sam.pth") else a for a in argv]
    assert main(no_sam) == 2
    assert "error: --sam " in capsys.readouterr().err
    raw = json.loads((tmp_path / "instances.json").read_text())
    raw["annotations"][5]["bbox"] = "oops"
    (tmp_path / "instances.json").write_text(json.dumps(raw))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'instances.json'}: annotations[5].bbox is 'oops'" in err


@pytest.mark.slow
def test_detector_instances_for_images_without_annotations(tmp_path):
    """GroundingDINO (the tiny random model of the tests) in place of an instances file; the
    boxes are cached, so a second call asks the detector nothing."""
    from data_prep import detect
    from data_prep.rocs import detect_instances

    _synthetic_images(tmp_path / "img")
    model = detect.save_tiny_model(str(tmp_path / "gdino"))
    calls = []
    base = detect.GroundingDetector(model, box_threshold=0.0, text_threshold=0.5)

    def detector(images, objects):
        calls.append(len(images))
        return base(images, objects)

    classes = ["man", "dog", "car"]
    got = detect_instances(tmp_path / "img", classes, detector, work=tmp_path / "work",
                           detector_key="tiny", batch=16, progress=False)
    assert [im.file_name for im in got] == sorted(f"synthetic/{i}.png" for i in SYNTHETIC)
    assert [im.id for im in got] == list(range(1, 31)) and sum(calls) == 30
    assert all((im.width, im.height) == (100, 100) for im in got)
    found = [i for im in got for i in im.instances]
    assert found and all(i.category in classes for i in found)
    assert all(0 <= i.box[0] <= i.box[2] <= 100 and 0 <= i.box[1] <= i.box[3] <= 100
               for i in found)
    calls.clear()
    again = detect_instances(tmp_path / "img", classes, detector, work=tmp_path / "work",
                             detector_key="tiny", batch=16, progress=False)
    assert again == got and calls == []


@pytest.mark.slow
def test_cli_with_the_detector_path(tmp_path, images, capsys):
    from data_prep import detect
    from data_prep.__main__ import main

    argv = _rocs_cli(tmp_path, images, tmp_path / "out")
    i = argv.index("--instances")
    model = detect.save_tiny_model(str(tmp_path / "gdino"))
    (tmp_path / "classes.txt").write_text("man\ndog\n\ncar\n")
    (tmp_path / "none.json").write_text("{}")
    det = argv[:i] + argv[i + 2:] + ["--detector", model, "--classes",
                                      f"@{tmp_path / 'classes.txt'}", "--top-fraction", "1"]
    det[det.index(str(tmp_path / "replies.json"))] = str(tmp_path / "none.json")
    assert main(det) == 2  # no reply for any object: nothing to write, said as such
    assert "error: no caption survived the selection" in capsys.readouterr().err
    assert len(list((tmp_path / "out" / "work" / "boxes").glob("*.json"))) == 30
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["high_clutter"] == 30 and summary["kept_captions"] == 0
    assert main(argv + ["--detector", model, "--classes", "man"]) == 2
    assert "pass one of --instances FILE" in capsys.readouterr().err


def test_classes_coco80_is_one_list_and_unknown_names_are_errors(tmp_path):
    from data_prep.rocs import CLASS_LISTS, COCO80, class_list

    assert len(COCO80) == len(set(COCO80)) == 80 and CLASS_LISTS["coco80"] is COCO80
    assert COCO80[:3] == ("person", "bicycle", "car") and COCO80[-1] == "toothbrush"
    assert class_list("coco80") == list(COCO80) and class_list("man, dog") == ["man", "dog"]
    (tmp_path / "c.txt").write_text("man\n\ndog\n")
    assert class_list(f"@{tmp_path / 'c.txt'}") == ["man", "dog"]
    with pytest.raises(ValueError, match="--classes coco91: unknown class list .*coco80"):
        class_list("coco91")
    with pytest.raises(FileNotFoundError, match="--classes @nope.txt: no such file"):
        class_list("@nope.txt")
    with pytest.raises(ValueError, match="no class names"):
        class_list(" , ")


@pytest.mark.slow
def test_cli_classes_coco80_with_the_tiny_grounding_dino(tmp_path, capsys):
    """`--detector` with `--classes coco80`: the tiny GroundingDINO (64 text tokens) gets the 80
    names in several prompts. A first run without replies drops every rare object with
    vlm_no_reply (so summary.json names them); a second, from the cached boxes and masks, has
    a reply for each, one too short twice (dropped with its word count)."""
    from PIL import Image

    from data_prep import detect
    from data_prep.__main__ import main
    from data_prep.rocs import COCO80, prompt_groups
    from data_prep.segment import save_tiny_sam

    rng = np.random.default_rng(1)
    (tmp_path / "img").mkdir()
    for k in range(2):
        Image.fromarray(rng.integers(0, 256, (100, 100, 3), dtype=np.uint8)).save(
            tmp_path / "img" / f"{k}.png")
    model = detect.save_tiny_model(str(tmp_path / "gdino"))
    save_tiny_sam(str(tmp_path / "sam.pth"))
    tokenizer = detect.GroundingDetector(model).processor.tokenizer
    count = lambda names: len(tokenizer(detect.make_prompt(names))["input_ids"])  # noqa: E731
    groups = prompt_groups(list(COCO80), detect.GroundingDetector(model))
    assert count(list(COCO80)) > 64 and len(groups) > 1 and sum(groups, []) == list(COCO80)
    assert all(count(g) <= 64 for g in groups)
    (tmp_path / "replies.json").write_text("{}")
    argv = ["rocs", "--images", str(tmp_path / "img"), "--detector", model, "--classes",
            "coco80", "--out", str(tmp_path / "out"), "--sam", str(tmp_path / "sam.pth"),
            "--sam-type", "tiny", "--top-fraction", "1", "--max-mask-area", "1.0",
            "--vlm-replies", str(tmp_path / "replies.json"), "--device", "cpu", "--no-progress"]
    assert main(argv) == 2
    assert "no caption survived" in capsys.readouterr().err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rare = summary["dropped"][rc.NO_REPLY]
    assert rare and {d["object"] for d in rare} <= set(COCO80)
    replies = {f"{d['image_id']}/{d['instance_id']}": f"A cluttered scene with many things and "
               f"a {d['object']} in it." for d in rare}
    short = f"{rare[0]['image_id']}/{rare[0]['instance_id']}"
    replies[short] = replies[short + "/retry"] = f"A {rare[0]['object']}."
    (tmp_path / "replies.json").write_text(json.dumps(replies))
    assert main(argv) == 0, capsys.readouterr().err
    assert "computed 0 images' masks" in capsys.readouterr().out  # boxes and masks cached
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["kept_captions"] == len(rare) - 1
    words = len(rare[0]["object"].split()) + 1
    assert [(d["image_id"], d["instance_id"], d["reason"])
            for d in summary["dropped"]["caption_words"]] == [
        (rare[0]["image_id"], rare[0]["instance_id"], f"caption_words:{words} (8-18)")]


def test_cli_classes_and_caption_words_errors(tmp_path, images, capsys):
    from data_prep.__main__ import main

    argv = _rocs_cli(tmp_path, images, tmp_path / "out")
    i = argv.index("--instances")
    det = argv[:i] + argv[i + 2:] + ["--detector", str(tmp_path / "gdino")]
    assert main(det + ["--classes", "coco91"]) == 2
    assert "error: --classes coco91: unknown class list (named lists: coco80" in (
        capsys.readouterr().err)
    assert main(argv + ["--classes", "coco80"]) == 2
    assert "error: --classes names what --detector looks for" in capsys.readouterr().err
    assert main(argv + ["--caption-words", "18-8"]) == 2
    assert "error: --caption-words '18-8': expected LO-HI" in capsys.readouterr().err
    import contextlib
    import io
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        main(["rocs", "--help"])
    text = " ".join(help_text.getvalue().split())
    assert "coco80 (the 80 COCO class names" in text and "--caption-words LO-HI" in text
