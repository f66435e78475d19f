"""One grammar for `--config.KEY=VALUE`: every command that takes a recipe's overrides (the
launcher, `launch/train.py`, and its alias for detector runs, `python -m
sclaro_jax.eval.detect`) reads a switch's `True`/`true`/`TRUE`/`1` and `False`/`false`/`0` the
same, and answers a mistyped key, a value of the wrong type, a switch's bad value and a missing
value with the same one `error:` line (less the program's name in `(see PROG --help)`).

In process and without training: the values through each command's parsing function (it
reads the command line and loads the recipe, nothing runs), the errors through each command's
entry point (they are refused before anything runs)."""

import pytest

from launch import train as launcher
from sclaro_jax.config import apply_overrides, load_config
from sclaro_jax.eval import detect

RECIPE = "detection:demo"  # a recipe both commands take (eval.detect: detector runs only)
SWITCH = "checkpoint_async"  # a bool key of the recipe (default True)


def launcher_recipe(workdir, overrides):
    """The recipe `python launch/train.py --config RECIPE --workdir W --eval-only OVERRIDES`
    reads (`launch.train.parse`)."""
    return launcher.parse(["--config", RECIPE, "--workdir", str(workdir), "--eval-only",
                           *overrides]).recipe


def detect_recipe(workdir, overrides):
    """The recipe `python -m sclaro_jax.eval.detect --config RECIPE --workdir W OVERRIDES`
    reads (`eval.detect.parse`)."""
    return detect.parse(["--config", RECIPE, "--workdir", str(workdir), *overrides]).recipe


def direct_recipe(workdir, overrides):
    """`config.apply_overrides` on the recipe (what both commands call), the flags' "KEY=V"."""
    config = load_config(RECIPE)
    apply_overrides(config, [o.removeprefix("--config.") for o in overrides])
    return config


READERS = {"launcher": launcher_recipe, "eval.detect": detect_recipe, "apply_overrides":
           direct_recipe}

BOOLS = [("False", False), ("false", False), ("FALSE", False), ("0", False),
         ("True", True), ("true", True), ("TRUE", True), ("1", True)]


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_switch_reads_the_same_on_every_command(reader, tmp_path):
    """Each spelling, after the opposite value (the overrides apply in order: the last one
    counts, so each case changes the key), in both forms `--config.K=V` and `--config.K V`."""
    read = READERS[reader]
    for text, value in BOOLS:
        before = f"--config.{SWITCH}={'0' if value else '1'}"
        got = read(tmp_path, [before, f"--config.{SWITCH}={text}"])
        assert got[SWITCH] is value, (reader, text)
        if reader != "apply_overrides":
            got = read(tmp_path, [before, f"--config.{SWITCH}", text])
            assert got[SWITCH] is value, (reader, text, "space")
    # the other value kinds, the same way on every command
    got = read(tmp_path, ["--config.epochs=3", "--config.head_lr=.5",
                          "--config.eval_split=val", "--config.backbone.teacher=true"])
    assert (got.epochs, got.head_lr, got.eval_split, got.backbone.teacher) == (
        3, 0.5, "val", True)
    assert type(got.epochs) is int and type(got.head_lr) is float


# (the overrides, what the one error line says): each refused by every command alike
BAD = {
    "typo": (["--config.checkpoint_asynk=false"],
             "unknown config key 'checkpoint_asynk' (in --config.checkpoint_asynk=false); did "
             "you mean checkpoint_async"),
    "wrong type": (["--config.epochs=x"], "--config.epochs=x: config.epochs takes int values "
                                          "(the recipe's is 100), not 'x'"),
    "not whole": (["--config.epochs=1.5"], "--config.epochs=1.5: config.epochs takes int values"),
    "bad switch": ([f"--config.{SWITCH}=maybe"],
                   f"--config.{SWITCH}=maybe: config.{SWITCH} takes bool values (the recipe's "
                   "is True), not 'maybe'; a switch is True, true, 1, False, false or 0"),
    "switch 2": ([f"--config.{SWITCH}=2"], f"config.{SWITCH} takes bool values"),
    "a number as a switch": (["--config.epochs=true"], "config.epochs takes int values"),
    "no value": (["--config.epochs"], "--config.epochs: expected KEY=VALUE"),
}


def _launcher_error(capsys, workdir, overrides) -> str:
    with pytest.raises(SystemExit) as exited:
        launcher.cli(["launch/train.py", "--config", RECIPE, "--workdir", str(workdir),
                      "--eval-only", *overrides])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    return err.rstrip("\n")


def _detect_error(capsys, workdir, overrides) -> str:
    assert detect.main(["--config", RECIPE, "--workdir", str(workdir), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_override_is_the_same_error_line_on_every_command(case, capsys, tmp_path):
    overrides, says = BAD[case]
    lines = {"launcher": _launcher_error(capsys, tmp_path, overrides),
             "eval.detect": _detect_error(capsys, tmp_path, overrides)}
    progs = {"launcher": launcher.PROG, "eval.detect": detect.PROG}
    for name, line in lines.items():
        assert line.startswith("error: ") and says in line, (name, line)
        assert line.endswith(f" (see {progs[name]} --help)"), (name, line)
    same = {line.replace(progs[name], "PROG") for name, line in lines.items()}
    assert len(same) == 1, lines
    with pytest.raises((KeyError, ValueError)):  # the library's own reading refuses it too
        direct_recipe(tmp_path, overrides)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_the_launcher_reads_absls_spellings_and_the_runs_own_recipe(tmp_path):
    """absl's old spellings of the launcher's switches; `--eval-only` without `--config` reads
    WORKDIR/config.json (then the overrides), as eval.detect does."""
    base = ["--config", RECIPE, "--workdir", str(tmp_path)]
    for argv, want in ((["--noeval"], {"eval": False}), (["--no_eval"], {"eval": False}),
                       (["--eval=false"], {"eval": False}), (["--no-eval", "--eval"],
                                                             {"eval": True}),
                       (["--no_progress", "--allow_config_change"],
                        {"progress": False, "allow_config_change": True}),
                       (["--noprogress", "--verify-data", "--verbose"],
                        {"progress": False, "verify_data": True, "verbose": True}),
                       (["--eval_only", "--step", "3"], {"eval_only": True, "step": 3})):
        got = vars(launcher.parse(base + argv))
        assert {k: got[k] for k in want} == want, argv
    written = load_config(RECIPE)
    written.epochs = 7
    (tmp_path / "config.json").write_text(written.to_json_best_effort())
    own = [launcher.parse(["--workdir", str(tmp_path), "--eval-only", "--config.head_lr=0.5"]),
           detect.parse(["--workdir", str(tmp_path), "--config.head_lr=0.5"])]
    for got in own:
        assert got.eval_only and got.config is None
        assert (got.recipe.epochs, got.recipe.head_lr, got.recipe.eval_split) == (
            7, 0.5, written.eval_split)
    with pytest.raises(launcher.UsageError, match="--config is required"):
        launcher.parse(["--workdir", str(tmp_path)])  # training needs a recipe
