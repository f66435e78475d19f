"""data_prep.curate.rules: the appendix's label-curation rules on hand-made cases."""

import hashlib

import numpy as np
import pytest

from data_prep.curate import objects as curate_objects
from data_prep.curate import rules as cr

# A dict-based stand-in for nltk.pos_tag (nltk's tagger data is not installed here); unknown
# words are nouns.
FAKE_TAGS = {"small": "JJ", "wooden": "JJ", "shiny": "JJ", "big": "JJ", "bigger": "JJR",
             "biggest": "JJS", "fresh": "JJ", "old": "JJ", "red": "NN", "running": "VBG"}


class FakeTagger:
    def __init__(self):
        self.calls = []

    def __call__(self, tokens):
        self.calls.append(tuple(tokens))
        return [(t, FAKE_TAGS.get(t, "NN")) for t in tokens]


# --------------------------------------------------------------------------- text


@pytest.mark.parametrize("raw, expected", [
    ("  Red   CAR ", "red car"),
    ("T-Shirt", "t-shirt"),
    ("children\u2019s toy!!", "children's toy"),
    ("\uff32\uff45\uff44 car", "red car"),  # full-width letters (NFKC)
    ("- car -", "car"),
    ("'quoted'", "quoted"),
    ("car, truck; (bus)", "car truck bus"),
    ("snake_case", "snake case"),
    ("", ""),
])
def test_normalise_text(raw, expected):
    assert cr.normalise_text(raw) == expected


# --------------------------------------------------------------------------- colours


@pytest.mark.parametrize("name, expected", [
    ("red car", "car"),
    ("dark blue shirt", "shirt"),
    ("pale light blue sky", "sky"),
    ("dark-blue jacket", "jacket"),
    ("red-coloured car", "car"),
    ("black and white dog", "dog"),
    ("black-and-white dog", "dog"),
    ("grey gray cat", "cat"),
    # colour-only names are kept whole
    ("orange", "orange"),
    ("dark blue", "dark blue"),
    ("light orange", "light orange"),
    # modifiers and "and" count only next to a colour; only leading tokens go
    ("light bulb", "light bulb"),
    ("dark room", "dark room"),
    ("red and car", "red and car"),
    ("car red", "car red"),
    ("bluebird", "bluebird"),
    # kept compounds, also with a plural second word
    ("white board", "white board"),
    ("white boards", "white boards"),
    ("red white board", "white board"),
    ("orange juice", "orange juice"),
    ("blue jeans", "jeans"),
])
def test_strip_colours(name, expected):
    assert cr.strip_colours(name) == expected


# --------------------------------------------------------------------------- adjectives


@pytest.mark.parametrize("name, expected", [
    ("small wooden table", "table"),
    ("garbage truck", "garbage truck"),  # noun compound
    ("biggest bigger dog", "dog"),  # JJS, JJR
    ("small big", "big"),  # the last token always stays
    ("big", "big"),
    ("running shoe", "running shoe"),  # VBG is not an adjective
    ("fresh orange juice", "orange juice"),  # stops at a kept compound
    ("dog small", "dog small"),  # only leading tokens
])
def test_strip_adjectives(name, expected):
    assert cr.strip_adjectives(name, FakeTagger()) == expected


def test_strip_adjectives_rejects_a_tagger_that_drops_tokens():
    with pytest.raises(ValueError, match="1 tags for the 2 tokens of 'small dog'"):
        cr.strip_adjectives("small dog", lambda tokens: [(tokens[0], "JJ")])


@pytest.fixture
def no_nltk_data(monkeypatch, tmp_path):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    curate_objects._default_tagger.cache_clear()
    yield tmp_path
    curate_objects._default_tagger.cache_clear()


def test_missing_tagger_data_says_what_to_install(no_nltk_data):
    with pytest.raises(cr.MissingNLTKData) as info:
        cr.require_tagger()
    message = str(info.value)
    assert "python -m nltk.downloader averaged_perceptron_tagger_eng" in message
    assert "taggers/averaged_perceptron_tagger_eng/" in message
    assert str(no_nltk_data) in message
    assert isinstance(info.value, RuntimeError)
    # The default tagger is never replaced by a silent fallback, and the check comes first.
    with pytest.raises(cr.MissingNLTKData):
        cr.strip_adjectives("small dog")
    with pytest.raises(cr.MissingNLTKData):
        cr.object_canonical_map([])


def test_tagger_resource_is_what_nltk_pos_tag_loads():
    from nltk.tag import PRETRAINED_TAGGERS

    assert PRETRAINED_TAGGERS["eng"] == cr.TAGGER_RESOURCE


