"""The run layer under every trainer (ScenarioCLIP's `sclaro_jax.train`, the detector's
`sclaro_jax.detection.train`): the run folder (`folder`: graceful stop, unfinished checkpoints,
log truncation, config drift, data identity), its one writer (`lock`), device layouts
(`sharding`), the compilation cache (`cache`), the step compiled ahead for every batch shape
(`ahead`), parameter groups by name (`params`), the checkpoints (`checkpoints`) and the one
loop, `run_steps` (`loop`).

It imports nothing of sclaro_jax but `config`, `compile`, `ops`, `files` and `heap`: no
trainer, model, data or evaluation code.
"""

from sclaro_jax.run.checkpoints import Checkpoints
from sclaro_jax.run.loop import Hooks, LoopSpec, NonFiniteLossError, Result, run_steps

__all__ = ["Checkpoints", "Hooks", "LoopSpec", "NonFiniteLossError", "Result", "run_steps"]
