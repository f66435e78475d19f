"""Stage-1 VLM prompt, reply parsing (against a hand-written corpus) and VLM wrappers."""

import collections
import json
from pathlib import Path

import pytest
from PIL import Image

from data_prep.vlm import (PROMPT, RECOVERY_NOTES, ParseError, ScriptedVLM, TransformersVLM,
                           parse_response)

CORPUS = json.loads((Path(__file__).parent / "data" / "vlm_replies.json").read_text())
# Corpus kinds that need no recovery note, or that are hopeless (expect an error).
PLAIN_KINDS = {"well_formed", "whitespace"}


def _matches(note: str, code: str) -> bool:
    return note == code or (code.endswith(":") and note.startswith(code)) or \
        note.startswith(code + ":")


def _result(entry):
    return parse_response(entry["reply"])


@pytest.mark.parametrize("entry", CORPUS, ids=[f"{i:02d}-{e['kind']}" for i, e in
                                               enumerate(CORPUS)])
def test_corpus_reply(entry):
    expect = entry["expect"]
    if "error" in expect:
        with pytest.raises(ParseError) as info:
            _result(entry)
        assert info.value.reason == expect["error"]
        assert expect["error"] in str(info.value)
        return
    got = _result(entry)
    assert set(got) == {"action", "objects", "relations", "caption", "notes"}
    assert got["action"] == expect["action"]
    assert got["objects"] == expect["objects"]
    assert got["relations"] == [tuple(r) for r in expect["relations"]]
    assert all(type(r) is tuple for r in got["relations"])
    assert got["caption"] == expect["caption"]
    assert sorted(got["notes"]) == expect["notes"]
    assert len(set(got["notes"])) == len(got["notes"])
    if entry["kind"] not in PLAIN_KINDS:
        assert any(_matches(n, entry["kind"]) for n in got["notes"]), got["notes"]


def test_corpus_is_broad():
    kinds = collections.Counter(e["kind"] for e in CORPUS)
    assert len(CORPUS) >= 60
    assert kinds["well_formed"] >= 15
    assert sum("error" in e["expect"] for e in CORPUS) >= 6


def test_every_recovery_note_occurs_in_corpus():
    notes = collections.Counter(n for e in CORPUS if "error" not in e["expect"]
                                for n in _result(e)["notes"])
    for code in RECOVERY_NOTES:
        assert sum(c for n, c in notes.items() if _matches(n, code)) > 0, code
    for note in notes:  # and nothing outside the documented list
        assert any(_matches(note, code) for code in RECOVERY_NOTES), note


def test_parses_are_consistent():
    """Relations only name listed objects (same spelling); at most 10 unique objects."""
    for entry in CORPUS:
        if "error" in entry["expect"]:
            continue
        got = _result(entry)
        assert len(got["objects"]) <= 10
        assert len({o.lower() for o in got["objects"]}) == len(got["objects"])
        for subject, predicate, obj in got["relations"]:
            assert subject in got["objects"] and obj in got["objects"] and predicate


# ---------------------------------------------------------------- prompt

def test_prompt_is_the_appendix_prompt():
    lines = PROMPT.splitlines()
    assert lines[0] == "Given the image, return only the following information:"
    assert "1. A list of major unique objects in the image (limit to 10 objects)." in lines
    assert ("2. The relations between those objects in the form of relation triplets: "
            "<object1> <relation> <object2>.") in lines
    assert "Do not provide any extra information or descriptions." in lines
    assert lines[-9:] == ['{', '"action": "<some action>"', '"objects": ["object1", "object2", ...],',
                          '"relations": [', '["object1", "relation", "object2"],', '...', ']',
                          '"dense caption": "The image shows a... <description>"', '}']
    assert "langle" not in PROMPT and "$" not in PROMPT


def test_prompt_example_itself_parses():
    filled = PROMPT[PROMPT.index("{"):].replace("<some action>", "eating")
    got = parse_response(filled)
    assert got["action"] == "eating"
    assert got["objects"] == ["object1", "object2"]
    assert got["relations"] == [("object1", "relation", "object2")]
    assert got["caption"] == "The image shows a... <description>"
    assert set(got["notes"]) == {"missing_commas", "ellipsis"}


# ---------------------------------------------------------------- focused rules

def test_valid_json_takes_the_json_path_unchanged():
    text = json.dumps({"action": "eating", "objects": ["man", "apple"],
                       "relations": [["man", "eating", "apple"]],
                       "dense caption": "He said \"hi\" to the \u2018apple\u2019."})
    got = parse_response(text)
    assert got["caption"] == "He said \"hi\" to the \u2018apple\u2019."
    assert got["notes"] == []


def test_string_relation_takes_longest_prefix_and_suffix():
    got = parse_response('{"objects": ["player", "tennis player", "racket", "tennis racket"], '
                         '"relations": ["tennis player swinging tennis racket"]}')
    assert got["relations"] == [("tennis player", "swinging", "tennis racket")]


