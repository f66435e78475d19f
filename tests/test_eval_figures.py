"""Evaluation suite: Table A1 costs, relation localisation, attention / t-SNE / curve figures."""

import dataclasses
import io
import json

import jax
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from sclaro_jax.data import schema
from sclaro_jax.eval.protocols import cost, figures, localise
from sclaro_jax.models import clip, scenarioclip

# The "tiny" preset with one transformer layer per tower: building and compiling models is most
# of this file's time on a 2-core machine.
SMALL = clip.config_from_preset("tiny")
SMALL = SMALL.replace(vision=dataclasses.replace(SMALL.vision, num_hidden_layers=1),
                      text=dataclasses.replace(SMALL.text, num_hidden_layers=1))


@pytest.fixture(scope="module")
def tiny_models():
    """One real ScenarioCLIP of `SMALL` towers; its global pair stands in for a second model."""
    sc = scenarioclip.ScenarioCLIP(lambda i: clip.create(SMALL, seed=10 + i), 32,
                                   rngs=nnx.Rngs(2))
    return {"ScenarioCLIP": sc, "global pair": sc.pair("global")}


# --------------------------------------------------------------------------- metrics

def _numpy_metrics(prob, target):
    """Plain per-example reference: loops, no broadcasting tricks."""
    pred = prob >= 0.5
    truth = target >= 0.5
    tp = fp = fn = 0
    for p, t in zip(pred.ravel(), truth.ravel()):
        tp += p and t
        fp += p and not t
        fn += t and not p
    if tp + fp + fn == 0:
        dice = iou = 1.0
    else:
        dice = 2 * tp / (2 * tp + fp + fn)
        iou = tp / (tp + fp + fn)
    return dice, iou, float(np.mean(np.abs(prob - target)))


def test_segmentation_metrics_match_numpy_with_empty_masks():
    t = np.zeros((5, 6, 6), np.float32)
    p = np.zeros((5, 6, 6), np.float32)
    t[0, 1:4, 1:4] = 1
    p[0, 2:5, 2:5] = 0.9  # overlap 2x2 of 3x3 and 3x3: dice 8/18, iou 4/14
    p[0, 0, 0] = 0.49  # below threshold: counts for MAE only
    p[1] = 0.2  # both empty -> dice = iou = 1
    p[2, 0, 0] = 0.7  # empty target, one predicted pixel -> 0
    t[3, :2] = 1  # target, empty prediction -> 0
    t[4] = 1
    p[4] = 0.5  # threshold is inclusive
    per = localise.per_example_metrics(p, t)
    for i in range(5):
        dice, iou, mae = _numpy_metrics(p[i], t[i])
        assert per["dice"][i] == pytest.approx(dice)
        assert per["iou"][i] == pytest.approx(iou)
        assert per["mae"][i] == pytest.approx(mae)
    assert per["dice"][0] == pytest.approx(8 / 18) and per["iou"][0] == pytest.approx(4 / 14)
    assert per["dice"][1] == per["iou"][1] == 1.0
    assert per["dice"][2] == per["iou"][2] == 0.0
    assert per["dice"][3] == per["iou"][3] == 0.0
    assert per["dice"][4] == per["iou"][4] == 1.0
    mean = localise.segmentation_metrics(p, t)
    assert mean["dice"] == pytest.approx(per["dice"].mean())
    assert mean["mae"] == pytest.approx(per["mae"].mean())
    with pytest.raises(localise.LocaliseError):
        localise.segmentation_metrics(p[:, :3], t)


# --------------------------------------------------------------------------- inputs / masks

def _png(pixels):
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _sample(mask_kind="box"):
    h, w = 8, 10
    img = (np.arange(h * w * 3).reshape(h, w, 3) % 250 + 1).astype(np.uint8)  # no zero pixel
    objects = (schema.Object("cup", (1.0, 1.0, 3.0, 4.0)),      # cols 1-2, rows 1-3
               schema.Object("table", (5.0, 5.0, 10.0, 8.0)),   # cols 5-9, rows 5-7
               schema.Object("dog", (0.0, 0.0, 10.0, 8.0)))
    rel = schema.Relation(0, "on", 1, "cup on table", _png(img))
    return img, schema.Sample("s1", "demo", "test", _png(img), w, h, "eating", "a cup",
                              objects, (rel,), mask_kind)


