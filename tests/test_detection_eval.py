"""sclaro_jax.detection.evaluate against pycocotools run directly (loadRes + summarize) and
hand computations from its per-class precision."""

import contextlib
import io
import math
import sys

import numpy as np
import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from sclaro_jax.detection.evaluate import coco_evaluate, markdown_table

NUM_CLASSES = 6  # class 5 never occurs in the ground truth


def _random_boxes(rng, n, size=200):
    xy = rng.uniform(0, size - 40, (n, 2))
    wh = rng.uniform(8, 40, (n, 2))
    return np.concatenate([xy, xy + wh], axis=1)


def _scene(seed=0, images=20, false_positives=4):
    """Ground truth over classes 0-4 and noisy detections: jittered true boxes with random
    scores and labels sometimes wrong, misses, and false positives (some of class 5)."""
    rng = np.random.default_rng(seed)
    gt, dets = [], []
    for i in range(images):
        k = 0 if i == 3 else int(rng.integers(1, 7))  # image 3: no ground truth
        boxes, labels = _random_boxes(rng, k), rng.integers(0, 5, k)
        gt.append((boxes, labels))
        keep = rng.random(k) < 0.8
        jitter = boxes[keep] + rng.normal(0, 2, (keep.sum(), 4))
        jitter[:, 2:] = np.maximum(jitter[:, 2:], jitter[:, :2] + 1)
        wrong = rng.random(keep.sum()) < 0.15
        det_labels = np.where(wrong, rng.integers(0, 6, keep.sum()), labels[keep])
        fp = int(rng.integers(0, false_positives))
        d_boxes = np.concatenate([jitter, _random_boxes(rng, fp)])
        d_labels = np.concatenate([det_labels, rng.integers(0, 6, fp)])
        d_scores = rng.random(len(d_boxes))
        if i == 7:  # an image without detections
            d_boxes, d_scores, d_labels = np.zeros((0, 4)), np.zeros(0), np.zeros(0, int)
        dets.append((d_boxes, d_scores, d_labels))
    return gt, dets


def _direct_cocoeval(gt, dets, max_dets=300):
    """COCOeval the way its README runs it: a ground-truth COCO, loadRes of the results."""
    anns, results = [], []
    for i, (boxes, labels) in enumerate(gt):
        for b, c in zip(boxes, labels):
            w, h = b[2] - b[0], b[3] - b[1]
            anns.append(dict(id=len(anns) + 1, image_id=i, category_id=int(c) + 1,
                             bbox=[b[0], b[1], w, h], area=w * h, iscrowd=0))
    for i, (boxes, scores, labels) in enumerate(dets):
        results += [dict(image_id=i, category_id=int(c) + 1, score=float(s),
                         bbox=[b[0], b[1], b[2] - b[0], b[3] - b[1]])
                    for b, s, c in zip(boxes, scores, labels)]
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = dict(images=[dict(id=i) for i in range(len(gt))], annotations=anns,
                            categories=[dict(id=c + 1) for c in range(NUM_CLASSES)])
        coco.createIndex()
        ev = COCOeval(coco, coco.loadRes(results), "bbox")
        ev.params.maxDets = [1, 10, max_dets]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


def test_matches_cocoeval_summarize():
    gt, dets = _scene()
    assert max(len(s) for _, s, _ in dets) <= 100  # so AP at 300 detections = AP at 100
    out = coco_evaluate(gt, dets, NUM_CLASSES)  # max_dets=300
    assert set(out) == {"AP", "AP50", "AP75"} and all(isinstance(v, float) for v in out.values())
    ev = _direct_cocoeval(gt, dets, 100)  # summarize's AP row reads maxDets == 100 only
    assert 0.1 < ev.stats[0] < 0.9  # a non-trivial case
    for key, stat in zip(("AP", "AP50", "AP75"), ev.stats[:3]):
        assert out[key] == pytest.approx(stat, abs=1e-4)
    ev = _direct_cocoeval(gt, dets, 300)
    assert ev.stats[0] == -1  # the pycocotools quirk coco_evaluate avoids
    assert out["AP50"] == pytest.approx(ev.stats[1], abs=1e-4)
    assert out["AP75"] == pytest.approx(ev.stats[2], abs=1e-4)


def test_max_dets_is_passed_on():
    gt, dets = _scene(seed=1, false_positives=30)  # several detections per image and class
    seen = set()
    for max_dets in (1, 2, 300):
        ev = _direct_cocoeval(gt, dets, max_dets)
        out = coco_evaluate(gt, dets, NUM_CLASSES, max_dets=max_dets)
        assert out["AP50"] == pytest.approx(ev.stats[1], abs=1e-4)
        assert out["AP75"] == pytest.approx(ev.stats[2], abs=1e-4)
        seen.add(round(out["AP50"], 6))
    assert len(seen) > 1  # the limit matters in this case


def test_perfect_and_missing_detections():
    gt, _ = _scene()
    perfect = [(b, np.ones(len(b)), c) for b, c in gt]
    out = coco_evaluate(gt, perfect, NUM_CLASSES, groups=np.array(list("rrccff")))
    assert out["AP"] == out["AP50"] == out["AP75"] == 1.0
    assert out["APr"] == out["APc"] == 1.0
    assert out["APf"] == 1.0  # class 4 (class 5 has no ground truth and is left out)
    empty = [(np.zeros((0, 4)), np.zeros(0), np.zeros(0, int)) for _ in gt]
    out = coco_evaluate(gt, empty, NUM_CLASSES)
    assert out["AP"] == out["AP50"] == out["AP75"] == 0.0