def test_four_token_relation_joins_its_middle():
    got = parse_response('{"objects": ["man", "chair"], '
                         '"relations": [["man", "sitting", "on", "chair"]]}')
    assert got["relations"] == [("man", "sitting on", "chair")]
    assert "relation_joined" in got["notes"]
    # ends that are not listed objects, or a listed object inside: still dropped
    for tokens in (["man", "sitting", "on", "sofa"], ["man", "on", "chair", "near", "man"]):
        got = parse_response(json.dumps({"objects": ["man", "chair"], "relations": [tokens]}))
        assert got["relations"] == [] and "relation_dropped:arity" in got["notes"], tokens


def test_string_relation_needs_a_predicate_between_objects():
    got = parse_response('{"objects": ["man", "horse"], "relations": ["man horse", "man"]}')
    assert got["relations"] == []
    assert "relation_dropped:unsplittable" in got["notes"]


def test_string_relation_with_separators_may_name_new_objects():
    got = parse_response('{"objects": ["man"], "relations": ["man, holding, cup", '
                         '"(man -> near -> table)"]}')
    assert got["relations"] == [("man", "holding", "cup"), ("man", "near", "table")]
    assert got["objects"] == ["man", "cup", "table"]


def test_relation_names_take_the_object_list_spelling():
    got = parse_response('{"objects": ["Red Car", "road"], "relations": [["red car", "on", '
                         '"ROAD"]]}')
    assert got["relations"] == [("Red Car", "on", "road")]


def test_relation_objects_added_only_while_room():
    objects = [f"thing{i}" for i in range(9)]
    text = json.dumps({"objects": objects, "relations": [
        ["thing0", "on", "a"], ["thing0", "near", "b"], ["b", "under", "c"]]})
    got = parse_response(text)
    assert got["objects"] == objects + ["a"]
    assert got["relations"] == [("thing0", "on", "a")]
    assert set(got["notes"]) >= {"relation_object_added", "relation_dropped:unknown_object"}


def test_objects_keep_first_spelling_and_at_most_ten():
    names = ["Cup", "cup", "CUP"] + [f"o{i}" for i in range(12)]
    got = parse_response(json.dumps({"objects": names}))
    assert got["objects"] == ["Cup"] + [f"o{i}" for i in range(9)]
    assert {"duplicate_object", "objects_truncated"} <= set(got["notes"])


def test_duplicate_keys_keep_first_non_empty_value():
    got = parse_response('{"action": "", "action": "eating", "action": "running"}')
    assert got["action"] == "eating"
    assert "duplicate_key" in got["notes"]


def test_escapes_in_the_tolerant_path():
    got = parse_response('{"action": "eating"\n"objects": ["caf\\u00e9 table", "say \\"hi\\""]}')
    assert got["objects"] == ["caf\u00e9 table", 'say "hi"']
    assert "missing_commas" in got["notes"]


def test_inner_quotes_and_apostrophes_stay_in_strings():
    got = parse_response("{'action': 'talking', 'objects': ['man', 'woman'], 'dense caption': "
                         "'The man's sign says \"open\" today.'}")
    assert got["caption"] == 'The man\'s sign says "open" today.'


def test_first_usable_object_is_taken():
    got = parse_response('Format: {like this}. Answer: {"action": "running"} and {"action": '
                         '"walking"}')
    assert got["action"] == "running"
    assert "prose_around_json" in got["notes"]


def test_python_code_is_never_evaluated(tmp_path):
    marker = tmp_path / "ran"
    text = "{'action': __import__('pathlib').Path(%r).touch()}" % str(marker)
    with pytest.raises(ParseError):
        parse_response(text)
    assert not marker.exists()


def test_parse_error_is_a_value_error_with_a_reason():
    with pytest.raises(ValueError, match="no_json"):
        parse_response("No objects visible.")
    with pytest.raises(ParseError, match="not an object"):
        parse_response("[1, 2]")
    with pytest.raises(TypeError, match="str"):
        parse_response(None)


def test_long_replies_parse_fast():
    import time
    objects = [f"object {i}" for i in range(10)]
    body = ", ".join(f'["object {i % 10}", "next to number {i}", "object {(i + 1) % 10}"]'
                     for i in range(2000))
    text = ("noise { " * 10) + '{"action": "x" "objects": %s "relations": [%s]}' % (
        json.dumps(objects), body)
    start = time.perf_counter()
    got = parse_response(text)
    assert len(got["relations"]) == 2000
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------- VLM wrappers

def _images(n):
    return [Image.new("RGB", (8, 8), (10 * i, 0, 0)) for i in range(n)]


def test_scripted_vlm_callable_and_sequence():
    vlm = ScriptedVLM(lambda i, image: f"{i}:{image.getpixel((0, 0))[0]}")
    assert vlm(_images(2)) == ["0:0", "1:10"]
    assert vlm(_images(1)) == ["2:0"]
    canned = ScriptedVLM(["a", "b"])
    assert canned(_images(2)) == ["a", "b"]
    with pytest.raises(IndexError, match="2 replies"):
        canned(_images(1))


def test_transformers_vlm_needs_a_local_model_folder(tmp_path):
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(FileNotFoundError, match="config.json") as info:
            TransformersVLM(str(path), device="cpu")
        assert "image-text-to-text" in str(info.value)
        assert "--vlm-trust-remote-code" in str(info.value)
