"""Stage 1 of the SCLARO annotation pipeline (appendix A): ask a VLM for an action, objects,
relation triplets and a caption per image, and parse its reply.

Replies are often not valid JSON (the prompt's own example lacks commas), so `parse_response`
tries `json` first and then a tolerant parser of its own (no `eval`). Every recovery it applies
is recorded in the result's `notes` as a short code from `RECOVERY_NOTES` (codes ending in ":"
take a suffix, e.g. "missing_key:action", "relation_dropped:arity").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from PIL import Image

PROMPT = """\
Given the image, return only the following information:
1. A list of major unique objects in the image (limit to 10 objects).
2. The relations between those objects in the form of relation triplets: <object1> <relation> <object2>.
3. Action should be a single word of a broad class, like "playing", "eating", "running", "talking", "driving" etc. Avoid specific actions like "serving", "gulping", "steering" etc.
4. The description tag should be one or two sentences long, describing the image in general terms.
Do not provide any extra information or descriptions.
Give the output in a json format, example:
{
"action": "<some action>"
"objects": ["object1", "object2", ...],
"relations": [
["object1", "relation", "object2"],
...
]
"dense caption": "The image shows a... <description>"
}"""

MAX_OBJECTS = 10
FIELDS = ("action", "objects", "relations", "caption")

RECOVERY_NOTES = (
    # Text around and inside the JSON object.
    "code_fence", "prose_around_json", "list_wrapped", "truncated", "cut_at_syntax_error",
    "missing_commas", "trailing_comma", "extra_comma", "single_quotes", "unicode_quotes",
    "python_literals", "unquoted_keys", "comments", "ellipsis",
    # Keys.
    "duplicate_key", "key_alias", "ignored_key", "missing_key:",
    # Field values.
    "nested_list", "empty_string", "value_from_list:", "invalid_value:",
    "objects_from_string", "object_from_dict", "object_dropped:", "duplicate_object",
    "objects_truncated",
    "relations_from_string", "relation_unwrapped", "relation_from_string", "relation_from_dict",
    "relation_dropped:", "relation_object_added", "duplicate_relation",
)

# Normalised key (lowercase, "_"/"-" as spaces) -> field; the prompt's own spelling is CANONICAL.
KEY_ALIASES = {
    "action": "action", "activity": "action",
    "objects": "objects", "object": "objects", "object list": "objects",
    "unique objects": "objects",
    "relations": "relations", "relation": "relations", "relationships": "relations",
    "relation triplets": "relations", "triplets": "relations",
    "dense caption": "caption", "caption": "caption", "description": "caption",
}
CANONICAL_KEYS = {"action": "action", "objects": "objects", "relations": "relations",
                  "caption": "dense caption"}
SUBJECT_KEYS = ("subject", "object1", "subj", "head")
PREDICATE_KEYS = ("predicate", "relation", "relationship", "rel")
OBJECT_KEYS = ("object", "object2", "obj", "tail")
OBJECT_NAME_KEYS = ("name", "label", "object")
MAX_CANDIDATES = 20


class ParseError(ValueError):
    """A reply with nothing usable; `reason` is a short stable code."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class _Notes(list):
    def add(self, code: str) -> None:
        if code not in self:
            self.append(code)


class _Ellipsis:
    """`...` placeholder copied from the prompt's example; skipped wherever it appears."""


ELLIPSIS = _Ellipsis()


