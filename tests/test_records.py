"""SCLARO records: schema round trip, the atomic shard writer, bad data, splits, the demo."""

import dataclasses
import io
import json
import os

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader
from PIL import Image

from data_prep import demo, shards, views
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
    # schema version 2 with the demo config's 32 px views (conftest), originals kept (the
    # evaluation suite needs them)
    assert (ds.schema_version, ds.view_size, ds.has_originals) == (2, 32, True)
    assert {k: ds.manifest[k] for k in ("view_size", "originals", "view_quality",
                                        "global_short_side")} == {
        "view_size": 32, "originals": True, "view_quality": schema.VIEW_QUALITY,
        "global_short_side": 42}
    for s in seen.values():
        assert s == views.with_views(views.drop_views(s), 32, keep_originals=True)


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


def test_demo_photographs_are_found_in_their_packages_without_importing_them():
    """Each annotated photograph's path is its package's folder + its path, read from the
    package's import spec (a child process: importing scikit-learn alone takes a second);
    a package that is not installed, or a file it does not hold, is a DemoError naming it."""
    import subprocess
    import sys
    script = ("import json, sys; from data_prep import demo; "
              "paths = [demo.image_path(e) for e in demo.load_annotations()]; "
              "print(json.dumps([paths, sorted(m for m in ('sklearn', 'skimage', 'matplotlib') "
              "if m in sys.modules)]))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    paths, imported = json.loads(result.stdout)
    assert imported == []  # found, not imported
    entries = demo.load_annotations()
    assert {e["package"] for e in entries} == {"sklearn", "skimage", "matplotlib"}
    import matplotlib
    import skimage
    import sklearn
    folders = {m.__name__: os.path.dirname(m.__file__) for m in (matplotlib, skimage, sklearn)}
    assert paths == [os.path.join(folders[e["package"]], e["path"]) for e in entries]
    assert all(os.path.isfile(p) for p in paths)
    entry = dict(entries[0], package="no_such_package_here", source="no-such-package")
    with pytest.raises(demo.DemoError, match="ships with the 'no-such-package' package, which is "
                                             r"not installed: pip install"):
        demo.image_path(entry)
    entry = dict(entries[0], path="data/no_such_photo.png")
    with pytest.raises(demo.DemoError, match="no_such_photo.png not found in the installed"):
        demo.image_path(entry)


@pytest.mark.slow
def test_cli_demo_writes_and_refuses_to_clobber(tmp_path, capsys):
    from data_prep.__main__ import main
    out = str(tmp_path / "d")
    assert main(["demo", "--out", out, "--records-per-shard", "100"]) == 0
    assert "wrote 14 records" in capsys.readouterr().out
    assert main(["demo", "--out", out]) == 2
    assert "already holds a dataset" in capsys.readouterr().err
    assert main(["demo", "--out", out, "--overwrite", "--image-size", "64",
                 "--no-keep-originals"]) == 0
    assert "schema version 2, 64 px views, originals dropped" in capsys.readouterr().out
    assert sorted(f for f in os.listdir(out) if f.endswith(".array_record")) == [
        "test-00000-of-00001.array_record", "train-00000-of-00003.array_record",
        "train-00001-of-00003.array_record", "train-00002-of-00003.array_record",
        "val-00000-of-00001.array_record"]
    ds = open_dataset(out, verify=True)
    assert (ds.schema_version, ds.view_size, ds.has_originals) == (2, 64, False)
    sample = schema.decode(_read_all(ds.paths("train")[0])[0])
    assert sample.image is None and sample.objects[0].view is not None
    assert Image.open(io.BytesIO(sample.objects[0].view)).size == (64, 64)


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
    with pytest.raises(schema.SchemaVersionError, match=r"version 0; this code reads versions "
                                                        r"\(1, 2\).*data_prep"):
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


# --------------------------------------------------------------------------- schema version 2


def _v2(sample=None, size=32, keep=False):
    return views.with_views(sample or make_sample(), size, keep_originals=keep)


def _png_of(w, h):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("keep", [False, True])
def test_v2_round_trip(keep):
    s = _v2(keep=keep)
    schema.validate(s)
    record = schema.encode(s)
    assert schema.record_version(record) == 2 and schema.decode(record) == s
    assert (s.image is not None) == keep == s.has_originals
    assert schema.record_version(schema.encode(make_sample())) == 1
    for o in s.objects:
        assert Image.open(io.BytesIO(o.view)).size == (32, 32)


@pytest.mark.parametrize("change, message", [
    (lambda s: dataclasses.replace(s, objects=(dataclasses.replace(s.objects[0], view=None),
                                               s.objects[1])),
     "view_size 32 but the train_image or an object / relation view is missing"),
    (lambda s: dataclasses.replace(s, train_image=None), "train_image or an object"),
    (lambda s: dataclasses.replace(s, relations=(dataclasses.replace(s.relations[0], view=None),)),
     "relation view is missing"),
    (lambda s: dataclasses.replace(s, objects=(dataclasses.replace(s.objects[0],
                                                                   view=_png_of(30, 30)),
                                               s.objects[1])),
     r"object 0 \('cat'\) view decodes to 30x30, record says 32x32"),
    (lambda s: dataclasses.replace(s, relations=(dataclasses.replace(s.relations[0],
                                                                     view=_png_of(32, 31)),)),
     r"relation 0 \('cat sitting on mat'\) view decodes to 32x31, record says 32x32"),
    (lambda s: dataclasses.replace(s, train_image=_png_of(10, 10)),
     "train_image decodes to 10x10, record says 48x36"),  # schema.train_image_size(.., 32)
    (lambda s: dataclasses.replace(s, view_size=0), "view_size 0 is not a positive integer"),
    (lambda s: views.drop_originals(views.drop_views(s)),
     r"without training views \(schema version 1\) must hold the original image"),
    (lambda s: dataclasses.replace(views.drop_views(s), relations=(
        dataclasses.replace(s.relations[0], region=None, view=None),)),
     "must hold the original image and every relation region"),
])
def test_validate_refuses_broken_v2_and_v1_without_originals(change, message):
    with pytest.raises(schema.RecordError, match=f"sample 's0': .*{message}"):
        schema.validate(change(_v2(keep=True)))


def _only_record(folder):
    ds = open_dataset(str(folder), verify=True)
    return [r for split in schema.SPLITS for p in ds.paths(split) for r in _read_all(p)], ds


def test_writer_versions_and_conversions(tmp_path):
    a = make_sample("a")
    # default: version 2 at 224 px without originals, views made by views.with_views
    m = _write(tmp_path / "d", [a, schema.encode(make_sample("b"))])
    assert {k: m[k] for k in ("schema_version", "view_size", "originals", "view_quality",
                              "global_short_side")} == {
        "schema_version": 2, "view_size": 224, "originals": False,
        "view_quality": schema.VIEW_QUALITY, "global_short_side": 290}
    records, ds = _only_record(tmp_path / "d")
    assert schema.decode(records[0]) == views.with_views(a, 224)
    assert (ds.schema_version, ds.view_size, ds.has_originals) == (2, 224, False)
    # view_size=None: the legacy version 1, records as given
    m = _write(tmp_path / "v1", [a], view_size=None)
    assert m["schema_version"] == 1 and "view_size" not in m and "originals" not in m
    assert _only_record(tmp_path / "v1")[0] == [schema.encode(a)]
    # a record with views of the writer's size passes through byte for byte ...
    c = schema.encode(_v2(make_sample("c")))
    _write(tmp_path / "same", [c], view_size=32)
    assert _only_record(tmp_path / "same")[0] == [c]
    # ... its originals dropped unless kept
    ck = _v2(make_sample("c"), keep=True)
    _write(tmp_path / "drop", [ck], view_size=32)
    assert _only_record(tmp_path / "drop")[0] == [c]
    _write(tmp_path / "keep", [ck], view_size=32, keep_originals=True)
    assert _only_record(tmp_path / "keep")[0] == [schema.encode(ck)]
    # views of another size are made from the originals (the same as from the v1 sample)
    _write(tmp_path / "other", [ck], view_size=48)
    assert _only_record(tmp_path / "other")[0] == [schema.encode(views.with_views(
        make_sample("c"), 48))]
    # version 2 with originals -> version 1: the views go
    _write(tmp_path / "back", [ck], view_size=None)
    assert _only_record(tmp_path / "back")[0] == [schema.encode(make_sample("c"))]


@pytest.mark.parametrize("kw, message", [
    (dict(view_size=48), "sample 'c' holds 32 px views and no originals: views at 48 px need "
                         "the full-resolution photograph"),
    (dict(view_size=32, keep_originals=True),
     r"sample 'c' holds 32 px views without the original photograph and regions, and this "
     r"dataset is written with originals \(--keep-originals\)"),
    (dict(view_size=None), "sample 'c' holds 32 px views and no originals; a version-1 dataset "
                           "needs the full-size photograph"),
])
def test_writer_refuses_what_needs_missing_originals(tmp_path, kw, message):
    w = shards.ShardWriter(str(tmp_path / "o"), **kw)
    with pytest.raises(schema.MissingOriginalsError, match=message):
        w.add(schema.encode(_v2(make_sample("c"))))
    w.abort()
    assert os.listdir(tmp_path / "o") == []


def _write(folder, samples, **kw):
    with shards.ShardWriter(str(folder), **kw) as w:
        for s in samples:
            w.add(s)
    return w.manifest


def test_stale_writer_folders_go_live_ones_stay(tmp_path):
    import socket
    import subprocess
    import sys
    out = tmp_path / "out"
    out.mkdir()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True)
    dead = int(ended.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    me, host = os.getpid(), socket.gethostname()
    folders = {  # name: (owner.json or None, removed?)
        f".writing-{dead}-a": (None, True),
        f".writing-{dead}-b": ({"pid": dead, "host": host, "start": "1"}, True),
        f".writing-{zombie.pid}-c": (None, True),
        f".writing-{me}-d": ({"pid": me, "host": host, "start": "1"}, True),  # pid reused
        f".writing-{me}-e": ({"pid": me, "host": host,
                              "start": shards._process_start(me)}, False),
        f".writing-{live.pid}-f": (None, False),
        f".writing-{dead}-g": ({"pid": dead, "host": "another-host", "start": "1"}, False),
        ".writing-abc123": (None, False),  # no pid in the name: left alone
    }
    (out / "train-00004-of-00005.array_record").write_bytes(b"left by a killed publish")
    (out / "notes.txt").write_text("not ours")
    for name, (owner, _) in folders.items():
        (out / name).mkdir()
        (out / name / "train-00000.array_record").write_bytes(b"partial")
        if owner:
            (out / name / shards.OWNER).write_text(json.dumps(owner))
    try:
        w = shards.ShardWriter(str(out))
        mine = os.path.basename(w._tmp)
        assert mine.startswith(f".writing-{me}-")
        owner = json.loads((out / mine / shards.OWNER).read_text())
        assert owner == {"pid": me, "host": host, "start": shards._process_start(me)}
        kept = [n for n, (_, gone) in folders.items() if not gone]
        assert sorted(os.listdir(out)) == sorted(
            kept + [mine, "train-00004-of-00005.array_record", "notes.txt"])
        w.add(make_sample("x"))
        w.close()
        assert sorted(os.listdir(out)) == sorted(  # the stray shard went, nothing else
            kept + ["notes.txt", "manifest.json", "train-00000-of-00001.array_record"]
            + list(schema.VOCAB_FILES.values()))
    finally:
        live.stdin.close()
        live.wait()
        zombie.wait()
