"""SCLARO label curation: the deterministic rules (appendix, label-curation paragraphs).

Actions: Multi-Moments ground-truth labels are kept as given; VLM phrases are normalised and
mapped through a user-curated table ("taking photos" -> "taking a photograph"); an empty action
means "no action" and is kept. Candidates for that table, for the curator to review, come from
lemmatised content words (`action_candidates`, `require_lemmatizer`) and from embedding
similarity (`similar_action_candidates`).

Objects, three steps; this module does the first two, the embedding + HDBSCAN clustering of step
three lives elsewhere and consumes `object_canonical_map`'s values:
  1. `consistent_objects`: per sample, the names every stage agrees on (VLM objects and
     GroundingDINO detections), unioned over samples.
  2. `object_canonical_map`: strip colour descriptors (a predefined list, `COLOURS`) and
     adjectives (NLTK's POS tagger), then fold a plural into its singular when both occur.

Relations: subject and object become their cluster labels, stopwords leave the predicate, so
"air conditioner mounted on wall" and "air conditioner mounted wall" are one vocabulary entry.
The vocabulary is deduplicated; within one image every instance is kept.

Everything is pure Python with dict lookups; per-name work is done once per distinct name.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from sclaro_jax.data.schema import triplet_text

Tagger = Callable[[list[str]], list[tuple[str, str]]]
Triplet = tuple[str, str, str]

# --------------------------------------------------------------------------- text

_TYPOGRAPHIC = str.maketrans({
    "\u2018": "'", "\u2019": "'", "\u02bc": "'", "`": "'",
    "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\u2212": "-",
})
_NOT_WORD_OR_JOINER = re.compile(r"[^\w\s'-]|_")
_LOOSE_JOINER = re.compile(r"(?<!\w)['-]+|['-]+(?!\w)")


@functools.lru_cache(maxsize=1 << 18)
def normalise_text(s: str) -> str:
    """NFKC, lowercase, punctuation -> space (hyphens and apostrophes survive only inside a
    word: "T-Shirt" -> "t-shirt", "children's" stays, "- car -" -> "car"), whitespace collapsed.
    """
    s = unicodedata.normalize("NFKC", s).translate(_TYPOGRAPHIC).lower()
    s = _LOOSE_JOINER.sub(" ", _NOT_WORD_OR_JOINER.sub(" ", s))
    return " ".join(s.split())


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
TAGGER_RESOURCE = "taggers/averaged_perceptron_tagger_eng/"  # what nltk 3.9+ pos_tag loads
TAGGER_INSTALL = "python -m nltk.downloader averaged_perceptron_tagger_eng"


class MissingNLTKData(RuntimeError):
    """NLTK, or the POS-tagger data the adjective rule needs, is not installed."""


def require_tagger() -> Tagger:
    """`nltk.pos_tag` after checking its model is installed; else `MissingNLTKData` saying how
    to install it. Never falls back to another tagger."""
    try:
        import nltk
    except ImportError as e:
        raise MissingNLTKData(
            "object curation strips adjectives with NLTK's POS tagger, but nltk is not "
            f"installed: pip install nltk, then {TAGGER_INSTALL}") from e
    try:
        nltk.data.find(TAGGER_RESOURCE)
    except LookupError:
        raise MissingNLTKData(
            f"object curation strips adjectives with nltk.pos_tag (nltk {nltk.__version__}), "
            f"which needs the resource {TAGGER_RESOURCE!r}; it is not in any NLTK data folder "
            f"({', '.join(map(str, nltk.data.path))}). Install it with:\n    {TAGGER_INSTALL}\n"
            "or point the NLTK_DATA environment variable at a folder that holds it, or pass "
            "tagger=") from None
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


# --------------------------------------------------------------------------- plurals

_IRREGULAR_PLURALS = (("children", "child"), ("people", "person"), ("women", "woman"),
                      ("men", "man"), ("teeth", "tooth"), ("feet", "foot"), ("geese", "goose"),
                      ("mice", "mouse"))


@functools.lru_cache(maxsize=1 << 16)
def singular_candidates(word: str) -> tuple[str, ...]:
    """Possible singulars of a word, most specific rule first.

    Irregular endings (men -> man, so also firemen -> fireman; people, children, feet, teeth,
    mice, geese), -ies -> -y, -ves -> -f / -fe, -ses -xes -zes -ches -shes -> drop "es",
    -oes -> -o, -s -> drop "s" (not after -ss, -us, -is). Candidates need not be words:
    `fold_plurals` only uses one that occurs.
    """
    out = [word[:-len(pl)] + sg for pl, sg in _IRREGULAR_PLURALS if word.endswith(pl)]
    if word.endswith("ies") and len(word) > 3:
        out.append(word[:-3] + "y")
    if word.endswith("ves"):
        out += [word[:-3] + "f", word[:-3] + "fe"]
    if word.endswith(("ses", "xes", "zes", "ches", "shes", "oes")):
        out.append(word[:-2])
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        out.append(word[:-1])
    return tuple(out)


def fold_plurals(names: Iterable[str]) -> dict[str, str]:
    """{plural: singular} for the names whose singular (last word singularised) is also among
    `names`; names are compared as given.

    {"cars", "car", "glasses"} -> {"cars": "car"}: "glasses" stays because "glass" is absent;
    with "glass" present it folds into "glass" (the rule cannot tell spectacles from glass).
    "women" -> "woman", "red cars" -> "red car" (only the last word is singularised).
    """
    present = set(names)
    mapping: dict[str, str] = {}
    for name in present:
        head, _, last = name.rpartition(" ")
        prefix = head + " " if head else ""
        for candidate in singular_candidates(last):
            singular = prefix + candidate
            if singular != name and singular in present:
                mapping[name] = singular
                break
    for name, singular in mapping.items():  # a singular that is itself folded (rare)
        seen = {name}
        while singular in mapping and singular not in seen:
            seen.add(singular)
            singular = mapping[singular]
        mapping[name] = singular
    return mapping


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


# --------------------------------------------------------------------------- relations

STOPWORDS: frozenset[str] = frozenset("""
    a about above after again against ain all am an and any are aren aren't as at be because
    been before being below between both but by can couldn couldn't d did didn didn't do does
    doesn doesn't doing don don't down during each few for from further had hadn hadn't has hasn
    hasn't have haven haven't having he he'd he'll her here hers herself he's him himself his
    how i i'd if i'll i'm in into is isn isn't it it'd it'll it's its itself i've just ll m ma
    me mightn mightn't more most mustn mustn't my myself needn needn't no nor not now o of off
    on once only or other our ours ourselves out over own re s same shan shan't she she'd she'll
    she's should shouldn shouldn't should've so some such t than that that'll the their theirs
    them themselves then there these they they'd they'll they're they've this those through to
    too under until up ve very was wasn wasn't we we'd we'll we're were weren weren't we've what
    when where which while who whom why will with won won't wouldn wouldn't y you you'd you'll
    your you're yours yourself yourselves you've
