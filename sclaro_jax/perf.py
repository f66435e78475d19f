"""How the training step is computed, never what it computes: `config.perf` (`PerfConfig`).

Each switch gives the default step's numbers up to floating-point rounding
(tests/test_step_switches.py holds each to the default step) and only changes how fast it runs,
so a resumed run may change them (`run.folder.SAFE_KEYS`). The defaults are the step as it was
before the switches; a GPU run picks the ones worth turning on (bench/bench_gpu_train.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from sclaro_jax import compile
from sclaro_jax.models.layers import AttentionOptions


def parse_xla_options(text: str) -> dict[str, Any]:
    """"name=value ..." (whitespace-separated, a leading "--" allowed as in XLA_FLAGS) -> dict;
    true / false (any case) become booleans, other values stay strings (XLA parses them)."""
    out = {}
    for item in text.split():
        name, sep, value = item.removeprefix("--").partition("=")
        if not sep or not name:
            raise ValueError(f"perf.xla_options: {item!r} is not name=value (e.g. "
                             "'xla_gpu_enable_command_buffer= xla_gpu_graph_min_graph_size=8')")
        out[name] = {"true": True, "false": False}.get(value.lower(), value)
    return out


@dataclasses.dataclass(frozen=True)
class PerfConfig:
    """The switches (`config.perf`), each off by default:

    - `fused_qkv`: q, k and v from one [d, 3d] matmul per attention layer, same parameters
      (`layers.AttentionOptions`).
    - `attention`: the attention core, "einsum" (the default), "xla"
      (`jax.nn.dot_product_attention` on XLA) or "cudnn" (its cuDNN flash-attention kernel:
      CUDA GPUs, bfloat16 compute; refused elsewhere when the model is built).
    - `fused_update`: gradient clipping, the AdamW groups and the EMA teacher in one pass over
      flat buffers (`train.fused_update`), the same optimiser state.
    - `xla_options`: XLA compile options of the train step, merged over `sclaro_jax.compile`'s
      per-backend ones: a dict, or "name=value ..." (`parse_xla_options`). XLA checks every one
      when the step is built (an unknown name or a bad value is an error); those of another
      backend (`xla_gpu_*` on a CPU) are left out with a log line (`compile.checked_options`).
    - `packed_multiple`: each planned packed crop size rounded up to a multiple of this (with
      the devices' `align`: their least common multiple), e.g. 64 for tensor-core-friendly
      matmul shapes; more padding, the same numbers.
    """

    fused_qkv: bool = False
    attention: str = "einsum"
    fused_update: bool = False
    xla_options: tuple[tuple[str, Any], ...] = ()
    packed_multiple: int = 1

    def __post_init__(self):
        options = self.xla_options
        if isinstance(options, str):
            options = parse_xla_options(options)
        if hasattr(options, "items"):  # a dict or a ConfigDict
            options = tuple(sorted(options.items()))
        object.__setattr__(self, "xla_options", tuple(options))
        bad = [name for name, _ in self.xla_options if not name.startswith("xla_")]
        if bad:
            raise ValueError(f"perf.xla_options: {bad} are not XLA option names (xla_...)")
        try:
            self.attention_options()
        except ValueError as err:
            raise ValueError(f"perf.attention: {err}") from None
        if not (isinstance(self.packed_multiple, int) and self.packed_multiple >= 1):
            raise ValueError(f"perf.packed_multiple must be a positive integer, got "
                             f"{self.packed_multiple!r}")

    @classmethod
    def from_config(cls, config) -> "PerfConfig":
        """`config.perf` (the defaults where a config has none); unknown keys are refused."""
        perf = config.get("perf")
        perf = {} if perf is None else dict(perf.items())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(perf) - known)
        if unknown:
            raise ValueError(f"config.perf has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**perf)

    def attention_options(self) -> AttentionOptions:
        return AttentionOptions(implementation=self.attention, fused_qkv=self.fused_qkv)

    def compiler_options(self) -> dict[str, Any]:
        """`xla_options` for this process's backend, checked by XLA (`compile.checked_options`;
        a ValueError names the config key)."""
        try:
            return compile.checked_options(dict(self.xla_options))
        except ValueError as err:
            raise ValueError(f"perf.xla_options: {err}") from None

    def packed_align(self, align: int = 1) -> int:
        """The multiple of `packing.plan`'s sizes: `align` (the devices a host's slice is split
        over) and `packed_multiple` both divide it."""
        return math.lcm(align, self.packed_multiple)
