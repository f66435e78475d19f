"""The Grain pipeline: static shapes, every field against the records, bad data, exact resume."""

import dataclasses
import io
import json
import logging
import os

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from PIL import Image

import grain.python as grain
from data_prep import shards
from sclaro_jax.data import schema
from sclaro_jax.data.dataset import open_dataset
from sclaro_jax.data.batch import batch_shapes
from sclaro_jax.data.pipeline import PipelineConfig, make_loader, normalize, sample_key
from sclaro_jax.data.tokenizer import ClipTokenizer
from test_records import make_sample

CFG = PipelineConfig(max_objects=6, max_relations=4, image_size=64)


def _records(demo_dir, split):
    out = {}
    for path in open_dataset(demo_dir).paths(split):
        reader = ArrayRecordReader(path)
        for r in reader.read_all():
            s = schema.decode(r)
            out[sample_key(s.id)] = s
        reader.close()
    return out


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_batches_static_shapes_and_every_field(demo_dir):
    records = _records(demo_dir, "train")
    vocab = open_dataset(demo_dir).vocab
    tok = ClipTokenizer()
    expected = batch_shapes(4, CFG)
    it = iter(make_loader(demo_dir, "train", 4, config=CFG, seed=0))
    seen = set()
    for batch in _take(it, 6):  # 24 examples: more than two epochs of 10 records
        assert {k: v.shape for k, v in batch.items()} == expected
        assert batch["image"].dtype == np.uint8 and batch["objects"].dtype == np.uint8
        for i in range(4):
            s = records[int(batch["sample_key"][i])]
            seen.add(s.id)
            assert batch["valid"][i] and batch["bad_record"][i] == 0
            assert tok.decode(batch["action_tokens"][i]) == s.action
            assert batch["action_label"][i] == vocab.actions.index(s.action)
            assert vocab.sources[batch["source"][i]] == s.source
            n_o, n_r = min(len(s.objects), 6), min(len(s.relations), 4)
            assert batch["object_mask"][i].tolist() == [True] * n_o + [False] * (6 - n_o)
            assert batch["relation_mask"][i].tolist() == [True] * n_r + [False] * (4 - n_r)
            assert batch["dropped_objects"][i] == len(s.objects) - n_o
            assert batch["dropped_relations"][i] == len(s.relations) - n_r
            for k in range(n_o):
                assert tok.decode(batch["object_tokens"][i, k]) == s.objects[k].name
                assert vocab.objects[batch["object_labels"][i, k]] == s.objects[k].name
            for k in range(n_r):
                assert tok.decode(batch["relation_tokens"][i, k]) == s.relations[k].text
                assert vocab.relations[batch["relation_labels"][i, k]] == s.relations[k].text
            assert not batch["objects"][i, n_o:].any() and not batch["relations"][i, n_r:].any()
            assert (batch["object_labels"][i, n_o:] == -1).all()
    assert seen == {s.id for s in records.values()}
    assert sum(len(s.objects) > 6 for s in records.values()) > 0  # the cap was exercised


def _torchvision_view(img, box, size):
    """The reference transform: PIL crop, torchvision Resize(size, bicubic) + CenterCrop(size)."""
    import torchvision.transforms.functional as F
    from torchvision.transforms import InterpolationMode
    crop = img if box is None else img.crop(box)
    view = F.center_crop(F.resize(crop, size, InterpolationMode.BICUBIC), size)
    return np.asarray(view).astype(int)


def _assert_close_to_reference(got, ref, what):
    diff = np.abs(got.astype(int) - ref)
    assert diff.mean() < 0.2 and np.mean(diff > 2) < 1e-3, (what, diff.mean(), diff.max())