""".split())
"""NLTK's English stopword list (`nltk.corpus.stopwords.words("english")`, 198 words), copied
so that no corpus download is needed. It holds spatial prepositions: "sitting on" and
"sitting under" both become "sitting", as the appendix's rule implies."""


@functools.lru_cache(maxsize=1 << 16)
def _normalise_predicate(predicate: str, stopwords: frozenset[str]) -> str:
    text = normalise_text(predicate)
    kept = [w for w in text.split() if w not in stopwords]
    return " ".join(kept) if kept else text


def normalise_predicate(predicate: str, stopwords: Iterable[str] = STOPWORDS) -> str:
    """Normalised predicate without stopwords: "mounted on" -> "mounted", "is next to" ->
    "next", "in front of" -> "front". If only stopwords remain the normalised predicate is kept
    whole ("on" stays "on", "out of" stays); an empty predicate stays "".
    """
    if not isinstance(stopwords, frozenset):
        stopwords = frozenset(stopwords)
    return _normalise_predicate(predicate, stopwords)


def _object_label(name: str, object_map: Mapping[str, str]) -> str:
    if name in object_map:
        return object_map[name]
    key = normalise_text(name)
    return object_map.get(key, key)


def canonical_triplet(subject: str, predicate: str, object: str, object_map: Mapping[str, str],
                      stopwords: Iterable[str] = STOPWORDS) -> Triplet:
    """(subject label, predicate without stopwords, object label).

    `object_map` maps names to cluster labels; a name is looked up as given, then normalised;
    a missing name keeps its normalised form. Appendix example: ("air conditioner",
    "mounted on", "wall") and ("air conditioner", "mounted", "wall") give the same triplet.
    """
    return (_object_label(subject, object_map), normalise_predicate(predicate, stopwords),
            _object_label(object, object_map))


