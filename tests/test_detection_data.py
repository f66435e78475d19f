"""sclaro_jax.detection.data: examples from the demo records, class statistics, the
instance-aware sampler (chi-square against its weights), copy-paste, resizing and padding."""

import dataclasses
import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image
from scipy import stats

from sclaro_jax.data import schema
from sclaro_jax.data.dataset import DatasetError, open_dataset
from sclaro_jax.detection import data
from sclaro_jax.detection.data import DetectionExample


def _records(demo_dir, split):
    source = open_dataset(demo_dir).source(split)
    return {s.id: s for s in (schema.decode(source[i]) for i in range(len(source)))}


def _inside(example):
    h, w = example.image.shape[:2]
    b = example.boxes
    return bool(np.all((b[:, 0] >= 0) & (b[:, 1] >= 0) & (b[:, 2] <= w) & (b[:, 3] <= h)
                       & (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])))


def _strip(decode, **fields):
    """A schema.decode whose samples have `fields` replaced (e.g. image=None)."""
    return lambda record: dataclasses.replace(decode(record), **fields)


# ----------------------------------------------------------------- loading

def test_load_examples_reads_originals_and_vocabulary(demo_dir):
    examples, classes = data.load_examples(demo_dir, "train")
    records = _records(demo_dir, "train")
    assert classes == list(open_dataset(demo_dir).vocab.objects)
    assert [e.id for e in examples] == list(records)
    for e in examples:
        s = records[e.id]
        assert e.image.dtype == np.uint8 and e.image.shape == (s.height, s.width, 3)
        assert e.boxes.dtype == np.float32 and e.labels.dtype == np.int32
        assert _inside(e) and np.all((e.labels >= 0) & (e.labels < len(classes)))
        assert [classes[c] for c in e.labels] == [o.name for o in s.objects]
        np.testing.assert_allclose(e.boxes, [o.box for o in s.objects])
    chelsea = next(e for e in examples if e.id == "skimage-chelsea")
    assert chelsea.image.shape == (300, 451, 3)
    np.testing.assert_array_equal(chelsea.image, np.asarray(
        Image.open(io.BytesIO(records["skimage-chelsea"].image)).convert("RGB")))


def test_load_examples_scales_boxes_to_the_training_image(demo_dir, monkeypatch):
    monkeypatch.setattr(schema, "decode", _strip(schema.decode, image=None))
    examples, classes = data.load_examples(demo_dir, "train")
    chelsea = next(e for e in examples if e.id == "skimage-chelsea")
    assert chelsea.image.shape == (34, 51, 3)  # the stored training image of a 451 x 300 photo
    boxes = np.array([(0, 0, 451, 300), (133, 87, 203, 148), (295, 109, 343, 163),
                      (230, 223, 293, 265), (340, 0, 400, 70)], np.float64)
    np.testing.assert_allclose(chelsea.boxes, boxes * ([51 / 451, 34 / 300] * 2), rtol=1e-6)
    assert [classes[c] for c in chelsea.labels] == ["cat", "eye", "eye", "nose", "ear"]
    assert all(_inside(e) for e in examples)


def test_load_examples_class_subset_clipping_and_dropping(demo_dir, monkeypatch):
    original = schema.decode

    def decode(record):
        s = original(record)
        extra = (schema.Object("eye", (-20.0, -10.0, 30.0, 40.0)),    # clipped to (0, 0, 30, 40)
                 schema.Object("eye", (s.width + 1.0, 0.0, s.width + 9.0, 5.0)))  # outside
        return dataclasses.replace(s, objects=s.objects + extra)

    monkeypatch.setattr(schema, "decode", decode)
    examples, classes = data.load_examples(demo_dir, "train", classes=["eye", "cat", "unicorn"])
    assert classes == ["eye", "cat", "unicorn"]
    by_id = {e.id: e for e in examples}
    assert len(by_id) == 10
    chelsea = by_id["skimage-chelsea"]
    assert chelsea.labels.tolist() == [1, 0, 0, 0]
    np.testing.assert_allclose(chelsea.boxes[-1], [0, 0, 30, 40])
    flower = by_id["sklearn-flower"]  # only the added eye survives
    assert flower.labels.tolist() == [0] and _inside(flower)


