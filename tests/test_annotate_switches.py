"""The speed switches of `data_prep annotate` (its "speed" flags) on tiny random models: each
gives the output of the default path. GroundingDINO's text encoded once per distinct prompt:
the same detections, exactly. SAM with SDPA attention or a compiled image encoder: the same
masks, image embeddings equal to float32 rounding. The VLM's static KV cache and larger
(left-padded) batches: the same greedy tokens as a hand-written greedy loop. bf16 autocast:
GroundingDINO's encoder outputs and SAM's embeddings within bf16 rounding (stated below)."""

import copy

import numpy as np
import pytest
from PIL import Image

from data_prep.testing import photograph

SCENES = ("astronaut", "coffee", "astronaut", "coffee", "chelsea")
OBJECTS = [["woman", "flag"], ["cup", "saucer"], ["woman", "flag"], ["cup", "saucer"],
           ["woman", "flag"]]
BOXES = np.array([[50, 40, 300, 350], [200, 100, 500, 380], [10, 10, 590, 390]], float)


@pytest.fixture(scope="module")
def detector_path(tmp_path_factory, one_torch_thread):
    from data_prep import detect
    return detect.save_tiny_model(str(tmp_path_factory.mktemp("gdino")))


@pytest.fixture(scope="module")
def photos():
    return [Image.fromarray(photograph(name)) for name in SCENES]


def detector(path, **switches):
    from data_prep.detect import GroundingDetector
    return GroundingDetector(path, box_threshold=0.0, text_threshold=0.0, batch_size=4,
                             **switches)


def test_text_encoded_once_per_distinct_prompt_gives_the_same_detections(detector_path,
                                                                           photos):
    reference = detector(detector_path)(photos, OBJECTS)
    once = detector(detector_path, text_once=True)
    assert once(photos, OBJECTS) == reference  # boxes, scores, labels, phrases: exactly
    assert sum(len(found) for found in reference) > 50
    # batches (same processed size): astronaut x2, coffee x2, chelsea: 5 rows, 3 encoded
    encoder = once.model.model.text_backbone
    assert (encoder.rows_in, encoder.rows_encoded) == (5, 3)


def outputs_of(det, photos, objects):
    """The raw model outputs of each batch `det` runs, float32."""
    import torch
    got = []
    det.model.register_forward_hook(lambda m, a, o: got.append(
        {k: v.float() for k, v in o.items() if torch.is_tensor(v)}))
    det(photos, objects)
    return got


def relative(a, b) -> float:
    import torch
    a, b = a.float(), b.float()
    finite = torch.isfinite(a)
    return float((a - b)[finite].norm() / a[finite].norm())


def test_bf16_detector_encoder_within_bf16_rounding(detector_path, photos):
    """Under autocast the encoder's vision and text states stay within 3% (relative L2) of
    float32; the random model's 30 queries are a top-k over near-equal scores, which bf16
    reorders, so its final boxes are not compared here (with real weights: on the device)."""
    ref = outputs_of(detector(detector_path), photos[:2], OBJECTS[:2])
    bf = outputs_of(detector(detector_path, bf16=True), photos[:2], OBJECTS[:2])
    assert len(ref) == len(bf) == 2
    for r, b in zip(ref, bf):
        for key in ("encoder_last_hidden_state_vision", "encoder_last_hidden_state_text",
                    "enc_outputs_class"):
            assert 0 < relative(r[key], b[key]) < 0.03, key


@pytest.fixture(scope="module")
def sam(one_torch_thread):
    """The tiny SAM with random relative-position tables (zeros at init, which would leave
    the SDPA mask untested)."""
    import torch

    from data_prep import segment
    model = segment.build_tiny_sam(3)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.image_encoder.named_parameters():
        if "rel_pos" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.5
    return model


def embedding_and_masks(model, **switches):
    import torch

    from data_prep.segment import SamSegmenter
    seg = SamSegmenter(copy.deepcopy(model), **switches)
    image = photograph("coffee")
    pixels = torch.as_tensor(seg.predictor.transform.apply_image(image)).permute(2, 0, 1)
    with torch.no_grad(), seg.autocast():
        embedding = seg.predictor.model.image_encoder(
            seg.predictor.model.preprocess(pixels[None].float())).float()
    return embedding, seg(image, BOXES)


def test_sam_sdpa_gives_the_same_masks(sam):
    from data_prep.segment import use_sdpa
    assert use_sdpa(copy.deepcopy(sam)) == 2  # the windowed and the global block
    embedding, masks = embedding_and_masks(sam)
    sdpa_embedding, sdpa_masks = embedding_and_masks(sam, sdpa=True)
    assert relative(embedding, sdpa_embedding) < 1e-5
    np.testing.assert_array_equal(sdpa_masks, masks)
    assert 0.05 < masks.mean() < 0.95


