"""SCLARO label curation, the predicate vocabulary's manual pass (the appendix ends its
stopword rule with "a final pass of manual curation"): the predicate table a curator reads and
the overrides file they write.

Predicate table (`format_predicate_table`, written by `curate` as `*.predicate_table.tsv`
beside the clusters file and as `OUT/predicate_table.tsv`): one row per predicate of the
vocabulary, with its relation count, the raw predicates merged into it (each with its count)
and, where those raw predicates differ by a spatial preposition ("sitting on" / "sitting
under" both -> "sitting"), the prepositions that were merged.

Overrides file (`read_overrides`, `curate --relation-overrides FILE`): UTF-8 text, one entry a
line, blank lines and lines starting with "#" ignored; predicates are compared after
`normalise_text` (case, punctuation):

    keep sitting on, sitting under      these raw predicates keep their whole text
    rename front -> in front of         a predicate of the rule (or of a keep) gets a new name
    merge next, beside -> near          two or more predicates become one

`keep` takes raw predicates (normalised text, as in the table's raw column); `rename` and
`merge` take the predicates the rule gives after the keeps (the table's first column without
overrides) and are applied once, not chained. Entries are checked against the dataset's
predicates before any slow work: an unknown predicate, an unknown action, a predicate renamed
twice or kept twice, or a rename whose target is renamed again stops the run with the file,
line and entry named. The same raw predicates and the same file give the same map.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
from typing import Iterable, Mapping

from data_prep.curate.relations import normalise_predicate, spatial_phrases
from data_prep.curate.text import STOPWORDS, normalise_text

ACTIONS = ("keep", "rename", "merge")
TABLE_COLUMNS = ("predicate", "count", "raw predicates (count)", "spatial prepositions merged")


@dataclasses.dataclass(frozen=True)
class OverrideEntry:
    line: int
    action: str               # keep, rename or merge
    predicates: tuple[str, ...]
    to: str                   # "" for keep
    text: str                 # the line as written

    def as_dict(self) -> dict:
        return {"line": self.line, "action": self.action, "predicates": list(self.predicates),
                "to": self.to}


@dataclasses.dataclass(frozen=True)
class RelationOverrides:
    path: str                 # absolute
    sha256: str               # of the file's bytes
    entries: tuple[OverrideEntry, ...]

    def as_dict(self) -> dict:
        """What the curation log and the manifest record."""
        return {"file": self.path, "sha256": self.sha256,
                "entries": [e.as_dict() for e in self.entries]}


class OverridesError(ValueError):
    """An overrides file that cannot be applied; the message names file, line and entry."""


def _error(path: str, entry: OverrideEntry | None, line: int, text: str, why: str):
    return OverridesError(f"{path} line {entry.line if entry else line}: "
                          f"{(entry.text if entry else text)!r}: {why}")


def _names(path: str, line: int, text: str, part: str) -> tuple[str, ...]:
    names = tuple(normalise_text(p) for p in part.split(","))
    if not part.strip() or not all(names):
        raise _error(path, None, line, text, "an empty predicate (predicates are separated "
                                             "by commas)")
    return names


def parse_overrides(text: str, path: str = "<overrides>") -> tuple[OverrideEntry, ...]:
    """The entries of an overrides file's text (see the module docstring), in file order."""
    entries = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        action, _, rest = line.partition(" ")
        if action not in ACTIONS:
            raise _error(path, None, number, line, f"unknown action {action!r} (expected "
                                                   f"keep, rename or merge)")
        if action == "keep":
            if "->" in rest:
                raise _error(path, None, number, line, "keep takes no '-> target'")
            entries.append(OverrideEntry(number, action, _names(path, number, line, rest), "",
                                         line))
            continue
        sources, arrow, target = rest.partition("->")
        if not arrow:
            raise _error(path, None, number, line, f"{action} needs 'OLD -> NEW'")
        names = _names(path, number, line, sources)
        to = _names(path, number, line, target)
        if len(to) != 1:
            raise _error(path, None, number, line, "one target after '->'")
        if action == "rename" and len(names) != 1:
            raise _error(path, None, number, line, "rename takes one predicate; merge takes "
                                                   "several")
        if action == "merge" and len(names) < 2:
            raise _error(path, None, number, line, "merge takes two or more predicates; "
                                                   "rename takes one")
        entries.append(OverrideEntry(number, action, names, to[0], line))
    return tuple(entries)


