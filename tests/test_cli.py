"""One convention for every command line (`sclaro_jax.cli`): flags documented with hyphens, the
underscore spelling accepted as a hidden alias; --help states each default once; a user error
is one `error:` line and exit status 2."""

import argparse
import os
import re

import pytest

from sclaro_jax import cli
from sclaro_jax.eval import detect, rocs, suite
from sclaro_jax.eval.retrieval import synthetic
from sclaro_jax.export import wds


def parsers() -> dict:
    """{name: (the parser, the parser that owns the flags, argv prefix of the sub-command)}."""
    from data_prep.__main__ import build_parser
    out = {m.__name__.removeprefix("sclaro_jax."): (m._parser(),) * 2 + ([],)
           for m in (suite, rocs, detect, synthetic, wds)}
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        out[f"data_prep {name}"] = (top, parser, [name])
    return out


def _value(action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    if action.dest == "stage_cpus":  # "auto" or a number
        return ["0.5"]
    if hasattr(action.type, "range"):  # cli.number_in
        return [str(action.type.range[0])]
    return [{int: "3", cli.positive_int: "3", float: "0.5"}.get(action.type, "v")]


@pytest.mark.parametrize("name", sorted(parsers()))
def test_flags_are_documented_with_hyphens_and_take_underscores(name):
    parser, owner, prefix = parsers()[name]
    assert not re.findall(r"(?<![\w-])--[a-z0-9]+_\w*", owner.format_help())
    required = [x for a in owner._actions if a.required
                for x in [a.option_strings[0], *_value(a)]]
    aliases = 0
    for action in owner._actions:
        for flag in action.option_strings:
            if not flag.startswith("--") or "-" not in flag[2:] or action.required:
                continue
            alias = "--" + flag[2:].replace("-", "_")
            want = parser.parse_args([*prefix, *required, flag, *_value(action)])
            got = parser.parse_args([*prefix, *required, alias, *_value(action)])
            assert vars(got) == vars(want), (flag, alias)
            aliases += 1
    assert aliases  # every command has hyphenated flags


def test_the_no_progress_flag_in_both_spellings():
    from data_prep.__main__ import build_parser
    argvs = {"eval.suite": (suite._parser(), ["--workdir", "w"]),
             "eval.rocs": (rocs._parser(), ["--model", "m", "--split", "s"]),
             "eval.detect": (detect._parser(), ["--workdir", "w"]),
             "data_prep curate": (build_parser(), ["curate", "--data", "d", "--out", "o"]),
             "data_prep reshard": (build_parser(), ["reshard", "--in", "i", "--out", "o"])}
    for name, (parser, argv) in argvs.items():
        for flag in ("--no-progress", "--no_progress"):
            assert parser.parse_args(argv + [flag]).no_progress is True, (name, flag)
        assert parser.parse_args(argv).no_progress is False, name
    reshard = argvs["data_prep reshard"]
    for flag, keep in (("--no_keep_originals", False), ("--keep_originals", True),
                       ("--no-keep-originals", False)):
        assert reshard[0].parse_args(reshard[1] + [flag]).keep_originals is keep, flag


@pytest.mark.parametrize("module", [suite, rocs, detect, synthetic])
def test_help_states_each_default_once(module):
    """Every option with a default (not None, not empty, not a flag's False) says it exactly
    once in --help, as "(default: X)" or in its own words; the others say no
    "(default: None)"."""
    parser = module._parser()
    text = parser.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: [])" not in text
    assert ".:" not in text  # the description's sentence ends once
    # the option blocks of the help, whitespace normalised (wrapping may split "(default: x)")
    options = text[text.index("options:"):]
    blocks = {}
    for chunk in re.split(r"\n(?=  -)", options):
        first = chunk.split()[0].rstrip(",")
        blocks[first] = " ".join(chunk.split())
    for action in parser._actions:
        if not action.option_strings or action.default == argparse.SUPPRESS:
            continue  # --help
        block = blocks[action.option_strings[0]]
        assert block.count("(default") <= 1, block
        if not (action.default is None or action.default is False
                or action.default in ("", [])):
            assert block.count(f"(default: {action.default})") == 1 or (
                "default" in (action.help or "")), block
    if module is rocs:
        assert "embedding cache (default: OUT/cache)" in blocks["--cache-dir"]
        assert blocks["--batch-size"].count("default") == 1