def test_group_means_by_hand():
    gt, dets = _scene(seed=2)
    ev = _direct_cocoeval(gt, dets)
    precision = ev.eval["precision"][:, :, :, 0, -1]  # area "all", maxDets 300
    per_class = []
    for k in range(NUM_CLASSES):
        p = precision[:, :, k]
        per_class.append(p[p > -1].mean() if (p > -1).any() else math.nan)
    assert math.isnan(per_class[5]) and not any(math.isnan(v) for v in per_class[:5])
    groups = np.array(["r", "c", "r", "f", "c", "f"])
    out = coco_evaluate(gt, dets, NUM_CLASSES, groups=groups)
    assert out["APr"] == pytest.approx((per_class[0] + per_class[2]) / 2, abs=1e-9)
    assert out["APc"] == pytest.approx((per_class[1] + per_class[4]) / 2, abs=1e-9)
    assert out["APf"] == pytest.approx(per_class[3], abs=1e-9)
    assert out["AP"] == pytest.approx(np.mean(per_class[:5]), abs=1e-9)
    # a group whose only class has no ground truth: NaN, key present
    out = coco_evaluate(gt, dets, NUM_CLASSES, groups=np.array(list("rrrccf")))
    assert math.isnan(out["APf"]) and 0 <= out["APr"] <= 1 and 0 <= out["APc"] <= 1


def test_errors():
    gt, dets = _scene()
    no_gt = [(np.zeros((0, 4)), np.zeros(0, int)) for _ in gt]
    with pytest.raises(ValueError, match="no ground-truth box"):
        coco_evaluate(no_gt, dets, NUM_CLASSES)
    with pytest.raises(ValueError, match="labels must lie in"):
        coco_evaluate(gt, dets, 3)
    with pytest.raises(ValueError, match="images"):
        coco_evaluate(gt, dets[:-1], NUM_CLASSES)


def test_missing_pycocotools_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pycocotools.coco", None)
    gt, dets = _scene()
    with pytest.raises(ImportError, match=r'pip install -e "\.\[eval\]" from the sclaro-jax '
                       r'checkout'):
        coco_evaluate(gt, dets, NUM_CLASSES)


def test_coco_evaluate_prints_nothing(capsys):
    gt, dets = _scene()
    coco_evaluate(gt, dets, NUM_CLASSES)
    assert capsys.readouterr().out == ""


def test_markdown_table():
    rows = {"CLIP ViT-B/32": {"AP": 0.1234, "AP50": 0.25, "AP75": 0.1, "APr": 0.0,
                              "APc": 0.0567, "APf": 0.99951},
            "ScenarioCLIP": {"AP": 0.2, "AP50": 0.4, "AP75": 0.15, "APr": math.nan}}
    assert markdown_table(rows) == (
        "| Model | AP | AP50 | AP75 | APr | APc | APf |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n"
        "| CLIP ViT-B/32 | 12.3 | 25.0 | 10.0 | 0.0 | 5.7 | 100.0 |\n"
        "| ScenarioCLIP | 20.0 | 40.0 | 15.0 | - | - | - |\n")


@pytest.mark.parametrize("mode", ["squash", "longest_side"])
def test_detections_are_scored_in_the_original_pixels(mode):
    """The ground truth's own boxes, detected in the resized input (plus a box lying in the
    padding), mapped back by the detection task's `original_detections`: the boxes are the
    originals and AP is 1 against the original ground truth."""
    from sclaro_jax.detection import data
    from sclaro_jax.detection.task import original_detections

    rng = np.random.default_rng(3)
    originals, resized = [], []
    for i, (h, w) in enumerate([(120, 200), (200, 90), (64, 64)]):
        gt = _random_boxes(rng, 4, size=min(h, w))
        ex = data.DetectionExample(str(i), np.zeros((h, w, 3), np.uint8), gt,
                                   rng.integers(0, NUM_CLASSES - 1, 4))
        originals.append(ex)
        resized.append(data.resize_for_detection(ex, 64, mode))
    detections = []
    for ex in resized:
        boxes = np.concatenate([ex.boxes, [[0, 63.9, 64, 64]]])  # the last one in the padding
        detections.append((boxes, np.ones(len(boxes)), np.concatenate([ex.labels, [0]])))
    mapped = original_detections(detections, resized)
    for (boxes, scores, labels), ex, r in zip(mapped, originals, resized):
        in_padding = r.content[0] < 64
        assert len(boxes) == len(ex.boxes) + (not in_padding)
        np.testing.assert_allclose(boxes[:len(ex.boxes)], ex.boxes, atol=1e-3)
    ground_truth = [(ex.boxes, ex.labels) for ex in originals]
    metrics = coco_evaluate(ground_truth, [(b[:4], s[:4], l[:4]) for b, s, l in mapped],
                            NUM_CLASSES)
    assert metrics["AP"] == pytest.approx(1.0)
