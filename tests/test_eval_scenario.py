"""The ScenarioCLIP evaluators (eval.embedding, zero_shot, probe, scene_graph, scenario, report)
on the bundled demo dataset with a tiny random ScenarioCLIP: each
number is recomputed here with plain loops from the embeddings (or from the views directly)."""

import json
import os

import grain.python as grain
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sclaro_jax import ops
from sclaro_jax.data import augment, schema
from sclaro_jax.data.dataset import open_dataset
from sclaro_jax.data.tokenizer import ClipTokenizer
from sclaro_jax.eval.protocols import (embedding, probe, report, scenario, scene_graph,
                                       zero_shot)
from test_pipeline import write_v2_dataset

SIZE, BATCH, TEXT_BATCH = 32, 16, 64


@pytest.fixture(scope="module")
def model():
    from sclaro_jax.models import scenarioclip
    return scenarioclip.build("scenarioclip", preset="tiny", embed_dim=16, seed=0)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emb_cache"))


@pytest.fixture(scope="module")
def test_emb(model, demo_dir, cache_dir):
    return embedding.embed_dataset(model, demo_dir, "test", image_size=SIZE, batch_size=BATCH,
                                  cache_dir=cache_dir, progress=False, fingerprint="tiny-0")


def l2(x):
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def plain_order(row):
    return sorted(range(len(row)), key=lambda c: (-row[c], c))


def samples(demo_dir, split):
    ds = open_dataset(demo_dir)
    out = []
    for path in ds.paths(split):
        src = grain.ArrayRecordDataSource([path])
        out += [schema.decode(src[i]) for i in range(len(src))]
    return out


# The pair's own methods under a plain nnx.jit (eager calls of the towers are slow on a CPU).
_encode_text = nnx.jit(lambda pair, ids: pair.encode_text(ids))
_encode_image = nnx.jit(lambda pair, pixels: pair.encode_image(ops.normalize(pixels)))


def direct_texts(model, level, texts):
    ids = ClipTokenizer()(list(texts), length=embedding.DEFAULT_TEXT_LENGTH)
    return l2(_encode_text(model.pair(level), jnp.asarray(ids)))


def test_embeddings_shapes_and_metadata(test_emb, demo_dir):
    e = test_emb
    manifest = open_dataset(demo_dir).manifest["splits"]["test"]
    assert e.num_images == manifest["records"] == 3
    assert e.global_emb.shape == (3, 16)
    assert e.object_emb.shape == (manifest["objects"], 16)
    assert e.relation_emb.shape == e.union_emb.shape == (manifest["relations"], 16)
    for name in ("global", "object", "relation", "union"):
        x = getattr(e, f"{name}_emb")
        assert x.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1, atol=1e-5)
        assert (getattr(e, f"{name}_norm") > 0).all()
    ss = samples(demo_dir, "test")
    assert e.image_ids.tolist() == [s.id for s in ss]
    assert e.object_names.tolist() == [o.name for s in ss for o in s.objects]
    assert e.relation_texts.tolist() == [r.text for s in ss for r in s.relations]
    for j in range(len(e.relation_texts)):
        assert e.object_names[e.relation_subject[j]] == e.relation_subject_names[j]
        assert e.object_names[e.relation_object[j]] == e.relation_object_names[j]
        assert e.object_image[e.relation_subject[j]] == e.relation_image[j]
        assert e.relation_texts[j] == schema.triplet_text(
            e.relation_subject_names[j], e.relation_predicates[j], e.relation_object_names[j])