def test_data_prep_user_errors_exit_2_naming_the_folder(tmp_path, capsys):
    """A folder of the user's own that is not a dataset: one `error:` line that names it and
    says what writes a dataset (the demo only one of the options), exit 2."""
    from data_prep.__main__ import main
    mine = tmp_path / "my_photos"
    mine.mkdir()
    (mine / "a.jpg").write_bytes(b"")
    assert main(["reshard", "--in", str(mine), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert f"{mine} is not a SCLARO dataset folder" in err
    assert "`python -m data_prep annotate --root IMAGES --out DIR`" in err
    assert "or the bundled demo, `python -m data_prep demo --out DIR`" in err


def _usage_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    return err.rstrip("\n")


def test_usage_errors_are_one_line_naming_the_typo_first(tmp_path, capsys):
    """argparse's usage block is gone; an unknown flag is named (with the closest flag of the
    sub-command that was reached) before a missing required flag; a mistyped sub-command or
    choice gets the closest; no sub-command at all names them."""
    from data_prep.__main__ import main
    assert _usage_error(capsys, main, ["annotate", "--sorce", "folder"]) == (
        "error: unrecognized argument: --sorce (did you mean --source?) "
        "(see python -m data_prep annotate --help)")
    # --dta is curate's --data, not annotate's --detector or another command's flag
    assert _usage_error(capsys, main, ["curate", "--dta", "x", "--out", str(tmp_path)]) == (
        "error: unrecognized argument: --dta (did you mean --data?) "
        "(see python -m data_prep curate --help)")
    err = _usage_error(capsys, main, ["anotate", "--root", "x"])
    assert err.startswith("error: argument COMMAND: invalid choice: 'anotate' (choose from ")
    assert err.endswith("(did you mean annotate?) (see python -m data_prep --help)")
    assert _usage_error(capsys, main, []) == (
        "error: a command is required: one of demo, demo-models, annotate, import, curate, "
        "reshard, rocs (see python -m data_prep --help)")
    assert _usage_error(capsys, rocs.main, ["--model", "m", "--split", "s", "--k", "x"]) == (
        "error: argument --k: 'x' is not a whole number from 1 to 2147483647 (see python -m "
        "sclaro_jax.eval.rocs --help)")
    assert _usage_error(capsys, rocs.main, ["--modl", "m", "--sply", "s"]) == (
        "error: unrecognized arguments: --modl (did you mean --model?), --sply (did you mean "
        "--split?) (see python -m sclaro_jax.eval.rocs --help)")
    # an empty argument (a script's variable that expanded to nothing) is named as one
    empty = ("error: unrecognized argument: '' (an empty argument: a shell variable or array "
             "that expanded to nothing?) (see {} --help)")
    assert _usage_error(capsys, rocs.main, ["--model", "m", "--split", "s", ""]) == empty.format(
        "python -m sclaro_jax.eval.rocs")
    from launch import train as launcher
    assert _usage_error(capsys, launcher.cli, ["launch/train.py", "--config", "scenarioclip:demo",
                                               "--workdir", str(tmp_path), ""]) == empty.format(
        "python launch/train.py")


def test_an_output_folder_is_checked_when_the_flags_are_read(tmp_path, capsys):
    """`cli.writable`: a file in the way, a folder that takes no new files (/proc, even for
    root), all before any work; a writable path comes back unchanged and leaves nothing."""
    from sclaro_jax import cli
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for out, why in ((a_file, f"{a_file} is a file, not a folder"),
                     (a_file / "sub", f"cannot write {a_file / 'sub'}: {a_file} is a file, not "
                                      "a folder"),
                     ("/proc/sclaro/out", "cannot write /proc/sclaro/out: /proc refuses new "
                                          "files (No such file or directory)")):
        assert _usage_error(capsys, synthetic.main, ["--out", str(out)]) == (
            f"error: argument --out: {why} (see python -m sclaro_jax.eval.retrieval.synthetic "
            "--help)")
    fresh = tmp_path / "new" / "deeper"
    assert cli.writable(str(fresh)) == str(fresh)
    assert os.listdir(tmp_path) == ["a_file"]


def test_ctrl_c_is_a_keyboard_interrupt_or_a_system_error_raised_over_one():
    """`cli.ctrl_c`: the commands that report Ctrl-C in one line catch what CPython raises when
    the interrupt lands under a C call that ignores it (a SystemError whose context is the
    KeyboardInterrupt), and nothing else."""
    def caught(raise_inner, outer):
        try:
            try:
                raise_inner()
            except BaseException:
                raise outer
        except BaseException as e:  # noqa: BLE001
            return e

    def interrupt():
        raise KeyboardInterrupt

    def value_error():
        raise ValueError("x")

    assert cli.ctrl_c(KeyboardInterrupt())
    assert cli.ctrl_c(caught(interrupt, SystemError("returned a result with an exception set")))
    nested = caught(lambda: (_ for _ in ()).throw(
        caught(interrupt, SystemError("inner"))), SystemError("outer"))
    assert cli.ctrl_c(nested)
    assert not cli.ctrl_c(SystemError("a bug of its own"))
    assert not cli.ctrl_c(caught(value_error, SystemError("over a ValueError")))
    assert not cli.ctrl_c(caught(interrupt, ValueError("a ValueError over an interrupt")))
    assert not cli.ctrl_c(ValueError("x"))
