"""The recipe's train step as the trainer builds it, for the benches of a GPU session
(bench/gpu_profile.py, bench/bench_step_variants.py): a config file and overrides, records at
the config's image size (written once), then `trainer`'s own model, state, jitted step,
packed sizes and batches, compiled by `run.ahead.CompiledSteps` as a run compiles it. The
session's stages then share one executable through JAX's persistent cache
(JAX_COMPILATION_CACHE_DIR), and a winner found here is what `launch/train.py` runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    from sclaro_jax.config import CODE_NOTE

    parser.add_argument("--config", default="configs/scenarioclip.py",
                        help=f"the recipe, FILE[:VARIANT]; {CODE_NOTE}")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config value, e.g. model.dtype=bfloat16 (repeatable)")
    parser.add_argument("--data", default="",
                        help="dataset folder: written here with --samples records if it holds "
                             "none (default: config.data.dir, else a new temporary folder)")
    parser.add_argument("--samples", type=int, default=512,
                        help="records to write: demo photographs with their own crop counts")


def set_value(config, key: str, text: str) -> None:
    """config[key] (dotted) = `text` as the type of the value it replaces."""
    *parents, leaf = key.split(".")
    for part in parents:
        config = config[part]
    old = config[leaf]
    config[leaf] = text in ("True", "true", "1") if isinstance(old, bool) else type(old)(text)


def recipe(args, **fixed):
    """The config of --config with --override and `fixed` (dotted key -> value) applied, its
    data.dir a dataset folder (records written first where it holds none)."""
    from bench_input import build_shards
    from sclaro_jax.config import load_config

    config = load_config(args.config)
    with config.unlocked():
        for item in args.override:
            set_value(config, *item.split("=", 1))
        for key, value in fixed.items():
            *parents, leaf = key.split(".")
            node = config
            for part in parents:
                node = node[part]
            node[leaf] = value
        data = args.data or config.data.dir or os.path.join(tempfile.mkdtemp(), "shards")
        config.data.dir = data
    if not os.path.exists(os.path.join(data, "manifest.json")):
        t0 = time.perf_counter()
        build_shards(data, args.samples, view_size=config.data.image_size, demo_counts=True)
        print(f"wrote {args.samples} records to {data} in {time.perf_counter() - t0:.1f} s",
              flush=True)
    return config


def trainer_step(config, batches: int) -> dict:
    """The trainer's jitted step, state and mesh for `config`, its first `batches` host batches
    (from its own loader, the packed sizes agreed as in training) and the batch specs of every
    packed size. Compilation is left to the caller (`CompiledSteps(built["jitted"], ...)`)."""
    from sclaro_jax.data.dataset import open_dataset
    from sclaro_jax.train import trainer

    tcfg = trainer.train_config(config, 1000)
    graphdef, state, jitted, mesh, sizes, it = trainer.build(config, open_dataset(
        config.data.dir), tcfg)
    host = [sizes.agree(next(it), i) for i in range(batches)]
    return {"jitted": jitted, "state": state, "mesh": mesh, "specs": sizes.specs(),
            "host": host, "packed": sizes.sizes}
