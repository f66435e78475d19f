"""data_prep.segment: SAM loading, box-prompted masks on real photographs, relation regions."""

import numpy as np
import pytest
import skimage.data
import torch
from segment_anything import SamPredictor

from data_prep import focus
from sclaro_jax.data.images import box_mask
from data_prep.segment import (DroppedRelation, SamSegmenter, build_tiny_sam, load_sam,
                               relation_regions, save_tiny_sam)

ASTRONAUT_BOXES = np.array([[150, 20, 350, 250],     # head
                            [0, 180, 512, 512],      # suit
                            [380, 300, 470, 460.5]])  # flag
COFFEE_BOXES = np.array([[100, 20, 520, 380],        # cup and saucer
                         [200, 40, 450, 200],         # coffee
                         [0, 0, 90, 400],
                         [300, 300, 301, 301]])       # a one-pixel box


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sam") / "tiny_sam.pth")
    return path, save_tiny_sam(path, seed=3)


@pytest.fixture(scope="module")
def segmenter(tiny_file):
    return SamSegmenter(tiny_file[1])


@pytest.fixture(scope="module")
def coffee_masks(segmenter):
    return segmenter(skimage.data.coffee(), COFFEE_BOXES)


# --- load_sam ------------------------------------------------------------------------------------

def test_missing_file_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--sam PATH.*sam_vit_h_4b8939\.pth"):
        load_sam(str(tmp_path / "nope.pth"))


def test_unknown_model_type_lists_choices(tiny_file):
    with pytest.raises(ValueError, match=r"'vit_x'.*'tiny'.*'vit_b'.*'vit_h'.*'vit_l'"):
        load_sam(tiny_file[0], model_type="vit_x")


def test_mismatched_file_names_the_type_it_looks_like(tiny_file, tmp_path):
    with pytest.raises(ValueError, match=r"width 48 .*model_type='vit_h'.*looks like .*'tiny'"):
        load_sam(tiny_file[0], model_type="vit_h")
    # A vit_b-width encoder stem loaded as vit_l: rejected before the big model is built.
    stem = tmp_path / "stem.pth"
    torch.save({"image_encoder.patch_embed.proj.weight": torch.zeros(768, 3, 16, 16)}, stem)
    with pytest.raises(ValueError, match=r"width 768 .*'vit_l'.*looks like model_type='vit_b'"):
        load_sam(str(stem), model_type="vit_l")


def test_incomplete_state_dict_names_the_missing_key(tiny_file, tmp_path):
    state = tiny_file[1].state_dict()
    del state["mask_decoder.iou_token.weight"]
    path = tmp_path / "cut.pth"
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"(?s)cut\.pth.*mask_decoder\.iou_token\.weight"):
        load_sam(str(path), model_type="tiny")


class _Pickled:
    pass


