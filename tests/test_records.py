"""SCLARO records: schema round trip, the atomic shard writer, bad data, splits, the demo."""

import dataclasses
import io
import json
import os

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader
from PIL import Image

from data_prep import demo, shards
from sclaro_jax.data import schema
from sclaro_jax.data.dataset import DatasetError, open_dataset


def _read_all(path):
    reader = ArrayRecordReader(path)
    records = reader.read_all()
    reader.close()
    return records


def _png(w=64, h=48, seed=0):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def make_sample(sample_id="s0", w=64, h=48, **changes):
    image = _png(w, h)
    objects = (schema.Object("cat", (2.0, 3.0, 30.0, 40.0)),
               schema.Object("mat", (0.0, 20.0, 64.0, 48.0)))
    relations = (schema.Relation(0, "sitting on", 1, "cat sitting on mat", _png(w, h, 1)),)
    sample = schema.Sample(id=sample_id, source="unit", split="train", image=image, width=w,
                           height=h, action="sitting", caption="a cat sits on a mat",
                           objects=objects, relations=relations, mask_kind="box")
    return dataclasses.replace(sample, **changes)


def test_demo_round_trip_every_field(demo_dir):
    ds = open_dataset(demo_dir, verify=True)
    entries = {e["id"]: e for e in demo.load_annotations()}
    assert len(entries) >= 12
    seen = {}
    for split in schema.SPLITS:
        for path in ds.paths(split):
            for record in _read_all(path):
                s = schema.decode(record)
                assert s.split == split
                seen[s.id] = s
    assert sorted(seen) == sorted(entries)
    assert {k: ds.num_records(k) for k in schema.SPLITS} == {"train": 10, "val": 1, "test": 3}
    for sid, s in seen.items():
        e = entries[sid]
        with open(demo.image_path(e), "rb") as f:
            assert s.image == f.read()  # the photograph's bytes, unchanged
        assert (s.width, s.height) == (e["width"], e["height"])
        assert (s.source, s.action, s.caption, s.mask_kind) == (
            e["source"], e["action"], e["caption"], "box")
        assert [(o.name, list(o.box)) for o in s.objects] == [
            (o["name"], [float(v) for v in o["box"]]) for o in e["objects"]]
        assert [(r.subject, r.predicate, r.object) for r in s.relations] == [
            (r["subject"], r["predicate"], r["object"]) for r in e["relations"]]
        for r in s.relations:
            assert r.text == " ".join([s.objects[r.subject].name, r.predicate,
                                       s.objects[r.object].name])
            assert Image.open(io.BytesIO(r.region)).size == (s.width, s.height)
    # vocabularies hold every label, sorted and unique
    for key, labels in (("actions", {s.action for s in seen.values()}),
                        ("objects", {o.name for s in seen.values() for o in s.objects}),
                        ("relations", {r.text for s in seen.values() for r in s.relations}),
                        ("predicates", {r.predicate for s in seen.values() for r in s.relations}),
                        ("sources", {s.source for s in seen.values()})):
        assert list(getattr(ds.vocab, key)) == sorted(labels)
    assert ds.manifest["mask_kinds"] == {"box": len(seen)}


def test_demo_relation_region_is_focused_region_of_box_masks(demo_dir):
    from data_prep.focus import focused_region
    ds = open_dataset(demo_dir)
    s = schema.decode(_read_all(ds.paths("train")[0])[0])
    rgb = np.asarray(Image.open(io.BytesIO(s.image)).convert("RGB"))
    r = s.relations[0]
    m1 = demo.box_mask(s.objects[r.subject].box, s.width, s.height)
    m2 = demo.box_mask(s.objects[r.object].box, s.width, s.height)
    expected = focused_region(rgb, m1, m2).astype(int)
    got = np.asarray(Image.open(io.BytesIO(r.region))).astype(int)
    assert np.abs(got - expected).mean() < 2.0  # JPEG quality 95


def test_cli_demo_writes_and_refuses_to_clobber(tmp_path, capsys):
    from data_prep.__main__ import main
    out = str(tmp_path / "d")
    assert main(["demo", "--out", out, "--records-per-shard", "100"]) == 0
    assert "wrote 14 records" in capsys.readouterr().out
    assert main(["demo", "--out", out]) == 1
    assert "already holds a dataset" in capsys.readouterr().err
    assert main(["demo", "--out", out, "--overwrite"]) == 0
    assert sorted(f for f in os.listdir(out) if f.endswith(".array_record")) == [
        "test-00000-of-00001.array_record", "train-00000-of-00003.array_record",
        "train-00001-of-00003.array_record", "train-00002-of-00003.array_record",
        "val-00000-of-00001.array_record"]


def test_encode_decode_round_trip():
    s = make_sample()
    assert schema.decode(schema.encode(s)) == s


