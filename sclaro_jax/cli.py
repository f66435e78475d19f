"""The conventions every command line shares (`python -m data_prep` and its sub-commands,
`python -m sclaro_jax.eval.suite`, `.rocs`, `.detect`, `.retrieval.synthetic`,
`python -m sclaro_jax.export.wds`):

- flags are spelled with hyphens (`--no-progress`, `--batch-size`), and that is what --help,
  the usage line and error messages show; the same flag with underscores (`--no_progress`,
  `--batch_size`) is accepted as a hidden alias, so either habit works;
- --help states each default once (`DefaultsOnce`);
- a usage error (an unknown flag, a missing or badly typed value) is one line,
  `error: MESSAGE (see PROG --help)`, exit 2, without argparse's usage block; an unknown flag
  (or sub-command, or choice) is named before any missing required one, with the closest known
  spelling ("did you mean --source?");
- an output folder flag (`type=writable`) is checked at parse time: one that cannot be written,
  or that others may write (writable by every user without the sticky bit, or another user's),
  is a usage error naming the folder and why;
- a number flag declares its range (`number_in`): `--top 0`, `--alpha nan` are usage errors
  naming the flag and the range;
- any other user error (a missing file, a folder that is not a dataset, a folder that cannot be
  written, an optional package that is not installed; `USER_ERRORS`) prints one `error:` line
  (`message`) and exits 2; a traceback (exit 1) is a bug. A missing optional package
  (`MissingExtra`, from `need`) names the extra that brings it and the pip command. Control
  characters in the line (a file name or label from data holding ESC, BEL, a newline or
  U+202E) are escaped (`bounds.printable`): it stays one line and cannot drive the terminal.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import math
import numbers
import os
import re
import sys

from sclaro_jax.bounds import printable
from sclaro_jax.files import UnsafePathError, probe_writable, refuse_shared_folder


class MissingExtra(ImportError):
    """An optional package that is not installed: the message names what needs it, the extra
    that brings it and the pip command (`need`). A user error (`USER_ERRORS`)."""


def install_command(extra: str) -> str:
    """The pip command that installs `extra`."""
    return f'pip install -e ".[{extra}]" from the sclaro-jax checkout'


def need(module: str, extra: str, purpose: str, package: str | None = None,
         otherwise: str = ""):
    """`importlib.import_module(module)`, or `MissingExtra`: "PURPOSE needs the PACKAGE package
    (CAUSE): install the `EXTRA` extra, pip install ...[, or OTHERWISE]" (PACKAGE: `module`'s
    top name; OTHERWISE: how to do without, e.g. "pass --no-figures")."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = package or module.partition(".")[0]
        cause = (str(e).strip().splitlines() or ["it did not import"])[0]
        raise MissingExtra(f"{purpose} needs the {package} package ({cause}): install the "
                           f"`{extra}` extra, {install_command(extra)}"
                           + (f", or {otherwise}" if otherwise else ""), name=package) from None


# Errors a command reports as one `error:` line (exit 2): missing or unwritable files and
# folders (OSError), bad values and folders that are not what they should be (ValueError, the
# base of the library's own errors: DatasetError, RangeError, ...), unknown keys, optional
# packages that are not installed (MissingExtra).
USER_ERRORS = (OSError, ValueError, KeyError, MissingExtra)


# What a Ctrl-C arrives as (`ctrl_c` tells which of them is one): `except INTERRUPTS as e:` then
# `if not ctrl_c(e): raise`.
INTERRUPTS = (KeyboardInterrupt, SystemError)


def ctrl_c(e: BaseException) -> bool:
    """Whether `e` is a Ctrl-C: a KeyboardInterrupt, or the SystemError CPython raises when the
    interrupt lands in Python code that a C function called and did not check (`<built-in
    function fspath> returned a result with an exception set`, the KeyboardInterrupt as its
    context). A command that reports an interrupt in one line catches both."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        if not isinstance(e, SystemError):
            return False
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def message(e: BaseException) -> str:
    """The one line that reports `e`: an OSError as 'PATH: what went wrong', a KeyError without
    its quotes, others as they are."""
    if isinstance(e, OSError) and e.strerror:
        where = e.filename if e.filename is not None else ""
        return f"{where}: {e.strerror}" if where else e.strerror
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return str(e)


def fail(e: BaseException, verbose: bool = False) -> int:
    """Print `e`'s one `error:` line (after its traceback with --verbose); returns 2, the exit
    status of a user error."""
    if verbose:
        import traceback
        traceback.print_exc()
    print(f"error: {printable(message(e))}", file=sys.stderr)
    return 2


def closest(name: str, known) -> str | None:
    """The known spelling closest to a mistyped `name`, or None."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return found[0] if found else None


