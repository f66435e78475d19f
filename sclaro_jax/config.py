"""Experiment configs, loaded one way: `load_config("path/to/file.py[:variant]")`.

A config file defines `get_config(variant=None) -> ml_collections.ConfigDict` (configs/ holds
the repository's: scenarioclip.py, scenarioclip_nokd.py, pyramidclip.py). launch/train.py and
`python -m sclaro_jax.eval.suite` both load their `--config` here; the trainer checks the keys
of `config.train` against `sclaro_jax.train.core.TrainConfig` when a run starts.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import ml_collections


def load_config(spec: str) -> ml_collections.ConfigDict:
    """`path/to/config.py[:variant]` -> the file's `get_config(variant)` ConfigDict (variant
    None when not given). The file's grandparent folder (the repository root for configs/) goes
    on sys.path, so configs can import each other as `configs.x`."""
    path, _, variant = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path} (from --config {spec!r})")
    root = str(Path(path).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    module_spec = importlib.util.spec_from_file_location(f"_sclaro_config_{Path(path).stem}",
                                                         path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"{path} defines no get_config(variant)")
    return module.get_config(variant or None)
