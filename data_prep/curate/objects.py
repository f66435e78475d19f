"""SCLARO label curation, objects (appendix, label-curation paragraphs), three steps; this
module does the first two, the embedding + HDBSCAN clustering of step three lives in
`data_prep.curate.cluster` and consumes `object_canonical_map`'s values:
  1. `consistent_objects`: per sample, the names every stage agrees on (VLM objects and
     GroundingDINO detections), unioned over samples.
  2. `object_canonical_map`: strip colour descriptors (a predefined list, `COLOURS`) and
     adjectives (NLTK's POS tagger), then fold a plural into its singular when both occur.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Sequence

from data_prep.curate.text import fold_plurals, normalise_text, singular_candidates
from data_prep.nltk_data import TAGGER_INSTALL, TAGGER_RESOURCE, require_nltk

Tagger = Callable[[list[str]], list[tuple[str, str]]]

# --------------------------------------------------------------------------- colours

COLOURS: frozenset[str] = frozenset("""
    red green blue yellow orange purple pink brown black white grey gray silver gold golden
    beige tan maroon navy teal turquoise cyan magenta violet indigo ivory cream khaki olive lime
    lavender lilac mauve burgundy crimson scarlet amber bronze copper coral aqua azure cobalt
    emerald jade ruby rust mustard ochre taupe fuchsia charcoal blond blonde auburn
    reddish greenish bluish yellowish orangish purplish pinkish brownish blackish whitish
    greyish grayish multicoloured multicolored colourful colorful
""".split())
"""The predefined colour-term list: basic colours, common shades and "-ish" forms."""

COLOUR_MODIFIERS: frozenset[str] = frozenset({"light", "dark", "bright", "pale", "deep"})
"""Colour words only when followed by a colour word: "light blue shirt" loses both, "light
bulb" keeps "light"."""

_COLOUR_CONNECTORS = frozenset({"and"})  # "black and white dog" -> "dog"
_HYPHENATED_PARTS = frozenset({"coloured", "colored", "and"})  # "red-coloured", "black-and-white"

KEEP_COMPOUNDS: frozenset[str] = frozenset({
    "orange juice", "orange peel", "lime juice", "olive oil", "olive tree", "cream cheese",
    "white board", "black board", "red carpet", "red wine", "white wine", "green tea",
    "black tea", "black pepper", "green bean", "gold medal", "silver medal",
    "bronze medal", "gold fish",
})
"""Two-word names whose leading colour (or adjective) is part of the noun: stripping stops at
their first word ("fresh orange juice" -> "orange juice", "white board(s)" stays)."""


def _starts_kept_compound(tokens: Sequence[str], i: int) -> bool:
    """tokens[i:i + 2] is a kept compound, its second word possibly plural ("white boards")."""
    if i + 1 >= len(tokens):
        return False
    second = tokens[i + 1]
    return any(f"{tokens[i]} {w}" in KEEP_COMPOUNDS
               for w in (second, *singular_candidates(second)))


def _is_colour_token(token: str) -> bool:
    """A colour term, or a hyphenated one ("dark-blue", "red-coloured", "black-and-white")."""
    if token in COLOURS:
        return True
    if "-" not in token:
        return False
    parts = token.split("-")
    return (any(p in COLOURS for p in parts)
            and all(p in COLOURS or p in COLOUR_MODIFIERS or p in _HYPHENATED_PARTS
                    for p in parts))


def _colour_run(tokens: Sequence[str]) -> int:
    """How many leading tokens are colour words. A modifier counts only before a colour term,
    "and" only between colour terms; a kept compound ends the run."""
    n = len(tokens)
    i = 0
    while i < n and not _starts_kept_compound(tokens, i):
        j = i + 1 if i > 0 and tokens[i] in _COLOUR_CONNECTORS else i
        while j < n and tokens[j] in COLOUR_MODIFIERS:
            j += 1
        if j >= n or not _is_colour_token(tokens[j]) or _starts_kept_compound(tokens, j):
            break
        i = j + 1
    if i < n and tokens[i] in _COLOUR_CONNECTORS:  # "red and car": no dangling "and car"
        return 0
    return i


def strip_colours(name: str) -> str:
    """Drop the leading colour descriptors of a normalised name, only when a head noun remains.

    "red car" -> "car", "dark blue shirt" -> "shirt", "black and white dog" -> "dog",
    "dark-blue jacket" -> "jacket". A name made only of colour words is kept whole: "orange"
    (the fruit) stays "orange", "dark blue" stays. Only leading tokens go ("car red" stays). By
    this rule "white board" would become "board", so it is one of the `KEEP_COMPOUNDS`, which
    are never split ("whiteboard" as one word is never touched). Modifiers
    (`COLOUR_MODIFIERS`) go only before a colour: "light bulb" stays.
    """
    tokens = name.split()
    end = _colour_run(tokens)
    if end == 0 or end == len(tokens):
        return name
    return " ".join(tokens[end:])