def test_file_that_needs_unpickling_code_is_refused(tmp_path):
    path = tmp_path / "object.pth"
    torch.save({"model": _Pickled()}, path)
    with pytest.raises(ValueError, match=r"object\.pth.*weights_only=True"):
        load_sam(str(path), model_type="tiny")
    other = tmp_path / "other.pth"
    torch.save({"weight": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match=r"not a SAM checkpoint"):
        load_sam(str(other), model_type="tiny")


def test_round_trip_gives_identical_weights_and_masks(tiny_file, segmenter):
    path, saved = tiny_file
    loaded = load_sam(path, model_type="tiny")
    assert not loaded.training
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    image = skimage.data.astronaut()
    expected = segmenter(image, ASTRONAUT_BOXES)
    np.testing.assert_array_equal(SamSegmenter(loaded)(image, ASTRONAUT_BOXES), expected)
    # The comparison can fail: another seed's weights give other masks.
    other = SamSegmenter(build_tiny_sam(seed=4))(image, ASTRONAUT_BOXES)
    assert (other != expected).any()


# --- SamSegmenter --------------------------------------------------------------------------------

def single_box_logits(sam, image, boxes):
    """Independent path: segment_anything's own single-box `SamPredictor.predict`."""
    predictor = SamPredictor(sam)
    predictor.set_image(image)
    return np.stack([predictor.predict(box=box, multimask_output=False, return_logits=True)[0][0]
                     for box in boxes])


def assert_masks_are_thresholded(masks, logits, name):
    """masks == logits > 0, except where a logit lies within float noise of the threshold
    (batching changes the summation order of the decoder's matmuls)."""
    clear = np.abs(logits) > 1e-5 * np.abs(logits).max()
    np.testing.assert_array_equal(masks[clear], (logits > 0)[clear], err_msg=name)
    assert (~clear).mean() < 1e-3, name


@pytest.mark.parametrize("name,boxes", [("astronaut", ASTRONAUT_BOXES),
                                        ("coffee", COFFEE_BOXES)])
def test_masks_equal_sam_predictor_one_box_at_a_time(segmenter, coffee_masks, name, boxes):
    image = getattr(skimage.data, name)()
    masks = coffee_masks if name == "coffee" else segmenter(image, boxes)
    assert masks.dtype == bool and masks.shape == (len(boxes), *image.shape[:2])
    assert_masks_are_thresholded(masks, single_box_logits(segmenter.predictor.model, image,
                                                          boxes), name)
    assert masks.any(axis=(1, 2)).all()


def test_deterministic_and_box_batch_independent(segmenter, coffee_masks):
    image = skimage.data.coffee()
    np.testing.assert_array_equal(segmenter(image, COFFEE_BOXES), coffee_masks)
    one_at_a_time = SamSegmenter(segmenter.predictor.model, box_batch=1)
    logits = single_box_logits(segmenter.predictor.model, image, COFFEE_BOXES)
    assert_masks_are_thresholded(one_at_a_time(image, COFFEE_BOXES), logits, "box_batch=1")
    # Different boxes give different masks (the comparisons above can fail).
    assert (coffee_masks[0] != coffee_masks[1]).any()


def test_no_boxes_and_timings(segmenter):
    image = skimage.data.coffee()
    before = dict(segmenter.timings)
    empty = segmenter(image, np.zeros((0, 4)))
    assert empty.shape == (0, 400, 600) and empty.dtype == bool
    assert segmenter.timings == before
    segmenter(image, COFFEE_BOXES[:1])
    assert all(segmenter.timings[k] > before[k] for k in ("preprocess", "model", "postprocess"))


def test_bad_input_is_named(segmenter):
    image = skimage.data.coffee()
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        segmenter(image.astype(np.float32), COFFEE_BOXES)
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        segmenter(image, COFFEE_BOXES[:, :3])
    with pytest.raises(ValueError, match=r"box 1 "):
        segmenter(image, [[0, 0, 10, 10], [50, 0, 40, 10]])
    with pytest.raises(ValueError, match="box_batch"):
        SamSegmenter(segmenter.predictor.model, box_batch=0)


# --- relation_regions ----------------------------------------------------------------------------

CHELSEA = skimage.data.chelsea()  # 300 x 451
SCENE_BOXES = np.array([[10, 10, 60, 80],       # 0 person, far from the horse
                        [200, 150, 260, 250],   # 1 person, next to the horse
                        [240, 140, 380, 280],   # 2 horse
                        [300, 20, 420, 90]])    # 3 grass
SCENE_LABELS = ["person", "person", "horse", "grass"]


def scene_masks():
    h, w = CHELSEA.shape[:2]
    return np.stack([box_mask(b, w, h) for b in SCENE_BOXES])


def test_closest_pair_gives_the_focused_region_of_its_masks():
    masks = scene_masks()
    relations = [("person", "riding", "horse"), ("horse", "near", "person"),
                 ("person", "next to", "person")]
    regions, dropped = relation_regions(CHELSEA, SCENE_BOXES, SCENE_LABELS, masks, relations)
    assert dropped == []
    assert [(r.subject, r.predicate, r.object) for r in regions] == [
        (1, "riding", 2), (2, "near", 1), (0, "next to", 1)]
    for r in regions:
        assert r.region.dtype == np.uint8 and r.region.shape == CHELSEA.shape
        np.testing.assert_array_equal(
            r.region, focus.focused_region(CHELSEA, masks[r.subject], masks[r.object]))
    assert not np.array_equal(regions[0].region, regions[2].region)


def test_dropped_relations_and_their_reasons():
    masks = scene_masks()
    masks[3] = False  # SAM found nothing in the grass box
    relations = [("dog", "on", "grass"), ("person", "holding", "cup"),
                 ("horse", "next to", "horse"), ("horse", "on", "grass"),
                 ("person", "riding", "horse")]
    regions, dropped = relation_regions(CHELSEA, SCENE_BOXES, SCENE_LABELS, masks, relations)
    assert [(r.subject, r.object) for r in regions] == [(1, 2)]
    assert dropped == [DroppedRelation(("dog", "on", "grass"), "no_subject_detection"),
                       DroppedRelation(("person", "holding", "cup"), "no_object_detection"),
                       DroppedRelation(("horse", "next to", "horse"), "no_pair"),
                       DroppedRelation(("horse", "on", "grass"), "empty_mask")]


def test_no_detections_and_mismatched_inputs():
    h, w = CHELSEA.shape[:2]
    regions, dropped = relation_regions(CHELSEA, np.zeros((0, 4)), [], np.zeros((0, h, w), bool),
                                        [("person", "riding", "horse")])
    assert regions == [] and [d.reason for d in dropped] == ["no_subject_detection"]
    with pytest.raises(ValueError, match="3 labels"):
        relation_regions(CHELSEA, SCENE_BOXES, SCENE_LABELS[:3], scene_masks(), [])
    with pytest.raises(ValueError, match="masks of shape"):
        relation_regions(CHELSEA, SCENE_BOXES, SCENE_LABELS, scene_masks()[:, :10], [])


def test_sam_masks_end_to_end(segmenter, coffee_masks):
    """Segmenter output feeds relation_regions: cup (box 0) and coffee (box 1) pair up."""
    image = skimage.data.coffee()
    labels = ["cup", "coffee", "table", "spoon"]
    regions, dropped = relation_regions(image, COFFEE_BOXES, labels, coffee_masks,
                                        [("coffee", "in", "cup")])
    assert dropped == [] and (regions[0].subject, regions[0].object) == (1, 0)
    np.testing.assert_array_equal(
        regions[0].region, focus.focused_region(image, coffee_masks[1], coffee_masks[0]))
