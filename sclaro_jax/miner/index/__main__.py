"""`python -m sclaro_jax.miner.index build|search ...` (`command.main`)."""

import sys

from sclaro_jax.miner.index.command import main

sys.exit(main())