def canonicalise_image_relations(relations: Iterable[Sequence[str]],
                                 object_map: Mapping[str, str],
                                 stopwords: Iterable[str] = STOPWORDS) -> list[Triplet]:
    """One image's (subject, predicate, object) relations as canonical triplets, in order and
    with duplicates kept: two "person holding cup" are two instances (different boxes)."""
    out = []
    for i, relation in enumerate(relations):
        if isinstance(relation, str) or len(relation) != 3:
            raise ValueError(f"relation {i}: expected (subject, predicate, object), "
                             f"got {relation!r}")
        out.append(canonical_triplet(*relation, object_map, stopwords))
    return out


def relation_text(triplet: Sequence[str]) -> str:
    """A canonical triplet's vocabulary text (`schema.triplet_text`; an empty predicate leaves
    one space, not two)."""
    return " ".join(triplet_text(*triplet).split())


def dedupe_triplets(triplets: Iterable[Sequence[str]]) -> list[Triplet]:
    """Canonical triplets with exact repeats dropped, first occurrence order. For the vocabulary
    only: an image's own relations keep their duplicates (`canonicalise_image_relations`)."""
    return list(dict.fromkeys(tuple(t) for t in triplets))


def relation_vocabulary(per_image_triplets: Iterable[Iterable[Sequence[str]]]) -> list[str]:
    """Sorted distinct `relation_text`s over all images (and sources): the relation classes."""
    return sorted({relation_text(t) for image in per_image_triplets for t in image})


# --------------------------------------------------------------------------- actions

def load_action_map(path: str | Path) -> dict[str, str]:
    """Read the curator's action table: `surface form<TAB>canonical class` per line; lines
    starting with '#' and blank lines are skipped. Both columns are normalised. A canonical
    class that is itself a surface form is followed ("taking photos -> taking a photo ->
    taking a photograph"). Errors name the file and line: wrong column count, an empty column,
    one surface form given two classes, a cycle.
    """
    path = Path(path)
    mapping: dict[str, str] = {}
    line_of: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            columns = line.split("\t")
            if len(columns) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'surface form<TAB>canonical "
                                 f"class', got {len(columns)} tab-separated column(s): {line!r}")
            surface, canonical = (normalise_text(c) for c in columns)
            if not surface or not canonical:
                raise ValueError(f"{path}:{lineno}: empty "
                                 f"{'surface form' if not surface else 'canonical class'}: "
                                 f"{line!r}")
            if surface in mapping and mapping[surface] != canonical:
                raise ValueError(f"{path}:{lineno}: {surface!r} -> {canonical!r}, but line "
                                 f"{line_of[surface]} maps it to {mapping[surface]!r}")
            mapping[surface] = canonical
            line_of.setdefault(surface, lineno)
    resolved = {}
    for surface, canonical in mapping.items():
        chain = [surface]
        while canonical in mapping and canonical != mapping[canonical]:
            if canonical in chain:
                raise ValueError(f"{path}:{line_of[surface]}: the mapping loops: "
                                 f"{' -> '.join(chain + [canonical])}")
            chain.append(canonical)
            canonical = mapping[canonical]
        resolved[surface] = canonical
    return resolved