def test_load_examples_without_any_image_names_the_record(demo_dir, monkeypatch):
    monkeypatch.setattr(schema, "decode", _strip(schema.decode, image=None, train_image=None))
    with pytest.raises(DatasetError) as err:
        data.load_examples(demo_dir, "val")
    message = str(err.value)
    assert "skimage-coffee" in message and "'val'" in message
    assert open_dataset(demo_dir).root in message


def test_class_counts_match_the_records(demo_dir):
    examples, classes = data.load_examples(demo_dir, "train")
    records = _records(demo_dir, "train").values()
    instances = Counter(o.name for s in records for o in s.objects)
    images = Counter(name for s in records for name in {o.name for o in s.objects})
    np.testing.assert_array_equal(data.class_instance_counts(examples, len(classes)),
                                  [instances[c] for c in classes])
    np.testing.assert_array_equal(data.class_image_counts(examples, len(classes)),
                                  [images[c] for c in classes])


# ----------------------------------------------------------------- sampling

def _synthetic(label_lists, size=8):
    return [DetectionExample(f"s{i}", np.zeros((size, size, 3), np.uint8),
                             np.tile([0, 0, 4, 4], (len(ls), 1)), ls)
            for i, ls in enumerate(label_lists)]


SYNTHETIC = [[0, 0, 0], [0, 1], [1, 2], [], [0]]  # instances: class 0: 5, class 1: 2, class 2: 1
# max over present classes of 1 / n_c; the image without boxes gets the smallest (1/5)
SYNTHETIC_WEIGHTS = np.array([1 / 5, 1 / 2, 1, 1 / 5, 1 / 5]) / 2.1


def test_instance_aware_weights_by_hand():
    weights = data.instance_aware_weights(_synthetic(SYNTHETIC), 3)
    np.testing.assert_allclose(weights, SYNTHETIC_WEIGHTS, rtol=1e-12)
    assert weights.dtype == np.float64 and weights.sum() == pytest.approx(1.0)


def test_sampler_frequencies_chi_square():
    sampler = data.InstanceAwareSampler(data.instance_aware_weights(_synthetic(SYNTHETIC), 3),
                                        seed=3)
    draws = np.concatenate([sampler.indices(step, 100) for step in range(100)])  # 10,000
    observed = np.bincount(draws, minlength=len(SYNTHETIC))
    assert stats.chisquare(observed, len(draws) * SYNTHETIC_WEIGHTS).pvalue > 0.001
    uniform = np.full(len(SYNTHETIC), len(draws) / len(SYNTHETIC))
    assert stats.chisquare(observed, uniform).pvalue < 1e-6


def test_sampler_is_deterministic_in_seed_and_step():
    weights = np.arange(1, 11, dtype=np.float64)
    a, b = data.InstanceAwareSampler(weights, 7), data.InstanceAwareSampler(weights, 7)
    batch = a.indices(12, 16)
    assert batch.shape == (16,) and batch.dtype == np.int64
    np.testing.assert_array_equal(batch, b.indices(12, 16))
    b.indices(3, 16)  # drawing other steps first changes nothing
    np.testing.assert_array_equal(batch, b.indices(12, 16))
    assert not np.array_equal(batch, a.indices(13, 16))
    assert not np.array_equal(batch, data.InstanceAwareSampler(weights, 8).indices(12, 16))
    with pytest.raises(ValueError):
        data.InstanceAwareSampler(np.zeros(3), 0)


def test_rare_classes_and_frequency_groups():
    np.testing.assert_array_equal(data.rare_classes(np.array([0, 1, 49, 50, 200])),
                                  [False, True, True, False, False])
    np.testing.assert_array_equal(data.rare_classes(np.array([3, 10]), threshold=10),
                                  [True, False])
    groups = data.class_frequency_groups(np.array([0, 1, 10, 11, 100, 101, 5000]))
    assert groups.tolist() == ["r", "r", "r", "c", "c", "f", "f"]


# ----------------------------------------------------------------- copy-paste

RARE = np.array([True, False, True, False, False])  # classes 0, 2 rare; 1, 3, 4 frequent


