"""ROCS / MINER evaluation: split loaders, the embedding cache, encoders and the CLI end to end."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sclaro_jax import miner
from sclaro_jax.eval import encoders, rocs
from sclaro_jax.eval.retrieval import data as data_lib
from sclaro_jax.eval.retrieval import gallery, scoring, synthetic
from sclaro_jax.miner.index import cache

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------
# Split loaders
# ------------------------------------------------------------------------------------------

def _pngs(folder, n, size=(40, 30)):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = []
    for i in range(n):
        a = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(a).save(folder / f"im{i}.png")
        arrays.append(a)
    return arrays


def write_hf_split(out, images, captions, ids=None, split=None) -> Path:
    """Save test images + captions as a Hugging Face dataset folder in ROCS's layout (one row per
    image: `image`, `image_id`, `captions`), with `save_to_disk` (a `DatasetDict` when `split`
    names the split). Needs the `datasets` package."""
    import datasets

    ids = [f"{i:06d}" for i in range(len(images))] if ids is None else list(ids)
    ds = datasets.Dataset.from_dict(
        {"image": [Image.fromarray(np.asarray(im)) for im in images], "image_id": ids,
         "captions": [list(c) for c in captions]},
        features=datasets.Features({"image": datasets.Image(), "image_id": datasets.Value("string"),
                                    "captions": datasets.Sequence(datasets.Value("string"))}))
    if split is not None:
        ds = datasets.DatasetDict({split: ds})
    ds.save_to_disk(os.fspath(out))
    return Path(out)


def test_coco_captions_file_gives_one_query_per_caption(tmp_path):
    arrays = _pngs(tmp_path / "imgs", 3)
    doc = {"images": [{"id": 10 + i, "file_name": f"im{i}.png"} for i in range(3)],
           "annotations": [{"image_id": 12, "caption": "c"}, {"image_id": 10, "caption": "a"},
                           {"image_id": 10, "caption": "b"}, {"image_id": 11, "caption": " "}]}
    (tmp_path / "caps.json").write_text(json.dumps(doc))
    split = data_lib.load_split(str(tmp_path / "caps.json"), image_root=str(tmp_path / "imgs"))
    # im1 has only an empty caption: no query, but still in the gallery (a distractor)
    assert split.image_ids == ["im0.png", "im1.png", "im2.png"]
    assert split.queries == ["a", "b", "c"] and split.gt.tolist() == [0, 0, 2]
    np.testing.assert_array_equal(split.load_image(2), arrays[2])


def test_karpathy_file_reads_the_test_split(tmp_path):
    _pngs(tmp_path / "val2014", 3)
    doc = {"images": [
        {"filepath": "val2014", "filename": f"im{i}.png", "split": s,
         "sentences": [{"raw": f"cap {i} {j}"} for j in range(2)]}
        for i, s in enumerate(["test", "train", "test"])]}
    (tmp_path / "dataset_coco.json").write_text(json.dumps(doc))
    split = data_lib.load_split(str(tmp_path / "dataset_coco.json"), image_root=str(tmp_path))
    assert split.num_images == 2 and split.queries[2] == "cap 2 0"
    assert split.gt.tolist() == [0, 0, 1, 1]
    assert split.load_image(1).shape == (30, 40, 3)
    with pytest.raises(data_lib.SplitError, match=r"no image has split 'val'.*'test', 'train'"):
        data_lib.load_split(str(tmp_path / "dataset_coco.json") + ":val",
                            image_root=str(tmp_path))


def test_hf_folder_in_rocs_layout_and_its_errors(tmp_path):
    images = [np.full((20, 24, 3), 40 * i, np.uint8) for i in range(3)]
    write_hf_split(tmp_path / "rocs", images, [["a dog"], ["a cup", "a mug"], []],
                   split="coco")
    split = data_lib.load_split(f"rocs_coco={tmp_path / 'rocs'}:coco")
    assert split.name == "rocs_coco" and split.num_images == 3
    assert split.queries == ["a dog", "a cup", "a mug"] and split.gt.tolist() == [0, 1, 1]
    np.testing.assert_array_equal(split.load_image(2), images[2])
    with pytest.raises(data_lib.SplitError, match="no split 'flickr'.*'coco'"):
        data_lib.load_split(f"{tmp_path / 'rocs'}:flickr")
    with pytest.raises(data_lib.SplitError, match="no column 'text'"):
        data_lib.load_split(f"{tmp_path / 'rocs'}:coco", caption_column="text")
    with pytest.raises(data_lib.SplitError, match="split not found"):
        data_lib.load_split(str(tmp_path / "nowhere"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(data_lib.SplitError, match="bad.json is not valid JSON"):
        data_lib.load_split(str(tmp_path / "bad.json"))


def test_missing_image_file_is_named(tmp_path):
    doc = {"images": [{"id": 1, "file_name": "gone.png"}],
           "annotations": [{"image_id": 1, "caption": "x"}]}
    (tmp_path / "c.json").write_text(json.dumps(doc))
    split = data_lib.load_split(str(tmp_path / "c.json"))
    with pytest.raises(data_lib.SplitError, match="gone.png"):
        split.load_image(0)


def test_images_outside_their_folder_are_left_out_unread(tmp_path):
    """A COCO captions file, a Karpathy file and a datasets folder naming images outside the
    folder they are relative to (absolute, ../): each such image is left out of the gallery,
    with its captions, and counted; the others load as before."""
    import datasets

    arrays = _pngs(tmp_path / "imgs", 2)
    _pngs(tmp_path / "users_files", 1)
    private = tmp_path / "users_files" / "im0.png"
    coco = {"images": [{"id": 1, "file_name": "im1.png"}, {"id": 2, "file_name": str(private)},
                       {"id": 3, "file_name": "../users_files/im0.png"}],
            "annotations": [{"image_id": i, "caption": f"caption {i}"} for i in (1, 2, 3)]}
    (tmp_path / "caps.json").write_text(json.dumps(coco))
    split = data_lib.load_split(str(tmp_path / "caps.json"), image_root=str(tmp_path / "imgs"))
    assert split.image_ids == ["im1.png"] and split.queries == ["caption 1"]
    assert split.skipped == {"outside_root": 2} and split.subset(1).skipped == split.skipped
    np.testing.assert_array_equal(split.load_image(0), arrays[1])
    karpathy = {"images": [{"filepath": fp, "filename": fn, "split": "test",
                            "sentences": [{"raw": f"of {fn}"}]}
                           for fp, fn in (("", "im0.png"), ("../users_files", "im0.png"))]}
    (tmp_path / "dataset_coco.json").write_text(json.dumps(karpathy))
    split = data_lib.load_split(str(tmp_path / "dataset_coco.json"),
                                image_root=str(tmp_path / "imgs"))
    assert split.num_images == 1 and split.skipped == {"outside_root": 1}
    np.testing.assert_array_equal(split.load_image(0), arrays[0])
    folder = tmp_path / "rows"  # a path column: paths relative to the folder, inside it
    datasets.Dataset.from_dict({"image": ["im.png", str(private)], "caption": ["in", "out"]}
                               ).save_to_disk(str(folder))
    Image.fromarray(arrays[0]).save(folder / "im.png")
    split = data_lib.load_split(str(folder))
    assert split.queries == ["in"] and split.skipped == {"outside_root": 1}
    np.testing.assert_array_equal(split.load_image(0), arrays[0])


# ------------------------------------------------------------------------------------------
# Gallery embeddings and their cache
# ------------------------------------------------------------------------------------------

class CountingEncoder(synthetic.PlantedColourEncoder):
    def __init__(self):
        super().__init__()
        self.views = 0

    def encode_views(self, views):
        self.views += len(views)
        return super().encode_views(views)


def test_gallery_embeddings_crops_match_direct_encoding_and_cache_resumes(tmp_path):
    json_path = synthetic.make_planted_split(tmp_path / "d", num_images=7, seed=3)
    split = data_lib.load_split(str(json_path))
    enc = CountingEncoder()
    spec = gallery.CropSpec("fixed5")
    emb = gallery.embed_split(enc, split, spec, cache_dir=tmp_path / "c", part_size=3,
                              progress=False)
    assert emb.images.shape == (7, 15) and emb.crops.shape == (7, 5, 15)
    assert emb.images.dtype == np.float16 and enc.views == 7 * 6
    image = split.load_image(4)
    (x0, y0, x1, y1) = miner.crop_boxes(image.shape[1], image.shape[0])[2]
    direct = enc.encode_views(np.stack([enc.view(image), enc.view(image[y0:y1, x0:x1])]))
    np.testing.assert_allclose(emb.images[4], direct[0], atol=1e-3)
    np.testing.assert_allclose(emb.crops[4, 2], direct[1], atol=1e-3)
    np.testing.assert_allclose(emb.texts, enc.encode_texts(split.queries), atol=1e-6)
    # a rerun reads everything from the cache; losing one part recomputes only that part
    enc2 = CountingEncoder()
    again = gallery.embed_split(enc2, split, spec, cache_dir=tmp_path / "c", part_size=3,
                                progress=False)
    assert enc2.views == 0
    np.testing.assert_array_equal(again.crops, emb.crops)
    key = gallery.cache_key(enc, split, spec)
    (tmp_path / "c" / key / "gallery-00001-of-00003.npy").unlink()
    gallery.embed_split(enc2, split, spec, cache_dir=tmp_path / "c", part_size=3, progress=False)
    assert enc2.views == 3 * 6
    # other crop settings are another cache entry
    assert gallery.cache_key(enc, split, gallery.CropSpec("grid3x3")) != key
    square = gallery.CropSpec("fixed5", shape="square")
    assert gallery.cache_key(enc, split, square) != key
    meta = json.loads((tmp_path / "c" / key / "meta.json").read_text())
    assert meta["crops"]["shape"] == "aspect" and meta["crop_rule"].startswith("aspect-keeping")
    # a cache made with the earlier square crops, put where the aspect crops' cache goes (a
    # folder renamed by hand), is refused, naming the file and both rules
    gallery.embed_split(enc, split, square, cache_dir=tmp_path / "s", progress=False)
    (tmp_path / "s" / gallery.cache_key(enc, split, square)).rename(tmp_path / "s" / key)
    with pytest.raises(cache.CacheMismatchError, match=r"meta.json: the cached embeddings "
                       r"were made with crops .*'square'.* not .*'aspect'"):
        gallery.embed_split(enc, split, spec, cache_dir=tmp_path / "s", progress=False)


# ------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------

def _unit(rng, *shape):
    x = rng.normal(size=shape).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_evaluate_numbers_follow_the_kernels(rng):
    def unit(*shape):
        return _unit(rng, *shape)

    emb = gallery.GalleryEmbeddings(unit(30, 16).astype(np.float16),
                                  unit(30, 5, 16).astype(np.float16), unit(45, 16))
    gt = rng.integers(0, 30, 45)
    out = scoring.evaluate(emb, gt, scoring.Settings(k=5))
    assert list(out) == ["Global", "Global+CSLS", "Global+crops", "MINER"]
    s = emb.texts @ emb.images.astype(np.float32).T
    ranks = (s > s[np.arange(45), gt][:, None]).sum(1)
    assert out["Global"]["R@5"] == pytest.approx(100 * np.mean(ranks < 5), abs=1e-4)
    fused = miner.fused_scores(emb.texts, emb.images, emb.crops, alpha=0.4)
    expect = miner.recall_at_k(miner.csls(fused, k=5), gt)
    assert out["MINER"]["R@1"] == pytest.approx(expect[1], abs=1e-4)
    with pytest.raises(ValueError, match="needs a query bank"):
        scoring.evaluate(emb, gt, scoring.Settings(rescore="qbnorm"))
    banked = scoring.evaluate(emb, gt, scoring.Settings(rescore="csls-bank"), bank=unit(20, 16))
    assert "Global+CSLS(bank)" in banked


@pytest.mark.parametrize("rescore", ["csls", "none"])
def test_streaming_evaluation_gives_the_in_memory_numbers(rng, rescore):
    def unit(*shape):
        return _unit(rng, *shape)

    emb = gallery.GalleryEmbeddings(unit(70, 16).astype(np.float16),
                                  unit(70, 5, 16).astype(np.float16), unit(90, 16))
    gt = rng.integers(0, 70, 90)
    settings = scoring.Settings(k=4, rescore=rescore)
    full = scoring.evaluate(emb, gt, settings)
    streamed = scoring.evaluate_streaming(emb, gt, settings, chunk=32)
    assert list(streamed) == list(full)
    for method in full:
        for key, value in full[method].items():
            assert streamed[method][key] == pytest.approx(value, abs=1e-6), (method, key)
    with pytest.raises(ValueError, match="--stream supports"):
        scoring.evaluate_streaming(emb, gt, scoring.Settings(rescore="qbnorm"))


def test_cli_help_and_clear_errors(tmp_path):
    run = subprocess.run([sys.executable, "-m", "sclaro_jax.eval.rocs", "--help"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "--alpha" in run.stdout and "--rescore" in run.stdout
    assert rocs.main(["--model", str(tmp_path / "none"), "--split", str(tmp_path)]) == 2
    json_path = synthetic.make_planted_split(tmp_path / "d", num_images=3)
    code = rocs.main(["--model", str(tmp_path / "no_model"), "--split", str(json_path),
                      "--out", str(tmp_path / "o")])
    assert code == 2


def test_named_encoders_come_from_the_encoder_registry():
    # synthetic registers itself (encoders imports no encoder module); a name is taken once:
    # another factory under it is refused, the same one again (its module run as __main__
    # after an import by name) takes its place
    enc = encoders.load_encoder("planted-colours")
    assert type(enc) is synthetic.PlantedColourEncoder
    assert encoders.ENCODERS["planted-colours"] is synthetic.PlantedColourEncoder

    class Other(synthetic.PlantedColourEncoder):
        pass

    with pytest.raises(ValueError, match="registered already"):
        encoders.register_encoder("planted-colours")(Other)
    assert encoders.register_encoder("planted-colours")(
        synthetic.PlantedColourEncoder) is synthetic.PlantedColourEncoder
    assert encoders.ENCODERS["planted-colours"] is synthetic.PlantedColourEncoder
    emb = enc.encode_texts(["a red and blue flag", "nothing"])
    np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, rtol=1e-6)
    assert emb[0, synthetic.NAMES.index("red")] == emb[0, synthetic.NAMES.index("blue")] > 0


def test_planted_benchmark_miner_beats_global(tmp_path, capsys):
    json_path = synthetic.make_planted_split(tmp_path / "planted", num_images=56, seed=0)
    out = tmp_path / "out"
    code = rocs.main(["--model", "planted-colours", "--split", f"planted={json_path}",
                      "--out", str(out), "--no_progress"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())["results"]["planted"]
    captured = capsys.readouterr()
    printed = captured.out
    assert "| MINER |" in printed and (out / "results.md").exists()
    # the CSLS kernels' wait is announced before it and timed after, compiled or cached
    notes = [line for line in captured.err.splitlines() if line.startswith("CSLS kernels")]
    assert len(notes) == 2 and notes[0].endswith("...") and notes[1].endswith(" s)"), notes
    assert re.search(r"(compiled and cached in \S+|loaded from numba's cache) \(\d+\.\d s\)$",
                     notes[1]), notes
    # global pooling prefers the decoys; the crop view recovers the small flag
    assert res["Global+crops"]["R@1"] > res["Global"]["R@1"] + 30
    assert res["MINER"]["R@1"] > res["Global"]["R@1"] + 30
    assert res["MINER"]["R@1"] >= 80


def _demo_rocs_folder(tmp_path):
    """A ROCS-format split (datasets save_to_disk) of the bundled demo's real photographs, one
    query per caption and per annotated object."""
    from data_prep.demo import image_path, load_annotations

    images, captions = [], []
    for entry in load_annotations():
        with Image.open(image_path(entry)) as img:
            images.append(np.asarray(img.convert("RGB")))
        names = sorted({o["name"] for o in entry["objects"]})[:2]
        captions.append([entry["caption"]] + [f"a photo with a {n}" for n in names])
    return write_hf_split(tmp_path / "rocs", images, captions,
                          ids=[e["id"] for e in load_annotations()], split="coco")


@pytest.mark.slow
def test_cli_end_to_end_on_a_rocs_folder_with_a_tiny_clip(tmp_path, tiny_hf):
    folder = _demo_rocs_folder(tmp_path)
    out = tmp_path / "out"
    argv = ["--model", str(tiny_hf[0]), "--split", f"rocs_coco={folder}:coco", "--out",
            str(out), "--no_progress", "--k", "3"]
    assert rocs.main(argv) == 0
    record = json.loads((out / "results.json").read_text())
    res = record["results"]["rocs_coco"]
    assert record["splits"]["rocs_coco"]["images"] == 14
    assert set(res) == {"Global", "Global+CSLS", "Global+crops", "MINER"}
    for method in res.values():
        assert 0 <= method["R@1"] <= method["R@5"] <= method["R@10"] <= 100
        assert 0 <= method["never_retrieved"] <= 1
    # the encoder the CLI used gives the cached embeddings
    enc = encoders.load_encoder(str(tiny_hf[0]))
    split = data_lib.load_split(f"{folder}:coco")
    cached = gallery.embed_split(enc, split, gallery.CropSpec(), cache_dir=out / "cache",
                                 progress=False)
    direct = enc.encode_views(enc.view(split.load_image(5))[None])
    np.testing.assert_allclose(cached.images[5], direct[0], atol=2e-3)


@pytest.mark.slow
def test_scenarioclip_level_encoder_matches_the_checkpointed_teacher(scenario_workdir):
    teacher = True
    import jax.numpy as jnp

    from sclaro_jax import ops
    from sclaro_jax.checkpoint import load_checkpoint

    with pytest.raises(encoders.EncoderError, match="choose a level"):
        encoders.load_encoder(str(scenario_workdir))
    enc = encoders.load_encoder(str(scenario_workdir), level="object", teacher=teacher)
    who = "teacher" if teacher else "student"
    assert enc.name == f"scenarioclip:{scenario_workdir.name}:object:{who}@7"
    pair = load_checkpoint(str(scenario_workdir), teacher=teacher)[0].pair("object")
    image = np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    view = enc.view(image)
    assert view.shape == (32, 32, 3)
    want = np.asarray(pair.encode_image(jnp.asarray(ops.normalize(view))[None]))[0]
    np.testing.assert_allclose(enc.encode_views(view[None])[0], want / np.linalg.norm(want),
                               atol=1e-5)
    want = np.asarray(pair.encode_text(jnp.asarray(enc.tokenize(["a dog on a mat"]))))[0]
    np.testing.assert_allclose(enc.encode_texts(["a dog on a mat"])[0],
                               want / np.linalg.norm(want), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["siglip", "siglip2"])
def test_cli_end_to_end_with_tiny_siglip_towers(tmp_path, kind):
    import jax.numpy as jnp

    from sclaro_jax.models import siglip
    from tiny_siglip import save_tiny_siglip

    save_tiny_siglip(tmp_path / kind, kind)
    folder = _demo_rocs_folder(tmp_path)
    out = tmp_path / "out"
    assert rocs.main(["--model", str(tmp_path / kind), "--split", f"{folder}:coco", "--out",
                      str(out), "--no_progress", "--k", "3", "--rescore", "shortlist",
                      "--shortlist_m", "5", "--max_images", "8"]) == 0
    res = json.loads((out / "results.json").read_text())["results"]["coco[:8]"]
    assert set(res) == {"Global", "Global+CSLS(top-M)", "Global+crops", "MINER"}
    assert all(0 <= r["R@1"] <= r["R@10"] <= 100 for r in res.values())
    # the encoder's uint8 view + in-jit normalisation equals siglip.preprocess + the model
    enc = encoders.load_encoder(str(tmp_path / kind))
    image = data_lib.load_split(f"{folder}:coco").load_image(3)
    model = siglip.from_hf(tmp_path / kind)
    pixels = siglip.preprocess([image], siglip.image_config(tmp_path / kind))
    want = np.asarray(model.encode_image(jnp.asarray(pixels)))[0]
    np.testing.assert_allclose(enc.encode_views(enc.view(image)[None])[0],
                               want / np.linalg.norm(want), atol=1e-5)
    ids = siglip.load_tokenizer(tmp_path / kind)(["a photo with a cup"])
    want = np.asarray(model.encode_text(jnp.asarray(ids)))[0]
    np.testing.assert_allclose(enc.encode_texts(["a photo with a cup"])[0],
                               want / np.linalg.norm(want), atol=1e-5)
