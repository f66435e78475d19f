"""Train a task's run, then evaluate it: ScenarioCLIP, a baseline or the detector
(`config.trainer`, a task of `sclaro_jax.run.task`):

    python launch/train.py --config configs/scenarioclip.py[:VARIANT] --workdir DIR [--config.x.y=V]
    python launch/train.py --config configs/detection.py[:demo] --workdir DIR [--config.x.y=V]
    sclaro-train --config detection:demo --workdir DIR     # installed: any folder, by name
    python launch/train.py --workdir DIR --eval-only [--step N] [--config.x.y=V]  # again

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

The command line has one grammar, the one of every command (`sclaro_jax.cli`, and
`sclaro_jax.config.apply_overrides` for the recipe's keys): flags with hyphens (`--no-progress`,
`--allow-config-change`; the underscore spellings and absl's old `--noeval` work too);
`--config.KEY=VALUE` or `--config.KEY VALUE` (repeatable, applied in order) sets a key of the
recipe, its value read as the key's type (a switch takes `True`/`true`/`1` or `False`/`false`/
`0`); a usage error (an unknown flag or config key, with the closest known; a bad value; a
missing --config or --workdir) is one `error: ... (see --help)` line and exit 2, and any other
user error one `error:` line, exit 2 (the traceback too with --verbose).

Evaluating a run again is this command's `--eval-only`: `--workdir DIR --eval-only` alone
evaluates DIR with its own recipe (DIR/config.json), `--config` (and overrides) with another.
`python -m sclaro_jax.eval.detect --workdir DIR` is an alias of it for detector runs.
"""

import argparse
import logging
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # `python launch/train.py` in a checkout: the checkout that holds this file
    sys.path.insert(0, ROOT)  # (imported as launch.train, sclaro-train: importable already)

from sclaro_jax import cli as conventions  # noqa: E402
from sclaro_jax.config import (BOOL_TEXT, CODE_NOTE, apply_overrides,  # noqa: E402
                               list_configs, load_config, run_config, split_overrides)

PROG = "python launch/train.py"


class UsageError(ValueError):
    """A usage error found after the flags were read (a missing --config or --workdir, an
    unknown config key, a bad value): `error: MESSAGE (see PROG --help)`, exit 2."""


def build_parser(prog: str = PROG) -> conventions.ArgumentParser:
    """The launcher's flags (`sclaro_jax.cli`'s conventions). The `--config.KEY=VALUE`
    overrides are taken out of the command line before it is read (`parse`); --help is the
    launcher's own (`print_help`)."""
    on_off = argparse.BooleanOptionalAction
    p = conventions.parser(prog, "Train a task's run, then evaluate it.")
    p.add_argument("--config", default=None, metavar="NAME[:VARIANT]|FILE[:VARIANT]",
                   help="the recipe (required, but with --eval-only: the run's own, "
                        "WORKDIR/config.json); then --config.KEY=VALUE overrides (repeatable); "
                        f"{CODE_NOTE}")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="the run's folder: checkpoints, metrics.jsonl and TensorBoard logs "
                        "(required)")
    p.add_argument("--allow-config-change", action=on_off, default=False,
                   help="continue a run with a config that differs from the one it was "
                        "started with (both are kept in the workdir)")
    p.add_argument("--verify-data", action=on_off, default=False,
                   help="check every shard's sha256 against the manifest before training "
                        "(the quick size and record-count check always runs)")
    p.add_argument("--verbose", action=on_off, default=False, help="print tracebacks for errors")
    p.add_argument("--eval", action=on_off, default=True,
                   help="evaluate the run when its training is complete (--no-eval: train only)")
    p.add_argument("--eval-only", action=on_off, default=False,
                   help="evaluate WORKDIR's newest checkpoint, no training")
    p.add_argument("--step", type=conventions.number_in(0, conventions.INT_MAX), default=None,
                   metavar="N",
                   help="with --eval-only: the checkpoint step to evaluate (default: the newest "
                        "complete one)")
    p.add_argument("--progress", action=on_off, default=True,
                   help="progress bars (--no-progress: none)")
    return p


def _switches(parser) -> set[str]:
    """The on/off flags as defined (`--eval-only`)."""
    return {a.option_strings[0] for a in parser._actions
            if isinstance(a, argparse.BooleanOptionalAction)}