# --------------------------------------------------------------------------- adjectives

ADJECTIVE_TAGS = frozenset({"JJ", "JJR", "JJS"})
TAGGER_SKIP = ("or skip adjective stripping: `python -m data_prep curate --no-pos-tagger` "
               "(in Python, curate(..., use_tagger=False), or your own tagger=, a function "
               "of a token list returning (token, Penn tag) pairs)")


def require_tagger() -> Tagger:
    """`nltk.pos_tag` after checking its model is installed; else `MissingNLTKData` saying how
    to install it, or to skip it. Never falls back to another tagger."""
    nltk = require_nltk("object curation strips adjectives with NLTK's POS tagger, which",
                        {TAGGER_RESOURCE: TAGGER_INSTALL}, f", {TAGGER_SKIP}")
    return nltk.pos_tag


@functools.cache
def _default_tagger() -> Tagger:
    return require_tagger()  # a failure is not cached: installing the data later works


def strip_adjectives(name: str, tagger: Tagger | None = None) -> str:
    """Drop leading tokens tagged JJ / JJR / JJS; the last token always stays.

    "small wooden table" -> "table" when both are tagged JJ; noun compounds stay ("garbage
    truck": "garbage" is NN). `tagger` maps a token list to (token, tag) pairs; default
    `nltk.pos_tag` (its data must be installed, see `require_tagger`).
    """
    tokens = name.split()
    if len(tokens) < 2:
        return name
    tagged = (tagger or _default_tagger())(tokens)
    if len(tagged) != len(tokens):
        raise ValueError(f"the POS tagger returned {len(tagged)} tags for the {len(tokens)} "
                         f"tokens of {name!r}")
    i = 0
    while (i < len(tokens) - 1 and tagged[i][1] in ADJECTIVE_TAGS
           and not _starts_kept_compound(tokens, i)):
        i += 1
    return name if i == 0 else " ".join(tokens[i:])


# --------------------------------------------------------------------------- objects

_ARTICLES = frozenset({"a", "an", "the"})


def consistent_objects(samples: Iterable[Sequence[Iterable[str]]]) -> set[str]:
    """Objects step 1: per sample the normalised names found by every stage (VLM object list,
    GroundingDINO detections), then the union over samples. Names a stage missed are dropped.

    [(["Car", "tree"], ["car"]), (["dog"], ["dog", "cat"])] -> {"car", "dog"}.
    """
    kept: set[str] = set()
    for i, stages in enumerate(samples):
        if isinstance(stages, (str, bytes)) or len(stages) < 2:
            raise ValueError(f"sample {i}: expected name lists from at least two stages "
                             f"(VLM objects, detections), got {stages!r}")
        common = None
        for k, names in enumerate(stages):
            if isinstance(names, (str, bytes)):
                raise ValueError(f"sample {i}, stage {k}: expected a list of names, "
                                 f"got the string {names!r}")
            normalised = {normalise_text(n) for n in names} - {""}
            common = normalised if common is None else common & normalised
        kept |= common
    return kept


def standardise_object_name(raw: str, tagger: Tagger | None = None) -> str:
    """Normalised name without a leading article, colour descriptors or adjectives ("The Small
    Dark-Blue Cars" -> "cars"); colours and adjectives are stripped in turn until neither
    changes the name, so "shiny red car" loses both even when the tagger calls "red" a noun."""
    tokens = normalise_text(raw).split()
    if len(tokens) > 1 and tokens[0] in _ARTICLES:
        tokens = tokens[1:]
    name = " ".join(tokens)
    while True:
        stripped = strip_adjectives(strip_colours(name), tagger)
        if stripped == name:
            return name
        name = stripped


def object_canonical_map(names: Iterable[str], tagger: Tagger | None = None) -> dict[str, str]:
    """Objects step 2: {raw name: standardised name}; the set of values is what step 3 embeds.

    `standardise_object_name` on each distinct name, then `fold_plurals` over the results:
    {"Red Cars", "car", "small dog"} -> {"Red Cars": "car", "car": "car", "small dog": "dog"}.
    Names that normalise to nothing ("!!") are left out. `tagger` defaults to nltk.pos_tag and
    is checked before any work (`MissingNLTKData`).
    """
    tagger = tagger or _default_tagger()
    by_normalised: dict[str, str] = {}
    standard: dict[str, str] = {}
    for raw in names:
        if raw in standard:
            continue
        key = normalise_text(raw)
        if key not in by_normalised:
            by_normalised[key] = standardise_object_name(key, tagger)
        if by_normalised[key]:
            standard[raw] = by_normalised[key]
    folded = fold_plurals(set(standard.values()))
    return {raw: folded.get(s, s) for raw, s in standard.items()}
