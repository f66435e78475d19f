"""Train a task's run, then evaluate it: ScenarioCLIP, a baseline or the detector
(`config.trainer`, a task of `sclaro_jax.run.task`):

    python launch/train.py --config configs/scenarioclip.py[:VARIANT] --workdir DIR [--config.x.y=V]
    python launch/train.py --config configs/detection.py[:demo] --workdir DIR [--config.x.y=V]
    sclaro-train --config detection:demo --workdir DIR     # installed: any folder, by name

`--config` takes a recipe's file or its name (`scenarioclip:demo`, from any folder). A config
file is Python that runs when it is loaded, like a script: pass only files you trust (it is run
from its path; no folder is added to the import path for it). Rerunning
the same command resumes from the newest checkpoint in DIR. When the run is complete, the task
evaluates it (ScenarioCLIP: the evaluators of `config.evals`; the detector: COCO AP) into
DIR/results.json and DIR/results.md and prints the table; `--eval-only` evaluates DIR's newest
checkpoint (or `--step N`'s) without training, `--no-eval` trains only. Ctrl-C (SIGINT) or SIGTERM stops after the
current step with a checkpoint (a second Ctrl-C aborts at once). A rerun whose config differs
in more than the logging / checkpoint / eval settings, the data folder or the sharding (the
run's length included: it sets the schedule) is refused unless --allow-config-change. A
second run on a workdir in use is refused, naming the first. With an empty `config.data.dir`,
the `:demo` variants write the bundled demo to DIR/demo_data first.

The conventions of every command (`sclaro_jax.cli`): flags with hyphens (`--no-progress`,
`--allow-config-change`; absl's underscore spellings and `--noeval` work too), a usage error
(an unknown flag or config key, with the closest known; a bad value; a missing --workdir) is
one `error: ... (see --help)` line and exit 2, and any other user error one `error:` line,
exit 2 (the traceback too with --verbose).
"""

import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging
import ml_collections
from ml_collections import config_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # `python launch/train.py` in a checkout: the checkout that holds this file
    sys.path.insert(0, ROOT)  # (imported as launch.train, sclaro-train: importable already)

from sclaro_jax.config import (CODE_NOTE, check_override_keys, list_configs,  # noqa: E402
                               load_config)


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
                      "(--no-eval: train only)")
    flags.DEFINE_bool("eval_only", False, "evaluate WORKDIR's newest checkpoint, no training")
    flags.DEFINE_integer("step", None, "with --eval-only: the checkpoint step to evaluate "
                         "(default: the newest complete one)", lower_bound=0)
    flags.DEFINE_bool("progress", True, "progress bars (--no-progress: none)")


FLAGS = flags.FLAGS


def check_data_dir(config, task) -> None:
    """An empty config.data.dir is for the demo configs only (the launcher writes the bundled
    demo, `prepare_demo`); other recipes are refused, before the workdir is made, naming the
    flag and the command that writes their data (`config.data.prepare`, when they name one)."""
    if config.data.dir or task.demo_view_size(config) is not None:
        return
    if config.data.get("prepare"):  # a user error: one `error:` line, exit 2
        raise ValueError(f"config.data.dir is empty: pass --config.data.dir=DIR, the dataset "
                         f"written by `{config.data.prepare}`")
    raise ValueError(f"config.data.dir is empty: pass --config.data.dir=DIR (a dataset folder "
                     f"from `python -m data_prep`), or use the :demo variant of "
                     f"configs/{task.name}.py for the bundled demo")


def prepare_demo(config, workdir: str, task) -> None:
    """An empty config.data.dir with a demo config: the bundled demo in WORKDIR/demo_data, made
    at the image size of the task's demo views (0: the originals)."""
    size = task.demo_view_size(config)
    from data_prep.demo import build_demo  # the demo's data: data_prep, not sclaro_jax
    data = os.path.join(workdir, "demo_data")
    manifest = os.path.join(data, "manifest.json")
    if not os.path.exists(manifest):
        logging.getLogger("sclaro_jax").info("writing the bundled demo dataset to %s (once) ...",
                                             data)
        build_demo(data, **({"image_size": size} if size else {}), progress=False)
    elif size:
        from sclaro_jax.bounds import read_json
        if read_json(manifest).get("view_size") != size:  # written for another image size
            build_demo(data, image_size=size, overwrite=True, progress=False)
    with config.unlocked():
        config.data.dir = data


def main(argv):
    del argv
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
    check_data_dir(config, task)
    lock.hold_workdir(workdir)  # this process is the run's one writer until it ends
    if not config.data.dir:
        prepare_demo(config, workdir, task)
    fitted = None
    if not FLAGS.eval_only:
        fitted = task.fit(config, workdir, allow_config_change=FLAGS.allow_config_change,
                          verify_data=FLAGS.verify_data, progress=FLAGS.progress)
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
        evaluated = task.evaluate(config, workdir, progress=FLAGS.progress, step=FLAGS.step,
                                  fitted=fitted)
        print(f"\n{evaluated.table}\n\nresults: {evaluated.path} (and "
              f"{os.path.join(workdir, 'results.json')})")
        if evaluated.next:
            print(evaluated.next)


