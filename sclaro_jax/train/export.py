"""`python -m sclaro_jax.train.export`: the model export's command at its address; its code is
`sclaro_jax.export.command` (in `sclaro_jax.export` beside `hf`, the library it drives), whose
public names this module gives to existing imports."""

import sys

from sclaro_jax.export.command import OPEN_CLIP_LEVEL_REFUSAL, UsageError, check_out, main

__all__ = ["OPEN_CLIP_LEVEL_REFUSAL", "UsageError", "check_out", "main"]

if __name__ == "__main__":
    from sclaro_jax.heap import freeze_for_process
    freeze_for_process()  # a command's process: its imports are not scanned again
    sys.exit(main())
