"""ScenarioCLIP w/o KD: three pairs, contrastive alignment only (same recipe otherwise)."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "_scenarioclip_config", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "scenarioclip.py"))
scenarioclip = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scenarioclip)


def get_config(arg: str | None = None):
    c = scenarioclip.get_config(arg)
    c.train.lambda_kd = 0.0
    return c
