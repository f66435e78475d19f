"""Stage 2 (GroundingDINO): prompt, phrase mapping, thresholds and NMS, the detector end to end on
a tiny random transformers GroundingDINO."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from data_prep import detect
from data_prep.demo import ANNOTATIONS
from data_prep.detect import Detection, GroundingDetector, make_prompt, map_phrase, postprocess


def test_make_prompt():
    assert make_prompt(["Man", "red Car"]) == "man. red car."
    assert make_prompt(["  Tall   Tree ", "", "   ", "St. Louis arch", "DOG"]) == \
        "tall tree. st louis arch. dog."
    assert make_prompt([]) == ""
    assert make_prompt(["", " . "]) == ""


@pytest.mark.parametrize("phrase, objects, expected", [
    ("man", ["Man", "red Car"], "Man"),
    ("car", ["Man", "red Car"], "red Car"),                  # sub-span of a name
    ("red car", ["car", "red car"], "red car"),              # exact name beats the earlier overlap
    ("man dog", ["dog", "man"], "dog"),                      # merged names, tie: the earliest
    ("person. red car. [SEP]", ["person", "red car"], "red car"),   # most shared words
    ("cars", ["car", "cars"], "cars"),
    ("##s", ["car", "s"], None),                             # lone wordpiece fragment
    ("[SEP]", ["car"], None),
    ("", ["car"], None),
    ("tree", ["car", "man"], None),
    ("cafe", ["Café"], "Café"),                              # BERT-uncased strips accents
    ("t - shirt", ["hat", "T-shirt"], "T-shirt"),
])
def test_map_phrase(phrase, objects, expected):
    assert map_phrase(phrase, objects) == expected


def iou(a, b):
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def greedy_nms(boxes, scores, groups, threshold):
    """Reference NMS: highest score first, suppress same-group boxes with IoU > threshold."""
    kept = []
    for i in sorted(range(len(boxes)), key=lambda k: -scores[k]):
        if all(groups[i] != groups[j] or iou(boxes[i], boxes[j]) <= threshold for j in kept):
            kept.append(i)
    return kept


def run(boxes, scores, phrases, objects, **kw):
    return postprocess(np.array(boxes, np.float32), np.array(scores, np.float32), phrases,
                       objects, **kw)


def test_box_threshold_is_strict_like_transformers(tiny_detector):
    # float32 logits whose sigmoid is exactly 0.25, just above and just below it
    logits = torch.tensor([-math.log(3), -math.log(3) + 1e-6, -math.log(3) - 1e-6, 2.2])
    probs = torch.sigmoid(logits)
    assert probs[0] == 0.25 and probs[1] > 0.25 and probs[2] < 0.25
    boxes = [[0, 0, 10, 10], [20, 0, 30, 10], [40, 0, 50, 10], [60, 0, 70, 10]]
    found = run(boxes, probs.numpy(), ["car"] * 4, ["car"])
    assert [d.score for d in found] == [probs[3].item(), probs[1].item()]

    outputs = SimpleNamespace(logits=logits[None, :, None].expand(1, 4, 8).contiguous(),
                              pred_boxes=torch.tensor([[[0.5, 0.5, 0.1, 0.1]] * 4]))
    raw = tiny_detector.processor.post_process_grounded_object_detection(
        outputs, torch.ones(1, 8, dtype=torch.long), threshold=0.25, text_threshold=0.25)
    assert raw[0]["scores"].tolist() == [probs[1].item(), probs[3].item()]


def test_nms_iou_boundary():
    objects = ["car"]
    # IoU 0.5 (> 0.4): only the higher-scoring box survives
    found = run([[0, 0, 30, 10], [10, 0, 40, 10]], [0.6, 0.7], ["car", "car"], objects)
    assert [d.box for d in found] == [(10.0, 0.0, 40.0, 10.0)]
    # IoU 0.3: both survive, highest score first
    found = run([[0, 0, 10, 10], [0, 0, 10, 3]], [0.6, 0.7], ["car", "car"], objects)
    assert [d.box for d in found] == [(0.0, 0.0, 10.0, 3.0), (0.0, 0.0, 10.0, 10.0)]
    # either side of 0.4 (at exactly 0.4 float32 rounding decides)
    assert len(run([[0, 0, 10, 10], [0, 0, 10, 3.9]], [0.6, 0.7], ["car"] * 2, objects)) == 2
    assert len(run([[0, 0, 10, 10], [0, 0, 10, 4.1]], [0.6, 0.7], ["car"] * 2, objects)) == 1


def test_nms_per_label_and_class_agnostic():
    objects = ["man", "dog"]
    boxes = [[0, 0, 30, 10], [10, 0, 40, 10]]                # IoU 0.5
    per_label = run(boxes, [0.6, 0.7], ["man", "dog"], objects)
    assert [(d.label, d.score) for d in per_label] == [("dog", np.float32(0.7)),
                                                       ("man", np.float32(0.6))]
    agnostic = run(boxes, [0.6, 0.7], ["man", "dog"], objects, class_agnostic=True)
    assert [d.label for d in agnostic] == ["dog"]


def test_postprocess_matches_reference_nms_on_random_detections():
    rng = np.random.default_rng(0)
    objects = ["man", "red car", "dog"]
    phrases = ["man", "car", "dog", "man dog", "tree", "[SEP]"]
    xy = rng.uniform(0, 80, (60, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(5, 40, (60, 2))], 1).astype(np.float32)
    scores = rng.uniform(0, 1, 60).astype(np.float32)
    phrase = [phrases[k] for k in rng.integers(0, len(phrases), 60)]
    for class_agnostic in (False, True):
        found = postprocess(boxes, scores, phrase, objects, class_agnostic=class_agnostic)
        labels = [map_phrase(p, objects) for p in phrase]
        valid = [i for i in range(60) if scores[i] > 0.25 and labels[i] is not None]
        groups = [0 if class_agnostic else labels[i] for i in valid]
        kept = greedy_nms([boxes[i].tolist() for i in valid], [scores[i] for i in valid],
                          groups, 0.4)
        expected = [valid[k] for k in kept]
        assert [(d.box, d.score, d.label, d.phrase) for d in found] == [
            (tuple(boxes[i].tolist()), float(scores[i]), labels[i], phrase[i])
            for i in expected]
        assert 0 < len(found) < len(valid)


def test_postprocess_clips_and_drops_outside_boxes():
    found = run([[-5, -5, 20, 700], [120, 10, 150, 20], [10, 10, 30, 30]], [0.9, 0.8, 0.7],
                ["man", "man", "nothing"], ["man"], image_size=(100, 600))
    assert found == [Detection((0.0, 0.0, 20.0, 600.0), np.float32(0.9), "man", "man")]
    with pytest.raises(ValueError, match="2 boxes, 2 scores and 1 phrases"):
        run([[0, 0, 1, 1]] * 2, [0.5, 0.5], ["man"], ["man"])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return detect.save_tiny_model(str(tmp_path_factory.mktemp("tiny_grounding_dino")))


@pytest.fixture(scope="module")
def tiny_detector(tiny_model):
    # A random model: box threshold 0 so it detects something, text threshold 0.5 so phrases
    # cover varying parts of the prompt.
    return GroundingDetector(tiny_model, box_threshold=0.0, text_threshold=0.5, batch_size=4)


@pytest.fixture(scope="module")
def photos():
    import skimage.data

    images = [Image.fromarray(skimage.data.astronaut()), Image.fromarray(skimage.data.coffee()),
              Image.fromarray(skimage.data.immunohistochemistry())]
    objects = [["Person", "flag", "space shuttle"], ["cup", "saucer", "spoon"],
               ["stained tissue", "cell nucleus"]]
    return images, objects


def test_tiny_model_loads_offline_and_knows_the_demo_words(tiny_model, tiny_detector,
                                                           monkeypatch):
    from transformers import GroundingDinoProcessor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    processor = GroundingDinoProcessor.from_pretrained(tiny_model)
    with open(ANNOTATIONS, encoding="utf-8") as f:
        entries = json.load(f)["images"]
    prompts = [make_prompt([o["name"] for o in e["objects"]]) for e in entries]
    prompts.append("person. red car. man. dog. cat. stained tissue. cell nucleus. t-shirt.")
    for prompt in prompts:
        ids = processor.tokenizer(prompt)["input_ids"]
        assert processor.tokenizer.unk_token_id not in ids, prompt
    assert tiny_detector.model.config.num_queries == 30


@pytest.mark.slow
def test_detector_end_to_end(tiny_detector, photos):
    images, objects = photos
    # the astronaut and the micrograph (512x512) share one processed size, the coffee (600x400)
    # another: the call runs a batch of two and a batch of one.
    shapes = [tuple(tiny_detector.processor.image_processor(images=im, return_tensors="pt")
                    ["pixel_values"].shape) for im in images]
    assert shapes[0] == shapes[2] != shapes[1]

    before = dict(tiny_detector.timings)
    batch = tiny_detector(images, objects)
    assert set(tiny_detector.timings) == {"preprocess", "model", "postprocess"}
    assert all(tiny_detector.timings[k] > before[k] for k in before)
    assert len(batch) == 3
    labels_seen = set()
    for image, names, found in zip(images, objects, batch):
        assert 0 < len(found) <= tiny_detector.model.config.num_queries
        scores = [d.score for d in found]
        assert scores == sorted(scores, reverse=True)
        for d in found:
            assert d.label in names and d.label == map_phrase(d.phrase, names)
            x0, y0, x1, y1 = d.box
            assert 0 <= x0 < x1 <= image.width and 0 <= y0 < y1 <= image.height
            assert 0.0 < d.score <= 1.0
        by_label = {}
        for d in found:
            by_label.setdefault(d.label, []).append(d.box)
        for boxes in by_label.values():     # no same-label duplicates survive NMS
            assert all(iou(a, b) <= 0.4 + 1e-6 for i, a in enumerate(boxes) for b in boxes[:i])
        labels_seen |= {d.label for d in found}
    assert len(labels_seen) > 3

    assert tiny_detector(images, objects) == batch          # deterministic
    for image, names, found in zip(images, objects, batch):  # batching changes nothing
        single = tiny_detector([image], [names])[0]
        assert [(d.label, d.phrase) for d in single] == [(d.label, d.phrase) for d in found]
        np.testing.assert_allclose([d.box for d in single], [d.box for d in found], atol=1e-3)
        np.testing.assert_allclose([d.score for d in single], [d.score for d in found],
                                   atol=1e-5)


def test_detector_skips_empty_object_lists_and_converts_grey_images(tiny_detector, photos):
    import skimage.data

    grey = Image.fromarray(skimage.data.camera())
    assert grey.mode == "L"
    found = tiny_detector([grey, photos[0][0]], [["man", "camera"], ["", " "]])
    assert found[1] == []
    assert found[0] and {d.label for d in found[0]} <= {"man", "camera"}
    with pytest.raises(ValueError, match="2 images but 1 object lists"):
        tiny_detector([grey, grey], [["man"]])
    with pytest.raises(TypeError, match="image 0: expected a PIL.Image.Image"):
        tiny_detector([np.zeros((8, 8, 3), np.uint8)], [["man"]])


def test_detector_needs_a_saved_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="pass --detector PATH"):
        GroundingDetector(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pass --detector PATH"):
        GroundingDetector(str(tmp_path / "missing"))


def test_prompt_longer_than_max_text_len_is_an_error(tiny_detector, photos):
    names = [f"{w} {w}" for w in ["man", "dog", "cat", "cup", "car", "tree", "sky", "boat",
                                   "bird", "bus", "hat", "pole", "rock", "sign", "sofa",
                                   "snow", "sun", "tie", "vase", "wall", "zebra", "road"]]
    assert len(tiny_detector.processor.tokenizer(make_prompt(names))["input_ids"]) > 64
    with pytest.raises(ValueError, match="image 0: the prompt .* more than GroundingDINO's "
                                         "max_text_len 64"):
        tiny_detector([photos[0][0]], [names])

