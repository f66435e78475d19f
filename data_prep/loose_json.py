"""A tolerant JSON reader for VLM replies: `json` first, then a parser of its own (no `eval`)
that reads what VLMs write instead of JSON. Every repair it makes is recorded as a short code in
a `Notes` list (the codes are listed in `data_prep.vlm_reply.RECOVERY_NOTES`).

Any text is read without an exception, in time linear in its length: containers nested deeper
than `MAX_DEPTH` are cut there like a syntax error (no recursion past it), and an integer
longer than Python's int conversion limit reads as a float (inf beyond float's range).
"""

from __future__ import annotations

import json
import re
from typing import Any


class Notes(list):
    """Recovery codes in the order first met, each once."""

    def add(self, code: str) -> None:
        if code not in self:
            self.append(code)


class _Ellipsis:
    """`...` placeholder copied from the prompt's example; skipped wherever it appears."""


ELLIPSIS = _Ellipsis()
MAX_DEPTH = 64  # containers nested deeper are cut (a reply needs 3: object, relations, triplet)


def parse_at(text: str, start: int, notes: Notes) -> tuple[Any, int | None]:
    """Parse the value at `start`: json first, then the tolerant parser. Returns (value, end);
    end is None when the text was cut (truncated or a syntax error; value is then None when
    not even a container had begun). Never raises for any `text`."""
    try:
        value, end = json.JSONDecoder(
            object_pairs_hook=lambda pairs: _pairs_to_dict(pairs, notes),
            parse_int=_int).raw_decode(text, start)
        if not _deeper_than(value, MAX_DEPTH):
            return value, end
    except (json.JSONDecodeError, RecursionError):  # json's C scanner recurses per level
        pass
    notes.clear()
    parser = LooseParser(text, start, notes)
    try:
        value = parser.value()
    except _Cut:  # a scalar cut short, or no value at all
        return None, None
    return value, None if parser.stopped else parser.pos


