"""The pages: README.md is a newcomer's page (at most 300 lines; its first block, the two
commands, is the first thing after the opening paragraph, and its test command is the one
.ci/run runs); every page README.md and docs/*.md link to exists; and every command that they
show in a ```bash / ```sh block answers --help, naming each flag the pages use with it.

The --help runs happen in one subprocess, a driver that runs each entry point in turn
(`runpy`, catching SystemExit) and records its exit status and output: importing jax costs
seconds per process, and the pages name about twenty entry points. The entry points that
tests/test_layout.py used to run one process each (the launcher, `python -m data_prep` and its
sub-commands, the evaluation and export modules) are REQUIRED here, whether a page names them
or not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 300
DEMO_COMMAND = ('pip install -c constraints.txt -e ".[demo]" && python launch/train.py '
                '--config configs/scenarioclip.py:demo --workdir /tmp/sclaro_demo')
TEST_COMMAND = ('pip install -c constraints.txt -e ".[test]" && '
                'python -m pytest -q -n 2 --dist loadfile')

SHELL_BLOCKS = ("bash", "sh", "shell")
# modules whose first positional argument is a sub-command: `python -m data_prep SUB` -> SUB --help
SUBCOMMANDS = ("data_prep", "data_prep.clip_benchmark", "sclaro_jax.miner.index")
# other projects' commands that the pages run (the test command): importable, not run here
EXTERNAL = ("pytest",)
DATA_PREP_COMMANDS = ("demo", "demo-models", "annotate", "import", "curate", "reshard", "rocs")
# (kind, target, argv) that answer --help whatever the pages name; with text their output holds
REQUIRED = {
    ("path", "launch/train.py", ("--help",)): "--workdir",
    ("module", "data_prep", ("--help",)): "annotation pipeline",
    **{("module", "data_prep", (c, "--help")): f"usage: python -m data_prep {c}"
       for c in DATA_PREP_COMMANDS},
    **{("module", m, ("--help",)): "usage: python -m " + m
       for m in ("sclaro_jax.eval.rocs", "sclaro_jax.eval.suite",
                 "sclaro_jax.eval.retrieval.synthetic", "sclaro_jax.eval.detect",
                 "sclaro_jax.export.wds", "sclaro_jax.train.export")},
}


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


# ---- reading the pages


def code_blocks(text: str, langs=SHELL_BLOCKS) -> list[list[str]]:
    """The lines of each fenced block whose info string is one of `langs`, in page order."""
    blocks, current, lang = [], None, ""
    for line in text.splitlines():
        fence = line.lstrip().startswith("```")
        if current is None and fence:
            current, lang = [], line.lstrip()[3:].strip().split(" ")[0]
        elif current is not None and fence:
            if lang in langs:
                blocks.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def strip_comment(line: str) -> str:
    """`line` without a shell comment: a `#` that starts a word, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def command_lines(block: list[str]) -> list[str]:
    """A block's commands, one string each: comments stripped, `\\` continuations joined."""
    out, pending = [], ""
    for raw in block:
        line = strip_comment(raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            out.append(line)
    return out


def commands(text: str) -> list[list[str]]:
    """Every command of the page's shell blocks as an argv list; `a && b`, `a; b` and `a | b`
    are two commands each."""
    found = []
    for block in code_blocks(text):
        for line in command_lines(block):
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, ""
            argv = []
            for token in [*lexer, ";"]:
                if token in ("&&", "||", ";", "|", "&"):
                    if argv:
                        found.append(argv)
                    argv = []
                else:
                    argv.append(token)
    return found


def console_scripts() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"].get("scripts", {})


def entry_point(argv: list[str], scripts: dict[str, str]):
    """(kind, target, help argv) of a command to check, or None for one that is not ours (pip,
    ray, ...): `python path.py` -> path; `python -m M [SUB]` -> module (SUB --help where M takes
    sub-commands; kind "external" for EXTERNAL modules); a console script of pyproject.toml ->
    script, its "module:function"; `bash path.sh` -> bash."""
    if argv[0] in ("python", "python3") and len(argv) > 1:
        if argv[1] == "-m" and len(argv) > 2:
            module, rest = argv[2], argv[3:]
            if module in EXTERNAL:
                return ("external", module, ())
            sub = (rest[0],) if module in SUBCOMMANDS and rest and not rest[0].startswith("-") \
                else ()
            return ("module", module, (*sub, "--help"))
        if argv[1].endswith(".py"):
            return ("path", argv[1], ("--help",))
        return None
    if argv[0] in scripts:
        return ("script", f"{argv[0]}={scripts[argv[0]]}", ("--help",))
    if argv[0] == "bash" and len(argv) > 1 and argv[1].endswith(".sh"):
        return ("bash", argv[1], ("--help",))
    return None


def flags_used(argv: list[str]) -> set[str]:
    """The long flags a command passes (`--x-y=1` -> `--x-y`), less the launcher's
    `--config.KEY=VALUE` overrides (the recipe's keys, not flags)."""
    return {a.split("=", 1)[0] for a in argv
            if a.startswith("--") and len(a) > 2 and not a.startswith("--config.")}


def documented(paths=None) -> dict[tuple, dict]:
    """entry point -> {"pages": where it is shown, "flags": the flags used with it}."""
    scripts, found = console_scripts(), {}
    for path in paths or pages():
        for argv in commands(path.read_text(encoding="utf-8")):
            entry = entry_point(argv, scripts)
            if entry:
                seen = found.setdefault(entry, {"pages": set(), "flags": set()})
                seen["pages"].add(path.name)
                seen["flags"] |= flags_used(argv)
    return found


# ---- running --help

DRIVER = r'''
import contextlib, importlib, io, json, runpy, subprocess, sys, traceback

def absl_flags():
    module = sys.modules.get("absl.flags")
    return module.FLAGS if module else None

import absl.app, absl.logging  # their own flags are there before any entry runs
results = []
for kind, target, argv in json.load(open(sys.argv[1])):
    out, err, code = io.StringIO(), io.StringIO(), 0
    flags = absl_flags()
    known = set(flags) if flags is not None else set()
    saved = sys.argv[:]
    if kind == "bash":
        run = subprocess.run(["bash", target, *argv], capture_output=True, text=True, timeout=60)
        code = run.returncode
        out.write(run.stdout), err.write(run.stderr)
    else:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if kind == "module":
                    sys.argv = [target, *argv]
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                elif kind == "path":
                    sys.argv = [target, *argv]
                    runpy.run_path(target, run_name="__main__")
                elif kind == "script":  # NAME=module:function, as the installed script runs it
                    name, _, func = target.partition("=")
                    module, _, attr = func.partition(":")
                    sys.argv = [name, *argv]
                    getattr(importlib.import_module(module), attr)()
                else:
                    raise ValueError(f"unknown kind {kind}")
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = "raised"
            finally:
                sys.argv = saved
    flags = absl_flags()
    if flags is not None:  # the launcher defines absl flags; the next entry defines them anew
        for name in set(flags) - known:
            if name in flags:
                delattr(flags, name)
    results.append({"entry": [kind, target, argv], "code": code, "stdout": out.getvalue(),
                    "stderr": err.getvalue()[-3000:]})
json.dump(results, open(sys.argv[2], "w"))
'''


def run_help(entries, tmp: Path, timeout: int = 600) -> dict[tuple, dict]:
    """entry -> {"code", "stdout", "stderr"}: each entry's --help, all in one subprocess."""
    spec, out = tmp / "entries.json", tmp / "results.json"
    spec.write_text(json.dumps([[k, t, list(a)] for k, t, a in entries]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(spec), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return {(r["entry"][0], r["entry"][1], tuple(r["entry"][2])): r
            for r in json.loads(out.read_text())}


USAGE = re.compile(r"usage:|^\s*--\w", re.IGNORECASE | re.MULTILINE)
HELP_FLAG = re.compile(r"--(?:\[no-?\])?([A-Za-z0-9][\w-]*)")


def missing_flags(used: set[str], help_text: str) -> list[str]:
    """The flags of `used` that `help_text` does not name (hyphens and underscores alike;
    `--no-x` is named by `--x` too: argparse's and absl's negations)."""
    named = {m.replace("-", "_") for m in HELP_FLAG.findall(help_text)}
    missing = []
    for flag in sorted(used):
        name = flag[2:].replace("-", "_")
        if name not in named and not (name.startswith("no_") and name[3:] in named):
            missing.append(flag)
    return missing


def help_problems(entry, result: dict, flags=(), expect: str | None = None) -> list[str]:
    text = result["stdout"]
    problems = []
    if result["code"] != 0:
        problems.append(f"exit {result['code']}: {result['stderr'][-1500:]}")
    elif not USAGE.search(text):
        problems.append(f"no usage text in its --help: {text[:300]!r}")
    if expect and expect not in text:
        problems.append(f"--help does not say {expect!r}")
    if result["code"] == 0 and (missing := missing_flags(set(flags), text)):
        problems.append(f"--help names no {', '.join(missing)}")
    return [f"{' '.join(entry[1:2] + entry[2])}: {p}" for p in problems]


@pytest.fixture(scope="module")
def shown():
    return documented()


# ---- the faults: every command README names, run with a typo flag, a wrong type, a missing
# input and an unwritable output (None: the command has none, and why). {tmp} is a fresh
# folder; {missing} does not exist; /proc takes no new files, even from root.

LAUNCH = ("--config", "scenarioclip:demo", "--workdir", "{tmp}/run")
_LAUNCHER_FAULTS = {
    "typo": ("--config", "scenarioclip:demo", "--workdr", "{tmp}/run"),
    "type": (*LAUNCH, "--config.data.batch_size=x"),
    "missing": (*LAUNCH, "--config.data.dir={missing}"),
    "unwritable": ("--config", "scenarioclip:demo", "--workdir", "/proc/sclaro/run"),
}
FAULTS = {
    ("path", "launch/train.py", ()): _LAUNCHER_FAULTS,
    ("script", "sclaro-train=launch.train:console", ()): _LAUNCHER_FAULTS,
    ("module", "data_prep", ("annotate",)): {
        "typo": ("annotate", "--sorce", "folder", "--root", "{tmp}", "--out", "{tmp}/ds"),
        "type": ("annotate", "--root", "{tmp}", "--out", "{tmp}/ds", "--retries", "x"),
        "missing": ("annotate", "--root", "{missing}", "--out", "{tmp}/ds", "--vlm-replies",
                    "{missing}/replies.json", "--detector", "{missing}/gdino", "--sam",
                    "{missing}/sam.pth"),
        "unwritable": ("annotate", "--root", "{tmp}", "--out", "/proc/sclaro/ds"),
    },
    ("module", "data_prep", ("import",)): {
        "typo": ("import", "--sorce", "psg", "--root", "{tmp}", "--out", "{tmp}/psg"),
        "type": ("import", "--source", "psg", "--root", "{tmp}", "--out", "{tmp}/psg",
                 "--limit", "x"),
        "missing": ("import", "--source", "psg", "--root", "{missing}", "--out", "{tmp}/psg"),
        "unwritable": ("import", "--source", "psg", "--root", "{tmp}", "--out",
                       "/proc/sclaro/psg"),
    },
    ("module", "data_prep", ("demo-models",)): {
        "typo": ("demo-models", "--outt", "{tmp}/models"),
        "type": ("demo-models", "--out", "{tmp}/models", "--photos", "x"),
        "missing": None,  # writes from the bundled demo
        "unwritable": ("demo-models", "--out", "/proc/sclaro/models"),
    },
    ("module", "data_prep", ("curate",)): {
        "typo": ("curate", "--dta", "{tmp}", "--out", "{tmp}/cur"),
        "type": ("curate", "--data", "{tmp}", "--out", "{tmp}/cur", "--min-samples", "x"),
        "missing": ("curate", "--data", "{missing}", "--out", "{tmp}/cur"),
        "unwritable": ("curate", "--data", "{tmp}", "--out", "/proc/sclaro/cur"),
    },
    ("module", "sclaro_jax.eval.suite", ()): {
        "typo": ("--workdr", "{tmp}"),
        "type": ("--workdir", "{tmp}", "--batch-size", "x"),
        "missing": ("--workdir", "{missing}"),
        "unwritable": ("--workdir", "{tmp}", "--out", "/proc/sclaro/eval"),
    },
    ("module", "sclaro_jax.eval.retrieval.synthetic", ()): {
        "typo": ("--outt", "{tmp}/planted"),
        "type": ("--out", "{tmp}/planted", "--num-images", "x"),
        "missing": None,  # writes a benchmark from nothing
        "unwritable": ("--out", "/proc/sclaro/planted"),
    },
    ("module", "sclaro_jax.eval.rocs", ()): {
        "typo": ("--modl", "planted-colours", "--split", "{tmp}/captions.json"),
        "type": ("--model", "planted-colours", "--split", "{tmp}/captions.json", "--k", "x"),
        "missing": ("--model", "planted-colours", "--split", "{missing}/captions.json",
                    "--out", "{tmp}/rocs"),
        "unwritable": ("--model", "planted-colours", "--split", "{tmp}/captions.json", "--out",
                       "/proc/sclaro/rocs"),
    },
    ("module", "sclaro_jax.miner.index", ("build",)): {
        "typo": ("build", "--imagse", "{tmp}/g.npy", "--out", "{tmp}/idx"),
        "type": ("build", "--images", "{tmp}/g.npy", "--out", "{tmp}/idx", "--chunk", "x"),
        "missing": ("build", "--images", "{missing}/g.npy", "--bank", "{missing}/b.npy",
                    "--out", "{tmp}/idx"),
        "unwritable": ("build", "--images", "{tmp}/g.npy", "--out", "/proc/sclaro/idx"),
    },
    ("module", "sclaro_jax.eval.detect", ()): {
        "typo": ("--workdr", "{tmp}"),
        "type": ("--workdir", "{tmp}", "--config", "detection:demo", "--config.epochs=x"),
        "missing": ("--workdir", "{missing}"),
        "unwritable": None,  # writes only into --workdir, the run it reads
    },
    ("module", "sclaro_jax.train.export", ()): {
        "typo": ("--workdr", "{tmp}", "--level", "object", "--out", "{tmp}/export"),
        "type": ("--workdir", "{tmp}", "--level", "object", "--out", "{tmp}/export", "--step",
                 "x"),
        "missing": ("--workdir", "{missing}", "--level", "object", "--out", "{tmp}/export"),
        "unwritable": ("--workdir", "{tmp}", "--level", "object", "--out",
                       "/proc/sclaro/export"),
    },
    ("module", "sclaro_jax.export.wds", ()): {
        "typo": ("--dta", "{tmp}", "--out", "{tmp}/wds"),
        "type": ("--data", "{tmp}", "--out", "{tmp}/wds", "--shard-size", "x"),
        "missing": ("--data", "{missing}", "--out", "{tmp}/wds"),
        "unwritable": ("--data", "{tmp}", "--out", "/proc/sclaro/wds"),
    },
    ("bash", "bench/gpu_session.sh", ()): {
        "typo": ("--tinyy", "--out", "{tmp}/gpu"),
        "type": ("--tiny", "--out", "{tmp}/gpu", "--budget", "x"),
        "missing": None,  # makes its own data
        "unwritable": ("--tiny", "--out", "/proc/sclaro/gpu"),
    },
}
FAULT_KINDS = ("typo", "type", "missing", "unwritable")


def fault_entries(tmp: Path) -> dict[tuple, tuple[tuple, str]]:
    """(kind, target, argv) to run -> (its FAULTS key, the fault)."""
    out = {}
    for key, faults in FAULTS.items():
        for fault, argv in faults.items():
            if argv is not None:
                filled = tuple(a.format(tmp=tmp, missing=tmp / "missing") for a in argv)
                out[(key[0], key[1], filled)] = (key, fault)
    return out


@pytest.fixture(scope="module")
def fault_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def helped(shown, fault_tmp, tmp_path_factory):
    """Every --help run and every fault run, in one driver process."""
    entries = sorted({*(e for e in shown if e[0] != "external"), *REQUIRED,
                      *fault_entries(fault_tmp)})
    return run_help(entries, tmp_path_factory.mktemp("help"))


# ---- the tests


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
    first_fence = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert lines[first_fence] == "```bash", "README's first block is not a bash block"
    assert not any(line.startswith("#") for line in lines[1:first_fence]), (
        "a heading comes between the opening paragraph and the two commands")
    first = code_blocks(text)[0]
    assert [line for line in first if line.strip() and not line.startswith("#")] == [
        DEMO_COMMAND, TEST_COMMAND]
    assert all(line.startswith("# ") for line in first if line.strip()
               and line not in (DEMO_COMMAND, TEST_COMMAND)), "comment lines only beside them"


def test_ci_runs_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    last = [line.strip() for line in ci if line.strip() and not line.lstrip().startswith("#")][-1]
    assert last == TEST_COMMAND


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_linked_page_exists(page):
    text = page.read_text(encoding="utf-8")
    targets = [t for t in LINK.findall(text)
               if "://" not in t and not t.startswith(("#", "mailto:"))]
    missing = [t for t in targets if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"
    if page == README:
        docs = {p.name for p in (ROOT / "docs").glob("*.md")}
        linked = {Path(t.split("#")[0]).name for t in targets if t.startswith("docs/")}
        assert docs <= linked, f"README does not link {sorted(docs - linked)}"


def test_pages_show_the_main_commands(shown):
    assert len(shown) >= 15, sorted(shown)
    external = {e[1] for e in shown if e[0] == "external"}
    assert all(importlib.util.find_spec(m) for m in external), external


@pytest.mark.slow
def test_every_command_in_the_pages_answers_help(shown, helped):
    problems = []
    for entry in sorted({*shown, *REQUIRED}):
        if entry[0] == "external":
            continue
        problems += help_problems(entry, helped[entry], shown.get(entry, {}).get("flags", ()),
                                  REQUIRED.get(entry))
    assert not problems, "\n".join(problems)


PLANTED = """# A page

Prose names `python -m sclaro_jax.eval.prose_only`, which is not a command block.

```bash
# a comment: python -m sclaro_jax.eval.in_a_comment
pip install -e ".[demo]" && python -m sclaro_jax.eval.planted --out /tmp/x \\
    --two-words "a # b" --k 3   # trailing comment --not-a-flag
python -m data_prep curate --data D --out O
sclaro-train --config scenarioclip:demo --workdir W --config.train.steps=2
python launch/train.py --help
ray start --head
```

```python
import os  # python -m sclaro_jax.eval.in_python
```
"""


def test_extractor_finds_the_planted_commands(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PLANTED)
    found = documented([page])
    assert set(found) == {
        ("module", "sclaro_jax.eval.planted", ("--help",)),
        ("module", "data_prep", ("curate", "--help")),
        ("script", "sclaro-train=launch.train:console", ("--help",)),
        ("path", "launch/train.py", ("--help",)),
    }
    assert found[("module", "sclaro_jax.eval.planted", ("--help",))]["flags"] == {
        "--out", "--two-words", "--k"}
    assert found[("script", "sclaro-train=launch.train:console", ("--help",))]["flags"] == {
        "--config", "--workdir"}


def test_driver_fails_a_planted_bad_command_and_a_missing_flag(tmp_path):
    good = ("module", "json.tool", ("--help",))
    bad = ("module", "sclaro_jax.eval.nosuch", ("--help",))
    results = run_help([good, bad], tmp_path, timeout=120)
    assert not help_problems(good, results[good], {"--indent", "--no-ensure-ascii"})
    assert help_problems(bad, results[bad]) and results[bad]["code"] != 0
    assert "No module named" in results[bad]["stderr"]
    assert help_problems(good, results[good], {"--no-such-flag"}) == [
        "json.tool --help: --help names no --no-such-flag"]


def readme_entries() -> set[tuple]:
    """(kind, target, sub-command) of each command README names (not other projects')."""
    return {(k, t, argv[:-1]) for k, t, argv in documented([README]) if k != "external"}


def test_every_readme_command_has_a_row_of_faults():
    assert readme_entries() == set(FAULTS), "README's commands and FAULTS differ"
    assert all(tuple(faults) == FAULT_KINDS for faults in FAULTS.values())
    assert all(faults["typo"] and faults["type"] for faults in FAULTS.values())


@pytest.mark.slow
def test_every_readme_command_answers_each_fault_in_one_error_line(helped, fault_tmp):
    """Exit 2, nothing on stdout, one stderr line, `error: ...`, no traceback; usage errors
    (typo, type) end with `(see PROG --help)`, a typo gets the closest flag; a missing input
    and an unwritable output are named."""
    problems = []
    for entry, (key, fault) in fault_entries(fault_tmp).items():
        result = helped[entry]
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        where = f"{' '.join((entry[1],) + entry[2])} [{fault}]"
        line = lines[-1] if lines else ""
        if result["code"] != 2 or len(lines) != 1 or not line.startswith("error: ") \
                or result["stdout"].strip():
            problems.append(f"{where}: exit {result['code']}, stdout "
                            f"{result['stdout'][-300:]!r}, stderr {result['stderr'][-600:]!r}")
            continue
        if fault in ("typo", "type") and not line.endswith("--help)"):
            problems.append(f"{where}: a usage error without (see ... --help): {line}")
        if fault == "typo" and "did you mean --" not in line:
            problems.append(f"{where}: no suggestion: {line}")
        if fault == "missing" and str(fault_tmp / "missing") not in line:
            problems.append(f"{where}: does not name the missing input: {line}")
        if fault == "unwritable" and "/proc/sclaro" not in line:
            problems.append(f"{where}: does not name the output: {line}")
    assert not problems, "\n".join(problems)
