"""`python -m data_prep curate` on the demo dataset: two passes (clusters written, then applied),
records rewritten with canonical labels, decisions logged, Table A3 statistics."""

import dataclasses
import hashlib
import json

import pytest

from data_prep import shards, views
from data_prep.curate import rules as curate_rules
from data_prep.__main__ import main
from data_prep.curate import NeedsLabels, curate, read_samples
from sclaro_jax.data import schema

ADJECTIVES = {"small", "large", "big", "old", "young", "wooden", "tall", "little"}


def fake_tagger(tokens):
    return [(t, "JJ" if t in ADJECTIVES else "NN") for t in tokens]


@pytest.mark.slow
def test_two_passes_rewrite_the_records(demo_dir, tmp_path):
    # The demo with one image whose VLM reply named no action: curation keeps it as it is.
    demo, _ = read_samples(str(demo_dir), progress=False)
    blank = demo[1].id
    raw = [dataclasses.replace(s, action="") if s.id == blank else s for s in demo]
    src = tmp_path / "raw"  # version 2, 224 px views, no originals (the writer's default)
    shards.write_dataset(raw, str(src), ids=[s.id for s in demo], progress=False)
    out, clusters = tmp_path / "curated", tmp_path / "clusters.json"
    with pytest.raises(NeedsLabels, match="label"):
        curate(str(src), str(out), clusters=str(clusters), tagger=fake_tagger,
               action_lemmatizer="porter", progress=False)
    candidates = (tmp_path / "clusters.action_candidates.tsv").read_text().splitlines()
    assert candidates[0].startswith("# surface form") and "lemmatiser porter" in candidates[0]
    assert not (out / schema.MANIFEST).exists()
    doc = json.loads(clusters.read_text())
    assert doc["clusters"], "HDBSCAN found no cluster among the demo's object names"
    doc["clusters"][0]["label"] = "my label"
    renamed = set(doc["clusters"][0]["members"])
    clusters.write_text(json.dumps(doc))
    before, _ = read_samples(str(src), progress=False)
    action = before[0].action
    assert action
    amap = tmp_path / "actions.tsv"
    amap.write_text(f"# curated\n{action}\tdoing things\n")
    result = curate(str(src), str(out), clusters=str(clusters), action_map=str(amap),
                    tagger=fake_tagger, progress=False)
    after, manifest = read_samples(str(out), progress=False)
    assert result["records"] == len(after) == len(before)
    log = json.loads((out / "curation_log.json").read_text())
    by_id = {s.id: s for s in after}
    for old in before:
        new = by_id[old.id]
        assert new.split == old.split  # same split rule and seed
        assert new.image == old.image and len(new.objects) == len(old.objects)
        assert new.train_image == old.train_image and new.view_size == old.view_size == 224
        assert [o.view for o in new.objects] == [o.view for o in old.objects]
        assert [r.view for r in new.relations] == [r.view for r in old.relations]
        for o_old, o_new in zip(old.objects, new.objects):
            entry = log["objects"][o_old.name]
            assert entry["standardised"] == curate_rules.standardise_object_name(
                o_old.name, fake_tagger)
            expected = "my label" if entry["standardised"] in renamed else entry["label"]
            assert o_new.name == expected and o_new.box == o_old.box
        for r_old, r_new in zip(old.relations, new.relations):
            assert r_new.predicate == curate_rules.normalise_predicate(r_old.predicate)
            assert r_new.text == schema.triplet_text(new.objects[r_new.subject].name,
                                                     r_new.predicate,
                                                     new.objects[r_new.object].name)
            assert r_new.region == r_old.region
        assert new.action == ("doing things" if old.action == action else old.action)
        assert (new.action == "") == (old.id == blank)
    vocab = schema.read_vocab(out / "objects.txt")
    assert "my label" in vocab and not renamed & set(vocab) - {"my label"}
    stats = json.loads((out / "statistics.json").read_text())
    assert sum(row["images"] for row in stats.values()) == len(before)
    assert manifest["records"] == len(before)
    assert sum(v["no_action"] for v in manifest["splits"].values()) == 1
    assert "" not in schema.read_vocab(out / "actions.txt")
    assert log["vocabulary"]["actions"] == len({s.action for s in before} - {""})
    # the output keeps the input's version, view size and originals policy ...
    assert (manifest["schema_version"], manifest["view_size"], manifest["originals"]) == (
        2, 224, False)
    # ... and a version-1 input gives a version-1 output with the same labels
    src1, out1 = tmp_path / "raw_v1", tmp_path / "curated_v1"
    shards.write_dataset(raw, str(src1), ids=[s.id for s in demo], progress=False,
                         view_size=None)
    curate(str(src1), str(out1), clusters=str(clusters), action_map=str(amap),
           tagger=fake_tagger, progress=False)
    after1, manifest1 = read_samples(str(out1), progress=False)
    assert manifest1["schema_version"] == 1 and "view_size" not in manifest1
    for s in after1:
        assert s.view_size is None and s.has_originals
        assert views.with_views(s, 224) == by_id[s.id]