# --------------------------------------------------------------------------- plurals


def test_fold_plurals_only_when_both_forms_occur():
    assert cr.fold_plurals({"cars", "car", "glasses"}) == {"cars": "car"}
    assert cr.fold_plurals({"cars", "glasses", "glass"}) == {"glasses": "glass"}
    assert cr.fold_plurals({"cars"}) == {}


def test_fold_plurals_rules_and_irregulars():
    pairs = {"boxes": "box", "buses": "bus", "horses": "horse", "dishes": "dish",
             "benches": "bench", "tomatoes": "tomato", "shoes": "shoe", "berries": "berry",
             "knives": "knife", "leaves": "leaf", "gloves": "glove", "men": "man",
             "women": "woman", "firemen": "fireman", "people": "person", "children": "child",
             "feet": "foot", "teeth": "tooth", "mice": "mouse", "geese": "goose",
             "red cars": "red car", "traffic lights": "traffic light"}
    names = set(pairs) | set(pairs.values())
    assert cr.fold_plurals(names) == pairs
    # -ss, -us, -is are not plurals: "glass" does not fold into "glas"
    assert cr.fold_plurals({"glass", "glas", "bus", "bu", "tennis", "tenni"}) == {}
    # only the last word is singularised
    assert cr.fold_plurals({"cars park", "car park"}) == {}


# --------------------------------------------------------------------------- objects


def test_consistent_objects_intersects_per_sample_then_unions():
    samples = [(["Car", "tree"], ["car", "road"]),
               (["dog", "Tree "], ["dog", "cat"]),
               (["sky"], [])]
    assert cr.consistent_objects(samples) == {"car", "dog"}


def test_consistent_objects_errors_name_the_sample():
    with pytest.raises(ValueError, match="sample 1, stage 1: expected a list of names"):
        cr.consistent_objects([(["a"], ["a"]), (["car"], "car")])
    with pytest.raises(ValueError, match="sample 0: expected name lists from at least two"):
        cr.consistent_objects([(["car"],)])


def test_object_canonical_map():
    tagger = FakeTagger()
    names = ["Red Cars", "car", "small dog", "Small  Dog!", "dogs", "The shiny red car", "garbage truck",
             "orange", "white boards", "glasses", "!!", "red car"]
    assert cr.object_canonical_map(names, tagger) == {
        "Red Cars": "car",  # colour stripped, then "cars" folds into "car"
        "car": "car",
        "small dog": "dog",
        "Small  Dog!": "dog",
        "dogs": "dog",  # folds: "dog" exists after standardisation
        "The shiny red car": "car",  # article, adjective, then colour (tagged NN here)
        "garbage truck": "garbage truck",
        "orange": "orange",
        "white boards": "white boards",  # no "white board" among the names
        "glasses": "glasses",  # no "glass"
        "red car": "car",
    }
    # Per-name work once per distinct normalised name, and never for single words.
    assert len(tagger.calls) == len(set(tagger.calls))


# --------------------------------------------------------------------------- relations


def test_stopwords_are_nltks_english_list():
    assert len(cr.STOPWORDS) == 198
    assert {"on", "in", "the", "of", "under", "above", "should've", "you're"} <= cr.STOPWORDS
    assert not {"next", "front", "near", "holding", "mounted"} & cr.STOPWORDS
    try:
        from nltk.corpus import stopwords
        installed = set(stopwords.words("english"))
    except LookupError:
        pytest.skip("nltk's stopwords corpus is not installed to compare with")
    assert cr.STOPWORDS == installed


@pytest.mark.parametrize("predicate, expected", [
    ("mounted on", "mounted"),
    ("Is Sitting On", "sitting"),
    ("in front of", "front"),
    ("on", "on"),  # nothing would remain: kept
    ("out of", "out of"),
    ("", ""),
])
def test_normalise_predicate(predicate, expected):
    assert cr.normalise_predicate(predicate) == expected


def test_normalise_predicate_custom_stopwords():
    assert cr.normalise_predicate("mounted on", stopwords={"mounted"}) == "on"


@pytest.mark.parametrize("predicate, expected", [
    ("sitting on", "sitting on"),
    ("Is sitting under", "sitting under"),
    ("is sitting on top of the", "sitting on top of"),
    ("parked in front of", "parked in front of"),
    ("mounted on the wall", "mounted on wall"),
    ("in front of", "front"),  # no verb before it: the appendix's rule
    ("is next to", "next"),
    ("on", "on"),
])
def test_keep_prepositions_after_the_verb(predicate, expected):
    assert cr.normalise_predicate(predicate, keep_prepositions=True) == expected


