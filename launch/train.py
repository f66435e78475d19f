"""Train a task's run, then evaluate it: ScenarioCLIP, a baseline or the detector
(`config.trainer`, a task of `sclaro_jax.run.task`):

    python launch/train.py --config configs/scenarioclip.py[:VARIANT] --workdir DIR [--config.x.y=V]
    python launch/train.py --config configs/detection.py[:demo] --workdir DIR [--config.x.y=V]
    sclaro-train --config detection:demo --workdir DIR     # installed: any folder, by name

`--config` takes a recipe's file or its name (`scenarioclip:demo`, from any folder). Rerunning
the same command resumes from the newest checkpoint in DIR. When the run is complete, the task
evaluates it (ScenarioCLIP: the evaluators of `config.evals`; the detector: COCO AP) into
DIR/results.json and DIR/results.md and prints the table; `--eval-only` evaluates DIR's newest
checkpoint without training, `--no-eval` trains only. Ctrl-C (SIGINT) or SIGTERM stops after the
current step with a checkpoint (a second Ctrl-C aborts at once). A rerun whose config differs
in more than the logging / checkpoint / eval settings, the data folder or the sharding (the
run's length included: it sets the schedule) is refused unless --allow-config-change. A
second run on a workdir in use is refused, naming the first. With an empty `config.data.dir`,
the `:demo` variants write the bundled demo to DIR/demo_data first. User errors print one
`error:` line (the traceback with --verbose).
"""

import json
import logging
import os
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
    flags.DEFINE_bool("eval", True, "evaluate the run when its training is complete "
                      "(--noeval: train only)")
    flags.DEFINE_bool("eval_only", False, "evaluate WORKDIR's newest checkpoint, no training")
    flags.mark_flags_as_required(["workdir"])


FLAGS = flags.FLAGS


def prepare_demo(config, workdir: str, task) -> None:
    """An empty config.data.dir with a demo config: the bundled demo in WORKDIR/demo_data, made
    at the image size of the task's demo views (0: the originals)."""
    size = task.demo_view_size(config)
    if size is None:
        raise app.UsageError(f"config.data.dir is empty: pass --config.data.dir=DIR (a dataset "
                             f"folder from `python -m data_prep`), or use the :demo variant of "
                             f"configs/{task.name}.py for the bundled demo")
    from data_prep.demo import build_demo  # the demo's data: data_prep, not sclaro_jax
    data = os.path.join(workdir, "demo_data")
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
    from sclaro_jax.run import lock, task as tasks
    task = tasks.of(config)
    task.check(config)  # before anything is written
    lock.hold_workdir(workdir)  # this process is the run's one writer until it ends
    if not config.data.dir:
        prepare_demo(config, workdir, task)
    if not FLAGS.eval_only:
        fitted = task.fit(config, workdir, allow_config_change=FLAGS.allow_config_change,
                          verify_data=FLAGS.verify_data)
        if fitted.step < fitted.steps:
            print(f"stopped at step {fitted.step} of {fitted.steps}; rerun the same command to "
                  "continue")
            return
        print(f"done: {fitted.steps} steps; metrics in {os.path.join(workdir, 'metrics.jsonl')},"
              f" checkpoints in {os.path.join(workdir, 'checkpoints')}")
    if (FLAGS.eval_only or FLAGS.eval) and config.distributed:
        print(f"evaluation: one process evaluates a run; python launch/train.py --config ... "
              f"--workdir {workdir} --eval-only")
    elif FLAGS.eval_only or FLAGS.eval:
        evaluated = task.evaluate(config, workdir)
        print(f"\n{evaluated.table}\n\nresults: {evaluated.path} (and "
              f"{os.path.join(workdir, 'results.json')})")
        if evaluated.next:
            print(evaluated.next)


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
    """--allow-config-change -> --allow_config_change, --no-eval -> --noeval (absl's flag
    names)."""
    if not arg.startswith("--") or arg.startswith("--config"):
        return arg
    name, eq, value = arg[2:].partition("=")
    if name.startswith(("no-", "no_")):  # --no-eval: absl's negation of a bool is --noeval
        name = "no" + name[3:]
    return "--" + name.replace("-", "_") + eq + value


def cli(args: list[str]) -> None:
    args = [_underscores(a) for a in args]
    verbose = "--verbose" in args
    spec, argv = split_config_spec(args[1:])
    argv = args[:1] + argv
    if any(arg in ("-h", "--help", "--helpshort") for arg in argv[1:]):
        print(__doc__)  # absl's own --help exits with status 1
        print("Recipes and their variants (--config NAME[:VARIANT], or a file: "
              "configs/NAME.py[:VARIANT] in a checkout):")
        print("\n".join(list_configs()))
        print()
        try:
            define_flags(spec, argv)
        except Exception as e:  # noqa: BLE001 (help still prints the flags it can)
            print(f"(--config {spec}: {_message(e)})")
            define_flags(None, argv)
        # this module's flags: the main module's are none when the installed `sclaro-train`
        # runs it (absl keys flags by the module that defines them)
        print(FLAGS.module_help(FLAGS.find_module_defining_flag("workdir")))
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


def console() -> None:
    """`sclaro-train`, the installed command."""
    cli(sys.argv)


if __name__ == "__main__":
    cli(sys.argv)
