"""Train ScenarioCLIP or a baseline:

    python launch/train.py --config configs/scenarioclip.py[:ARG] --workdir DIR [--config.x.y=V]

Rerunning the same command resumes from the newest checkpoint in DIR. With an empty
`config.data.dir`, the `:demo` variant writes the bundled demo shards to DIR/demo_data first.
"""

import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

config_flags.DEFINE_config_file("config", None, "config file[:variant], e.g. "
                                "configs/scenarioclip.py:demo", lock_config=True)
flags.DEFINE_string("workdir", None, "checkpoints, metrics.jsonl and TensorBoard logs")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's per-save INFO lines
    logging.getLogger("sclaro_jax").setLevel(logging.INFO)
    config = FLAGS.config
    workdir = FLAGS.workdir
    if config.distributed:  # multi-host: coordinator and process ids from the environment
        import jax
        jax.distributed.initialize()
    if not config.data.dir:
        if config.model.preset != "tiny" or config.data.batch_size > 16:
            raise app.UsageError("config.data.dir is empty: pass --config.data.dir=DIR (a "
                                 "dataset folder from `python -m data_prep`), or use "
                                 "configs/scenarioclip.py:demo for the bundled demo")
        from data_prep.demo import build_demo  # the demo's data: data_prep, not sclaro_jax
        data = os.path.join(workdir, "demo_data")
        if not os.path.exists(os.path.join(data, "manifest.json")):
            build_demo(data, progress=False)
        with config.unlocked():
            config.data.dir = data
    from sclaro_jax.train.trainer import train
    train(config, workdir)
    print(f"done: metrics in {os.path.join(workdir, 'metrics.jsonl')}, checkpoints in "
          f"{os.path.join(workdir, 'checkpoints')}")


if __name__ == "__main__":
    if any(arg in ("-h", "--help", "--helpshort") for arg in sys.argv[1:]):
        print(__doc__)  # absl's own --help exits with status 1
        print(FLAGS.main_module_help())
        sys.exit(0)
    app.run(main)