def _int(digits: str) -> int | float:
    """A JSON integer; a float when it has more digits than Python converts to int."""
    try:
        return int(digits)
    except ValueError:
        return float(digits)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` holds lists / dicts nested more than `limit` deep (without recursing)."""
    level = [value]
    for _ in range(limit):
        level = [v for item in level if isinstance(item, (list, dict))
                 for v in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return False
    return any(isinstance(v, (list, dict)) for v in level)


def keep_first_non_empty(out: dict, key: Any, value: Any, notes: Notes) -> None:
    """out[key] = value, unless `key` is already there with a non-empty value (a repeated key
    keeps its first non-empty value; "duplicate_key" is noted)."""
    if key in out:
        notes.add("duplicate_key")
        if not is_empty(out[key]):
            return
    out[key] = value


def _pairs_to_dict(pairs: list[tuple[str, Any]], notes: Notes) -> dict:
    out: dict = {}
    for key, value in pairs:
        keep_first_non_empty(out, key, value, notes)
    return out


def is_empty(value: Any) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return value is None or value == [] or value == {}


class _Cut(Exception):
    """Raised by a scalar that ran into the end of the text or a syntax error."""


OPEN_QUOTES = {'"': '"', "'": "'", "\u201c": "\u201d\"", "\u2018": "\u2019'",
               "\u201e": "\u201c\u201d\""}
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\",
           '"': '"', "'": "'"}
NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_ \-]*")  # a key when `COLON` follows
COLON = re.compile(r"\s*:")
CONSTANTS = {"true": True, "false": False, "null": None}
PY_CONSTANTS = {"True": True, "False": False, "None": None}


class LooseParser:
    """JSON plus what VLMs write instead: missing or extra commas, single / curly quotes,
    Python literals and tuples, bare keys, comments, `...`, unescaped inner quotes. At the end
    of the text or at a syntax error (a container opened `MAX_DEPTH` deep is one) it stops and
    closes every open container, dropping the scalar it was reading."""

    def __init__(self, text: str, pos: int, notes: Notes):
        self.text, self.pos, self.notes = text, pos, notes
        self.stopped = False
        self.depth = 0  # containers open

    def stop(self, code: str) -> None:
        self.stopped = True
        self.notes.add(code)

    def skip_space(self) -> None:
        text = self.text
        while self.pos < len(text):
            if text[self.pos].isspace():
                self.pos += 1
            elif text.startswith("//", self.pos) or text.startswith("/*", self.pos):
                closer = "\n" if text[self.pos + 1] == "/" else "*/"
                end = text.find(closer, self.pos + 2)
                self.pos = len(text) if end < 0 else end + len(closer)
                self.notes.add("comments")
            else:
                break

    def value(self) -> Any:
        """A container (possibly partial) or a scalar; scalars raise _Cut when cut."""
        self.skip_space()
        if self.pos >= len(self.text):
            self.stop("truncated")
            raise _Cut
        char = self.text[self.pos]
        if char in "{[(":
            return self.container(char)
        if char in OPEN_QUOTES:
            return self.string()
        if self.text.startswith("...", self.pos) or char == "\u2026":
            self.pos += 1 if char == "\u2026" else 3
            self.notes.add("ellipsis")
            return ELLIPSIS
        match = NUMBER.match(self.text, self.pos)
        if match:
            self.pos = match.end()
            return _int(match.group()) if match.group(1) is match.group(2) is None \
                else float(match.group())
        match = WORD.match(self.text, self.pos)
        if match and match.group() in CONSTANTS | PY_CONSTANTS:
            self.pos = match.end()
            if match.group() in PY_CONSTANTS:
                self.notes.add("python_literals")
            return (CONSTANTS | PY_CONSTANTS)[match.group()]
        self.stop("cut_at_syntax_error")
        raise _Cut

    def container(self, char: str) -> list | dict:
        if self.depth >= MAX_DEPTH:
            self.stop("cut_at_syntax_error")
            raise _Cut
        if char == "(":
            self.notes.add("python_literals")
        self.depth += 1
        try:
            return self.object() if char == "{" else self.array("]" if char == "[" else ")")
        finally:
            self.depth -= 1

    def separator(self, closer: str, started: bool, after_comma: bool) -> str:
        """Consume commas before the next member; returns "close", "member" or "end"."""
        while True:
            self.skip_space()
            if self.pos >= len(self.text):
                self.stop("truncated")
                return "end"
            char = self.text[self.pos]
            if char == closer:
                self.pos += 1
                if after_comma and started:
                    self.notes.add("trailing_comma")
                return "close"
            if char == ",":
                if after_comma or not started:
                    self.notes.add("extra_comma")
                after_comma = True
                self.pos += 1
                continue
            if started and not after_comma:
                self.notes.add("missing_commas")
            return "member"

    def array(self, closer: str) -> list:
        self.pos += 1
        items: list = []
        members = 0  # including skipped `...`
        after_comma = False
        while True:
            step = self.separator(closer, members > 0, after_comma)
            if step != "member":
                return items
            if self.text[self.pos] in "}])":
                self.stop("cut_at_syntax_error")
                return items
            try:
                item = self.value()
            except _Cut:
                return items
            if item is not ELLIPSIS:
                items.append(item)
            if self.stopped:
                return items
            members += 1
            after_comma = False

    def object(self) -> dict:
        self.pos += 1
        pairs: list = []
        members = 0
        after_comma = False
        while True:
            step = self.separator("}", members > 0, after_comma)
            if step != "member":
                return _pairs_to_dict(pairs, self.notes)
            if self.text[self.pos] in OPEN_QUOTES:
                try:
                    key = self.string()
                except _Cut:
                    return _pairs_to_dict(pairs, self.notes)
            else:
                match = BARE_KEY.match(self.text, self.pos)
                if not match or not COLON.match(self.text, match.end()):
                    self.stop("cut_at_syntax_error")
                    return _pairs_to_dict(pairs, self.notes)
                key = match.group().strip()
                self.pos = match.end()
                self.notes.add("unquoted_keys")
            self.skip_space()
            if self.pos >= len(self.text) or self.text[self.pos] != ":":
                self.stop("truncated" if self.pos >= len(self.text) else "cut_at_syntax_error")
                return _pairs_to_dict(pairs, self.notes)
            self.pos += 1
            try:
                value = self.value()
            except _Cut:
                return _pairs_to_dict(pairs, self.notes)
            if value is not ELLIPSIS:
                pairs.append((key, value))
            if self.stopped:
                return _pairs_to_dict(pairs, self.notes)
            members += 1
            after_comma = False

    def string(self) -> str:
        text = self.text
        opener = text[self.pos]
        closers = OPEN_QUOTES[opener]
        if opener == "'":
            self.notes.add("single_quotes")
        elif opener != '"':
            self.notes.add("unicode_quotes")
        pos = self.pos + 1
        out = []
        while pos < len(text):
            char = text[pos]
            if char == "\\" and pos + 1 < len(text):
                nxt = text[pos + 1]
                if nxt == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", text[pos + 2:pos + 6]):
                    out.append(chr(int(text[pos + 2:pos + 6], 16)))
                    pos += 6
                else:
                    out.append(ESCAPES.get(nxt, nxt))
                    pos += 2
                continue
            if char in closers and self._closes(pos + 1):
                self.pos = pos + 1
                return "".join(out)
            out.append(char)
            pos += 1
        self.pos = len(text)
        self.stop("truncated")
        raise _Cut

    def _closes(self, pos: int) -> bool:
        """A quote closes its string when followed by a delimiter, a newline, another quote or
        the end; otherwise it is an apostrophe or an unescaped inner quote."""
        text = self.text
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        return (pos >= len(text) or text[pos] in ",:]})\r\n" or text[pos] in OPEN_QUOTES
                or text.startswith("//", pos))
