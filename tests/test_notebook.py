"""notebooks/quickstart.ipynb runs top to bottom (small sizes) in a real Jupyter kernel."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKSTART_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("QUICKSTART_STEPS", "3")
    monkeypatch.setenv("QUICKSTART_PROBE_EPOCHS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = {i: "".join(o.get("text", "") for o in c.get("outputs", []))
               for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    text = "\n".join(outputs.values())
    assert "trained to step 3" in text
    assert "now equals the Hugging Face one: True" in text
    assert "| MINER |" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 3  # training curves, attention overlays, t-SNE
    assert (tmp_path / "work" / "eval" / "eval.json").exists()
