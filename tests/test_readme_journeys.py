"""README's journeys, run as README writes them: every command is read from README.md's own
```bash blocks (and, past README's end of a journey, from the docs page README sends the reader
to), never typed again here, and run in a child process with this interpreter as `python`.

What a journey may add to README's command is limited to documented flags that make it small
enough for a CPU test (fewer steps, a smaller model, a smaller view): `SMALL` lists them, by the
command they go to. Absolute paths under /tmp, /data and /runs move into the test's own folder (/tmp/x to
TEST_FOLDER/tmp/x).
Commands no journey runs are in `NOT_RUN`, each with its reason (the installs: this test runs in
the installed environment; annotation with the real models: their weights are a download), and
`test_every_readme_command_is_run_or_named` fails on a README command that is in neither, so a new
journey cannot go untested by accident.

Journeys (module-scoped runs, each a chain whose steps read what the one before wrote):
- the demo: train -> the launcher's table -> every protocol of the suite -> one level exported
  -> loaded by transformers with docs/exports.md's own snippet; a split as a webdataset;
- the detector: the demo recipe trained -> its AP table -> evaluated again (`--eval-only`,
  the run's own recipe);
- PSG: an OpenPSG folder in the released layout (psg.json, COCO JPEGs, panoptic PNGs, COCO
  captions: `test_import_scene_graphs.write_psg_root`) -> README's import -> README's `:psg`
  training -> README's suite on test, ending with its table, with NLTK's data absent
  (`--no-actions`);
- MINER: the planted-colours benchmark -> ROCS -> an index of its cached gallery -> ROCS through
  the index.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT = 900

# The documented flags a journey adds to README's command, by the command's start: small
# enough for a CPU test, every one a flag or key README, --help or the recipe documents.
SMALL = {
    "python launch/train.py --config configs/scenarioclip.py:demo": [
        "--config.train.steps=2", "--no-progress"],
    "python launch/train.py --config configs/detection.py:demo": [
        "--config.epochs=1", "--config.batch_size=2", "--config.checkpoint_every=5",
        "--config.detector.image_size=64", "--config.detector.rpn_pre_nms_top_n_train=64",
        "--config.detector.rpn_post_nms_top_n_train=32",
        "--config.detector.box_batch_size_per_image=16", "--no-progress"],
    # 48 px, not the tiny preset's own 32: its vision tower follows data.image_size
    "python -m data_prep import --source psg": ["--no-actions", "--image-size", "48"],
    "python launch/train.py --config configs/scenarioclip.py:psg": [
        "--config.model.preset=tiny", "--config.data.image_size=48",
        "--config.data.batch_size=2", "--config.data.workers=0", "--config.train.steps=2",
        "--no-progress"],
    "python -m sclaro_jax.eval.suite": ["--no-progress"],
}

# README commands no journey runs, by their start, and why.
NOT_RUN = {
    "pip install": "the installs: the test runs in the installed environment",
    "python -m pytest": "the test suite itself",
    "sclaro-train": "the installed name of launch/train.py (tests/test_install.py runs it)",
    "python -m data_prep annotate --source folder --root photos/": (
        "annotation with the real GroundingDINO and SAM: their weights are a download; the "
        "tiny-model form below is tests/test_demo_models.py's"),
    "python -m data_prep demo-models": "tests/test_demo_models.py",
    "python -m data_prep annotate --root /tmp/models/photos": "tests/test_demo_models.py",
    "python -m data_prep curate --data sclaro/": (
        "curation of an annotated folder: tests/test_curate*.py (its pass 1 waits for a person)"),
    "python -m sclaro_jax.eval.detect": (
        "the alias of the launcher's --eval-only that the detector journey runs: "
        "tests/test_detection_train.py::test_eval_detect_evaluates_the_run_again_and_a_rerun_resumes"),
    "bash bench/gpu_session.sh --tiny": "tests/test_gpu_session.py (90 s of its own)",
}


# ----------------------------------------------------------------------------------- reading


def code_blocks(path: Path, language: str) -> list[str]:
    """The ```LANGUAGE blocks of a Markdown file, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M)


def commands(path: Path = README) -> list[str]:
    """The shell commands of a Markdown file's ```bash blocks: continuation lines joined,
    comments and blank lines dropped, `A && B` as two commands."""
    out = []
    for block in code_blocks(path, "bash"):
        line = ""
        for raw in block.splitlines():
            text = raw.strip()
            if not line and (not text or text.startswith("#")):
                continue
            if text.endswith("\\"):
                line += text[:-1].rstrip() + " "
                continue
            line += text
            out += [part.strip() for part in line.split(" && ")]
            line = ""
    return [re.sub(r"\s+#.*$", "", c).strip() for c in out]  # trailing comments


def readme(start: str, path: Path = README, *, having: str = "", lacking: str = "") -> str:
    """The one command of `path` that starts with `start` (and holds `having`, and not
    `lacking`); a command written twice counts once."""
    found = sorted({c for c in commands(path) if c.startswith(start) and having in c
                    and not (lacking and lacking in c)})
    assert len(found) == 1, f"{path.name}: {len(found)} commands start with {start!r}: {found}"
    return found[0]


def argv(command: str, where: Path) -> list[str]:
    """The command as a child's argv: `python` is this interpreter, absolute paths under /tmp,
    /data and /runs move into `where`, and the journey's `SMALL` flags are appended."""
    moved = re.sub(r"(?<![\w.])/(tmp|data|runs)/", lambda m: f"{where}/{m.group(1)}/", command)
    args = shlex.split(moved)
    if args[0] == "python":
        args[0] = sys.executable
    extra = [flags for start, flags in SMALL.items() if command.startswith(start)]
    return args + (extra[0] if extra else [])


