"""Train ScenarioCLIP or a baseline:

    python launch/train.py --config configs/scenarioclip.py[:ARG] --workdir DIR [--config.x.y=V]

Rerunning the same command resumes from the newest checkpoint in DIR. With an empty
`config.data.dir`, the `:demo` variant writes the bundled demo shards to DIR/demo_data first.
"""

import logging
import json
import os
import sys

from absl import app, flags
from absl import logging as absl_logging
import ml_collections
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sclaro_jax.config import load_config  # noqa: E402  (after the path above)


def split_config_spec(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the value of --config, i.e. `--config=SPEC` or `--config SPEC`; argv without it). The
    rest, `--config.x.y=V` overrides included, goes to absl."""
    rest, spec, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config="):
            spec = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            spec, i = argv[i + 1], i + 1
        else:
            rest.append(arg)
        i += 1
    return spec, rest


def define_flags(spec: str | None, argv: list[str]) -> None:
    """--config (loaded by `sclaro_jax.config.load_config`, then `--config.x.y=V` overrides
    applied by absl's config_flags to `argv`, the command line without --config) and --workdir."""
    config = ml_collections.ConfigDict() if spec is None else load_config(spec)
    config_flags.DEFINE_config_dict("config", config, "config file[:variant], e.g. "
                                    "configs/scenarioclip.py:demo (required)", lock_config=True,
                                    sys_argv=argv)
    flags.DEFINE_string("workdir", None, "checkpoints, metrics.jsonl and TensorBoard logs")
    flags.mark_flags_as_required(["workdir"])


FLAGS = flags.FLAGS


def main(argv):
    del argv
    if not list(FLAGS.config.keys()):  # no --config: define_flags's empty placeholder
        raise app.UsageError("--config is required: a config file[:variant], e.g. "
                             "--config=configs/scenarioclip.py:demo")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's per-save INFO lines
    logging.getLogger("sclaro_jax").setLevel(logging.INFO)
    config = FLAGS.config
    workdir = FLAGS.workdir
    if config.distributed:  # many processes: coordinator and process ids from the environment
        from sclaro_jax.train.sharding import initialize_distributed
        initialize_distributed()
    if not config.data.dir:
        if config.model.preset != "tiny" or config.data.batch_size > 16:
            raise app.UsageError("config.data.dir is empty: pass --config.data.dir=DIR (a "
                                 "dataset folder from `python -m data_prep`), or use "
                                 "configs/scenarioclip.py:demo for the bundled demo")
        from data_prep.demo import build_demo  # the demo's data: data_prep, not sclaro_jax
        data = os.path.join(workdir, "demo_data")
        size = config.data.image_size  # the demo's training views are made at the model's size
        manifest = os.path.join(data, "manifest.json")
        if not os.path.exists(manifest):
            build_demo(data, image_size=size, progress=False)
        else:
            with open(manifest, encoding="utf-8") as f:
                if json.load(f).get("view_size") != size:  # written for another image size
                    build_demo(data, image_size=size, overwrite=True, progress=False)
        with config.unlocked():
            config.data.dir = data
    from sclaro_jax.train.trainer import train
    train(config, workdir)
    print(f"done: metrics in {os.path.join(workdir, 'metrics.jsonl')}, checkpoints in "
          f"{os.path.join(workdir, 'checkpoints')}")


if __name__ == "__main__":
    SPEC, ARGV = split_config_spec(sys.argv[1:])
    ARGV = sys.argv[:1] + ARGV
    define_flags(SPEC, ARGV)
    if any(arg in ("-h", "--help", "--helpshort") for arg in ARGV[1:]):
        print(__doc__)  # absl's own --help exits with status 1
        print(FLAGS.main_module_help())
        sys.exit(0)
    app.run(main, argv=ARGV)