def test_sam_bf16_masks_within_bf16_rounding(sam):
    """Embedding within 2% (relative L2) of float32, at least 99% of mask pixels the same."""
    embedding, masks = embedding_and_masks(sam)
    bf_embedding, bf_masks = embedding_and_masks(sam, bf16=True)
    assert 0 < relative(embedding, bf_embedding) < 0.02
    assert (bf_masks == masks).mean() >= 0.99


@pytest.mark.slow
def test_sam_compiled_encoder_gives_the_same_masks(sam):
    """torch.compile on the CPU: about a minute of compiling on one core."""
    embedding, masks = embedding_and_masks(sam)
    compiled_embedding, compiled_masks = embedding_and_masks(sam, compile=True)
    assert relative(embedding, compiled_embedding) < 1e-5
    np.testing.assert_array_equal(compiled_masks, masks)


# ------------------------------------------------------------------ the VLM


@pytest.fixture(scope="module")
def qwen(one_torch_thread):
    from data_prep.testing import random_qwen2_vl
    return random_qwen2_vl("tiny")


def greedy_tokens(model, processor, image, prompt, steps):
    """Greedy decoding by repeated full forward passes (no cache), one image."""
    import torch
    chat = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[chat], images=[image], return_tensors="pt")
    ids, kinds, new = inputs["input_ids"], inputs["mm_token_type_ids"], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                           mm_token_type_ids=kinds, pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"]).logits
            token = int(logits[0, -1].argmax())
            new.append(token)
            if token == model.generation_config.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
            kinds = torch.cat([kinds, torch.zeros_like(kinds[:, :1])], 1)  # text
    return new


def generated(vlm, images, prompt):
    """The new token ids of each image (up to its end of sequence) as `vlm` generates them."""
    calls, generate = [], vlm.model.generate

    def recording(**inputs):
        out = generate(**inputs)
        calls.append((inputs["attention_mask"], out[:, inputs["input_ids"].shape[1]:]))
        return out
    vlm.model.generate = recording
    try:
        vlm(images, prompt=prompt)
    finally:
        del vlm.model.generate
    eos = vlm.model.generation_config.eos_token_id
    rows = [row.tolist() for _, out in calls for row in out]
    rows = [row[:row.index(eos) + 1] if eos in row else row for row in rows]
    return rows, [mask for mask, _ in calls]


def test_vlm_static_cache_and_larger_batches_give_the_greedy_tokens(qwen):
    from data_prep.vlm import TransformersVLM
    model, processor = qwen
    rng = np.random.default_rng(0)
    # heights 56..140 px: 2 to 5 rows of merged patches, so a batch is left-padded
    images = [Image.fromarray(rng.integers(0, 256, (28 * (2 + i), 56, 3), dtype=np.uint8))
              for i in range(4)]
    prompt, steps = "w1 w2 w3", 6
    expected = [greedy_tokens(model, processor, im, prompt, steps) for im in images]
    assert len({tuple(t) for t in expected}) > 1  # the images matter: the order is checked
    for static in (False, True):
        for batch in (1, 4):
            vlm = TransformersVLM.of(model, processor, max_new_tokens=steps, batch_size=batch,
                                     static_cache=static)
            tokens, masks = generated(vlm, images, prompt)
            assert tokens == expected, (static, batch)
            if batch == 4:
                assert (masks[0][:, 0] == 0).any()  # left padding was there
            # every row's new tokens; a batch pads the rows that ended early
            assert vlm.generated_tokens == (sum(map(len, expected)) if batch == 1 else
                                            batch * max(map(len, expected)))


def test_switch_flags_reach_the_models(tmp_path):
    """The CLI flags land in AnnotateConfig and its loaders; bf16 alone is in run.json."""
    import argparse
    import dataclasses

    from data_prep.annotate import cli
    from data_prep.annotate.keys import config_key
    from data_prep.annotate.pipeline import AnnotateConfig
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["annotate", "--root", str(tmp_path), "--out",
                              str(tmp_path / "out"), "--detector-text-once", "--sam-sdpa",
                              "--vlm-static-cache", "--bf16"])
    assert (args.detector_text_once, args.sam_sdpa, args.sam_compile, args.vlm_static_cache,
            args.bf16) == (True, True, False, True, True)
    plain = AnnotateConfig(source="folder", root=str(tmp_path), out=str(tmp_path / "o"))
    switched = AnnotateConfig(source="folder", root=str(tmp_path), out=str(tmp_path / "o"),
                              detector_text_once=True, sam_sdpa=True, sam_compile=True,
                              vlm_static_cache=True)
    assert config_key(switched) == config_key(plain) and "bf16" not in config_key(plain)
    assert config_key(dataclasses.replace(plain, bf16=True))["bf16"] is True