def _donors(rng):
    images = [rng.integers(0, 256, (40, 50, 3), dtype=np.uint8) for _ in range(3)]
    return [DetectionExample("d0", images[0], [[2, 3, 12, 20], [20, 5, 45, 30]], [0, 1]),
            DetectionExample("d1", images[1], [[0, 0, 30, 15], [5, 20, 25, 38]], [3, 2]),
            DetectionExample("d2", images[2], [[10, 10, 20, 18]], [1])]


def _target(rng):
    return DetectionExample("t", rng.integers(0, 256, (48, 64, 3), dtype=np.uint8),
                            [[4, 4, 20, 30], [30, 10, 60, 40]], [4, 4])


def test_copy_paste_pastes_only_rare_classes_inside_the_image():
    rng = np.random.default_rng(0)
    donors, target = _donors(rng), _target(rng)
    before = target.image.copy()
    pasted = Counter()
    for seed in range(200):
        out = data.copy_paste(target, donors, RARE, np.random.default_rng(seed))
        assert out.image.shape == target.image.shape and _inside(out)
        new = out.labels[out.labels != 4]
        assert len(new) <= 3 and np.all(RARE[new])
        pasted.update(new.tolist())
    assert set(pasted) == {0, 2}  # both rare classes get pasted, frequent ones never
    np.testing.assert_array_equal(target.image, before)  # the target is not modified
    assert target.labels.tolist() == [4, 4]


def test_copy_paste_pixels_are_the_donor_crop():
    rng = np.random.default_rng(1)
    donors, target = _donors(rng), _target(rng)
    sources = {0: (donors[0], (2, 3, 12, 20)), 2: (donors[1], (5, 20, 25, 38))}
    for seed in range(20):
        out = data.copy_paste(target, donors, RARE, np.random.default_rng(seed), max_pastes=1)
        assert len(out.labels) == 3 and out.labels[-1] in sources
        donor, (x0, y0, x1, y1) = sources[int(out.labels[-1])]
        px0, py0, px1, py1 = out.boxes[-1]
        assert (px1 - px0, py1 - py0) == (x1 - x0, y1 - y0)
        px0, py0 = int(px0), int(py0)
        np.testing.assert_array_equal(out.image[py0:py0 + y1 - y0, px0:px0 + x1 - x0],
                                      donor.image[y0:y1, x0:x1])
        outside = np.ones(target.image.shape[:2], bool)
        outside[py0:py0 + y1 - y0, px0:px0 + x1 - x0] = False
        np.testing.assert_array_equal(out.image[outside], target.image[outside])


def test_copy_paste_shrinks_large_patches_and_removes_covered_boxes():
    rng = np.random.default_rng(2)
    target = _target(rng)  # 64 x 48
    big = DetectionExample("big", rng.integers(0, 256, (200, 300, 3), dtype=np.uint8),
                           [[0, 0, 256, 192]], [0])  # 4:3, larger than the target
    out = data.copy_paste(target, [big], RARE, np.random.default_rng(0))
    # the patch is scaled to 64 x 48 and covers the whole target: both old boxes go
    assert out.labels.tolist() == [0]
    np.testing.assert_allclose(out.boxes[0], [0, 0, 64, 48])
    expected = np.asarray(Image.fromarray(big.image[:192, :256]).resize((64, 48),
                                                                        Image.BILINEAR))
    np.testing.assert_array_equal(out.image, expected)
    # a 64 x 24 patch covers half of a whole-image box: kept; a box inside the patch: removed
    strip = DetectionExample("strip", rng.integers(0, 256, (24, 64, 3), dtype=np.uint8),
                             [[0, 0, 64, 24]], [2])
    whole = DetectionExample("w", target.image, [[0, 0, 64, 48]], [4])
    for seed in range(10):
        out = data.copy_paste(whole, [strip], RARE, np.random.default_rng(seed))
        assert out.labels.tolist() == [4, 2]
        py = int(out.boxes[1, 1])
        tiny = DetectionExample("t", target.image, [[0, 0, 64, 48], [8, py + 2, 20, py + 20]],
                                [4, 4])
        again = data.copy_paste(tiny, [strip], RARE, np.random.default_rng(seed))
        assert again.labels.tolist() == [4, 2]  # the same paste: the inner box is gone


