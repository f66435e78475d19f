"""The conventions every command line shares (`python -m data_prep` and its sub-commands,
`python -m sclaro_jax.eval.suite`, `.rocs`, `.detect`, `.retrieval.synthetic`,
`python -m sclaro_jax.export.wds`):

- flags are spelled with hyphens (`--no-progress`, `--batch-size`), and that is what --help,
  the usage line and error messages show; the same flag with underscores (`--no_progress`,
  `--batch_size`) is accepted as a hidden alias, so either habit works;
- --help states each default once (`DefaultsOnce`);
- a user error (a bad flag value, a missing file, a folder that is not a dataset) prints one
  `error:` line and exits 2; a traceback (exit 1) is a bug.
"""

from __future__ import annotations

import argparse
import sys


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


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` that also accepts each long flag in its other spelling
    (`other_spelling`) without listing it anywhere. Sub-command parsers made with
    `add_subparsers().add_parser` are of this class too.

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
        return super().parse_known_args(args, namespace)


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
