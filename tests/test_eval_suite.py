"""The evaluation CLI over a checkpoint directory: JSON, Markdown tables and PNG figures."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sclaro_jax.eval import suite

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_suite_cli_writes_every_number_the_tables_and_the_figures(scenario_workdir, tmp_path,
                                                                  capsys):
    with open(scenario_workdir / "metrics.jsonl", "w") as f:  # as the trainer logs them
        for step in (5, 10):
            f.write(json.dumps({"step": step, "loss": 3.0 / step, "loss_ca": 2.0 / step,
                                "loss_kd": 1.0 / step, "lr": 1e-4, "kd_temperature": 0.07,
                                "examples_per_sec": 9.0}) + "\n")
    out = tmp_path / "eval"
    code = suite.main(["--workdir", f"ScenarioCLIP={scenario_workdir}", "--workdir",
                       f"second={scenario_workdir}", "--out", str(out), "--probe_epochs",
                       "1", "--min_predicate_instances", "2", "--localisation_variants",
                       "frozen", "--figure_images", "2", "--no_progress"])
    assert code == 0
    err = capsys.readouterr().err  # each phase says what it does (no silent minute)
    for phase in (f"ScenarioCLIP: loading the checkpoint of {scenario_workdir} ...",
                  "ScenarioCLIP (step 7): embedding the test split of", "second: figures ..."):
        assert phase in err, err
    record = json.loads((out / "eval.json").read_text())
    assert list(record["models"]) == ["ScenarioCLIP", "second"]
    res = record["models"]["ScenarioCLIP"]
    assert res["step"] == 7 and res["weights"] == "student"
    for key in ("zero_shot", "linear_probe", "predcls", "sgcls", "localisation"):
        assert key in res, key
    assert 0 <= res["zero_shot"]["object"]["strict"]["all"]["top1"] <= 100
    assert 0 <= res["localisation"]["frozen"]["dice"] <= 1
    # the ViT-B/32 convention is checked in test_eval_figures; here the tiny model's table
    assert record["cost"]["ScenarioCLIP"]["pairs"] == 3
    table = (out / "eval.md").read_text()
    assert "## ScenarioCLIP (student, step 7)" in table and "Table A1" in table
    figures = record["figures"]
    assert set(figures) == {"training_curves/ScenarioCLIP", "training_curves/second",
                            "tsne/ScenarioCLIP", "tsne/second", "attention_overlays"}
    with Image.open(figures["attention_overlays"]) as img:
        width, height = img.size
    # two image rows; columns: the view + one per model
    assert width > height and np.asarray(Image.open(figures["tsne/ScenarioCLIP"])).std() > 0


def test_suite_help_and_missing_workdir(tmp_path):
    run = subprocess.run([sys.executable, "-m", "sclaro_jax.eval.suite", "--help"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "--workdir" in run.stdout and "--teacher" in run.stdout
    assert suite.main(["--workdir", str(tmp_path / "nope")]) == 2
