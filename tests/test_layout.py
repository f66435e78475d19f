"""Rules of the layout: sclaro_jax stays torch-free; the command lines answer --help."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_sclaro_jax_never_imports_torch():
    code = ("import sys, sclaro_jax.models.clip, sclaro_jax.data.tokenizer\n"
            "import sclaro_jax.data.pipeline, sclaro_jax.train.trainer, sclaro_jax.losses\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'data_prep'))\n"
            "assert not bad, bad\n")
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr


def test_train_cli_help_and_missing_data_message(tmp_path):
    help_ = _run("launch/train.py", "--help")
    assert help_.returncode == 0 and "--workdir" in help_.stdout
    run = _run("launch/train.py", "--config", "configs/scenarioclip.py", "--workdir",
               str(tmp_path))
    assert run.returncode != 0 and "config.data.dir is empty" in run.stderr


def test_data_prep_help():
    result = _run("-m", "data_prep", "--help")
    assert result.returncode == 0 and "annotation pipeline" in result.stdout
