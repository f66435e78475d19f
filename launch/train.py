"""Train ScenarioCLIP, a baseline or the detector (`config.trainer`):

    python launch/train.py --config configs/scenarioclip.py[:VARIANT] --workdir DIR [--config.x.y=V]
    python launch/train.py --config configs/detection.py[:demo] --workdir DIR [--config.x.y=V]

Rerunning the same command resumes from the newest checkpoint in DIR. Ctrl-C (SIGINT) or SIGTERM
stops after the current step with a checkpoint (a second Ctrl-C aborts at once). A rerun whose
config differs in more than the logging / checkpoint / eval settings, the data folder or the
sharding (the run's length included: it sets the schedule) is refused unless
--allow-config-change. A second run on a workdir in use is refused, naming the first. With an
empty `config.data.dir`, the `:demo` variants write the bundled demo shards to DIR/demo_data
first. User errors print one `error:` line (the traceback with --verbose).
"""

import json
import logging
import os
import shlex
import sys

from absl import app, flags
from absl import logging as absl_logging
import ml_collections
from ml_collections import config_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sclaro_jax.config import check_override_keys, list_configs, load_config  # noqa: E402


def split_flag(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """(the value of `name`, i.e. `NAME=V` or `NAME V`, the last one; argv without it)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        else:
            rest.append(arg)
        i += 1
    return value, rest


def split_config_spec(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the value of --config, i.e. `--config=SPEC` or `--config SPEC`; argv without it). The
    rest, `--config.x.y=V` overrides included, goes to absl."""
    return split_flag(argv, "--config")


def define_flags(spec: str | None, argv: list[str]) -> None:
    """--config (loaded by `sclaro_jax.config.load_config`, then `--config.x.y=V` overrides
    applied by absl's config_flags to `argv`, the command line without --config), --workdir and
    the run's switches. Unknown override keys are refused first, naming the closest known."""
    config = ml_collections.ConfigDict() if spec is None else load_config(spec)
    if spec is not None:
        check_override_keys(config, argv)
    config_flags.DEFINE_config_dict("config", config, "config file[:variant], e.g. "
                                    "configs/scenarioclip.py:demo (required)", lock_config=True,
                                    sys_argv=argv)
    flags.DEFINE_string("workdir", None, "checkpoints, metrics.jsonl and TensorBoard logs")
    flags.DEFINE_bool("allow_config_change", False, "continue a run with a config that differs "
                      "from the one it was started with (both are kept in the workdir)")
    flags.DEFINE_bool("verify_data", False, "check every shard's sha256 against the manifest "
                      "before training (the quick size and record-count check always runs)")
    flags.DEFINE_bool("verbose", False, "print tracebacks for errors")
    flags.mark_flags_as_required(["workdir"])


FLAGS = flags.FLAGS


def prepare_demo(config, workdir: str) -> None:
    """An empty config.data.dir with a demo config: the bundled demo in WORKDIR/demo_data, made
    at the config's image size (ScenarioCLIP; the detector reads the originals)."""
    detector = config.get("trainer", "scenarioclip") == "detection"
    demo = (config.detector.image_size <= 128 and config.batch_size <= 16) if detector else \
        (config.model.preset == "tiny" and config.data.batch_size <= 16)
    if not demo:
        name = "detection" if detector else "scenarioclip"
        raise app.UsageError("config.data.dir is empty: pass --config.data.dir=DIR (a "
                             "dataset folder from `python -m data_prep`), or use "
                             f"configs/{name}.py:demo for the bundled demo")
    from data_prep.demo import build_demo  # the demo's data: data_prep, not sclaro_jax
    data = os.path.join(workdir, "demo_data")
    size = None if detector else config.data.image_size  # the training views' size
    manifest = os.path.join(data, "manifest.json")
    if not os.path.exists(manifest):
        logging.getLogger("sclaro_jax").info("writing the bundled demo dataset to %s (once) ...",
                                             data)
        build_demo(data, **({"image_size": size} if size else {}), progress=False)
    elif size:
        with open(manifest, encoding="utf-8") as f:
            if json.load(f).get("view_size") != size:  # written for another image size
                build_demo(data, image_size=size, overwrite=True, progress=False)
    with config.unlocked():
        config.data.dir = data


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
        from sclaro_jax.run.sharding import initialize_distributed
        initialize_distributed()
    from sclaro_jax.run.folder import check_workdir
    from sclaro_jax.run.lock import hold_workdir
    check_workdir(workdir)
    hold_workdir(workdir)  # this process is the run's one writer until it ends
    if config.get("trainer", "scenarioclip") == "detection":
        from sclaro_jax.detection.train import check_rates
        check_rates(config)
    else:
        from sclaro_jax.train.trainer import check_recipe
        check_recipe(config)
    if not config.data.dir:
        prepare_demo(config, workdir)
    if config.get("trainer", "scenarioclip") == "detection":
        return train_detector(config, workdir)
    from sclaro_jax.train import trainer
    state = trainer.train(config, workdir, allow_config_change=FLAGS.allow_config_change,
                          verify_data=FLAGS.verify_data)
    import jax
    steps = trainer.total_steps(config, trainer.open_dataset(config.data.dir).num_records("train"))
    step = int(jax.device_get(state.step))
    if step < steps:
        print(f"stopped at step {step} of {steps}; rerun the same command to continue")
        return
    w = shlex.quote(workdir)
    print(f"done: {steps} steps; metrics in {os.path.join(workdir, 'metrics.jsonl')}, "
          f"checkpoints in {os.path.join(workdir, 'checkpoints')}\n"
          f"next: evaluate: python -m sclaro_jax.eval.suite --workdir {w}   (tables in "
          f"{os.path.join(workdir, 'eval', 'eval.md')})\n"
          f"      export one level for PyTorch: python -m sclaro_jax.train.export --workdir {w} "
          f"--level object --out {shlex.quote(os.path.join(workdir, 'export_object'))}")


def train_detector(config, workdir: str) -> None:
    """configs/detection.py: the detector's run (`sclaro_jax.detection.trainer`)."""
    import jax

    from sclaro_jax.detection import trainer
    _, state, info = trainer.run(config, workdir, allow_config_change=FLAGS.allow_config_change,
                                 verify_data=FLAGS.verify_data)
    step, steps = int(jax.device_get(state["step"])), info["steps"]
    if step < steps:
        print(f"stopped at step {step} of {steps}; rerun the same command to continue")
        return
    print(f"done: {steps} steps; metrics in {os.path.join(workdir, 'metrics.jsonl')}, "
          f"checkpoints in {os.path.join(workdir, 'checkpoints')}")


# Errors that are the user's to fix: one `error:` line (and the traceback with --verbose).
def user_errors() -> tuple[type, ...]:
    from sclaro_jax.data.dataset import DatasetError
    from sclaro_jax.data.schema import SchemaVersionError
    from sclaro_jax.run.folder import RunError
    return (DatasetError, SchemaVersionError, RunError, FileNotFoundError, PermissionError,
            NotADirectoryError, KeyError, ValueError, flags.Error)


def fail(message: str, verbose: bool) -> None:
    if verbose:
        import traceback
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _message(e: BaseException) -> str:
    return e.args[0] if isinstance(e, KeyError) and e.args else str(e)


def _underscores(arg: str) -> str:
    """--allow-config-change -> --allow_config_change (absl's flag names)."""
    if not arg.startswith("--") or arg.startswith("--config"):
        return arg
    name, eq, value = arg[2:].partition("=")
    return "--" + name.replace("-", "_") + eq + value


def cli(args: list[str]) -> None:
    args = [_underscores(a) for a in args]
    verbose = "--verbose" in args
    spec, argv = split_config_spec(args[1:])
    argv = args[:1] + argv
    if any(arg in ("-h", "--help", "--helpshort") for arg in argv[1:]):
        print(__doc__)  # absl's own --help exits with status 1
        print("Configs and their variants (--config FILE[:VARIANT]):")
        print("\n".join(list_configs(os.path.relpath(os.path.join(ROOT, "configs")))))
        print()
        try:
            define_flags(spec, argv)
        except Exception as e:  # noqa: BLE001 (help still prints the flags it can)
            print(f"(--config {spec}: {_message(e)})")
            define_flags(None, argv)
        print(FLAGS.main_module_help())
        sys.exit(0)
    try:
        from sclaro_jax.run.lock import probe_workdir
        workdir, _ = split_flag(argv, "--workdir")
        if workdir:  # a second run on a busy workdir: refused before the config loads jax
            probe_workdir(workdir)
        define_flags(spec, argv)
        argv = FLAGS(argv)  # parse here, so a bad value is one error line too
    except flags.Error as e:
        fail(f"{e}", verbose)
    except user_errors() as e:
        fail(_message(e), verbose)
    try:
        app.run(main, argv=argv)
    except SystemExit:
        raise
    except KeyboardInterrupt:  # the second Ctrl-C: out at once, without the threads' noise
        if verbose:
            import traceback
            traceback.print_exc()
        print("error: aborted (a second interrupt); the run's complete checkpoints are kept: "
              "rerun the same command to continue from the newest", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)  # background writer threads would hold the exit (and print on the way)
    except user_errors() as e:
        fail(_message(e), verbose)


if __name__ == "__main__":
    cli(sys.argv)
