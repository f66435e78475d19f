"""The parsers bench/fuzz.py fuzzes, on the inputs that crashed them (tests/data/fuzz/<target>/, as
the fuzzer saved them; those named `*-by-hand` written by hand), on the reply parser's worst
cases found by hand (nesting, digits, quadratic runs), in a short derandomized hypothesis pass
over every target; and the harness itself: a segmentation fault, a hang and an exception each
reported with the input saved.

A crash is what bench/fuzz.py calls one: an exception other than the target's refusal types
(`fuzz.crash_of`). Every saved input is kept: each crash it found is fixed in its reader.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# bench/fuzz.py by its path: bench/ on sys.path would shadow other tests' modules.
_spec = importlib.util.spec_from_file_location("bench_fuzz", ROOT / "bench" / "fuzz.py")
fuzz = sys.modules["bench_fuzz"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

CORPUS = ROOT / "tests" / "data" / "fuzz"
REPLY_PARSERS = ("vlm_reply", "loose_json")
EXAMPLES = 60  # per target in the hypothesis pass


def _replay(target: str, *paths, timeout: int = 20) -> subprocess.CompletedProcess:
    """bench/fuzz.py --replay in a process of its own, its scratch folder removed here (a fatal
    input ends the process before it could)."""
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz.py"), "--target",
                               target, "--timeout", str(timeout), "--scratch", scratch,
                               "--replay", *map(str, paths)],
                              capture_output=True, text=True, timeout=timeout + 120)


def _corpus():
    for folder in sorted(p for p in CORPUS.iterdir() if p.is_dir()):
        for path in sorted(folder.iterdir()):
            yield pytest.param(folder.name, path, id=f"{folder.name}/{path.name}")


@pytest.mark.parametrize("target,path", list(_corpus()))
def test_an_input_that_crashed_a_target_is_read_or_refused(target, path):
    """`exception-*`: an exception the target does not document; `fatal-*` (a fatal signal or
    a hang: it would end this process) replayed in a process of its own."""
    if path.name.startswith("fatal-"):
        proc = _replay(target, path)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        return
    crash = fuzz.crash_of(target, path.read_bytes())
    assert crash is None, f"{crash[0]}: {crash[1]!r}"


# ----------------------------------------------------------------------- found by hand

DEEP = 100_000  # past the recursion limit, json's C scanner's included
HAND = {
    "json-nested-past-the-recursion-limit": b'{"action": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "unclosed-nesting-json-then-loose": b'{"objects": [' + b"[" * DEEP,
    "python-tuples-nested-past-the-recursion-limit": b"{objects: (" + b"(" * 5000,
    "json-integer-past-the-digit-limit": b'{"action": ' + b"7" * 5000 + b"}",
    "loose-integer-past-the-digit-limit": b"{action: " + b"7" * 5000,
}


@pytest.mark.parametrize("target", REPLY_PARSERS)
@pytest.mark.parametrize("name", HAND)
def test_nesting_and_long_numbers_are_read(target, name):
    crash = fuzz.crash_of(target, HAND[name])
    assert crash is None, f"{crash[0]}: {crash[1]!r}"


def test_nesting_past_the_limit_is_cut_like_a_syntax_error_and_keeps_what_came_before():
    from data_prep.loose_json import MAX_DEPTH, Notes, parse_at
    from data_prep.vlm import parse_response
    got = parse_response('{"objects": ["cup", ' + "[" * 200 + "]" * 200 + "]}")
    assert got["objects"] == ["cup"] and "cut_at_syntax_error" in got["notes"]
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH  # exactly the limit: json reads it whole
    notes = Notes()
    assert parse_at(deepest, 0, notes) == (json.loads(deepest), len(deepest)) and not notes
    value, end = parse_at("[" + deepest + "]", 0, notes)
    assert end is None and value == json.loads(deepest) and notes == ["cut_at_syntax_error"]


def test_numbers_read_as_json_would_or_as_floats_past_the_digit_limit():
    from data_prep.loose_json import Notes, parse_at
    assert parse_at("[01, -2, 3.5e1, 4]", 0, Notes())[0] == [1, -2, 35.0, 4]
    value, _ = parse_at("[" + "9" * 5000 + "]", 0, Notes())
    assert value == [math.inf]
    assert parse_at("{'a': " + "9" * 5000, 0, Notes())[0] == {"a": math.inf}


def test_a_value_cut_before_it_began_is_none():
    from data_prep.loose_json import Notes, parse_at
    for text, note in (("", "truncated"), ("nope", "cut_at_syntax_error"),
                       ('"open', "truncated")):
        notes = Notes()
        assert parse_at(text, 0, notes) == (None, None) and notes == [note], text


LINEAR = {  # quadratic before: 25 s and 15 s on the development machine (loaded)
    "a bare key running into spaces": "{a" + " " * 100_000,
    "20,000 distinct objects": '{"objects": %s}' % json.dumps([f"o{i}" for i in range(20_000)]),
}


@pytest.mark.parametrize("name", LINEAR)
def test_long_replies_take_linear_time(name):
    from data_prep.vlm import ParseError, parse_response
    start = time.perf_counter()
    try:
        got = parse_response(LINEAR[name])
        assert len(got["objects"]) == 10 and "objects_truncated" in got["notes"]
    except ParseError as e:
        assert e.reason == "no_json"
    assert time.perf_counter() - start < 1.0


def test_a_box_thinner_than_a_pixel_is_viewed_as_the_pixel_it_lies_in():
    """The record input `exception-box-narrower-than-a-pixel` as the writer and the pipeline
    see it: a box whose corners are in order but round to one column (PIL crops nothing) makes
    a one-pixel-wide view when the views are written and when a version-1 record is read."""
    import dataclasses

    from PIL import Image

    from data_prep import views
    from sclaro_jax.data import augment, pipeline, schema
    path = CORPUS / "record" / "exception-box-narrower-than-a-pixel"
    sample = schema.decode(path.read_bytes())
    box = sample.objects[1].box
    assert box[0] < box[2] and round(box[0]) == round(box[2])
    photo = schema.decode_image(sample.image)
    assert photo.crop(box).size[0] == 0 and augment.box_crop(photo, box).size == (1, 22)
    assert augment.box_crop(photo, (5.5, 5.5, 6.5, 6.5)).size == (1, 1)  # round half to even
    assert augment.box_crop(photo, (47.6, 0, 47.9, 5)).size == (1, 5)  # at the right edge
    wide = Image.new("RGB", (9, 9))
    assert augment.box_crop(wide, (1.2, 2.6, 7.4, 8.2)).size == wide.crop(
        (1.2, 2.6, 7.4, 8.2)).size == (6, 5)  # as PIL crops it, where PIL's crop is not empty
    _, _, got = pipeline.sample_views(sample, pipeline.PipelineConfig(image_size=16,
                                                                      train=False))
    assert got["objects"].shape == (2, 16, 16, 3)
    written = views.with_views(dataclasses.replace(sample, relations=()), 16)
    assert written.objects[1].view is not None


# ----------------------------------------------------------------------- hypothesis pass

@pytest.mark.slow
@pytest.mark.parametrize("target", [t for t in fuzz.ALL if t != "torch_file"])
def test_a_short_hypothesis_pass_finds_no_crash(target):
    found = fuzz.hypothesis_pass(target, EXAMPLES)
    assert not found, [(sig, data[:200]) for sig, data in found]


@pytest.mark.slow
def test_a_short_hypothesis_pass_finds_no_crash_in_torch_files(tmp_path):
    """In a process of its own: a tensor reaching past its storage can end the process."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz.py"), "--target",
                           "torch_file", "--hypothesis", str(EXAMPLES), "--crashes",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