def test_embeddings_equal_direct_encoding(model, test_emb, demo_dir):
    """The demo is schema version 2 with originals: object and relation embeddings are of the
    stored views, the global one of the train_image's Resize + CenterCrop, the union ones of
    the photograph's union-box crops."""
    s = samples(demo_dir, "test")[1]
    assert s.has_views and s.view_size == SIZE and s.has_originals
    img = schema.decode_image(s.image)
    first = int(np.flatnonzero(test_emb.object_image == 1)[0])
    rel0 = int(np.flatnonzero(test_emb.relation_image == 1)[0])

    def enc(level, view):
        return l2(_encode_image(model.pair(level), view[None]))[0]

    def stored(view):
        return np.asarray(schema.decode_image(view))

    for k, o in enumerate(s.objects):
        np.testing.assert_allclose(test_emb.object_emb[first + k], enc("object", stored(o.view)),
                                   atol=1e-5)
    train_image = schema.decode_image(s.train_image)
    np.testing.assert_allclose(test_emb.global_emb[1], enc("global", np.asarray(
        augment.resize_centre_crop(train_image, SIZE, (s.width, s.height)))), atol=1e-5)
    r = s.relations[0]
    a, b = s.objects[r.subject].box, s.objects[r.object].box
    union = (min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]))
    np.testing.assert_allclose(test_emb.union_emb[rel0],
                               enc("relation", augment.region_view(img, union, SIZE)),
                               atol=1e-5)
    np.testing.assert_allclose(test_emb.relation_emb[rel0], enc("relation", stored(r.view)),
                               atol=1e-5)
    head = _encode_image(model.pair("object"), stored(s.objects[0].view)[None])
    np.testing.assert_allclose(test_emb.raw("object")[first], np.asarray(head)[0],
                               rtol=1e-4, atol=1e-4)


def test_cache_round_trip(model, test_emb, demo_dir, cache_dir):
    files = [f for f in os.listdir(cache_dir) if f.startswith("scenario-test-")]
    assert len(files) == 1 and test_emb.key in files[0]
    again = embedding.embed_dataset(model, demo_dir, "test", image_size=SIZE, batch_size=BATCH,
                                   cache_dir=cache_dir, progress=False, fingerprint="tiny-0")
    for name in ("global_emb", "object_emb", "union_emb", "relation_norm", "object_names",
                 "relation_subject"):
        np.testing.assert_array_equal(getattr(again, name), getattr(test_emb, name))
    assert again.split == "test" and again.image_size == SIZE
    # another model fingerprint (e.g. the EMA teacher) is another cache entry
    other = embedding._cache_key("teacher", open_dataset(demo_dir), "test", SIZE, "crop", True)
    assert other != test_emb.key


def test_text_encoding_equals_direct(model):
    texts = ["person", "motorcycle in front of shelf", "a"]
    for level in ("object", "relation"):
        np.testing.assert_allclose(embedding.encode_texts(model, level, texts, batch_size=2),
                                   direct_texts(model, level, texts), atol=1e-5)


def test_zero_shot_equals_plain(model, test_emb, demo_dir):
    vocab = open_dataset(demo_dir).vocab
    out = zero_shot.zero_shot(model, test_emb, vocab, text_batch_size=TEXT_BATCH)
    e = test_emb
    for task, level, classes, queries, names, image in (
            ("action", "global", vocab.actions, e.global_emb, e.actions, np.arange(3)),
            ("object", "object", vocab.objects, e.object_emb, e.object_names, e.object_image),
            ("relation", "relation", vocab.relations, e.relation_emb, e.relation_texts,
             e.relation_image)):
        # (encode_texts == direct encoding: test_text_encoding_equals_direct)
        text = embedding.encode_texts(model, level, classes, batch_size=TEXT_BATCH)
        assert out[task]["classes"] == len(classes)
        strict = {k: [] for k in (1, 5, 10)}
        lenient = {k: [] for k in (1, 5, 10)}
        for q, name, i in zip(queries, names, image):
            order = plain_order([float(q @ t) for t in text])
            own = {classes.index(n) for n, j in zip(names, image) if j == i}
            for k in (1, 5, 10):
                strict[k].append(classes.index(name) in order[:k])
                lenient[k].append(any(c in own for c in order[:k]))
        for k in (1, 5, 10):
            assert out[task]["strict"]["all"][f"top{k}"] == pytest.approx(
                100 * np.mean(strict[k]))
            if task != "action":
                assert out[task]["lenient"]["all"][f"top{k}"] == pytest.approx(
                    100 * np.mean(lenient[k]))
            for src in set(e.sources.tolist()):
                sel = [e.sources[i] == src for i in image]
                assert out[task]["strict"]["by_source"][src][f"top{k}"] == pytest.approx(
                    100 * np.mean([h for h, s in zip(strict[k], sel) if s]))
                assert out[task]["strict"]["by_source"][src]["n"] == sum(sel)
        assert "lenient" not in out["action"]