def test_predicate_table_flags_merged_prepositions():
    raws = {"sitting on": 3, "Sitting under": 1, "is sitting": 1, "holding": 2, "next to": 1}
    mapping = cr.predicate_map(raws)
    assert mapping["sitting on"] == mapping["Sitting under"] == "sitting"
    rows = cr.predicate_table(raws, mapping)
    assert rows[0] == {"predicate": "sitting", "count": 5, "spatial": ["(none)", "on", "under"],
                       "raw": [("sitting on", 3), ("Sitting under", 1), ("is sitting", 1)]}
    assert [r["spatial"] for r in rows[1:]] == [[], []]
    text = cr.format_predicate_table(rows, header=["h"])
    assert text.splitlines()[:3] == [
        "# h", "predicate\tcount\traw predicates (count)\tspatial prepositions merged",
        "sitting\t5\tsitting on (3); Sitting under (1); is sitting (1)\t(none) / on / under"]


def test_predicate_map_keep_prepositions_then_overrides():
    raws = ["sitting on", "sitting under", "is sitting on"]
    assert set(cr.predicate_map(raws, keep_prepositions=True).values()) == {
        "sitting on", "sitting under"}
    got = cr.predicate_map(raws, keep_prepositions=True,
                           overrides=_overrides("merge sitting on, sitting under -> sitting"))
    assert set(got.values()) == {"sitting"}


def _overrides(text):
    return cr.RelationOverrides("/o.txt", "0", cr.parse_overrides(text, "/o.txt"))


def test_overrides_keep_rename_merge():
    raws = ["sitting on", "Sitting Under", "in front of", "next to", "beside", "holding"]
    got = cr.predicate_map(raws, overrides=_overrides(
        "# the manual pass\n\nkeep sitting on, sitting under\nrename front -> in front of\n"
        "merge next, beside -> beside\n"))
    assert got == {"sitting on": "sitting on", "Sitting Under": "sitting under",
                   "in front of": "in front of", "next to": "beside", "beside": "beside",
                   "holding": "holding"}
    entry = _overrides("\n merge  next, Beside -> near ").entries[0]
    assert entry.as_dict() == {"line": 2, "action": "merge", "predicates": ["next", "beside"],
                               "to": "near"}


@pytest.mark.parametrize("text, message", [
    ("kep sitting on", "line 1: 'kep sitting on': unknown action 'kep'"),
    ("# c\nkeep sitting over", "line 2: 'keep sitting over': unknown predicate 'sitting over'"),
    ("rename sitting on -> x", "unknown predicate 'sitting on'"),  # rule's forms only
    ("rename front", "rename needs 'OLD -> NEW'"),
    ("rename front, next -> x", "rename takes one predicate"),
    ("merge front -> x", "merge takes two or more"),
    ("rename front -> ,", "an empty predicate"),
    ("keep sitting on\nkeep sitting on", "line 2: 'keep sitting on': 'sitting on' is already "
                                          "kept on line 1"),
    ("rename front -> x\nmerge front, next -> y", "line 2: 'merge front, next -> y': 'front' "
                                                  "is already renamed on line 1"),
    ("rename front -> next\nrename next -> near", "its target 'next' is renamed again on "
                                                 "line 2"),
])
def test_overrides_errors_name_file_line_and_entry(text, message):
    with pytest.raises(cr.OverridesError, match="^/o.txt line") as info:
        cr.predicate_map(["sitting on", "in front of", "next to"], overrides=_overrides(text))
    assert message in str(info.value)


def test_read_overrides_hashes_the_bytes(tmp_path):
    path = tmp_path / "o.txt"
    path.write_bytes(b"keep sitting on\n")
    got = cr.read_overrides(str(path))
    assert got.sha256 == hashlib.sha256(b"keep sitting on\n").hexdigest()
    assert got.path == str(path) and got.entries[0].predicates == ("sitting on",)


def test_appendix_relation_example():
    object_map = {"garbage truck": "waste management", "trash can": "waste management"}
    a = cr.canonical_triplet("air conditioner", "mounted", "wall", object_map)
    b = cr.canonical_triplet("Air Conditioner", "mounted on", "wall", object_map)
    assert a == b == ("air conditioner", "mounted", "wall")
    assert cr.relation_text(a) == "air conditioner mounted wall"
    # subject / object through the cluster labels; missing names keep their normalised form
    assert cr.canonical_triplet("trash can", "next to", "Garbage Truck", object_map) == (
        "waste management", "next", "waste management")