def canonical_action(raw: str, action_map: Mapping[str, str], *,
                     ground_truth: str | None = None) -> str:
    """The action class of one image. Ground truth (Multi-Moments) is returned as given;
    otherwise the normalised VLM phrase through `action_map`, or the normalised phrase when
    unmapped. "" (no action) stays "": such images are kept."""
    if ground_truth is not None:
        return ground_truth
    text = normalise_text(raw)
    return action_map.get(text, text)


WORDNET_RESOURCE = "corpora/wordnet"
WORDNET_INSTALL = "python -m nltk.downloader wordnet"
LEMMATIZERS = ("wordnet", "porter", "none")


def require_lemmatizer(kind: str = "wordnet") -> Callable[[str], str] | None:
    """The per-word lemmatiser the action candidates use.

    "wordnet": NLTK's WordNet lemmatiser, a word read as a verb first ("taking" -> "take"),
    then as a noun ("photos" -> "photo"); it needs NLTK's WordNet data, and without it this
    raises `MissingNLTKData` with the install command (never a silent fallback).
    "porter": NLTK's Porter stemmer (rules only, no data: "taking" -> "take", "photos" ->
    "photo"; stems, so "photographing" -> "photograph"). "none": no lemmatising (None)."""
    if kind not in LEMMATIZERS:
        raise ValueError(f"action lemmatiser {kind!r} is not one of {LEMMATIZERS}")
    if kind == "none":
        return None
    try:
        import nltk
    except ImportError as e:
        raise MissingNLTKData(f"the {kind} action lemmatiser needs nltk: pip install nltk"
                              ) from e
    if kind == "porter":
        from nltk.stem import PorterStemmer
        return PorterStemmer().stem
    try:
        nltk.data.find(WORDNET_RESOURCE)
    except LookupError:
        raise MissingNLTKData(
            f"action candidates lemmatise words with NLTK's WordNet lemmatiser (nltk "
            f"{nltk.__version__}), which needs the resource {WORDNET_RESOURCE!r}; it is not in "
            f"any NLTK data folder ({', '.join(map(str, nltk.data.path))}). Install it with:\n"
            f"    {WORDNET_INSTALL}\nor point NLTK_DATA at a folder that holds it, or pass "
            "--action-lemmatizer porter (rules, no data) or none") from None
    from nltk.stem import WordNetLemmatizer
    wordnet = WordNetLemmatizer()

    def lemmatize(word: str) -> str:
        verb = wordnet.lemmatize(word, "v")
        return verb if verb != word else wordnet.lemmatize(word, "n")
    return lemmatize


def action_candidates(actions: Iterable[str] | Mapping[str, int],
                      lemmatize: Callable[[str], str] | None = None
                      ) -> list[tuple[str, str, str]]:
    """Merge suggestions for the curator: (surface form, suggested class, reason), sorted.
    `actions`: one phrase per occurrence, or a phrase -> occurrences mapping.

    Actions whose content words (stopwords removed, then `lemmatize` per word if given, then
    plurals folded over all action words) are the same, in order, form a group; each member
    is suggested to merge into the group's most frequent phrase (ties: alphabetical first).
    "taking photos" ~ "taking a photo" (content words "taking photo").
    """
    counts: Counter = Counter()
    if isinstance(actions, Mapping):  # phrase -> occurrences
        for action, n in actions.items():
            counts[normalise_text(action)] += n
    else:
        counts.update(normalise_text(a) for a in actions)
    counts.pop("", None)
    if lemmatize is not None:
        lemmatize = functools.lru_cache(maxsize=None)(lemmatize)  # once per distinct word
    content: dict[str, list[str]] = {}
    for action in counts:
        words = [w for w in action.split() if w not in STOPWORDS] or action.split()
        content[action] = [lemmatize(w) for w in words] if lemmatize else words
    folded = fold_plurals({w for words in content.values() for w in words})
    groups: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for action, words in content.items():
        groups[tuple(folded.get(w, w) for w in words)].append(action)
    out = []
    for key, members in groups.items():
        if len(members) < 2:
            continue
        members.sort(key=lambda m: (-counts[m], m))
        target = members[0]
        for m in members[1:]:
            out.append((m, target, f"same content words {' '.join(key)!r} after stopword "
                                   f"removal and plural folding ({counts[m]} vs "
                                   f"{counts[target]} occurrences)"))
    return sorted(out)