def test_cli_first_pass_exits_3_and_missing_tagger_data_is_named(demo_dir, tmp_path, capsys,
                                                                 monkeypatch):
    import nltk
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "no_nltk_data")])
    base = ["curate", "--data", str(demo_dir), "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(base) == 2
    err = capsys.readouterr().err  # the install command, or the flag that does without
    assert curate_rules.TAGGER_INSTALL in err
    assert "`python -m data_prep curate --no-pos-tagger`" in err
    assert not err.rstrip().endswith("tagger=")  # it used to stop there
    assert main(base + ["--no-pos-tagger"]) == 2   # WordNet for the action lemmatiser
    assert curate_rules.WORDNET_INSTALL in capsys.readouterr().err
    assert not (tmp_path / "o.clusters.json").exists()
    assert main(base + ["--no-pos-tagger", "--action-lemmatizer", "porter"]) == 3
    assert "clusters" in capsys.readouterr().out
    assert (tmp_path / "o.clusters.json").exists()


def _tree_bytes(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_relation_overrides_keep_opposite_prepositions_apart(demo_dir, tmp_path):
    demo, _ = read_samples(str(demo_dir), progress=False)
    opposite = {0: "sitting on", 1: "sitting under", 2: "Sitting on"}  # sample -> predicate

    def with_predicate(s, predicate):
        r = s.relations[0]
        text = schema.triplet_text(s.objects[r.subject].name, predicate,
                                   s.objects[r.object].name)
        first = dataclasses.replace(r, predicate=predicate, text=text)
        return dataclasses.replace(s, relations=(first,) + s.relations[1:])

    raw = [with_predicate(s, opposite[i]) if i in opposite else s for i, s in enumerate(demo)]
    src, clusters = tmp_path / "raw", tmp_path / "clusters.json"
    shards.write_dataset(raw, str(src), ids=[s.id for s in demo], progress=False)
    with pytest.raises(NeedsLabels):  # the paper's rule: one "sitting", flagged in the table
        curate(str(src), str(tmp_path / "o"), clusters=str(clusters), tagger=fake_tagger,
               action_lemmatizer="porter", progress=False)
    table = (tmp_path / "clusters.predicate_table.tsv").read_text().splitlines()
    assert "sitting\t3\tSitting on (1); sitting on (1); sitting under (1)\ton / under" in table
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("# keep opposite relations apart\nkeep sitting on, sitting under\n")
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:  # no cluster labelled: this test is about predicates
        curate(str(src), str(out), clusters=str(clusters), tagger=fake_tagger,
               relation_overrides=str(overrides), accept_suggested=True, progress=False)
    out = outs[0]
    table = (out / "predicate_table.tsv").read_text()
    assert table == (tmp_path / "clusters.predicate_table.tsv").read_text()
    assert "sitting on\t2\tSitting on (1); sitting on (1)\t\n" in table
    assert "sitting under\t1\tsitting under (1)\t\n" in table
    vocab = schema.read_vocab(out / "predicates.txt")
    assert {"sitting on", "sitting under"} <= set(vocab) and "sitting" not in vocab
    after, manifest = read_samples(str(out), progress=False)
    by_id = {s.id: s for s in after}
    for i, predicate in opposite.items():
        assert by_id[demo[i].id].relations[0].predicate == predicate.lower()
    recorded = manifest["relation_curation"]
    assert recorded["keep_prepositions"] is False
    assert recorded["overrides"]["file"] == str(overrides)
    assert recorded["overrides"]["sha256"] == hashlib.sha256(overrides.read_bytes()).hexdigest()
    assert recorded["overrides"]["entries"] == [
        {"line": 2, "action": "keep", "predicates": ["sitting on", "sitting under"], "to": ""}]
    log = json.loads((out / "curation_log.json").read_text())
    assert log["relation_curation"] == recorded
    assert log["predicates"]["Sitting on"] == "sitting on"
    # the same inputs and the same file: the same bytes
    assert _tree_bytes(outs[0]) == _tree_bytes(outs[1])


def test_cli_refuses_a_bad_overrides_file_before_clustering(demo_dir, tmp_path, capsys):
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("keep in front of\nrename sitting -> seated\n")
    base = ["curate", "--data", str(demo_dir), "--out", str(tmp_path / "o"), "--no-progress",
            "--no-pos-tagger", "--action-lemmatizer", "porter"]
    assert main(base + ["--relation-overrides", str(overrides)]) == 2
    err = capsys.readouterr().err
    assert f"{overrides} line 2: 'rename sitting -> seated': unknown predicate 'sitting'" in err
    assert not (tmp_path / "o.clusters.json").exists()


def _no_adjectives(tokens):
    return [(t, "NN") for t in tokens]


def test_cli_refuses_a_clusters_file_without_any_label(demo_dir, tmp_path, capsys):
    """A second pass on a clusters file nobody labelled would take every suggestion unread
    (on the demo, nine unrelated names all became "wall"): refused, with the clusters that
    most need a look, unless --accept-suggested."""
    demo, _ = read_samples(str(demo_dir), progress=False)
    names = sorted(set(curate_rules.object_canonical_map(
        sorted({o.name for s in demo for o in s.objects}), tagger=_no_adjectives).values()))
    mixed, four = names[:9], names[9:13]  # like the demo's "wall" cluster; four other names
    dogs = ["dog", "dogs", "small dog", "big dog", "hot dog"]  # 5 names, 2 head words
    doc = {"clusters": [{"id": 0, "suggested_label": "dog", "label": "", "members": dogs},
                        {"id": 1, "suggested_label": mixed[0], "label": "", "members": mixed},
                        {"id": 2, "suggested_label": four[0], "label": "", "members": four}],
           "noise": names[13:]}
    clusters = tmp_path / "o.clusters.json"  # written by hand: no clustering run here
    clusters.write_text(json.dumps(doc))
    base = ["curate", "--data", str(demo_dir), "--out", str(tmp_path / "o"), "--no-progress",
            "--no-pos-tagger", "--action-lemmatizer", "porter"]
    assert main(base) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"error: {clusters}: no cluster has a \"label\"")
    assert "--accept-suggested" in err[0] and "o.clusters.md" in err[0]
    # most distinct head words first, then size: the mixed nine, the four, the dogs
    assert err[1] == (f"  cluster 1 (9 names, 9 head words) -> {mixed[0]!r}: "
                      f"{', '.join(mixed[:8])}, +1 more")
    assert err[2] == f"  cluster 2 (4 names, 4 head words) -> {four[0]!r}: {', '.join(four)}"
    assert err[3] == ("  cluster 0 (5 names, 2 head words) -> 'dog': dog, dogs, small dog, "
                      "big dog, hot dog")
    assert len(err) == 4 and not (tmp_path / "o").exists()
    assert main(base + ["--accept-suggested"]) == 0
    objects = set(schema.read_vocab(tmp_path / "o" / "objects.txt"))
    assert mixed[0] in objects and not set(mixed[1:]) & objects
    log = json.loads((tmp_path / "o" / "curation_log.json").read_text())
    assert log["inputs"]["accept_suggested"] is True


def test_cli_names_the_missing_hdbscan_package(tmp_path, capsys, monkeypatch):
    import sys

    import data_prep.curate
    monkeypatch.setitem(sys.modules, "hdbscan", None)  # as if it were not installed
    for name in ("cluster", "extend"):  # imported afresh, as in a new process
        monkeypatch.delitem(sys.modules, f"data_prep.curate.{name}", raising=False)
        monkeypatch.delattr(data_prep.curate, name, raising=False)
    assert main(["curate", "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: curate needs the hdbscan package") and err.count("\n") == 1
    assert 'pip install -e ".[data]"' in err