def test_duplicates_kept_per_image_dropped_from_vocabulary():
    object_map = {"man": "person", "woman": "person", "mug": "cup"}
    image1 = cr.canonicalise_image_relations(
        [("man", "holding", "cup"), ("woman", "is holding", "mug"), ("man", "on", "bench")],
        object_map)
    assert image1 == [("person", "holding", "cup"), ("person", "holding", "cup"),
                      ("person", "on", "bench")]
    image2 = cr.canonicalise_image_relations([("woman", "holding a", "cup")], object_map)
    assert cr.relation_vocabulary([image1, image2]) == ["person holding cup", "person on bench"]
    assert cr.dedupe_triplets(image1 + image2) == [("person", "holding", "cup"),
                                                   ("person", "on", "bench")]


def test_relation_with_empty_predicate():
    triplet = cr.canonical_triplet("dog", "", "ball", {})
    assert triplet == ("dog", "", "ball")
    assert cr.relation_text(triplet) == "dog ball"


def test_canonicalise_image_relations_rejects_a_pair():
    with pytest.raises(ValueError, match="relation 1: expected"):
        cr.canonicalise_image_relations([("a", "on", "b"), ("a", "b")], {})


# --------------------------------------------------------------------------- actions


def test_load_action_map(tmp_path):
    path = tmp_path / "actions.tsv"
    path.write_text("# curated by hand\n"
                    "taking photos\ttaking a photo\n"
                    "\n"
                    "Taking a Selfie\ttaking a photograph\n"
                    "   # indented comment\n"
                    "taking a photo\ttaking a photograph\n"
                    "taking photos\ttaking a photo\n", encoding="utf-8")
    assert cr.load_action_map(path) == {"taking photos": "taking a photograph",
                                        "taking a selfie": "taking a photograph",
                                        "taking a photo": "taking a photograph"}


@pytest.mark.parametrize("text, line, message", [
    ("a\tb\nc\td\te\n", 2, "got 3 tab-separated column"),
    ("# x\nrunning jogging\n", 2, "got 1 tab-separated column"),
    ("a\t  \n", 1, "empty canonical class"),
    ("\tb\n", 1, "empty surface form"),
    ("run\trunning\nwalk\twalking\nrun\tjogging\n", 3, "line 1 maps it to 'running'"),
    ("a\tb\nb\ta\n", 1, "loops: a -> b -> a"),
])
def test_load_action_map_errors_name_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "actions.tsv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=f"actions.tsv:{line}: .*{message}"):
        cr.load_action_map(path)


def test_canonical_action():
    action_map = {"taking photos": "taking a photograph"}
    assert cr.canonical_action("Taking Photos!", action_map) == "taking a photograph"
    assert cr.canonical_action("  Running ", action_map) == "running"  # unmapped: normalised
    assert cr.canonical_action("", action_map) == ""  # no action: kept
    # Multi-Moments ground truth is used exactly as given, whatever the VLM said
    assert cr.canonical_action("taking photos", action_map,
                               ground_truth="Taking Photos") == "Taking Photos"


def test_action_candidates():
    actions = ["taking a photo", "taking photos", "taking a photo", "Taking a selfie",
               "taking a photograph", "running", "", "walking dog", "dog walking"]
    suggested = {(a, b) for a, b, _ in cr.action_candidates(actions)}
    assert suggested == {("taking photos", "taking a photo")}
    lemma = {"photograph": "photo"}.get
    result = cr.action_candidates(actions, lemmatize=lambda w: lemma(w, w))
    assert [(a, b) for a, b, _ in result] == [("taking a photograph", "taking a photo"),
                                              ("taking photos", "taking a photo")]
    assert "'taking photo'" in result[1][2] and "1 vs 2 occurrences" in result[1][2]


# --------------------------------------------------------------------------- statistics


def test_source_statistics():
    samples = [
        {"source": "pvsg", "action": "cooking", "objects": ["person", "pan"],
         "triplets": ["person holding pan"]},
        {"source": "pvsg", "action": "cooking", "objects": ["person"],
         "triplets": ["person holding pan", "person holding pan"]},
        {"source": "pvsg", "action": "", "objects": ["person", "pan"],
         "triplets": ["person near pan"]},
        {"source": "pvsg", "action": "eating", "objects": [], "triplets": []},
        {"source": "kitti", "action": "driving", "objects": ["car"], "triplets": []},
    ]
    assert cr.source_statistics(samples) == {
        "kitti": {"images": 1, "actions": 1, "objects": 1, "triplets": 0,
                  "occurrences_per_triplet": 0.0},
        "pvsg": {"images": 4, "actions": 2, "objects": 2, "triplets": 2,
                 "occurrences_per_triplet": 2.0},
    }