@pytest.mark.parametrize("size", [96, 224])
def test_eval_views_equal_torchvision_resize_and_centre_crop(demo_dir, size):
    records = _records(demo_dir, "test")
    cfg = PipelineConfig(max_objects=10, max_relations=8, image_size=size, train=False,
                         fast_decode=False)
    batch = next(iter(make_loader(demo_dir, "test", 3, config=cfg, shuffle=False)))
    for i in range(3):
        s = records[int(batch["sample_key"][i])]
        img = Image.open(io.BytesIO(s.image)).convert("RGB")
        _assert_close_to_reference(batch["image"][i], _torchvision_view(img, None, size), s.id)
        for k, o in enumerate(s.objects[:10]):
            _assert_close_to_reference(batch["objects"][i, k],
                                       _torchvision_view(img, o.box, size), (s.id, o.name))
        for k, r in enumerate(s.relations[:8]):
            region = Image.open(io.BytesIO(r.region)).convert("RGB")
            _assert_close_to_reference(batch["relations"][i, k],
                                       _torchvision_view(region, None, size), (s.id, r.text))


def test_fast_jpeg_decode_stays_close_to_full_decode(demo_dir):
    cfg = PipelineConfig(max_objects=1, max_relations=8, image_size=96, train=False)
    fast = next(iter(make_loader(demo_dir, "test", 3, config=cfg, shuffle=False)))
    full = next(iter(make_loader(demo_dir, "test", 3, shuffle=False,
                                 config=dataclasses.replace(cfg, fast_decode=False))))
    m = full["relation_mask"]
    assert m.sum() >= 5
    diff = np.abs(fast["relations"][m].astype(int) - full["relations"][m])
    assert diff.mean() < 3.0, diff.mean()
    np.testing.assert_array_equal(fast["image"], full["image"])


def test_eval_is_deterministic_and_float32_is_clip_normalised(demo_dir):
    cfg = PipelineConfig(max_objects=4, max_relations=2, image_size=32, train=False)
    a = next(iter(make_loader(demo_dir, "train", 2, config=cfg, shuffle=False)))
    b = next(iter(make_loader(demo_dir, "train", 2, config=cfg, shuffle=False, seed=9)))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    f = next(iter(make_loader(demo_dir, "train", 2, shuffle=False,
                              config=PipelineConfig(max_objects=4, max_relations=2,
                                                    image_size=32, train=False,
                                                    pixels="float32"))))
    mean = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
    std = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
    for key, mask in (("image", np.ones(2, bool)), ("objects", a["object_mask"]),
                      ("relations", a["relation_mask"])):
        assert f[key].dtype == np.float32
        np.testing.assert_allclose(f[key][mask], (a[key][mask] / 255.0 - mean) / std, atol=1e-5)
        np.testing.assert_allclose(np.asarray(normalize(a[key][mask])), f[key][mask], atol=1e-5)
        assert not f[key][~mask].any()  # padding is 0.0