# ----------------------------------------------------------------------- the harness

def test_replay_tells_a_crash_from_a_refusal(tmp_path):
    for name in ("RAISE", "REFUSE", "fine"):
        (tmp_path / name).write_bytes(name.encode())
    proc = _replay("selftest", tmp_path / "REFUSE", tmp_path / "fine")
    assert proc.returncode == 0 and proc.stdout.count("ok (read or refused)") == 2, proc.stdout
    proc = _replay("selftest", tmp_path / "RAISE")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "CRASH RuntimeError at bench/fuzz.py" in proc.stdout
    assert "Traceback" in proc.stderr


@pytest.mark.slow
def test_the_fuzzer_reports_a_segfault_a_hang_and_an_exception_with_their_inputs(tmp_path):
    pytest.importorskip("atheris")
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fuzz.py"), "--target", "selftest", "--runs",
         "40", "--timeout", "2", "--minutes", "2", "--corpus", str(tmp_path / "corpus"),
         "--crashes", str(tmp_path / "crashes"), "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (result,) = json.loads(out.read_text())
    saved = {sig.split(" at ")[0]: Path(entry["file"]).read_bytes()
             for sig, entry in result["signatures"].items()}
    assert saved == {"crash: Segmentation fault": b"SEGV", "timeout: Timeout": b"HANG",
                     "RuntimeError": b"RAISE"}, result
    assert result["inputs"] == 3 and result["restarts"] == 2 and result["executions"] >= 40
    assert "| selftest |" in proc.stdout