def test_relation_input_and_mask_on_hand_made_record():
    img, sample = _sample()
    want = np.zeros((8, 10), bool)
    want[1:4, 1:3] = True
    want[5:8, 5:10] = True
    np.testing.assert_array_equal(localise.relation_mask(sample, 0), want)
    x = localise.relation_input(img, sample, 0)
    np.testing.assert_array_equal(x[want], img[want])
    assert (x[~want] == 0).all()
    # a half-covered pixel (centre outside) is out: box x0 = 1.6 starts at column 2
    assert localise.box_mask((1.6, 0, 3, 1), 10, 8)[0].nonzero()[0].tolist() == [2]
    with pytest.raises(localise.LocaliseError, match="relations"):
        localise.relation_mask(sample, 3)
    # "sam" records do not store the masks: a clear error, or the caller's masks
    _, sam = _sample("sam")
    with pytest.raises(localise.LocaliseError, match="mask_fn"):
        localise.relation_mask(sam, 0)
    own = np.zeros((8, 10), bool)
    own[2, 2] = True
    np.testing.assert_array_equal(localise.relation_mask(sam, 0, lambda s, j: own), own)
    # the input is zeroed by the boxes even when the target mask is smaller
    xs, ys = localise.relation_examples([sam], 8, mask_fn=lambda s, j: own)
    assert xs.shape == (1, 8, 8, 3) and ys.shape == (1, 8, 8) and ys.sum() >= 1


# --------------------------------------------------------------------------- decoder, training

@pytest.mark.slow
def test_decoder_shapes_and_frozen_vs_trainable(tiny_models):
    dec = localise.MaskDecoder(64, rngs=nnx.Rngs(0))
    assert dec(np.zeros((2, 4, 4, 64), np.float32)).shape == (2, 4, 4, 1)
    assert dec.conv1.kernel.shape == (3, 3, 64, 256)
    assert dec.conv2.kernel.shape == (3, 3, 256, 64)
    assert dec.conv3.kernel.shape == (1, 1, 64, 1)
    tower = tiny_models["ScenarioCLIP"].pair("relation").vision_model
    probs = localise.predict_masks(tower, dec, np.zeros((2, 32, 32, 3), np.float32))
    assert probs.shape == (2, 32, 32)
    assert float(probs.min()) > 0 and float(probs.max()) < 1

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    y = np.zeros((4, 32, 32), np.float32)
    y[:, 8:20, 4:28] = 1
    before = jax.tree.map(np.array, nnx.state(tower, nnx.Param))

    def same(a, b):
        return all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    frozen = localise.train_localiser(tower, x, y, variant="frozen", max_steps=2, batch_size=2,
                                      learning_rate=1e-3)
    assert len(frozen.losses) == 2
    assert same(nnx.state(frozen.tower, nnx.Param), before)
    assert not same(nnx.state(frozen.decoder, nnx.Param),
                    nnx.state(localise.MaskDecoder(64, rngs=nnx.Rngs(0)), nnx.Param))
    trained = localise.train_localiser(tower, x, y, variant="trainable", max_steps=2,
                                       batch_size=2, learning_rate=1e-3)
    assert not same(nnx.state(trained.tower, nnx.Param), before)
    assert same(nnx.state(tower, nnx.Param), before)  # the caller's model is left alone
    with pytest.raises(localise.LocaliseError, match="variant"):
        localise.train_localiser(tower, x, y, variant="partly")


@pytest.mark.slow
def test_evaluate_localisation_on_demo(demo_dir, tiny_models):
    out = localise.evaluate_localisation(tiny_models["ScenarioCLIP"], demo_dir,
                                         variant="frozen", max_steps=3, batch_size=8)
    assert out["num_train"] > 0 and out["num_test"] > 0 and out["steps"] == 3
    assert out["image_size"] == 32
    for k in ("dice", "iou"):
        assert 0.0 <= out[k] <= 1.0
    assert 0.0 <= out["mae"] <= 1.0


# --------------------------------------------------------------------------- attention overlays

class BrightnessTower:
    """A stand-in vision tower whose answer is known: the CLS token is (1, 0) and each patch
    token is (exp(mean patch value), 1), laid out by `clip.patchify` as the real towers lay
    patches out, so the brightest patch is the one most similar to CLS."""

    patch = 8

    def __call__(self, pixels):
        mean = clip.patchify(pixels, self.patch).mean(-1)
        tokens = np.stack([np.exp(np.asarray(mean)), np.ones_like(mean)], -1)
        cls = np.broadcast_to(np.array([1.0, 0.0]), (len(tokens), 1, 2))
        return np.concatenate([cls, tokens], 1), None