def _write_with_bad_records(folder):
    good = [make_sample(f"good{i}", **({"action": ""} if i == 2 else {})) for i in range(3)]
    with shards.ShardWriter(folder) as w:
        for s in good:
            w.add(s)
    corrupt = schema.encode(make_sample("corrupt-image", image=b"\xff\xd8 not a jpeg"))
    outside = schema.encode(make_sample("box-outside",
                                        objects=(schema.Object("cat", (0, 0, 99, 10)),),
                                        relations=()))
    index = schema.encode(make_sample("index-out-of-range", relations=(
        schema.Relation(0, "on", 7, "cat on mat", make_sample().relations[0].region),)))
    body = schema.encode(make_sample("future"))
    future = schema.MAGIC + (schema.SCHEMA_VERSION + 1).to_bytes(2, "little") + body[8:]
    garbage = schema.MAGIC + schema.SCHEMA_VERSION.to_bytes(2, "little") + b"\x93 truncated"
    bad = [corrupt, outside, index, future, garbage]
    path = os.path.join(folder, "train-extra.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for r in bad:
        writer.write(r)
    writer.close()
    manifest_path = os.path.join(folder, "manifest.json")
    m = json.load(open(manifest_path))
    m["splits"]["train"]["shards"].append({"file": "train-extra.array_record", "records": 5,
                                           "sha256": ""})
    json.dump(m, open(manifest_path, "w"))
    return len(good), len(bad)


def test_bad_records_are_skipped_and_counted(tmp_path, caplog):
    n_good, n_bad = _write_with_bad_records(str(tmp_path))
    cfg = PipelineConfig(max_objects=2, max_relations=2, image_size=32)
    loader = make_loader(str(tmp_path), "train", n_good + n_bad, config=cfg, shuffle=False,
                         num_epochs=1)
    with caplog.at_level(logging.WARNING, logger="sclaro_jax.data.pipeline"):
        batches = list(loader)
    assert len(batches) == 1
    b = batches[0]
    assert {k: v.shape for k, v in b.items()} == batch_shapes(n_good + n_bad, cfg)
    assert b["valid"].tolist() == [True] * n_good + [False] * n_bad
    assert b["bad_record"].tolist() == [0] * n_good + [1] * n_bad
    # good2 has no action: a valid example that the global level and text KD skip
    assert b["has_action"].tolist() == [True, True, False] + [False] * n_bad
    assert b["action_label"][2] == -1 and b["action_label"][0] >= 0
    assert not b["action_tokens"][2].any() and b["action_tokens"][0].any()
    assert b["object_mask"][2].any()
    assert not b["object_mask"][n_good:].any() and not b["relation_mask"][n_good:].any()
    text = caplog.text
    for name in ("'corrupt-image': image does not decode", "'box-outside': object 0",
                 "'index-out-of-range': relation 0", "schema version 2",
                 "corrupt SCLARO record payload"):
        assert name in text


@pytest.mark.parametrize("worker_count", [0, 2])
def test_restored_iterator_yields_exactly_the_same_batches(demo_dir, worker_count):
    cfg = PipelineConfig(max_objects=3, max_relations=2, image_size=32)

    def loader():
        return make_loader(demo_dir, "train", 3, config=cfg, seed=11, worker_count=worker_count)

    it = iter(loader())
    _take(it, 2)
    state = it.get_state()
    uninterrupted = _take(it, 5)  # crosses the epoch boundary (10 records, 3 per batch)
    restored = iter(loader())
    restored.set_state(state)
    for a, b in zip(uninterrupted, _take(restored, 5)):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # and the augmentation really is random from step to step
    assert any(not np.array_equal(x["image"], y["image"])
               for x, y in zip(uninterrupted, uninterrupted[1:]))


def test_hosts_read_disjoint_records(demo_dir):
    cfg = PipelineConfig(max_objects=1, max_relations=1, image_size=32, train=False)
    keys = []
    for host in range(2):
        loader = make_loader(demo_dir, "train", 1, config=cfg, num_epochs=1,
                             shard_options=grain.ShardOptions(host, 2, drop_remainder=True))
        keys.append({int(b["sample_key"][0]) for b in loader})
    assert len(keys[0]) == len(keys[1]) == 5
    assert not keys[0] & keys[1]
    assert keys[0] | keys[1] == set(_records(demo_dir, "train"))


def test_loader_errors_name_the_problem(demo_dir, tmp_path):
    from sclaro_jax.data.dataset import DatasetError
    with pytest.raises(DatasetError, match="no split 'dev'"):
        make_loader(demo_dir, "dev", 2)
    with pytest.raises(ValueError, match="object_view 'ragged'"):
        PipelineConfig(object_view="ragged")
    with pytest.raises(DatasetError, match="not a SCLARO dataset folder"):
        make_loader(str(tmp_path), "train", 2)


def test_text_length_32_gives_the_same_text_embeddings_as_77():
    """PipelineConfig.text_length defaults to 32: CLIP's text tower is causal and pools at the
    EOT token, so the padding after it changes nothing."""
    from sclaro_jax.models import clip
    model = clip.create("tiny", seed=3)
    texts = ["playing", "person riding horse", "cup on saucer next to spoon", "clock face"]
    tok = ClipTokenizer()
    short = np.asarray(model.encode_text(tok(texts, length=32)))
    full = np.asarray(model.encode_text(tok(texts, length=77)))
    np.testing.assert_allclose(short, full, atol=1e-5)