def test_source_statistics_names_the_missing_field():
    with pytest.raises(ValueError, match="sample 1: missing field 'triplets'"):
        cr.source_statistics([{"source": "a", "action": "", "objects": [], "triplets": []},
                              {"source": "a", "action": "", "objects": []}])


# --------------------------------------------------------------------------- action candidates


def _unit(rows):
    v = np.asarray(rows, np.float64)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_similar_action_candidates_follow_the_best_ranked_neighbour():
    actions = ["a photo", "a photograph", "a selfie", "eating", "dining", "reading"]
    counts = {"a photo": 3, "a photograph": 5, "a selfie": 1, "eating": 4, "dining": 4,
              "reading": 2}
    emb = _unit([[1, 0.2, 0, 0], [1, 0, 0, 0], [1, 0.6, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0.3],
                 [0, 1, 0, 0]])
    sim = emb @ emb.T
    # selfie ~ photo (0.94) but not ~ photograph (0.86 < 0.9): it reaches photograph via photo
    assert sim[2, 0] >= 0.9 > sim[2, 1] and sim[0, 1] >= 0.9
    rows = cr.similar_action_candidates(actions, counts, emb, 0.9, block=4)
    assert [(a, b) for a, b, _ in rows] == [("a photo", "a photograph"),
                                            ("a selfie", "a photograph"),
                                            ("eating", "dining")]  # tie at 4: alphabetical
    reason = dict((a, r) for a, _, r in rows)["a selfie"]
    assert reason.startswith(f"embedding cosine {sim[2, 0]:.2f} to 'a photo' (1 vs 3")
    assert "goes on to 'a photograph'" in reason
    assert cr.similar_action_candidates(actions, counts, emb, 0.9, skip={"a selfie"}) == [
        r for r in rows if r[0] != "a selfie"]
    assert cr.similar_action_candidates(actions, counts, emb, 1.0) == []
    assert cr.similar_action_candidates([], {}, np.zeros((0, 4))) == []
    with pytest.raises(ValueError, match="6 actions but 5 embeddings"):
        cr.similar_action_candidates(actions, counts, emb[:5])
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\]"):
        cr.similar_action_candidates(actions, counts, emb, 0.0)


def test_porter_lemmatiser_groups_action_forms():
    stem = cr.require_lemmatizer("porter")
    assert [stem(w) for w in ("taking", "photos", "selfies", "running")] == [
        "take", "photo", "selfi", "run"]
    actions = ["taking photos"] * 2 + ["taking a photo"] * 3 + ["take photo"]
    assert [(a, b) for a, b, _ in cr.action_candidates(actions, lemmatize=stem)] == [
        ("take photo", "taking a photo"), ("taking photos", "taking a photo")]
    assert cr.action_candidates({"taking photos": 2, "Taking a photo": 3, "take photo": 1},
                                lemmatize=stem) == cr.action_candidates(actions, lemmatize=stem)
    assert cr.require_lemmatizer("none") is None
    with pytest.raises(ValueError, match="'spacy' is not one of"):
        cr.require_lemmatizer("spacy")


def test_wordnet_lemmatiser_needs_its_data_and_reads_verbs_first(monkeypatch, tmp_path):
    import nltk
    import nltk.stem
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "empty")])
    with pytest.raises(cr.MissingNLTKData, match=r"(?s)python -m nltk\.downloader wordnet.*"
                       r"--action-lemmatizer porter"):
        cr.require_lemmatizer("wordnet")

    class FakeWordNet:  # the two lookups the rule makes, as WordNet answers them
        table = {("taking", "v"): "take", ("photos", "n"): "photo", ("photos", "v"): "photos",
                 ("saw", "v"): "see"}

        def lemmatize(self, word, pos):
            return self.table.get((word, pos), word)
    monkeypatch.setattr(nltk.data, "find", lambda resource: resource)
    monkeypatch.setattr(nltk.stem, "WordNetLemmatizer", FakeWordNet)
    lemma = cr.require_lemmatizer("wordnet")
    assert [lemma(w) for w in ("taking", "photos", "saw", "cat")] == [
        "take", "photo", "see", "cat"]