# --------------------------------------------------------------------------- statistics

def source_statistics(samples: Iterable[Mapping]) -> dict[str, dict[str, float]]:
    """Appendix Table A3 per source: images, distinct actions (no-action "" not counted),
    distinct objects, distinct triplets, and occurrences per triplet = images / distinct
    triplets, as the appendix computes it (PVSG 54,223 / 714 ~ 76; 0.0 without triplets).

    Each sample: {"source", "action", "objects": [labels], "triplets": [texts]}.
    """
    seen: dict[str, dict] = {}
    for i, sample in enumerate(samples):
        try:
            source, action = sample["source"], sample["action"]
            objects, triplets = sample["objects"], sample["triplets"]
        except KeyError as e:
            raise ValueError(f"sample {i}: missing field {e.args[0]!r} (needs source, action, "
                             "objects, triplets)") from None
        entry = seen.setdefault(source, {"images": 0, "actions": set(), "objects": set(),
                                         "triplets": set()})
        entry["images"] += 1
        if action:
            entry["actions"].add(action)
        entry["objects"].update(objects)
        entry["triplets"].update(triplets)
    return {source: {"images": e["images"], "actions": len(e["actions"]),
                     "objects": len(e["objects"]), "triplets": len(e["triplets"]),
                     "occurrences_per_triplet": (e["images"] / len(e["triplets"])
                                                 if e["triplets"] else 0.0)}
            for source, e in sorted(seen.items())}


def similar_action_candidates(actions: Sequence[str], counts: Mapping[str, int],
                              emb, threshold: float = 0.7, *, skip: Iterable[str] = (),
                              block: int = 1024) -> list[tuple[str, str, str]]:
    """Merge suggestions from embedding similarity: (surface form, suggested class, reason).

    `actions` are distinct normalised phrases with L2-normalised embeddings `emb` [A, D] (e.g.
    `curate_cluster.TextEncoder`), `counts` their occurrences. Actions are ranked by
    occurrences (ties: alphabetical). Each action points at the best-ranked action whose
    cosine similarity to it is >= `threshold` (itself included); following the pointers to the
    end gives the suggested class. Actions in `skip` (e.g. already suggested by
    `action_candidates`) get no row. Sorted like `action_candidates`."""
    import numpy as np
    actions = list(actions)
    emb = np.asarray(emb, np.float32)
    if emb.shape[0] != len(actions):
        raise ValueError(f"{len(actions)} actions but {emb.shape[0]} embeddings")
    if not 0 < threshold <= 1:
        raise ValueError(f"similarity threshold must be in (0, 1], got {threshold}")
    if not actions:
        return []
    order = sorted(range(len(actions)), key=lambda i: (-counts.get(actions[i], 0), actions[i]))
    rank = np.empty(len(actions), np.int64)
    rank[order] = np.arange(len(actions))
    parent = np.arange(len(actions))
    best_sim = np.ones(len(actions), np.float32)
    for start in range(0, len(actions), block):
        sim = emb[start:start + block] @ emb.T
        sim[np.arange(len(sim)), np.arange(start, start + len(sim))] = 1.0  # itself
        keyed = np.where(sim >= threshold, rank[None, :], len(actions))
        j = np.argmin(keyed, axis=1)
        parent[start:start + len(sim)] = j
        best_sim[start:start + len(sim)] = sim[np.arange(len(sim)), j]
    skip = set(skip)
    out = []
    for i, action in enumerate(actions):
        if parent[i] == i or action in skip:
            continue
        root = parent[i]
        while parent[root] != root:  # ranks strictly fall along the chain: it ends
            root = parent[root]
        via = actions[parent[i]]
        reason = (f"embedding cosine {best_sim[i]:.2f} to {via!r} ({counts.get(action, 0)} vs "
                  f"{counts.get(via, 0)} occurrences)")
        if root != parent[i]:
            reason += f", which goes on to {actions[root]!r}"
        out.append((action, actions[root], reason))
    return sorted(out)