def parse_response(text: str) -> dict:
    """Parse one Stage-1 reply into {action, objects, relations, caption, notes}.

    Raises ParseError (reason "empty", "no_json", "not_an_object" or "no_usable_fields") when
    the text holds no JSON-like object with any of the keys action / objects / relations.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_response expects a str reply, got {type(text).__name__}")
    if not text.strip():
        raise ParseError("empty", "the reply is empty")
    notes = _Notes()
    data = _find_object(text, notes)
    fields = _collect_fields(data, notes)
    if not {"action", "objects", "relations"} & fields.keys():
        raise ParseError("no_usable_fields",
                         f"the JSON object has none of the keys action / objects / relations "
                         f"(keys: {sorted(data)})")
    for field in FIELDS:
        if field not in fields:
            notes.add(f"missing_key:{field}")
    action = _text_field(fields.get("action"), "action", notes)
    objects = _objects(fields.get("objects"), notes)
    relations = _relations(fields.get("relations"), objects, notes)
    caption = _text_field(fields.get("caption"), "caption", notes)
    return {"action": action, "objects": objects, "relations": relations, "caption": caption,
            "notes": list(notes)}


# ---------------------------------------------------------------- locating the object

FENCE = re.compile(r"```[A-Za-z]*")


def _find_object(text: str, notes: _Notes) -> dict:
    """The first `{...}` in `text` with a usable key (else the first that parses at all)."""
    if "```" in text:
        notes.add("code_fence")
    list_reply = FENCE.sub("", text).lstrip().startswith("[")
    first_dict = None
    starts = [m.start() for m in re.finditer(r"\{", text)][:MAX_CANDIDATES]
    for start in starts:
        local = _Notes()
        data, end = _parse_at(text, start, local)
        if not isinstance(data, dict) or (not data and "cut_at_syntax_error" in local):
            continue  # not an object, or a brace in prose such as "{objects}"
        usable = _has_usable_key(data)
        if first_dict is None or usable:
            first_dict = (data, start, end, local)
        if usable:
            break
    if first_dict is None or (list_reply and not _has_usable_key(first_dict[0])):
        if list_reply:
            raise ParseError("not_an_object", "the reply is a JSON list, not an object with "
                                              "action / objects / relations")
        raise ParseError("no_json", "the reply holds no JSON object: "
                                    f"{_excerpt(text)!r}")
    data, start, end, local = first_dict
    if list_reply:
        notes.add("list_wrapped")
    elif FENCE.sub("", text[:start]).strip() or (
            end is not None and FENCE.sub("", text[end:]).strip()):
        notes.add("prose_around_json")
    for code in local:
        notes.add(code)
    return data


def _excerpt(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _has_usable_key(data: dict) -> bool:
    return any(KEY_ALIASES.get(_norm_key(k)) in ("action", "objects", "relations")
               for k in data)


def _parse_at(text: str, start: int, notes: _Notes) -> tuple[Any, int | None]:
    """Parse the value at `start`: json first, then the tolerant parser. Returns (value, end);
    end is None when the text was cut (truncated or a syntax error)."""
    try:
        value, end = json.JSONDecoder(
            object_pairs_hook=lambda pairs: _pairs_to_dict(pairs, notes)).raw_decode(text, start)
        return value, end
    except json.JSONDecodeError:
        notes.clear()
    parser = _LooseParser(text, start, notes)
    value = parser.value()
    return value, None if parser.stopped else parser.pos


def _pairs_to_dict(pairs: list[tuple[str, Any]], notes: _Notes) -> dict:
    """Repeated keys keep their first non-empty value."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            notes.add("duplicate_key")
            if not _is_empty(out[key]):
                continue
        out[key] = value
    return out


def _is_empty(value: Any) -> bool:
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
BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_ \-]*(?=\s*:)")
CONSTANTS = {"true": True, "false": False, "null": None}
PY_CONSTANTS = {"True": True, "False": False, "None": None}


class _LooseParser:
    """JSON plus what VLMs write instead: missing or extra commas, single / curly quotes,
    Python literals and tuples, bare keys, comments, `...`, unescaped inner quotes. At the end
    of the text or at a syntax error it stops and closes every open container, dropping the
    scalar it was reading."""

    def __init__(self, text: str, pos: int, notes: _Notes):
        self.text, self.pos, self.notes = text, pos, notes
        self.stopped = False

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
        if char == "{":
            return self.object()
        if char in "[(":
            if char == "(":
                self.notes.add("python_literals")
            return self.array("]" if char == "[" else ")")
        if char in OPEN_QUOTES:
            return self.string()
        if self.text.startswith("...", self.pos) or char == "\u2026":
            self.pos += 1 if char == "\u2026" else 3
            self.notes.add("ellipsis")
            return ELLIPSIS
        match = NUMBER.match(self.text, self.pos)
        if match:
            self.pos = match.end()
            return json.loads(match.group())
        match = WORD.match(self.text, self.pos)
        if match and match.group() in CONSTANTS | PY_CONSTANTS:
            self.pos = match.end()
            if match.group() in PY_CONSTANTS:
                self.notes.add("python_literals")
            return (CONSTANTS | PY_CONSTANTS)[match.group()]
        self.stop("cut_at_syntax_error")
        raise _Cut

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
                if not match:
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


# ---------------------------------------------------------------- fields

def _norm_key(key: str) -> str:
    return re.sub(r"[\s_\-]+", " ", str(key)).strip().lower()


def _clean(text: str) -> str:
    return " ".join(text.split())