def absl_spellings(args: list[str], switches: set[str]) -> list[str]:
    """absl's spellings of the on/off flags rewritten to the defined ones: `--noeval`,
    `--noallow_config_change` -> `--no-eval`, `--no-allow-config-change`; `--eval=false`,
    `--progress=0` -> `--no-progress`; `--eval=true` -> `--eval`. Up to a bare `--`."""
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        head, eq, value = arg.partition("=")
        name = "--" + head[2:].replace("_", "-") if head.startswith("--") else head
        if name.startswith("--no") and not name.startswith("--no-") \
                and "--" + name[4:] in switches:
            name = "--no-" + name[4:]
            arg = name + eq + value
        if name in switches and eq and value.lower() in BOOL_TEXT:
            arg = name if BOOL_TEXT[value.lower()] else "--no-" + name[2:]
        out.append(arg)
    return out


def parse(args: list[str], prog: str = PROG) -> SimpleNamespace:
    """The command line `args` (without the program's name) read and checked, and its recipe
    loaded with the overrides applied; nothing runs. Returns the flags (workdir, eval,
    eval_only, step, progress, allow_config_change, verify_data, verbose, config: the spec),
    `recipe` (the locked ConfigDict) and `overrides` ("KEY=VALUE", in order). An unknown flag or
    a bad flag value exits 2 with its one line (`sclaro_jax.cli`); a missing --config or
    --workdir, an unknown config key or a bad value raises `UsageError`; a recipe that cannot be
    loaded, an --eval-only workdir that does not exist, a busy workdir (`probe_workdir`, before
    jax is imported) their own errors."""
    overrides, rest = split_overrides(args)
    parser = build_parser(prog)
    flags = parser.parse_args(absl_spellings(rest, _switches(parser)))
    if flags.config is None and not flags.eval_only:
        raise UsageError("--config is required: a recipe's name or file[:variant], e.g. "
                         "--config scenarioclip:demo (with --eval-only, the run's own recipe "
                         "is the default)")
    if not flags.workdir:
        raise UsageError("--workdir is required: the run's folder (checkpoints, metrics, "
                         "results)")
    if flags.step is not None and not flags.eval_only:
        raise UsageError(f"--step {flags.step} picks the checkpoint that --eval-only "
                         "evaluates; pass --eval-only too (training resumes from the newest "
                         "checkpoint)")
    if flags.eval_only and not os.path.isdir(flags.workdir):
        raise FileNotFoundError(f"--workdir {flags.workdir} does not exist: pass the folder of "
                                "a run to evaluate (the --workdir it was trained in)")
    recipe = load_config(flags.config) if flags.config else run_config(flags.workdir)
    try:
        apply_overrides(recipe, overrides)
    except (KeyError, ValueError) as e:  # the recipe's keys are flags of the command line too
        raise UsageError(conventions.message(e)) from e
    recipe.lock()  # a key the recipe does not have is never made
    from sclaro_jax.run.lock import probe_workdir
    probe_workdir(flags.workdir)  # a second run on a busy workdir: refused before jax loads
    return SimpleNamespace(**vars(flags), recipe=recipe, overrides=overrides)

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
    data = os.path.join(workdir, "demo_data")
    manifest = os.path.join(data, "manifest.json")
    if not os.path.exists(manifest):
        from data_prep.demo import build_demo  # the demo's data: data_prep, not sclaro_jax
        logging.getLogger("sclaro_jax").info("writing the bundled demo dataset to %s (once) ...",
                                             data)
        build_demo(data, **({"image_size": size} if size else {}), progress=False)
    elif size:
        from sclaro_jax.bounds import read_json
        if read_json(manifest).get("view_size") != size:  # written for another image size
            from data_prep.demo import build_demo
            build_demo(data, image_size=size, overwrite=True, progress=False)
    with config.unlocked():
        config.data.dir = data


