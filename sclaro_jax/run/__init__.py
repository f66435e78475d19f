"""The run layer under every trainer (ScenarioCLIP's `sclaro_jax.train`, the detector's
`sclaro_jax.detection.train`): the run folder (`folder`: graceful stop, unfinished checkpoints,
log truncation, config drift, data identity), its one writer (`lock`), device layouts
(`sharding`), the compilation cache (`cache`), the step compiled ahead for every batch shape
(`ahead`), parameter groups by name (`params`), the checkpoints (`checkpoints`) and the one
loop, `run_steps` (`loop`).

It imports nothing of sclaro_jax but `config`, `compile`, `ops`, `files` and `heap`: no
trainer, model, data or evaluation code. The names below load their modules when first used,
so that importing a light module of the package (`lock`: a launcher's refusal of a busy
workdir) does not import JAX and orbax.
"""

_NAMES = {"Checkpoints": "sclaro_jax.run.checkpoints", "Hooks": "sclaro_jax.run.loop",
          "LoopSpec": "sclaro_jax.run.loop", "NonFiniteLossError": "sclaro_jax.run.loop",
          "Result": "sclaro_jax.run.loop", "run_steps": "sclaro_jax.run.loop"}

__all__ = ["Checkpoints", "Hooks", "LoopSpec", "NonFiniteLossError", "Result", "run_steps"]


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'sclaro_jax.run' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])