def test_attention_overlay_is_aligned_with_the_image(tmp_path):
    # A 32x32 image (no resize: the view is the image), black with a bright square in patch
    # (row 0, column 2) of the 4x4 grid: the top right, so a transposed map would land
    # bottom left.
    img = np.zeros((32, 32, 3), np.uint8)
    img[0:8, 16:24] = 255
    out_png = tmp_path / "att.png"
    res = figures.attention_overlays({"known": BrightnessTower()}, [img, img], str(out_png), 32,
                                     panel_px=128, title_px=20)
    grid = res["grids"]["known"][0]
    assert np.unravel_index(np.argmax(grid), grid.shape) == (0, 2)
    heat = res["maps"]["known"][0]
    r, c = np.unravel_index(np.argmax(heat), heat.shape)
    assert 0 <= r < 8 and 16 <= c < 24
    # In the PNG: the hottest (reddest) pixels of the overlay panel lie on the square.
    png = np.asarray(Image.open(out_png).convert("RGB")).astype(int)
    assert png.shape == (2 * 128 + 20, 2 * 128, 3) and res["size"] == (256, 276)
    x0, y0, x1, y1 = res["panels"][(1, 1)]
    panel = png[y0:y1, x0:x1]
    red = panel[..., 0] - panel[..., 2]
    ys, xs = np.nonzero(red >= red.max() - 10)
    scale = 128 / 32
    assert ys.mean() / scale < 8 and 16 <= xs.mean() / scale < 24
    # Red over the square's inner part, blue over the far (bottom-left) corner of the panel.
    core = panel[int(2 * scale):int(6 * scale), int(18 * scale):int(22 * scale)]
    far = panel[int(24 * scale):, :int(8 * scale)]
    assert (core[..., 0] > core[..., 2] + 50).all()
    assert (far[..., 2] > far[..., 0] + 50).all()
    x0, y0, x1, y1 = res["panels"][(0, 0)]
    plain = png[y0:y1, x0:x1].sum(-1)
    ys, xs = np.nonzero(plain > 600)
    assert ys.min() / scale >= 0 and ys.max() / scale < 8.5
    assert 15.5 < xs.min() / scale and xs.max() / scale < 24.5


@pytest.mark.slow
def test_attention_overlays_with_models(tmp_path, tiny_models):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40, 50, 3), dtype=np.uint8) for _ in range(3)]
    out_png = tmp_path / "models.png"
    res = figures.attention_overlays(tiny_models, images, str(out_png), 32, panel_px=96,
                                     title_px=24)
    with Image.open(out_png) as im:
        assert im.size == (3 * 96, 3 * 96 + 24)
    for name in tiny_models:
        assert res["grids"][name].shape == (3, 4, 4)
        assert res["maps"][name].shape == (3, 32, 32)
        assert 0.0 <= res["maps"][name].min() and res["maps"][name].max() <= 1.0
    assert res["views"].shape == (3, 32, 32, 3)
    # ScenarioCLIP's object tower is used (not its global or relation tower)
    sc = tiny_models["ScenarioCLIP"]
    views = res["views"]
    want = figures.cls_similarity(sc.pair("object").vision_model, views)
    np.testing.assert_allclose(res["grids"]["ScenarioCLIP"], want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(res["grids"]["ScenarioCLIP"], res["grids"]["global pair"])


def test_tsne_and_training_curves_png(tmp_path):
    rng = np.random.default_rng(0)
    labels = np.repeat(["car", "vehicle", "dog", "cup", "tree"], [8, 6, 4, 2, 1])
    emb = rng.normal(size=(len(labels), 12)).astype(np.float32)
    coords = figures.tsne_plot(emb, labels, str(tmp_path / "tsne.png"), top_k=3, max_iter=250)
    assert coords.shape == (len(labels), 2)
    with Image.open(tmp_path / "tsne.png") as im:
        assert im.size[0] > 300 and im.size[1] > 300
    small = figures.tsne_plot(emb[:4], labels[:4], str(tmp_path / "tsne4.png"),
                               max_iter=250)  # perplexity 3
    assert small.shape == (4, 2)
    with pytest.raises(figures.FigureError):
        figures.tsne_plot(emb[:2], labels[:2], str(tmp_path / "x.png"))

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 3 - s / 100, "loss_ca": 2.0, "loss_kd": 1.0, "lr": 1e-5,
             "kd_temperature": 0.07, "examples_per_sec": 50.0} for s in range(0, 50, 5)]
    rows.insert(3, {"eval": "val"})  # a row without a step is skipped
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert figures.training_curves(str(path), str(tmp_path / "curves.png")) == list(
        figures.CURVE_FIELDS)
    with Image.open(tmp_path / "curves.png") as im:
        assert im.size == (1260, 640)
    # PyramidCLIP logs no KD temperature: that panel says so, the rest are drawn
    path.write_text("\n".join(json.dumps({"step": s, "loss": 1.0}) for s in range(3)))
    assert figures.training_curves(str(path), str(tmp_path / "c2.png")) == ["loss"]
    with pytest.raises(figures.FigureError):
        figures.training_curves(str(tmp_path / "missing.jsonl"), str(tmp_path / "c3.png"))


