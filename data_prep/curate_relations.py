"""SCLARO label curation, relations (appendix, label-curation paragraphs): subject and object
become their cluster labels, stopwords leave the predicate, so "air conditioner mounted on
wall" and "air conditioner mounted wall" are one vocabulary entry. The vocabulary is
deduplicated; within one image every instance is kept.
"""

from __future__ import annotations

import functools
from typing import Iterable, Mapping, Sequence

from data_prep.curate_text import STOPWORDS, normalise_text
from sclaro_jax.data.schema import triplet_text

Triplet = tuple[str, str, str]


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