def writable(path: str) -> str:
    """argparse `type=` of an output folder: `path` unchanged when it, or the folder it would be
    made in, can be written (a probe file is made and removed there); else a usage error naming
    the folder and why (`--out /proc/x`: "cannot write /proc/x: /proc refuses new files (No
    such file or directory)"); so is a folder others may write (`files.refuse_shared_folder`)."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(full) and not os.path.isdir(full):
        raise argparse.ArgumentTypeError(f"{path} is a file, not a folder")
    probe = full
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise argparse.ArgumentTypeError(f"cannot write {path}: {probe} is a file, not a folder")
    try:
        probe_writable(probe)
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot write {path}: {probe} refuses new files ({e.strerror})") from None
    try:  # a folder others may write in (it, or the one it would be made in) is refused
        refuse_shared_folder(probe)
    except UnsafePathError as e:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {e}") from None
    return path


def positive_int(text: str) -> int:
    """argparse `type=` of a count of at least 1 (`--workers 0` is a usage error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


INT_MAX = 2**31 - 1  # the largest count a flag takes (a C int: faiss's nprobe, int32 row ids)


def _range_text(lo, hi) -> str:
    if isinstance(lo, numbers.Integral):
        return f"a whole number from {lo} to {hi}"
    return f"a number from {lo:g} to {hi:g}"


def in_range(value, lo, hi, name: str):
    """`value` when it is a number in [lo, hi] (a whole one where `lo` is an int; nan, inf and
    bools never are); else a ValueError naming `name` and the range."""
    whole = isinstance(lo, numbers.Integral)
    ok = (isinstance(value, numbers.Integral if whole else numbers.Real)
          and not isinstance(value, bool) and (whole or math.isfinite(value))
          and lo <= value <= hi)
    if not ok:
        raise ValueError(f"{name} must be {_range_text(lo, hi)}, not {value!r}")
    return int(value) if whole else float(value)


def number_in(lo, hi):
    """argparse `type=` of a number in [lo, hi] (`in_range`: whole where `lo` is an int):
    `--top 0` is the usage error "argument --top: '0' is not a whole number from 1 to
    2147483647"."""
    whole = isinstance(lo, numbers.Integral)

    def parse(text: str):
        try:
            return in_range(int(text) if whole else float(text), lo, hi, "value")
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {_range_text(lo, hi)}") from None

    parse.__name__ = f"number in [{lo}, {hi}]"
    parse.range = (lo, hi)
    return parse


def other_spelling(option: str) -> str | None:
    """'--no-progress' -> '--no_progress' and back; None for a flag with neither."""
    if not option.startswith("--"):
        return None
    body = option[2:]
    if "-" in body:
        return "--" + body.replace("-", "_")
    if "_" in body:
        return "--" + body.replace("_", "-")
    return None


_deepest: list = []  # [the innermost parser the last parse reached (a sub-command's)]


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` that also accepts each long flag in its other spelling
    (`other_spelling`) without listing it anywhere, and reports usage errors in one line
    (`error`). Sub-command parsers made with `add_subparsers().add_parser` are of this class
    too.

    The alias is rewritten to the flag as defined before argparse sees the arguments (a whole
    argument `--no_progress`, or `--batch_size=8`; nothing after a bare `--`), so a
    `--no_keep_originals` reaches a BooleanOptionalAction as `--no-keep-originals`, and the
    checks of required flags, help and error messages only ever see the defined spelling."""

    def aliases(self) -> dict[str, str]:
        """{alias: the defined flag} of this parser's own flags (not its sub-commands')."""
        defined = set(self._option_string_actions)
        out = {}
        for action in self._actions:
            for option in action.option_strings:
                alias = other_spelling(option)
                if alias and alias not in defined:
                    out[alias] = option
        return out

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        aliases = self.aliases()
        if aliases:
            out = []
            for i, arg in enumerate(args):
                if arg == "--":
                    out += args[i:]
                    break
                head, sep, value = arg.partition("=")
                out.append(aliases[head] + sep + value if head in aliases else arg)
            args = out
        self._argv = args
        _deepest[:] = [self]  # a sub-command's parser, entered next, takes the place
        return super().parse_known_args(args, namespace)

    def subparsers(self) -> list["ArgumentParser"]:
        """This parser's sub-command parsers, theirs and so on."""
        out = []
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    out += [sub, *getattr(sub, "subparsers", list)()]
        return out

    def long_options(self) -> list[str]:
        return [o for o in self._option_string_actions if o.startswith("--")]

    def unknown_flags(self, argv) -> list[str]:
        """The `--flags` of `argv` this parser defines neither whole nor as a prefix
        (argparse's abbreviations), up to a bare `--` (or a sub-command's name)."""
        known, out, commands = self.long_options(), [], bool(self.subparsers())
        for arg in argv:
            if arg == "--" or (commands and not arg.startswith("-")):
                break  # the rest is a sub-command's
            head = arg.partition("=")[0]
            if not head.startswith("--") or head in known:
                continue
            if self.allow_abbrev and any(k.startswith(head) for k in known):
                continue
            out.append(head)
        return out

    def suggest(self, flag: str) -> str:
        near = closest(flag, self.long_options())
        return f"{flag} (did you mean {near}?)" if near else flag

    def error(self, message):
        """One line, `error: MESSAGE (see PROG --help)`, and exit 2. Unknown flags are named
        (with the closest known) in place of argparse's complaint when the parse that failed
        reached them: `annotate --sorce folder` says --sorce, not that --root is missing. The
        parser reporting is the innermost one the parse reached (a sub-command's)."""
        parser = self
        if _deepest and _deepest[0] in self.subparsers():
            parser = _deepest[0]
        unknown = parser.unknown_flags(getattr(parser, "_argv", []))
        if message.startswith("unrecognized arguments:") and "" in getattr(parser, "_argv", []):
            message = ("unrecognized argument: '' (an empty argument: a shell variable or array "
                       "that expanded to nothing?)")
        elif unknown:
            named = ", ".join(parser.suggest(f) for f in unknown)
            message = f"unrecognized argument{'s' if len(unknown) > 1 else ''}: {named}"
        elif (m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)):
            near = closest(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
            if near:
                message = f"{message} (did you mean {near}?)"
        self.exit(2, f"error: {printable(message)} (see {parser.prog} --help)\n")


class DefaultsOnce(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help once: not when the help already states its
    default (says "default"), nor for an unset default (None, "", an empty list) or a flag's
    False."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == argparse.SUPPRESS
                or (isinstance(default, (str, list, tuple)) and not default)
                or "default" in text or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def parser(prog: str, description: str) -> ArgumentParser:
    """A command's top-level parser: `ArgumentParser` with the `DefaultsOnce` help."""
    return ArgumentParser(prog=prog, description=description, formatter_class=DefaultsOnce)