def test_images_without_action_leave_only_the_action_task(model, test_emb, demo_dir):
    """An image whose action is "" (kept by curation, appendix) is no action query and no
    action probe example; its objects and relations still count."""
    import dataclasses
    vocab = open_dataset(demo_dir).vocab
    actions = test_emb.actions.copy()
    actions[0] = ""
    blank = dataclasses.replace(test_emb, actions=actions)
    got = zero_shot.zero_shot(model, blank, vocab, text_batch_size=TEXT_BATCH)
    full = zero_shot.zero_shot(model, test_emb, vocab, text_batch_size=TEXT_BATCH)
    text = embedding.encode_texts(model, "global", vocab.actions, batch_size=TEXT_BATCH)
    hits = [vocab.actions.index(a) in plain_order([float(q @ t) for t in text])[:1]
            for q, a in zip(test_emb.global_emb[1:], test_emb.actions[1:])]
    assert got["action"]["strict"]["all"]["n"] == len(actions) - 1
    assert got["action"]["strict"]["all"]["top1"] == pytest.approx(100 * np.mean(hits))
    assert got["object"] == full["object"] and got["relation"] == full["relation"]
    probed = probe.probe_tasks(blank, blank, epochs=1)
    assert probed["action"]["n_train"] == probed["action"]["n"] == len(actions) - 1
    assert probed["object"]["n"] == len(test_emb.object_names)


def _plain_predicate_mr(model, e, subj, obj, min_instances, extra=None):
    counts = {}
    for p in e.relation_predicates:
        counts[p] = counts.get(p, 0) + 1
    preds = sorted(p for p, c in counts.items() if c >= min_instances)
    per = {k: {} for k in (1, 5, 10)}
    kept = [j for j in range(len(e.relation_predicates)) if e.relation_predicates[j] in preds]
    # every relation's prompts, one relation after another, encoded in one go
    prompts = [f"{subj[j]} {p} {obj[j]}" for j in kept for p in preds]
    texts = embedding.encode_texts(model, "relation", prompts, batch_size=TEXT_BATCH)
    for n, j in enumerate(kept):
        text = texts[n * len(preds):(n + 1) * len(preds)]
        order = plain_order([float(e.union_emb[j] @ t) for t in text])
        for k in (1, 5, 10):
            hit = preds.index(e.relation_predicates[j]) in order[:k]
            if extra is not None:
                hit = hit and extra[j]
            per[k].setdefault(e.relation_predicates[j], []).append(hit)
    return preds, {k: 100 * np.mean([np.mean(v) for v in per[k].values()]) for k in per}


@pytest.mark.parametrize("min_instances", [2, 5])
def test_predcls_equals_plain(model, test_emb, min_instances):
    e = test_emb
    out = scene_graph.predcls(model, e, min_instances=min_instances, text_batch_size=TEXT_BATCH)
    preds, mr = _plain_predicate_mr(model, e, e.relation_subject_names,
                                    e.relation_object_names, min_instances)
    assert out["predicates"] == len(preds) and out["relations_total"] == 16
    assert out["n"] == sum(p in preds for p in e.relation_predicates)
    for k in (1, 5, 10):
        assert out[f"mR@{k}"] == pytest.approx(mr[k], abs=1e-6)


def test_sgcls_equals_plain(model, test_emb, demo_dir):
    e = test_emb
    train_names = [o.name for s in samples(demo_dir, "train") for o in s.objects]
    vocab = sorted(set(train_names))
    assert embedding.split_labels(demo_dir, "train")["objects"] == train_names
    out = scene_graph.sgcls(model, e, train_names, min_instances=2, text_batch_size=TEXT_BATCH)
    text = embedding.encode_texts(model, "object", vocab, batch_size=TEXT_BATCH)
    pred = [vocab[plain_order([float(q @ t) for t in text])[0]] for q in e.object_emb]
    assert out["object_classes"] == len(vocab)
    assert out["object_top1"] == pytest.approx(
        100 * np.mean([p == n for p, n in zip(pred, e.object_names)]))
    subj = [pred[i] for i in e.relation_subject]
    obj = [pred[i] for i in e.relation_object]
    _, mr = _plain_predicate_mr(model, e, subj, obj, 2)
    correct = [pred[s] == e.object_names[s] and pred[o] == e.object_names[o]
               for s, o in zip(e.relation_subject, e.relation_object)]
    _, graph = _plain_predicate_mr(model, e, subj, obj, 2, extra=correct)
    for k in (1, 5, 10):
        assert out[f"mR@{k}"] == pytest.approx(mr[k], abs=1e-6)
        assert out[f"graph_mR@{k}"] == pytest.approx(graph[k], abs=1e-6)


