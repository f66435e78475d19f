"""`python -m sclaro_jax.miner.index build|search ...` (`command.main`)."""

import sys

from sclaro_jax.heap import freeze_for_process
from sclaro_jax.miner.index.command import main

freeze_for_process()  # a command's process: its imports are not scanned again
sys.exit(main())
