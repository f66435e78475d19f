"""sclaro_jax.bounds: the bounds checked before bytes (the commands that use them are run on
crafted files in tests/test_hostile_inputs.py)."""

import io

import numpy as np
import pytest
from PIL import Image

from sclaro_jax import bounds


def test_printable_escapes_control_characters_and_keeps_other_text():
    text = "a\x1b[2Jb\x07c\u202ed\ne\x00f\u2028g\ud800 é ü 中 tab\there"
    out = bounds.printable(text)
    assert out == "a\\x1b[2Jb\\x07c\\u202ed\\ne\\x00f\\u2028g\\ud800 é ü 中 tab\\there"
    assert not bounds.has_control(out)
    assert bounds.printable("plain text") == "plain text"


def test_label_problem_names_length_then_control_characters(monkeypatch):
    assert bounds.label_problem("traffic light") is None
    assert bounds.label_problem("x" * 257) == "long_label"
    assert bounds.label_problem("ca\x1bt") == "control_characters"
    assert bounds.label_problem("ca\u202et") == "control_characters"
    monkeypatch.setenv("SCLARO_MAX_LABEL_CHARS", "5")
    assert bounds.label_problem("person") == "long_label"
    monkeypatch.setenv("SCLARO_MAX_LABEL_CHARS", "0")
    with pytest.raises(bounds.BoundsError, match="SCLARO_MAX_LABEL_CHARS='0'"):
        bounds.label_problem("person")


def test_read_json_refuses_past_its_limit_and_deep_nesting(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    path.write_text('{"a": [1, 2, 3]}')
    assert bounds.read_json(path) == {"a": [1, 2, 3]}
    with pytest.raises(bounds.BoundsError, match="16 bytes, over the 10 byte limit"):
        bounds.read_json(path, limit=10)
    monkeypatch.setenv("SCLARO_MAX_JSON_BYTES", "15")
    with pytest.raises(bounds.BoundsError, match="SCLARO_MAX_JSON_BYTES=BYTES"):
        bounds.read_json(path)
    with pytest.raises(bounds.BoundsError, match="over the 1,000 byte limit"):
        bounds.read_json("/dev/zero", limit=1000)   # a size that says nothing, and grows
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(bounds.BoundsError, match="nested too deep"):
        bounds.read_json(path, limit=1 << 20)


def test_open_image_checks_the_header_against_pillows_limit(monkeypatch):
    buf = io.BytesIO()
    Image.fromarray(np.zeros((40, 50, 3), np.uint8)).save(buf, format="PNG")
    assert bounds.open_image(io.BytesIO(buf.getvalue()), "x").size == (50, 40)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 999)   # the bound: 1998 pixels
    with pytest.raises(bounds.BoundsError, match="photo: .*2000 pixels.*1998 pixels"):
        bounds.open_image(io.BytesIO(buf.getvalue()), "photo")   # Pillow's check, named
    with pytest.raises(bounds.BoundsError, match="photo: 50x40 is 2,000 pixels, over the 1,998"):
        bounds.check_pixels(50, 40, "photo")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    bounds.check_pixels(60000, 60000, "no bound")