def test_linear_probe_separable_toy(rng):
    centres = rng.normal(size=(4, 16)) * 3
    y = rng.integers(0, 4, size=400)
    x = centres[y] + rng.normal(size=(400, 16)) * 0.3
    names = np.array(["cat", "dog", "car", "sky"])[y]
    out = probe.linear_probe(x[:300], names[:300], x[300:], names[300:], epochs=30, lr=1e-2,
                                batch_size=32, ks=(1, 2))
    assert out["classes"] == 4 and out["n"] == 100 and out["unseen_test"] == 0
    assert out["top1"] >= 95 and out["top2"] >= out["top1"]
    # a test label never seen in training counts as a miss
    out = probe.linear_probe(x[:300], names[:300], x[300:302], ["cat", "zebra"], epochs=1,
                                ks=(1, 4))
    assert out["unseen_test"] == 1 and out["top4"] == 50.0


def test_evaluate_scenario_end_to_end(model, demo_dir, cache_dir, test_emb):
    result = scenario.evaluate_scenario(
        model, demo_dir, batch_size=BATCH, text_batch_size=TEXT_BATCH, cache_dir=cache_dir,
        fingerprint="tiny-0", probe_epochs=2, min_predicate_instances=2, progress=False)
    json.dumps(result)
    assert result["num_images"] == 3 and result["num_objects"] == 23
    for task in ("action", "object", "relation"):
        r = result["linear_probe"][task]
        for k in (1, 5, 10):
            assert 0 <= r[f"top{k}"] <= 100
    assert result["linear_probe"]["object"]["classes"] == len(
        set(embedding.split_labels(demo_dir, "train")["objects"]))
    assert result["predcls"]["predicates"] == 5
    assert result["zero_shot"]["object"]["strict"]["all"]["n"] == 23
    text = report.markdown_tables(result)
    for heading in ("Zero-shot retrieval", "Table A2", "Linear probe", "PredCls / SGCls"):
        assert heading in text
    with pytest.raises(ValueError, match="unknown tasks"):
        scenario.evaluate_scenario(model, demo_dir, tasks=("detection",))


def test_registry_evaluators_from_config_equal_the_functions(model, test_emb, demo_dir,
                                                             cache_dir):
    # config.evals -> registered evaluators (the trainer's and the suite's way): each yields
    # what its function gives on the same embeddings (read from the cache the fixture filled)
    import ml_collections

    from sclaro_jax.eval.protocols import registry

    scen = dict(every=0, split="test", batch_size=BATCH, text_batch_size=TEXT_BATCH,
                cache_dir=cache_dir, fingerprint="tiny-0")
    config = ml_collections.ConfigDict({"data": {"dir": demo_dir, "image_size": SIZE},
                                        "evals": {"zero_shot": scen,
                                                  "mr": dict(scen, type="predcls",
                                                             min_instances=2)}})
    evs = {ev.name: ev for ev in registry.evaluators(config)}
    zs, mr = evs["zero_shot"], evs["mr"]
    assert (zs.kind, mr.kind, len(evs)) == ("zero_shot", "predcls", 2)
    vocab = open_dataset(demo_dir).vocab
    assert dict(zs.run(model)) == zero_shot.zero_shot(model, test_emb, vocab,
                                                      text_batch_size=TEXT_BATCH)
    assert dict(mr.run(model)) == scene_graph.predcls(model, test_emb, min_instances=2,
                                                      text_batch_size=TEXT_BATCH)
    with pytest.raises(TypeError, match="no options"):
        registry.evaluators(ml_collections.ConfigDict(
            {"data": {"dir": demo_dir, "image_size": SIZE}, "evals": {"sgcls": {"epochs": 1}}}))


# --------------------------------------------------------------------------- version-2 data