@pytest.mark.parametrize("change, message", [
    (dict(image=b"\x89PNG\r\n\x1a\n garbage"), "image does not decode"),
    (dict(width=65), "image decodes to 64x48, record says 65x48"),
    (dict(objects=(schema.Object("cat", (2.0, 3.0, 70.0, 40.0)),)), "lies outside the 64x48"),
    (dict(objects=(schema.Object("cat", (30.0, 3.0, 2.0, 40.0)),)), "is empty or lies outside"),
    (dict(relations=(schema.Relation(0, "on", 5, "cat on mat", _png()),)),
     "object index 5 is out of range for 2 objects"),
    (dict(relations=(schema.Relation(0, "on", 1, "cat on the mat", _png()),)),
     "is not the canonical triplet 'cat on mat'"),
    (dict(relations=(schema.Relation(0, "on", 1, "cat on mat", _png(32, 32)),)),
     r"relation 0 \('cat on mat'\) region decodes to 32x32, record says 64x48"),
    (dict(split="holdout"), "split 'holdout'"),
    (dict(action=" eating"), r"action ' eating' has surrounding whitespace \(write '' for no"),
    (dict(action="  "), "action '  ' has surrounding whitespace"),
    (dict(action=None), "action must be a string, got NoneType"),
    (dict(source=""), "empty source"),
])
def test_writer_refuses_bad_samples_naming_them(tmp_path, change, message):
    out = tmp_path / "out"
    writer = shards.ShardWriter(str(out))
    writer.add(make_sample("good"))
    with pytest.raises(schema.RecordError, match=f"sample 'bad'.*{message}"):
        writer.add(make_sample("bad", **change))
    writer.abort()
    assert os.listdir(out) == []  # nothing published, temporary folder gone


def test_writer_refuses_unknown_schema_version_and_foreign_bytes(tmp_path):
    record = schema.encode(make_sample())
    future = schema.MAGIC + (schema.SCHEMA_VERSION + 1).to_bytes(2, "little") + record[8:]
    writer = shards.ShardWriter(str(tmp_path))
    with pytest.raises(schema.SchemaVersionError, match=r"schema version 3; this code reads "
                                                        r"versions \(1, 2\)"):
        writer.add(future)
    with pytest.raises(schema.RecordError, match="not a SCLARO record"):
        writer.add(b"hello")
    writer.add(record)  # an encoded record of this version is accepted as is
    manifest = writer.close()
    assert manifest["records"] == 1


def test_writer_is_atomic_when_interrupted(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with shards.ShardWriter(str(out), records_per_shard=1) as w:
            w.add(make_sample("a"))
            w.add(make_sample("b"))
            raise KeyboardInterrupt
    assert os.listdir(out) == []
    with pytest.raises(DatasetError, match="manifest.json not found.*python -m data_prep demo"):
        open_dataset(str(out))


def test_writer_duplicate_id(tmp_path):
    w = shards.ShardWriter(str(tmp_path))
    w.add(make_sample("a"))
    with pytest.raises(schema.RecordError, match="sample 'a': duplicate id"):
        w.add(make_sample("a"))
    w.abort()


def test_manifest_counts_checksums_and_versions(tmp_path):
    out = str(tmp_path / "ds")
    ids = [f"s{i:03d}" for i in range(20)]
    manifest = shards.write_dataset(
        (make_sample(i, source="a" if k % 2 else "b") for k, i in enumerate(ids)), out, ids=ids,
        records_per_shard=3, progress=False)
    assert manifest["records"] == 20
    assert [manifest["splits"][k]["records"] for k in schema.SPLITS] == [14, 2, 4]
    train = manifest["splits"]["train"]
    assert sum(s["records"] for s in train["shards"]) == 14 and len(train["shards"]) == 5
    assert sum(train["by_source"].values()) == 14
    ds = open_dataset(out, verify=True)
    # a shard changed after writing fails verification, naming the file
    path = ds.paths("train")[1]
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(DatasetError, match=os.path.basename(path) + ": sha256 does not match"):
        open_dataset(out, verify=True)
    # a manifest of another schema version is refused with what to do
    m = json.load(open(os.path.join(out, "manifest.json")))
    m["schema_version"] = 0
    json.dump(m, open(os.path.join(out, "manifest.json"), "w"))
    with pytest.raises(schema.SchemaVersionError, match="version 0; this code reads version 1.*"
                                                        "data_prep"):
        open_dataset(out)


def test_assign_splits_deterministic_exact_and_order_free():
    ids = [f"img{i}" for i in range(1000)]
    a = schema.assign_splits(ids, seed=42)
    assert a == schema.assign_splits(list(reversed(ids)), seed=42)
    counts = {k: sum(v == k for v in a.values()) for k in schema.SPLITS}
    assert counts == {"train": 700, "val": 100, "test": 200}
    b = schema.assign_splits(ids, seed=7)
    assert 0.2 < np.mean([a[i] != b[i] for i in ids]) < 0.7
    with pytest.raises(schema.RecordError, match="duplicate sample ids"):
        schema.assign_splits(["x", "x"])
