"""`python -m data_prep demo-models`: the annotate command it prints runs, in this process, on
what it wrote (tiny random models, demo photographs, replies) and writes a record per
photograph; a second run into the same folder is refused without --overwrite, and with it
replaces only what it wrote."""

import contextlib
import io
import json
import shlex
from pathlib import Path

import pytest

from data_prep.__main__ import main

PHOTOS = 2
README = Path(__file__).resolve().parents[1] / "README.md"


def _run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo_models")
    code, out, err = _run(["demo-models", "--out", str(folder), "--photos", str(PHOTOS)])
    assert code == 0, err
    return folder, out


def test_the_printed_annotate_command_writes_a_record_per_photograph(written):
    folder, out = written
    assert "RANDOM" in out and "not for making data" in out
    command = [line for line in out.splitlines() if line.startswith("python -m data_prep ")]
    assert len(command) == 1, out
    argv = shlex.split(command[0])
    assert argv[:4] == ["python", "-m", "data_prep", "annotate"] and "tiny" in argv
    assert len(list((folder / "photos").iterdir())) == PHOTOS
    code, out, err = _run(argv[3:])  # exactly the printed command
    assert code == 0, err
    assert f"{PHOTOS} images: {PHOTOS} kept" in out
    manifest = json.loads((folder / "sclaro" / "manifest.json").read_text())
    assert manifest["records"] == PHOTOS


def test_an_existing_folder_is_refused_without_overwrite(written):
    folder, _ = written
    before = sorted(p.name for p in folder.iterdir())
    code, out, err = _run(["demo-models", "--out", str(folder), "--photos", "1"])
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "--overwrite" in err, err
    assert len(list((folder / "photos").iterdir())) == PHOTOS  # untouched
    # --overwrite replaces what demo-models writes and leaves the rest of the folder
    (folder / "notes.txt").write_text("mine")
    code, out, err = _run(["demo-models", "--out", str(folder), "--photos", str(PHOTOS),
                           "--overwrite"])
    assert code == 0, err
    assert sorted(p.name for p in folder.iterdir()) == sorted(before + ["notes.txt"])
    assert (folder / "notes.txt").read_text() == "mine"


def test_readme_shows_the_command_that_demo_models_prints():
    from data_prep.demo_models import annotate_command
    text = README.read_text(encoding="utf-8").replace("\\\n", " ")
    shown = [shlex.split(line) for line in text.splitlines() if "--sam-type tiny" in line]
    assert shown == [shlex.split(annotate_command("/tmp/models"))]