def test_copy_paste_without_rare_donors_returns_a_copy():
    rng = np.random.default_rng(3)
    target = _target(rng)
    out = data.copy_paste(target, _donors(rng), np.zeros(5, bool), rng)
    np.testing.assert_array_equal(out.image, target.image)
    np.testing.assert_array_equal(out.boxes, target.boxes)
    assert out.image is not target.image


# ----------------------------------------------------------------- resize, pad

def test_resize_for_detection_scales_boxes_with_the_pixels():
    image = np.zeros((60, 90, 3), np.uint8)
    image[12:36, 30:60] = 255  # a white rectangle at box (30, 12, 60, 36)
    example = DetectionExample("r", image, [[30, 12, 60, 36]], [1])
    out = data.resize_for_detection(example, 30)
    assert out.image.shape == (30, 30, 3) and out.image.dtype == np.uint8
    np.testing.assert_allclose(out.boxes, [[10, 6, 20, 18]])
    np.testing.assert_array_equal(
        out.image, np.asarray(Image.fromarray(image).resize((30, 30), Image.BILINEAR)))
    assert out.image[7:17, 11:19].min() == 255  # inside the scaled box
    assert out.image[:, :9].max() == 0 and out.image[19:].max() == 0  # outside it
    assert out.labels.tolist() == [1]


def test_pad_targets_pads_and_truncates_keeping_the_first():
    boxes = np.arange(20, dtype=np.float32).reshape(5, 4)
    labels = np.array([3, 1, 4, 1, 5])
    b, l, v = data.pad_targets(boxes, labels, 8)
    assert b.shape == (8, 4) and b.dtype == np.float32 and l.dtype == np.int32
    np.testing.assert_array_equal(b[:5], boxes)
    np.testing.assert_array_equal(b[5:], 0)
    assert l.tolist() == [3, 1, 4, 1, 5, 0, 0, 0] and v.tolist() == [True] * 5 + [False] * 3
    b, l, v = data.pad_targets(boxes, labels, 3)
    np.testing.assert_array_equal(b, boxes[:3])
    assert l.tolist() == [3, 1, 4] and v.all()
    b, l, v = data.pad_targets(np.zeros((0, 4)), np.zeros(0), 2)
    assert not v.any() and b.shape == (2, 4)


# ----------------------------------------------------------------- ViTDet input (longest side)

def _rectangle_example(height, width, box):
    """Black image with a white rectangle exactly at the whole-pixel `box`."""
    image = np.zeros((height, width, 3), np.uint8)
    x0, y0, x1, y1 = box
    image[y0:y1, x0:x1] = 255
    return DetectionExample("r", image, [box], [2])


@pytest.mark.parametrize("height, width, size", [(60, 90, 45), (90, 60, 45), (30, 20, 64),
                                                 (37, 53, 32)])
def test_longest_side_resize_against_numpy(height, width, size):
    box = [width // 4, height // 3, width // 4 + width // 2, height // 3 + height // 2]
    example = _rectangle_example(height, width, box)
    out = data.resize_for_detection(example, size, "longest_side")
    # independent: the long side becomes `size`, aspect kept, rounded half up
    s = size / max(height, width)
    new_w, new_h = int(np.floor(width * s + 0.5)), int(np.floor(height * s + 0.5))
    assert max(new_w, new_h) == size
    assert out.image.shape == (size, size, 3) and out.image.dtype == np.uint8
    assert out.content_size == (new_h, new_w) and out.original_size == (height, width)
    np.testing.assert_allclose(out.scale, (new_w / width, new_h / height))
    expected = np.array(box, np.float64) * np.array([new_w / width, new_h / height] * 2)
    np.testing.assert_allclose(out.boxes, [expected], rtol=1e-6)
    # padding: bottom / right only, the pad pixel, never inside a target box
    np.testing.assert_array_equal(out.image[new_h:], np.broadcast_to(data.PAD_PIXEL,
                                                                     (size - new_h, size, 3)))
    np.testing.assert_array_equal(out.image[:, new_w:], np.broadcast_to(
        data.PAD_PIXEL, (size, size - new_w, 3)))
    assert (out.boxes[:, 2] <= new_w).all() and (out.boxes[:, 3] <= new_h).all()
    # the content is the picture: the white rectangle lies where the scaled box says (1 px)
    content = out.image[:new_h, :new_w, 0]
    rows, cols = np.nonzero(content > 127)
    np.testing.assert_allclose([cols.min(), rows.min(), cols.max() + 1, rows.max() + 1],
                               expected, atol=1.0)
    np.testing.assert_array_equal(content, np.asarray(Image.fromarray(example.image).resize(
        (new_w, new_h), Image.BILINEAR))[..., 0])


def test_longest_side_at_its_own_size_pads_only():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (40, 64, 3), dtype=np.uint8)
    boxes = np.array([[0, 0, 64, 40], [3.5, 2.25, 10, 39]], np.float32)
    out = data.resize_for_detection(DetectionExample("p", image, boxes, [0, 1]), 64,
                                    "longest_side")
    np.testing.assert_array_equal(out.image[:40], image)
    assert (out.image[40:] == np.array(data.PAD_PIXEL, np.uint8)).all()
    np.testing.assert_array_equal(out.boxes, boxes)


