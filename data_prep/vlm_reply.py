"""The Stage-1 reply parser: a VLM's reply -> {action, objects, relations, caption, notes}.

Replies are often not valid JSON (the prompt's own example lacks commas), so `parse_response`
reads them with `data_prep.loose_json` (`json` first, then a tolerant parser of its own, no
`eval`) and then repairs the fields. Every recovery it applies is recorded in the result's
`notes` as a short code from `RECOVERY_NOTES` (codes ending in ":" take a suffix, e.g.
"missing_key:action", "relation_dropped:arity").
"""

from __future__ import annotations

import re
from typing import Any

from data_prep.loose_json import Notes, keep_first_non_empty, parse_at
from sclaro_jax import bounds

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
    "angle_brackets", "nested_list", "empty_string", "value_from_list:", "invalid_value:",
    "objects_from_string", "object_from_dict", "object_dropped:", "duplicate_object",
    "objects_truncated",
    "relations_from_string", "relation_unwrapped", "relation_from_string", "relation_from_dict",
    "relation_joined", "relation_dropped:", "relation_object_added", "duplicate_relation",
)

# Normalised key (lowercase, "_"/"-" as spaces, surrounding spaces, quotes, "*" and ":" cut)
# -> field; the prompt's own spelling is CANONICAL. Any other spelling is noted "key_alias".
KEY_ALIASES = {
    "action": "action", "activity": "action",
    "objects": "objects", "object": "objects", "object list": "objects",
    "unique objects": "objects",
    "relations": "relations", "relation": "relations", "relationships": "relations",
    "relation triplets": "relations", "relation triplet": "relations",
    "relations triplets": "relations", "relationship triplets": "relations",
    "triplets": "relations",
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



def parse_response(text: str) -> dict:
    """Parse one Stage-1 reply into {action, objects, relations, caption, notes}.

    Raises ParseError (reason "empty", "no_json", "not_an_object" or "no_usable_fields") when
    the text holds no JSON-like object with any of the keys action / objects / relations;
    nothing else for any text (nesting past `loose_json.MAX_DEPTH` is cut like a syntax error).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_response expects a str reply, got {type(text).__name__}")
    if not text.strip():
        raise ParseError("empty", "the reply is empty")
    notes = Notes()
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


def _find_object(text: str, notes: Notes) -> dict:
    """The first `{...}` in `text` with a usable key (else the first that parses at all)."""
    if "```" in text:
        notes.add("code_fence")
    list_reply = FENCE.sub("", text).lstrip().startswith("[")
    first_dict = None
    starts = [m.start() for m in re.finditer(r"\{", text)][:MAX_CANDIDATES]
    for start in starts:
        local = Notes()
        data, end = parse_at(text, start, local)  # never raises; nesting past 64 is cut
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




# ---------------------------------------------------------------- fields

def _norm_key(key: str) -> str:
    return re.sub(r"[\s_\-]+", " ", str(key)).strip(" :*\"'`").lower()


def _clean(text: str) -> str:
    return " ".join(text.split())


PLACEHOLDER = re.compile(r"<([^<>]*)>")


def _unwrap(text: str, notes: Notes) -> str:
    """`text` cleaned, without the `<...>` of the prompt's placeholders ("<riding>" -> "riding")
    when they wrap all of it."""
    text = _clean(text)
    match = PLACEHOLDER.fullmatch(text)
    if match:
        notes.add("angle_brackets")
        text = _clean(match.group(1))
    return text


def _collect_fields(data: dict, notes: Notes) -> dict:
    fields: dict = {}
    for key, value in data.items():
        field = KEY_ALIASES.get(_norm_key(key))
        if field is None:
            notes.add("ignored_key")
            continue
        if key != CANONICAL_KEYS[field]:
            notes.add("key_alias")
        keep_first_non_empty(fields, field, value, notes)
    return fields


def _text_field(value: Any, field: str, notes: Notes) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        parts = [v for v in _flatten(value, notes) if isinstance(v, str) and v.strip()]
        notes.add(f"value_from_list:{field}")
        # An action is one word: take the first; a caption in pieces is joined.
        value = _clean(" ".join(_unwrap(v, notes) for v in (parts[:1] if field == "action"
                                                                 else parts)))
    elif not isinstance(value, str):
        notes.add(f"invalid_value:{field}")
        return ""
    else:
        value = _unwrap(value, notes)
    if field == "action" and bounds.label_problem(value):
        notes.add("invalid_value:action")
        return ""
    return value


def _flatten(items: list, notes: Notes) -> list:
    out = []
    for item in items:
        if isinstance(item, list):
            notes.add("nested_list")
            out.extend(_flatten(item, notes))
        else:
            out.append(item)
    return out


def _objects(value: Any, notes: Notes) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        notes.add("objects_from_string")
        value = re.split(r"[,;\n]", value)
    if not isinstance(value, list):
        notes.add("invalid_value:objects")
        return []
    objects: list[str] = []
    seen: set[str] = set()  # lowercased: `_find` over a long list would be quadratic
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
        name = _unwrap(item, notes)
        if not name:
            notes.add("empty_string")
        elif bounds.label_problem(name):  # past the label limit, or control characters
            notes.add(f"object_dropped:{bounds.label_problem(name)}")
        elif name.lower() in seen:
            notes.add("duplicate_object")
        else:
            seen.add(name.lower())
            objects.append(name)
    if len(objects) > MAX_OBJECTS:
        notes.add("objects_truncated")
        del objects[MAX_OBJECTS:]
    return objects


def _find(objects: list[str], name: str) -> str | None:
    """The spelling in `objects` of `name`, compared case-insensitively."""
    lowered = name.lower()
    return next((o for o in objects if o.lower() == lowered), None)


def _relations(value: Any, objects: list[str], notes: Notes) -> list[tuple[str, str, str]]:
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
            and _find(objects, _unwrap(value[0], Notes()))
            and _find(objects, _unwrap(value[2], Notes()))):
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


def _triplet(item: Any, objects: list[str], notes: Notes) -> tuple[str, str, str] | None:
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
    if len(item) > 3 and all(isinstance(p, str) for p in item):
        item = _join_middle(item, objects, notes)
    if item is None or len(item) != 3:
        notes.add("relation_dropped:arity")
        return None
    if not all(isinstance(p, str) for p in item):
        notes.add("relation_dropped:not_text")
        return None
    parts = [_unwrap(p, notes) for p in item]
    if not all(parts):
        notes.add("relation_dropped:empty")
        return None
    problem = next(filter(None, map(bounds.label_problem, parts)), None)
    if problem:
        notes.add(f"relation_dropped:{problem}")
        return None
    return tuple(parts)


def _join_middle(tokens: list[str], objects: list[str], notes: Notes) -> list[str] | None:
    """A relation of four or more tokens, ["man", "sitting", "on", "chair"] ->
    ["man", "sitting on", "chair"]: taken only when the first and last tokens are listed
    objects and no middle token is one (["cyclist", "riding", "bicycle", "on", "road"] chains
    two relations and stays dropped)."""
    seen = Notes()
    names = [_unwrap(t, seen) for t in tokens]
    middle = [n for n in names[1:-1] if n]
    if (not _find(objects, names[0]) or not _find(objects, names[-1]) or not middle
            or any(_find(objects, n) for n in middle)):
        return None
    for code in seen:  # "<sitting>" "<on>": the brackets are noted once the relation is kept
        notes.add(code)
    notes.add("relation_joined")
    return [tokens[0], " ".join(middle), tokens[-1]]


ANGLE_TRIPLET = re.compile(r"<([^<>]+)>\s*<([^<>]+)>\s*<([^<>]+)>")
ANGLE_ENDS = re.compile(r"<([^<>]+)>\s+([^<>]+?)\s+<([^<>]+)>")  # "<man> riding <horse>"


def _split_relation(text: str, objects: list[str]) -> list[str] | None:
    """"<a> <rel> <b>", "a | rel | b", "a, rel, b" or "a rel b" with a and b the longest
    object names that start and end the text."""
    match = ANGLE_TRIPLET.fullmatch(text) or ANGLE_ENDS.fullmatch(text)
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