# Errors that are the user's to fix: one `error:` line (and the traceback with --verbose).
def user_errors() -> tuple[type, ...]:
    from sclaro_jax.cli import MissingExtra
    from sclaro_jax.data.dataset import DatasetError
    from sclaro_jax.data.schema import SchemaVersionError
    from sclaro_jax.run.folder import RunError
    return (DatasetError, SchemaVersionError, RunError, FileNotFoundError, PermissionError,
            NotADirectoryError, KeyError, ValueError, flags.Error, MissingExtra)


def fail(message: str, verbose: bool) -> None:
    if verbose:
        import traceback
        traceback.print_exc()
    from sclaro_jax.bounds import printable
    print(f"error: {printable(message)}", file=sys.stderr)
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


def _hyphens(name: str) -> str:
    return "--" + name.replace("_", "-")


def own_flags() -> list:
    """This module's absl flags (the installed `sclaro-train` runs it under another name: absl
    keys flags by the module that defines them)."""
    return FLAGS.get_flags_for_module(FLAGS.find_module_defining_flag("workdir"))


def flags_help() -> str:
    """The flags as users spell them: `--allow-config-change`, `--[no-]eval`."""
    lines = []
    for flag in sorted(own_flags(), key=lambda f: f.name):
        if flag.name == "config":
            lines.append("  --config NAME[:VARIANT] | FILE[:VARIANT]: the recipe (required); "
                         f"then --config.KEY=VALUE overrides (repeatable); {CODE_NOTE}")
            continue
        if flag.boolean:
            spell = f"--[no-]{flag.name.replace('_', '-')}"
            default = f" (default: {'on' if flag.default else 'off'})"
        else:
            spell = f"{_hyphens(flag.name)} VALUE"
            default = "" if flag.default is None else f" (default: {flag.default})"
        lines.append(f"  {spell}: {flag.help}{default}")
    return "\n".join(lines)


def unknown_flag(args: list[str]) -> str | None:
    """The first flag of the command line `args` (as typed) that the launcher does not define,
    with the closest it does ("--workdr (did you mean --workdir?)"), or None."""
    from sclaro_jax.cli import closest

    spelled = []
    for flag in own_flags():
        spelled.append(_hyphens(flag.name))
        if flag.boolean:
            spelled.append("--no-" + flag.name.replace("_", "-"))
    for arg in args:
        if arg == "--":
            break
        if not arg.startswith("--") or arg.startswith(("--config.", "--config=")) \
                or arg == "--config":
            continue
        name = _underscores(arg)[2:].partition("=")[0]
        flag = FLAGS[name] if name in FLAGS else None
        if flag is None and name.startswith("no") and name[2:] in FLAGS:
            flag = FLAGS[name[2:]] if FLAGS[name[2:]].boolean else None
        if flag is None:
            typed = arg.partition("=")[0]
            near = closest(typed.replace("_", "-"), spelled)
            return typed + (f" (did you mean {near}?)" if near else "")
    return None


def usage(message: str, prog: str, verbose: bool) -> None:
    fail(f"{message} (see {prog} --help)", verbose)


def cli(args: list[str]) -> None:
    prog = ("python launch/train.py" if args[0].endswith(".py")
            else os.path.basename(args[0]))
    typed = args[1:]
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
        print("Flags:")
        print(flags_help())
        sys.exit(0)
    try:
        define_flags(spec, argv)  # before any other check: an unknown flag is named first
        if (bad := unknown_flag(typed)):
            usage(f"unrecognized argument: {bad}", prog, verbose)
        if spec is None:
            usage("--config is required: a recipe's name or file[:variant], e.g. "
                  "--config scenarioclip:demo", prog, verbose)
        from sclaro_jax.run.lock import probe_workdir
        workdir, _ = split_flag(argv, "--workdir")
        if not workdir:
            usage("--workdir is required: the run's folder (checkpoints, metrics, results)",
                  prog, verbose)
        probe_workdir(workdir)  # a second run on a busy workdir: refused before jax loads
        argv = FLAGS(argv)  # parse here, so a bad value is one error line too
        if FLAGS.step is not None and not FLAGS.eval_only:
            usage(f"--step {FLAGS.step} picks the checkpoint that --eval-only evaluates; pass "
                  "--eval-only too (training resumes from the newest checkpoint)", prog, verbose)
    except flags.Error as e:
        usage(str(e).replace("flag --config.", "--config."), prog, verbose)
    except KeyError as e:  # an unknown config key (check_override_keys)
        usage(_message(e), prog, verbose)
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