def run(args: SimpleNamespace, only: str | None = None) -> None:
    """Train and evaluate, or evaluate only, the run `args` (`parse`) describes. `only`: the one
    task whose runs this command takes (the refusal of another names eval.suite)."""
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's per-save INFO lines
    logging.getLogger("sclaro_jax").setLevel(logging.INFO)
    config, workdir = args.recipe, args.workdir
    if config.distributed:  # many processes: coordinator and process ids from the environment
        from sclaro_jax.run.sharding import initialize_distributed
        initialize_distributed()
    from sclaro_jax.run import lock, task as tasks
    task = tasks.of(config)
    if only and task.name != only:
        wanted = "a detector's" if only == "detection" else f"a {only} run"
        raise ValueError(f"{workdir} is a {task.name} run, not {wanted}: evaluate it with "
                         "python -m sclaro_jax.eval.suite")
    task.check(config)  # before anything is written
    check_data_dir(config, task)
    lock.hold_workdir(workdir)  # this process is the run's one writer until it ends
    if not config.data.dir:
        prepare_demo(config, workdir, task)
    fitted = None
    if not args.eval_only:
        fitted = task.fit(config, workdir, allow_config_change=args.allow_config_change,
                          verify_data=args.verify_data, progress=args.progress)
        if fitted.step < fitted.steps:
            print(f"stopped at step {fitted.step} of {fitted.steps}; rerun the same command to "
                  "continue")
            return
        print(f"done: {fitted.steps} steps; metrics in {os.path.join(workdir, 'metrics.jsonl')},"
              f" checkpoints in {os.path.join(workdir, 'checkpoints')}")
    if (args.eval_only or args.eval) and config.distributed:
        print(f"evaluation: one process evaluates a run; python launch/train.py --workdir "
              f"{workdir} --eval-only")
    elif args.eval_only or args.eval:
        evaluated = task.evaluate(config, workdir, progress=args.progress, step=args.step,
                                  fitted=fitted)
        print(f"\n{evaluated.table}\n\nresults: {evaluated.path} (and "
              f"{os.path.join(workdir, 'results.json')})")
        if evaluated.next:
            print(evaluated.next)


# Errors that are the user's to fix: one `error:` line (and the traceback with --verbose).
def user_errors() -> tuple[type, ...]:
    from sclaro_jax.data.dataset import DatasetError
    from sclaro_jax.data.schema import SchemaVersionError
    from sclaro_jax.run.folder import RunError
    return (DatasetError, SchemaVersionError, RunError, *conventions.USER_ERRORS)


def flags_help(parser) -> str:
    """The flags as users spell them: `--allow-config-change`, `--[no-]eval`."""
    lines = []
    for action in sorted(parser._actions, key=lambda a: a.option_strings[0].lstrip("-")):
        flag = action.option_strings[0]
        if flag in ("-h", "--help"):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            spell = "--[no-]" + flag[2:]
            default = f" (default: {'on' if action.default else 'off'})"
        else:
            spell = f"{flag} {action.metavar or 'VALUE'}"
            default = "" if action.default is None else f" (default: {action.default})"
        lines.append(f"  {spell}: {action.help}{default}")
    return "\n".join(lines)


def print_help(prog: str) -> None:
    print(__doc__)
    print("Recipes and their variants (--config NAME[:VARIANT], or a file: "
          "configs/NAME.py[:VARIANT] in a checkout):")
    print("\n".join(list_configs()))
    print()
    print("Flags:")
    print(flags_help(build_parser(prog)))


def main(args: list[str], prog: str = PROG, only: str | None = None) -> int:
    """The launcher on the command line `args` (without the program's name): 0 when it ran,
    2 after a user error's one `error:` line (a usage error's ends `(see PROG --help)`); an
    unknown flag or a bad flag value exits 2 (argparse). `only`: `run`'s."""
    before = args[:args.index("--")] if "--" in args else args
    if any(arg in ("-h", "--help", "--helpshort") for arg in before):
        print_help(prog)
        return 0
    verbose = "--verbose" in before
    try:
        launch = parse(args, prog)
        verbose = launch.verbose
    except UsageError as e:
        return conventions.fail(UsageError(f"{e} (see {prog} --help)"), verbose)
    except user_errors() as e:
        return conventions.fail(e, verbose)
    from absl import app
    try:
        # absl's flags parsed (Grain's worker processes read them) and its log handler, with no
        # flag of the command line: they were read above
        app.run(lambda _: run(launch, only), argv=[prog])
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    except conventions.INTERRUPTS as e:  # the second Ctrl-C: out at once, without the
        if not conventions.ctrl_c(e):     # threads' noise
            raise
        if verbose:
            import traceback
            traceback.print_exc()
        print("error: aborted (a second interrupt); the run's complete checkpoints are kept: "
              "rerun the same command to continue from the newest", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)  # background writer threads would hold the exit (and print on the way)
    except user_errors() as e:
        return conventions.fail(e, verbose)
    return 0


def cli(args: list[str]) -> None:
    """`args` as sys.argv holds it: exits 2 after a user error, returns when the run ran."""
    prog = PROG if args[0].endswith(".py") else os.path.basename(args[0])
    code = main(args[1:], prog)
    if code:
        sys.exit(code)


def console() -> None:
    """`sclaro-train`, the installed command."""
    from sclaro_jax.heap import freeze_for_process
    freeze_for_process()  # a command's process (not `main` or `run` called by a program)
    cli(sys.argv)


if __name__ == "__main__":
    console()