# --------------------------------------------------------------------------- Table A1

@pytest.fixture(scope="module")
def b32_pair():
    """An abstract (shapes only) ViT-B/32 CLIPPair: nothing is initialised."""
    return nnx.eval_shape(lambda: scenarioclip.CLIPPair(clip.create("ViT-B/32"),
                                                        rngs=nnx.Rngs(0)))


def test_vit_b32_parameter_counts(b32_pair):
    c = cost.pair_param_counts(b32_pair)
    # Hugging Face CLIPModel (openai/clip-vit-base-patch32 sizes) has 151,277,313 parameters
    # (transformers.CLIPModel(CLIPConfig()), counted once by hand): the appendix's 151.28M,
    # and 3 x 151,277,313 = 453.83M, the appendix's ScenarioCLIP figure.
    assert c["vision_tower"] == 87_456_000 and c["text_tower"] == 63_165_952
    assert c["clip_model"] == 151_277_313
    assert round(c["clip_model"] / 1e6, 2) == 151.28
    assert round(3 * c["clip_model"] / 1e6, 2) == 453.83
    # our pair: CLIP's projections replaced by Linear+LayerNorm heads (3,072 more parameters)
    assert c["heads"] == 394_752 + 263_680
    assert c["pair"] == 151_280_384 and round(c["pair"] / 1e6, 2) == 151.28
    assert round(3 * c["pair"] / 1e6, 2) == 453.84


def test_param_counts_of_models(tiny_models):
    sc = tiny_models["ScenarioCLIP"]
    py = nnx.eval_shape(lambda: scenarioclip.PyramidCLIP(lambda i: clip.create(SMALL), 32,
                                                         rngs=nnx.Rngs(0)))
    a, b = cost.param_counts(sc), cost.param_counts(py)
    assert a["num_pairs"] == 3 and b["num_pairs"] == 1
    assert a["pairs"] == 3 * b["pairs"]
    assert a["model"] == a["pairs"] + 4  # three logit scales + the KD temperature
    assert b["model"] == b["pairs"] + 3
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(sc, nnx.Param)))
    assert a["model"] == total


@pytest.mark.slow
def test_vit_b32_flops(b32_pair):
    flops = cost.pair_flops(b32_pair, full_last_layer=True, parts=True)
    pooled = cost.pair_flops(b32_pair)
    hand = cost.analytic_flops(b32_pair.config)
    # XLA counts 2 FLOPs per multiply-add plus elementwise work: within 1% of the hand count
    # of every matmul, and within 2.5% of the appendix's 14.55 G (measured: 14.83 G).
    assert flops["total"] == pytest.approx(hand["matmul"], rel=0.01)
    assert flops["total"] == pytest.approx(14.55e9, rel=0.025)
    # The appendix's 14.55 G is the Linear / patch-conv layers (+ projections) only: 14.54 G.
    assert hand["linear_and_projections"] == pytest.approx(14.55e9, rel=1e-3)
    # Our forward runs the last layer on the pooled token only: cheaper (measured 13.83 G).
    assert 0.9 * flops["total"] < pooled < flops["total"]
    table, rows = cost.cost_table({"PyramidCLIP": b32_pair})
    assert "151.28M" in table and rows["PyramidCLIP"]["pairs"] == 1
