"""Word-level rules that the object, relation and action rules share: text normalisation, the
stopword list, plural folding, and the error for missing NLTK data (`data_prep.nltk_data`).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import Iterable

from data_prep.nltk_data import MissingNLTKData  # noqa: F401  (shared with the import wing)

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