def read_overrides(path: str) -> RelationOverrides:
    """An overrides file, parsed (not yet checked against a dataset: `predicate_map` does)."""
    path = os.path.abspath(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OverridesError(f"{path}: not UTF-8 text ({e})") from None
    return RelationOverrides(path, hashlib.sha256(data).hexdigest(), parse_overrides(text, path))


def predicate_map(raw_predicates: Iterable[str], *, keep_prepositions: bool = False,
                  overrides: RelationOverrides | None = None,
                  stopwords: Iterable[str] = STOPWORDS) -> dict[str, str]:
    """{raw predicate: vocabulary predicate} for every raw predicate: the stopword rule
    (`normalise_predicate`, `keep_prepositions`), then the overrides' keeps, then their
    renames and merges. Raises OverridesError for an entry that does not fit the predicates."""
    raws = sorted(set(raw_predicates))
    ruled = {r: normalise_predicate(r, stopwords, keep_prepositions) for r in raws}
    if overrides is None:
        return ruled
    path = overrides.path
    by_text = collections.defaultdict(list)
    for r in raws:
        by_text[normalise_text(r)].append(r)
    kept: dict[str, OverrideEntry] = {}
    renamed: dict[str, OverrideEntry] = {}
    for e in overrides.entries:
        for p in e.predicates:
            if e.action == "keep":
                if p not in by_text:
                    raise _error(path, e, 0, "", f"unknown predicate {p!r}: no raw predicate "
                                                 f"of the dataset reads so (keep takes raw "
                                                 f"predicates, the table's third column)")
                if p in kept:
                    raise _error(path, e, 0, "", f"{p!r} is already kept on line "
                                                 f"{kept[p].line}")
                kept[p] = e
            else:
                if p in renamed:
                    raise _error(path, e, 0, "", f"{p!r} is already renamed on line "
                                                 f"{renamed[p].line}")
                renamed[p] = e
    after_keep = {r: normalise_text(r) if normalise_text(r) in kept else ruled[r] for r in raws}
    known = set(after_keep.values())
    for p, e in renamed.items():
        if p not in known:
            raise _error(path, e, 0, "", f"unknown predicate {p!r}: not among the dataset's "
                                         f"predicates after the rule and the keeps (the "
                                         f"table's first column)")
        if e.to in renamed and renamed[e.to] is not e:
            raise _error(path, e, 0, "", f"its target {e.to!r} is renamed again on line "
                                         f"{renamed[e.to].line}; rename straight to the "
                                         f"final name")
    return {r: renamed[p].to if p in renamed else p for r, p in after_keep.items()}


def predicate_table(raw_counts: Mapping[str, int], mapping: Mapping[str, str]) -> list[dict]:
    """Rows of the predicate table: {"predicate", "count", "raw": [(raw, count)], "spatial":
    [distinct preposition sets of the raw predicates] or []}. `spatial` is filled only where
    the raw predicates merged into one differ by a spatial preposition. Rows with a flag come
    first, then by count (descending) and predicate; raw predicates by count then text."""
    groups: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for raw, n in raw_counts.items():
        groups[mapping[raw]].append((raw, int(n)))
    rows = []
    for pred, raws in groups.items():
        raws.sort(key=lambda rn: (-rn[1], rn[0]))
        sets = sorted({" + ".join(spatial_phrases(r)) or "(none)" for r, _ in raws})
        rows.append({"predicate": pred, "count": sum(n for _, n in raws), "raw": raws,
                     "spatial": sets if len(sets) > 1 else []})
    rows.sort(key=lambda row: (not row["spatial"], -row["count"], row["predicate"]))
    return rows


def _cell(text: str) -> str:
    return " ".join(str(text).split())  # no tabs or newlines inside a cell


def format_predicate_table(rows: list[dict], header: Iterable[str] = ()) -> str:
    """The table as TSV: "# " header lines, the column names, one line per row (raw predicates
    "text (count)" joined by "; ", merged prepositions by " / ")."""
    lines = [f"# {_cell(h)}" for h in header]
    lines.append("\t".join(TABLE_COLUMNS))
    for row in rows:
        lines.append("\t".join((
            _cell(row["predicate"]) or '""', str(row["count"]),
            "; ".join(f"{_cell(r) or chr(34) * 2} ({n})" for r, n in row["raw"]),
            " / ".join(row["spatial"]))))
    return "\n".join(lines) + "\n"