def test_pad_pixel_normalises_to_about_zero():
    from sclaro_jax import ops

    assert np.abs(np.asarray(ops.normalize(np.array(data.PAD_PIXEL, np.float32)))).max() < 0.01


@pytest.mark.parametrize("mode", data.RESIZE_MODES)
def test_boxes_to_original_inverts_the_resize(mode):
    rng = np.random.default_rng(1)
    height, width = 75, 130
    xy = rng.uniform(0, [width, height], (20, 2))
    wh = rng.uniform(1, 30, (20, 2))
    boxes = data.clip_boxes(np.concatenate([xy, xy + wh], 1), width, height)
    example = DetectionExample("o", np.zeros((height, width, 3), np.uint8), boxes,
                               np.zeros(20, np.int32))
    out = data.resize_for_detection(example, 64, mode)
    back, keep = data.boxes_to_original(out.boxes, out)
    assert keep.all()
    np.testing.assert_allclose(back, boxes, atol=1e-4)
    # a detection reaching into the padding ends at the picture's edge; one inside it is dropped
    ch, cw = out.content
    pred = np.array([[10, 5, 64, 64], [0, 63.5, 64, 64]], np.float32)
    back, keep = data.boxes_to_original(pred, out)
    sx, sy = cw / width, ch / height
    np.testing.assert_allclose(back[0], [10 / sx, 5 / sy, width, height], rtol=1e-5)
    assert keep.tolist() == [True, mode == "squash"]


def test_copy_paste_into_a_padded_image_stays_in_the_picture():
    rng = np.random.default_rng(2)
    target = data.resize_for_detection(_target(rng), 64, "longest_side")
    ch, cw = target.content
    assert (ch, cw) != (64, 64)
    donors = [data.resize_for_detection(d, 64, "longest_side") for d in _donors(rng)]
    pasted = 0
    for seed in range(20):
        out, count = data.copy_paste_count(target, donors, RARE, np.random.default_rng(seed))
        pasted += count
        np.testing.assert_array_equal(out.image[ch:], target.image[ch:])  # padding untouched
        np.testing.assert_array_equal(out.image[:, cw:], target.image[:, cw:])
        assert (out.boxes[:, 2] <= cw).all() and (out.boxes[:, 3] <= ch).all()
        assert out.content_size == target.content_size
        assert out.original_size == target.original_size
    assert pasted > 0


def test_resize_mode_errors():
    example = DetectionExample("e", np.zeros((4, 4, 3), np.uint8), np.zeros((0, 4)), [])
    with pytest.raises(ValueError, match="unknown resize mode"):
        data.resize_for_detection(example, 8, "crop")
    with pytest.raises(ValueError, match="resized already"):
        data.resize_for_detection(data.resize_for_detection(example, 8), 8)


def test_rare_donors():
    examples = [DetectionExample(str(i), np.zeros((2, 2, 3), np.uint8),
                                 np.ones((len(lab), 4)) * [0, 0, 1, 1], lab)
                for i, lab in enumerate([[0], [1, 2], [], [2, 2], [0, 1]])]
    assert data.rare_donors(examples, np.array([False, False, True])).tolist() == [1, 3]
    assert data.rare_donors(examples, np.zeros(3, bool)).tolist() == []