def _collect_fields(data: dict, notes: _Notes) -> dict:
    fields: dict = {}
    for key, value in data.items():
        field = KEY_ALIASES.get(_norm_key(key))
        if field is None:
            notes.add("ignored_key")
            continue
        if key != CANONICAL_KEYS[field]:
            notes.add("key_alias")
        if field in fields:
            notes.add("duplicate_key")
            if not _is_empty(fields[field]):
                continue
        fields[field] = value
    return fields


def _text_field(value: Any, field: str, notes: _Notes) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        parts = [v for v in _flatten(value, notes) if isinstance(v, str) and v.strip()]
        notes.add(f"value_from_list:{field}")
        # An action is one word: take the first; a caption in pieces is joined.
        value = (parts[:1] if field == "action" else parts)
        return _clean(" ".join(value))
    if not isinstance(value, str):
        notes.add(f"invalid_value:{field}")
        return ""
    return _clean(value)


def _flatten(items: list, notes: _Notes) -> list:
    out = []
    for item in items:
        if isinstance(item, list):
            notes.add("nested_list")
            out.extend(_flatten(item, notes))
        else:
            out.append(item)
    return out


def _objects(value: Any, notes: _Notes) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        notes.add("objects_from_string")
        value = re.split(r"[,;\n]", value)
    if not isinstance(value, list):
        notes.add("invalid_value:objects")
        return []
    objects: list[str] = []
    for item in _flatten(value, notes):
        if isinstance(item, dict):
            names = [item[k] for k in OBJECT_NAME_KEYS if isinstance(item.get(k), str)]
            if not names:
                notes.add("object_dropped:dict_fields")
                continue
            notes.add("object_from_dict")
            item = names[0]
        if not isinstance(item, str):
            notes.add("object_dropped:not_text")
            continue
        name = _clean(item)
        if not name:
            notes.add("empty_string")
        elif _find(objects, name) is not None:
            notes.add("duplicate_object")
        else:
            objects.append(name)
    if len(objects) > MAX_OBJECTS:
        notes.add("objects_truncated")
        del objects[MAX_OBJECTS:]
    return objects


def _find(objects: list[str], name: str) -> str | None:
    """The spelling in `objects` of `name`, compared case-insensitively."""
    lowered = name.lower()
    return next((o for o in objects if o.lower() == lowered), None)


def _relations(value: Any, objects: list[str], notes: _Notes) -> list[tuple[str, str, str]]:
    """Triplets whose subject and object are in `objects` (added there while it has room)."""
    if value is None:
        return []
    if isinstance(value, str):
        notes.add("relations_from_string")
        value = [part for part in re.split(r"[;\n]", value) if part.strip()]
    elif isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        notes.add("invalid_value:relations")
        return []
    if (len(value) == 3 and all(isinstance(v, str) for v in value)
            and _find(objects, _clean(value[0])) and _find(objects, _clean(value[2]))):
        notes.add("relation_unwrapped")
        value = [value]
    items = []
    for item in value:
        if isinstance(item, list) and item and all(isinstance(i, list) for i in item):
            notes.add("nested_list")
            items.extend(item)
        else:
            items.append(item)
    relations: list[tuple[str, str, str]] = []
    seen = set()
    for item in items:
        triplet = _triplet(item, objects, notes)
        if triplet is None:
            continue
        subject, predicate, obj = triplet
        unknown = {n.lower(): n for n in (subject, obj) if _find(objects, n) is None}
        if unknown:
            if len(objects) + len(unknown) > MAX_OBJECTS:
                notes.add("relation_dropped:unknown_object")
                continue
            objects.extend(unknown.values())
            notes.add("relation_object_added")
        triplet = (_find(objects, subject), predicate, _find(objects, obj))
        key = tuple(part.lower() for part in triplet)
        if key in seen:
            notes.add("duplicate_relation")
            continue
        seen.add(key)
        relations.append(triplet)
    return relations


def _triplet(item: Any, objects: list[str], notes: _Notes) -> tuple[str, str, str] | None:
    if isinstance(item, dict):
        item = {_norm_key(k): v for k, v in item.items()}
        parts = [next((item[k] for k in keys if k in item), None)
                 for keys in (SUBJECT_KEYS, PREDICATE_KEYS, OBJECT_KEYS)]
        if any(p is None for p in parts):
            notes.add("relation_dropped:dict_fields")
            return None
        notes.add("relation_from_dict")
        item = parts
    elif isinstance(item, str):
        parts = _split_relation(_clean(item), objects)
        if parts is None:
            notes.add("relation_dropped:unsplittable")
            return None
        notes.add("relation_from_string")
        item = parts
    if not isinstance(item, list):
        notes.add("relation_dropped:not_text")
        return None
    if len(item) != 3:
        notes.add("relation_dropped:arity")
        return None
    if not all(isinstance(p, str) for p in item):
        notes.add("relation_dropped:not_text")
        return None
    parts = [_clean(p) for p in item]
    if not all(parts):
        notes.add("relation_dropped:empty")
        return None
    return tuple(parts)


