"""notebooks/quickstart.ipynb runs top to bottom (small sizes) in a real Jupyter kernel that
sees only what a `pip install -e ".[demo]" ipykernel` venv would hold, and
notebooks/colab_install.py (its Colab install cell) keeps the runtime's jax."""

import json
import os
import sys
from importlib import metadata
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from demo_extra import HOOK, closure, pyproject

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "notebooks"))
import colab_install  # noqa: E402

# What runs the notebook's kernel besides the demo extra (nbclient stays in this process).
RUNNER = ["ipykernel"]


def demo_extra_kernel(folder: Path, report: Path) -> str:
    """A kernel spec under `folder` (put on JUPYTER_PATH) whose ipykernel runs under
    demo_extra.HOOK: everything installed outside the closure of the core dependencies, the
    demo extra and RUNNER is hidden (torch, transformers, datasets, ...)."""
    allowed, missing = closure({"demo"}, pyproject(), RUNNER)
    assert not missing, f"not installed here, install .[test] first: {sorted(missing)}"
    spec = folder / "kernels" / "sclaro-demo-extra"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-c", HOOK, json.dumps(sorted(allowed)), str(report),
                 "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (demo extra only)", "language": "python"}))
    return spec.name


@pytest.mark.slow
def test_quickstart_notebook_runs_top_to_bottom_with_only_the_demo_extra(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKSTART_DIR", str(tmp_path / "work"))
    # 2 steps: the train step the demo launcher's 2-step runs compile (test_hostile_inputs.py's
    # planted run, test_install.py's demo run), read from the run's compilation cache
    monkeypatch.setenv("QUICKSTART_STEPS", "2")
    monkeypatch.setenv("QUICKSTART_PROBE_EPOCHS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    report = tmp_path / "imports.json"
    kernel = demo_extra_kernel(tmp_path / "jupyter", report)
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    # started in `/`, far from the checkout: the notebook finds its code, recipes (by name)
    # and files from any working directory, and writes nothing there
    elsewhere = Path("/")
    before = set(os.listdir(elsewhere))
    NotebookClient(nb, timeout=900, kernel_name=kernel,
                   resources={"metadata": {"path": str(elsewhere)}}).execute()
    assert set(os.listdir(elsewhere)) == before
    outputs = {i: "".join(o.get("text", "") for o in c.get("outputs", []))
               for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    text = "\n".join(outputs.values())
    # Not on Colab: no pip run; the pins a Colab install would keep are this kernel's jax.
    assert (f"jax pins kept: ['jax=={metadata.version('jax')}', "
            f"'jaxlib=={metadata.version('jaxlib')}']") in text
    assert f"code in {ROOT} | working in {elsewhere}" in text
    assert f"run, evaluation and figures in {tmp_path / 'work'}" in text
    assert "'clock face'" in text and "'in front of'" in text  # multi-word labels stay whole
    assert "trained to step 2" in text
    assert "now equals the Hugging Face one: True" in text
    assert "| MINER |" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 3  # training curves, attention overlays, t-SNE
    assert (tmp_path / "work" / "eval" / "eval.json").exists()
    # The kernel ran under the hook to its end, and imported no PyTorch
    seen = json.loads(report.read_text())
    assert "torch" in seen["hidden"] and "transformers" in seen["hidden"]  # the hook's own check
    assert not {m.partition(".")[0] for m in seen["modules"]} & {
        "torch", "torchvision", "transformers", "datasets"}


TESTED = """# tested set
jax==0.10.2
jaxlib==0.10.2
flax==0.12.8  # a comment
numpy==2.4.6
scipy==1.17.1
"""
# A Colab-like runtime: older jax with its CUDA plugin, numpy preinstalled, no flax, no scipy.
RUNTIME = {"jax": "0.7.2", "jaxlib": "0.7.2", "jax-cuda12-plugin": "0.7.2",
           "jax-cuda12-pjrt": "0.7.2", "numpy": "2.0.2", "ipython": "7.34.0"}


def pins(text):
    return {line.split("==")[0]: line.split("==")[1].split()[0]
            for line in text.splitlines() if "==" in line and not line.startswith("#")}


def test_runtime_constraints_keep_jax_and_installed_packages():
    assert pins(colab_install.runtime_constraints(TESTED, RUNTIME)) == {
        "jax": "0.7.2", "jaxlib": "0.7.2", "jax-cuda12-plugin": "0.7.2",
        "jax-cuda12-pjrt": "0.7.2", "numpy": "2.0.2", "flax": "0.12.8", "scipy": "1.17.1"}
    # keep_all=False: only the jax family keeps its installed versions
    assert pins(colab_install.runtime_constraints(TESTED, RUNTIME, keep_all=False)) == {
        "jax": "0.7.2", "jaxlib": "0.7.2", "jax-cuda12-plugin": "0.7.2",
        "jax-cuda12-pjrt": "0.7.2", "numpy": "2.4.6", "flax": "0.12.8", "scipy": "1.17.1"}
    assert pins(colab_install.runtime_constraints("", RUNTIME, keep_all=False)) == {
        "jax": "0.7.2", "jaxlib": "0.7.2", "jax-cuda12-plugin": "0.7.2", "jax-cuda12-pjrt": "0.7.2"}


def test_restart_only_when_an_imported_package_was_replaced():
    modules = {"numpy": {"numpy"}, "scipy": {"scipy"}, "pillow": {"PIL"}}
    before = {"numpy": "2.0.2", "scipy": "1.11.0", "pillow": "10.0"}
    after = {"numpy": "2.4.6", "scipy": "1.17.1", "pillow": "10.0", "flax": "0.12.8"}
    assert colab_install.restart_needed(before, after, {"numpy", "PIL"}, modules) == [
        "numpy 2.0.2 -> 2.4.6"]  # scipy changed but was not imported; PIL was not changed
    assert colab_install.restart_needed(before, after, {"PIL", "os"}, modules) == []
    assert colab_install.restart_needed(before, {}, {"PIL"}, modules) == ["pillow 10.0 -> removed"]


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """install() against a fake pip: `results` are its exit codes in turn; after the first
    success the runtime's versions become `after`."""
    (tmp_path / "constraints.txt").write_text(TESTED)
    state = {"versions": dict(RUNTIME), "calls": [], "results": [0], "after": None}

    def run(command):
        constraints = Path(command[command.index("-c") + 1]).read_text()
        state["calls"].append((command, pins(constraints)))
        code = state["results"][len(state["calls"]) - 1]
        if code == 0 and state["after"] is not None:
            state["versions"] = state["after"]
        return type("Done", (), {"returncode": code})()

    monkeypatch.setattr(colab_install.subprocess, "run", run)
    monkeypatch.setattr(colab_install, "installed_versions", lambda: dict(state["versions"]))
    monkeypatch.setattr(colab_install, "modules_by_distribution",
                        lambda: {"numpy": {"numpy"}, "ipython": {"IPython"}, "jax": {"jax"}})
    return state


def test_install_retries_with_looser_constraints_and_says_restart(fake_pip, tmp_path, capsys):
    fake_pip["results"] = [1, 0]  # the all-kept constraints fail, the jax-only-kept ones work
    fake_pip["after"] = {**RUNTIME, "numpy": "2.4.6", "flax": "0.12.8"}
    import numpy  # noqa: F401  (imported in this process: its replacement needs a restart)
    assert colab_install.install(str(tmp_path), "demo", workdir=str(tmp_path)) == [
        "numpy 2.0.2 -> 2.4.6"]
    (first, first_pins), (second, second_pins) = fake_pip["calls"]
    assert first[-2:] == ["-e", f"{tmp_path}[demo]"]
    assert first_pins["numpy"] == "2.0.2" and second_pins["numpy"] == "2.4.6"
    assert first_pins["jax"] == second_pins["jax"] == "0.7.2"
    out = capsys.readouterr().out
    assert "RESTART THE RUNTIME" in out and "numpy 2.0.2 -> 2.4.6" in out


def test_install_without_replacements_needs_no_restart(fake_pip, tmp_path, capsys):
    fake_pip["after"] = {**RUNTIME, "flax": "0.12.8", "scipy": "1.17.1"}
    assert colab_install.install(str(tmp_path), "demo", workdir=str(tmp_path)) == []
    assert len(fake_pip["calls"]) == 1
    out = capsys.readouterr().out
    assert "No restart needed" in out and "jax 0.7.2, jaxlib 0.7.2 kept" in out


def test_install_names_jax_when_nothing_resolves(fake_pip, tmp_path):
    fake_pip["results"] = [1, 1, 1]
    with pytest.raises(RuntimeError, match="runtime's jax 0.7.2 / jaxlib 0.7.2"):
        colab_install.install(str(tmp_path), "demo", workdir=str(tmp_path))
    assert [p for _, p in fake_pip["calls"]][-1] == {
        "jax": "0.7.2", "jaxlib": "0.7.2", "jax-cuda12-plugin": "0.7.2", "jax-cuda12-pjrt": "0.7.2"}