@pytest.fixture(scope="module")
def v2_dirs(demo_dir, tmp_path_factory):
    """The demo with 32 px stored views: without originals, and with them."""
    root = tmp_path_factory.mktemp("v2_eval")
    return {keep: write_v2_dataset(demo_dir, str(root / f"keep{int(keep)}"), SIZE,
                                   keep_originals=keep) for keep in (False, True)}


@pytest.fixture(scope="module")
def v2_emb(model, v2_dirs):
    return {keep: embedding.embed_dataset(model, d, "test", image_size=SIZE, batch_size=BATCH,
                                          progress=False) for keep, d in v2_dirs.items()}


def test_v2_embeddings_come_from_the_stored_views_and_train_image(model, v2_dirs, v2_emb,
                                                                  test_emb):
    """Objects and relations: the stored views; global: Resize + CenterCrop of the stored
    train_image (the photograph's crop box, scaled); union boxes: the originals when kept (then
    equal to version 1's), else the train_image with the boxes scaled to it."""
    def enc(level, view):
        return l2(_encode_image(model.pair(level), view[None]))[0]

    e = v2_emb[False]
    s = samples(v2_dirs[False], "test")[1]
    assert s.image is None and s.train_image is not None
    first = int(np.flatnonzero(e.object_image == 1)[0])
    rel0 = int(np.flatnonzero(e.relation_image == 1)[0])
    for k, o in enumerate(s.objects):
        np.testing.assert_allclose(e.object_emb[first + k],
                                   enc("object", np.asarray(schema.decode_image(o.view))),
                                   atol=1e-5)
    np.testing.assert_allclose(e.relation_emb[rel0], enc("relation", np.asarray(
        schema.decode_image(s.relations[0].view))), atol=1e-5)
    train = schema.decode_image(s.train_image)
    np.testing.assert_allclose(e.global_emb[1], enc("global", np.asarray(
        augment.resize_centre_crop(train, SIZE, (s.width, s.height)))), atol=1e-5)
    r = s.relations[0]
    a, b = s.objects[r.subject].box, s.objects[r.object].box
    sx, sy = train.size[0] / s.width, train.size[1] / s.height
    union = (min(a[0], b[0]) * sx, min(a[1], b[1]) * sy, max(a[2], b[2]) * sx,
             max(a[3], b[3]) * sy)
    np.testing.assert_allclose(e.union_emb[rel0],
                               enc("relation", augment.region_view(train, union, SIZE)),
                               atol=1e-5)
    np.testing.assert_allclose(v2_emb[True].union_emb, test_emb.union_emb, atol=1e-5)
    assert e.object_names.tolist() == test_emb.object_names.tolist()
    # the stored views are JPEGs of version 1's views: embeddings agree closely
    assert np.mean(np.sum(e.object_emb * test_emb.object_emb, axis=1)) > 0.99


def test_v2_without_originals_names_what_needs_them(model, v2_dirs, tmp_path):
    from sclaro_jax.eval import suite
    from sclaro_jax.eval.protocols import localise

    bare = v2_dirs[False]
    with pytest.raises(schema.MissingOriginalsError,
                       match=f"{bare}: relation localisation needs the full-size photographs"
                             r".*--keep-originals"):
        localise.evaluate_localisation(model, bare, max_steps=1, image_size=SIZE)
    with pytest.raises(schema.MissingOriginalsError,
                       match=f"{bare}: the attention-overlay figures need the full-size "
                             r"photographs \(or pass --no-figures\).*--keep-originals"):
        suite._test_images(bare, "test", 2)
    # with the originals kept, both read the photographs as version 1 does
    kept = v2_dirs[True]
    inputs, targets = localise.relation_examples(samples(kept, "test"), SIZE)
    assert len(inputs) == sum(len(s.relations) for s in samples(kept, "test"))
    assert [x.shape for x in suite._test_images(kept, "test", 2)] == [
        (s.height, s.width, 3) for s in samples(kept, "test")[:2]]


def test_v2_views_of_another_size_are_refused(model, v2_dirs):
    from sclaro_jax.data.dataset import DatasetError

    with pytest.raises(DatasetError, match="record 0: sample .* its stored views are 32 px "
                                           "and the pipeline's image_size is 48"):
        embedding.embed_dataset(model, v2_dirs[False], "test", image_size=48, progress=False)