ANGLE_TRIPLET = re.compile(r"<([^<>]+)>\s*<([^<>]+)>\s*<([^<>]+)>")


def _split_relation(text: str, objects: list[str]) -> list[str] | None:
    """"<a> <rel> <b>", "a | rel | b", "a, rel, b" or "a rel b" with a and b the longest
    object names that start and end the text."""
    match = ANGLE_TRIPLET.fullmatch(text)
    if match:
        return list(match.groups())
    text = text.strip("()[] ")
    for sep in ("|", "->", ",", ";", " - "):
        parts = [p.strip() for p in text.split(sep)]
        if len(parts) == 3 and all(parts):
            return parts
    lowered = text.lower()
    heads = [o for o in objects if lowered.startswith(o.lower() + " ")]
    tails = [o for o in objects if lowered.endswith(" " + o.lower())]
    if not heads or not tails:
        return None
    head, tail = max(heads, key=len), max(tails, key=len)
    middle = text[len(head):len(text) - len(tail)].strip()
    if not middle:
        return None
    return [head, middle, tail]


# ---------------------------------------------------------------- models

class VLM(Protocol):
    """Anything that answers PROMPT for a batch of images, one reply per image."""

    def __call__(self, images: list[Image.Image]) -> list[str]: ...


class ScriptedVLM:
    """Canned replies for tests and demos: `replies(index, image)` with a running image index,
    or a sequence indexed by it."""

    def __init__(self, replies: Callable[[int, Image.Image], str] | Sequence[str]):
        self.replies = replies
        self.count = 0

    def __call__(self, images: list[Image.Image]) -> list[str]:
        out = []
        for image in images:
            if callable(self.replies):
                out.append(self.replies(self.count, image))
            else:
                if self.count >= len(self.replies):
                    raise IndexError(f"ScriptedVLM has {len(self.replies)} replies, asked for "
                                     f"image {self.count}")
                out.append(self.replies[self.count])
            self.count += 1
        return out


class TransformersVLM:
    """A local transformers image-text-to-text model asked PROMPT with greedy decoding.

    The paper's Stage-1 model is Ovis-Gemma 9B (e.g. a local copy of "AIDC-AI/Ovis2-9B"); Ovis
    ships its own modelling code, so it needs `trust_remote_code=True`
    (`--vlm-trust-remote-code`), which is never turned on by default.
    """

    def __init__(self, model_path: str, *, device: str = "cuda", dtype: str = "bfloat16",
                 max_new_tokens: int = 512, batch_size: int = 8,
                 trust_remote_code: bool = False):
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"VLM folder {str(model_path)!r} has no config.json: pass a local folder of a "
                "transformers image-text-to-text model (the paper uses Ovis-Gemma 9B, e.g. a "
                "download of AIDC-AI/Ovis2-9B; Ovis needs --vlm-trust-remote-code)")
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        # Batched generation continues every row from its last token: pad on the left.
        self.processor.tokenizer.padding_side = "left"
        self.model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
        self.model.to(device).eval()
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    def __call__(self, images: list[Image.Image]) -> list[str]:
        import torch

        message = [{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": PROMPT}]}]
        chat = self.processor.apply_chat_template(message, add_generation_prompt=True,
                                                  tokenize=False)
        replies: list[str] = []
        for start in range(0, len(images), self.batch_size):
            chunk = [image.convert("RGB") for image in images[start:start + self.batch_size]]
            inputs = self.processor(text=[chat] * len(chunk), images=chunk, padding=True,
                                    return_tensors="pt")
            inputs = inputs.to(self.model.device, dtype=self.model.dtype)  # floats only
            with torch.inference_mode():
                out = self.model.generate(**inputs, do_sample=False,
                                          max_new_tokens=self.max_new_tokens)
            new_tokens = out[:, inputs["input_ids"].shape[1]:]
            replies.extend(self.processor.batch_decode(new_tokens, skip_special_tokens=True))
        return replies
