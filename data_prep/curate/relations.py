"""SCLARO label curation, relations (appendix, label-curation paragraphs): subject and object
become their cluster labels, stopwords leave the predicate, so "air conditioner mounted on
wall" and "air conditioner mounted wall" are one vocabulary entry. The vocabulary is
deduplicated; within one image every instance is kept.

NLTK's stopwords include spatial prepositions, so the rule also merges "sitting on" and
"sitting under" into "sitting". `keep_prepositions=True` (`curate
--relation-keep-prepositions`, off by default) keeps a spatial preposition
(`SPATIAL_PREPOSITIONS`) that follows a kept word of the predicate, its verb; the appendix's
"final pass of manual curation" has its tool in `data_prep.curate.predicates` (the predicate
table and the overrides file).
"""

from __future__ import annotations

import functools
from typing import Iterable, Mapping, Sequence

from data_prep.curate.text import STOPWORDS, normalise_text
from sclaro_jax.data.schema import triplet_text

Triplet = tuple[str, str, str]


# Spatial prepositions, multi-word ones matched first (longest match). Most single words are
# NLTK stopwords; "behind", "near", "beside" are not, and stay under either rule.
SPATIAL_PREPOSITIONS: tuple[str, ...] = (
    "in front of", "on top of", "in back of", "inside of", "out of", "next to", "close to",
    "on", "in", "at", "by", "under", "over", "above", "below", "behind", "beside", "near",
    "inside", "outside", "underneath", "beneath", "between", "among", "across", "along",
    "against", "around", "through", "into", "onto", "off", "atop", "within", "beyond",
    "toward", "towards", "past",
)
_SPATIAL = frozenset(tuple(p.split()) for p in SPATIAL_PREPOSITIONS)
_SPATIAL_LONGEST = max(len(p) for p in _SPATIAL)


def _spatial_at(words: Sequence[str], i: int) -> int:
    """Length in words of the longest spatial preposition starting at `words[i]` (0: none)."""
    for n in range(min(_SPATIAL_LONGEST, len(words) - i), 0, -1):
        if tuple(words[i:i + n]) in _SPATIAL:
            return n
    return 0


@functools.lru_cache(maxsize=1 << 16)
def spatial_phrases(predicate: str) -> tuple[str, ...]:
    """The spatial prepositions of a predicate (normalised), in order, longest match first:
    "is sitting on top of" -> ("on top of",), "sitting" -> ()."""
    words = normalise_text(predicate).split()
    out, i = [], 0
    while i < len(words):
        n = _spatial_at(words, i)
        if n:
            out.append(" ".join(words[i:i + n]))
        i += n or 1
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def _normalise_predicate(predicate: str, stopwords: frozenset[str],
                         keep_prepositions: bool = False) -> str:
    text = normalise_text(predicate)
    words = text.split()
    kept: list[str] = []
    i = 0
    while i < len(words):
        n = _spatial_at(words, i) if keep_prepositions and kept else 0
        if n:  # a spatial preposition after a kept word (the verb)
            kept.extend(words[i:i + n])
            i += n
            continue
        if words[i] not in stopwords:
            kept.append(words[i])
        i += 1
    return " ".join(kept) if kept else text


def normalise_predicate(predicate: str, stopwords: Iterable[str] = STOPWORDS,
                        keep_prepositions: bool = False) -> str:
    """Normalised predicate without stopwords: "mounted on" -> "mounted", "is next to" ->
    "next", "in front of" -> "front". If only stopwords remain the normalised predicate is kept
    whole ("on" stays "on", "out of" stays); an empty predicate stays "".

    `keep_prepositions`: a spatial preposition (`SPATIAL_PREPOSITIONS`, longest match) that
    comes after a kept word, the predicate's verb, stays whole: "is sitting on" -> "sitting
    on", "sitting under" -> "sitting under", "parked in front of" -> "parked in front of".
    Without a word before it the rule is unchanged ("in front of" -> "front", "on" -> "on").
    """
    if not isinstance(stopwords, frozenset):
        stopwords = frozenset(stopwords)
    return _normalise_predicate(predicate, stopwords, bool(keep_prepositions))


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