def run(command: str, where: Path) -> subprocess.CompletedProcess:
    """README's `command`, run from the checkout; exit status 0 asserted."""
    result = subprocess.run(argv(command, where), cwd=ROOT, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-3000:])
    return result


def test_every_readme_command_is_run_or_named():
    """Each README command is run by a journey below or named in NOT_RUN with its reason."""
    run_here = set(JOURNEY_COMMANDS)
    for command in commands():
        ran = [s for s in run_here if command.startswith(s)]
        named = [s for s in NOT_RUN if command.startswith(s)]
        assert len(ran) + len(named) == 1, (command, ran, named)
    for start in [*run_here, *NOT_RUN]:  # none names a command README no longer has
        assert any(c.startswith(start) for c in commands()), start


def test_the_reader_joins_continuations_and_splits_chains(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```bash\n# a comment\npip install x && python a.py \\\n    --b c"
                    "   # trailing\n\npython -m d --out /tmp/e\n```\n```python\nprint(1)\n```\n")
    assert commands(page) == ["pip install x", "python a.py --b c", "python -m d --out /tmp/e"]
    assert argv(readme("python -m d", page), tmp_path) == [
        sys.executable, "-m", "d", "--out", f"{tmp_path}/tmp/e"]


# ------------------------------------------------------------------------------ the journeys

DEMO_TRAIN = "python launch/train.py --config configs/scenarioclip.py:demo"
DEMO_SUITE = "python -m sclaro_jax.eval.suite --workdir /tmp/sclaro_demo"
EXPORT = "python -m sclaro_jax.train.export --workdir /tmp/sclaro_demo"
WDS = "python -m sclaro_jax.export.wds"
DETECT_TRAIN = "python launch/train.py --config configs/detection.py:demo"
DETECT_EVAL = "python launch/train.py --workdir /tmp/detect_demo --eval-only"
PSG_IMPORT = "python -m data_prep import --source psg"
PSG_TRAIN = "python launch/train.py --config configs/scenarioclip.py:psg"
PSG_SUITE = "python -m sclaro_jax.eval.suite --workdir /runs/psg"
PLANTED = "python -m sclaro_jax.eval.retrieval.synthetic"
ROCS = "python -m sclaro_jax.eval.rocs --model planted-colours"
INDEX = "python -m sclaro_jax.miner.index build"
JOURNEY_COMMANDS = (DEMO_TRAIN, DEMO_SUITE, EXPORT, WDS, DETECT_TRAIN, DETECT_EVAL, PSG_IMPORT,
                    PSG_TRAIN, PSG_SUITE, PLANTED, ROCS, INDEX)


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    return tmp_path_factory.mktemp("journeys")


@pytest.fixture(scope="module")
def demo(where):
    """README's first command (after its install): the demo trained and evaluated."""
    return run(readme(DEMO_TRAIN), where)


@pytest.mark.slow
def test_the_demo_trains_and_prints_its_table_then_the_suite_evaluates_it(demo, where):
    workdir = where / "tmp" / "sclaro_demo"
    assert "done: 2 steps" in demo.stdout
    assert "| action.strict.all |" in demo.stdout
    assert f"results: {workdir / 'results.md'}" in demo.stdout
    assert json.loads((workdir / "results.json").read_text())["step"] == 2
    suite = run(readme(DEMO_SUITE), where)
    tables = (workdir / "eval" / "eval.md").read_text()
    assert tables.strip() and tables.strip().splitlines()[0] in suite.stdout
    assert {"zero_shot", "linear_probe", "predcls", "sgcls", "localisation"} <= set(json.loads(
        (workdir / "eval" / "eval.json").read_text())["models"]["sclaro_demo"])


@pytest.mark.slow
def test_an_exported_level_loads_in_transformers_with_the_docs_snippet(demo, where):
    run(readme(EXPORT), where)
    out = where / "tmp" / "object_level"
    assert (out / "model.safetensors").is_file()
    pytest.importorskip("transformers")
    from PIL import Image

    (snippet,) = [b for b in code_blocks(ROOT / "docs" / "exports.md", "python")
                  if "AutoModel.from_pretrained" in b]
    scope = {"image": Image.new("RGB", (48, 40), (200, 30, 40))}
    exec(snippet.replace('"/tmp/object_level"', repr(str(out))), scope)  # noqa: S102
    assert tuple(scope["image_emb"].shape) == tuple(scope["text_emb"].shape) == (1, 64)
    assert {s["label"] for s in scope["scores"]} == {"riding", "eating"}


@pytest.mark.slow
def test_a_split_becomes_a_webdataset(demo, where):
    run(readme(WDS), where)
    shards = sorted((where / "tmp" / "wds").rglob("*.tar"))
    assert shards and all(s.stat().st_size > 0 for s in shards)


@pytest.mark.slow
def test_the_detector_demo_ends_with_its_ap_table_and_evaluates_again(where):
    trained = run(readme(DETECT_TRAIN), where)
    workdir = where / "tmp" / "detect_demo"
    header = "| Model | AP | AP50 | AP75 | APr | APc | APf |"
    assert "done: 5 steps" in trained.stdout and header in trained.stdout
    first = json.loads((workdir / "results.json").read_text())
    again = run(readme(DETECT_EVAL), where)
    assert header in again.stdout
    assert json.loads((workdir / "results.json").read_text())["metrics"] == first["metrics"]


def _fake_nltk(monkeypatch):
    """NLTK's tagger and WordNet present, answering from the fixture's word lists
    (`test_import_scene_graphs.RULE`, `LEMMAS`): the import's own calls into nltk are made."""
    import nltk
    import nltk.stem
    from test_import_scene_graphs import LEMMAS, RULE

    class FakeWordNet:
        def lemmatize(self, word, pos):
            return LEMMAS[word] if pos == "v" else word
    monkeypatch.setattr(nltk.data, "find", lambda resource: resource)
    monkeypatch.setattr(nltk, "pos_tag", RULE[0])
    monkeypatch.setattr(nltk.stem, "WordNetLemmatizer", FakeWordNet)


@pytest.mark.slow
@pytest.mark.parametrize("nltk_data", ["absent", "faked"])
def test_psg_import_trains_and_the_suite_ends_with_its_table(nltk_data, tmp_path, monkeypatch):
    """README's three PSG commands on an OpenPSG folder in the released layout: the import, the
    `:psg` recipe for 2 steps with the tiny preset at the import's view size, then the suite
    with its default tasks, which prints its table and exits 0; localisation runs on the
    panoptic masks. NLTK's data absent: the import runs with `--no-actions` and the suite skips
    the action probe in one line; a protocol named with --tasks that cannot run stays an error,
    before any checkpoint is read. NLTK's data present (its tagger and WordNet answering from
    the fixture's word lists; the import is README's command line through `data_prep`'s main,
    in this process): action words are imported and every protocol runs."""
    from data_prep.__main__ import main as data_prep
    from test_import_scene_graphs import write_psg_root

    where = tmp_path
    write_psg_root(where / "data" / "openpsg")
    if nltk_data == "absent":
        run(readme(PSG_IMPORT), where)
    else:
        _fake_nltk(monkeypatch)
        args = argv(readme(PSG_IMPORT), where)
        assert args[1:4] == ["-m", "data_prep", "import"] and "--no-actions" in args
        assert data_prep([a for a in args[3:] if a != "--no-actions"] + ["--no-progress"]) == 0
    assert (where / "data" / "sclaro-psg" / "manifest.json").is_file()
    trained = run(readme(PSG_TRAIN), where)
    assert "done: 2 steps" in trained.stdout
    workdir = where / "runs" / "psg"
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").open()]
    assert max(steps) == 2
    assert "zero_shot" in json.loads((workdir / "results.json").read_text())["evaluators"]
    suite = run(readme(PSG_SUITE), where)
    skipped = [line for line in suite.stderr.splitlines() if "skipped" in line]
    out = workdir / "eval"
    assert (out / "eval.md").read_text().strip().splitlines()[0] in suite.stdout
    record = json.loads((out / "eval.json").read_text())
    (model,) = record["models"].values()
    assert model["step"] == 2 and model["split"] == "test"
    assert 0 <= model["zero_shot"]["object"]["strict"]["all"]["top1"] <= 100
    assert {"predcls", "sgcls"} <= set(model) and "### Linear probe" in suite.stdout
    assert set(model["localisation"]) == {"frozen", "trainable"}
    assert model["localisation"]["frozen"]["num_test"] == 1
    assert model["localisation"]["frozen"]["image_size"] == 48
    assert "attention_overlays" in record["figures"]
    if nltk_data == "faked":
        assert skipped == [] and "## Skipped" not in suite.stdout, suite.stderr[-3000:]
        assert set(model["linear_probe"]) == {"action", "object", "relation"}
        return
    assert skipped == ["linear probe (action): skipped, the train split has no action labels "
                       "(imported with --no-actions)"], suite.stderr[-3000:]
    assert "## Skipped" in suite.stdout
    assert set(model["linear_probe"]) == {"object", "relation"}
    named = subprocess.run(argv(readme(PSG_SUITE), where) + ["--tasks", "linear_probe"],
                           cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert named.returncode == 2 and "error: linear probe (action)" in named.stderr, named.stderr
    assert "loading the checkpoint" not in named.stderr


@pytest.mark.slow
def test_the_planted_benchmark_retrieves_through_its_index(where):
    pytest.importorskip("faiss")
    run(readme(PLANTED), where)
    exact = run(readme(ROCS, lacking="--index"), where)
    run(readme(INDEX), where)
    indexed = run(readme(ROCS, having="--index"), where)
    assert exact.stdout.strip() and indexed.stdout.strip()
