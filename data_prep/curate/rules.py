"""SCLARO label curation: the deterministic rules (appendix, label-curation paragraphs), in one
namespace. Each rule lives in the module of what it curates:

  `data_prep.curate.objects`    colours and adjectives stripped, plurals folded (steps 1-2 of
                                three; step 3, the clustering, is `data_prep.curate.cluster`)
  `data_prep.curate.relations`  cluster labels for subject / object, stopwords out of the
                                predicate (optionally keeping spatial prepositions after the
                                verb), the deduplicated relation vocabulary
  `data_prep.curate.predicates` the manual pass over predicates: the predicate table and the
                                keep / rename / merge overrides file
  `data_prep.curate.actions`    the curator's action table and the merge suggestions for it
  `data_prep.curate.text`       what they share: text normalisation, stopwords, plurals

and the per-source statistics of the curated labels (appendix Table A3) are here. Everything is
pure Python with dict lookups; per-name work is done once per distinct name.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from data_prep.curate.actions import (LEMMATIZERS, WORDNET_INSTALL,  # noqa: F401
                                      WORDNET_RESOURCE, action_candidates, canonical_action,
                                      load_action_map, require_lemmatizer,
                                      similar_action_candidates)
from data_prep.curate.objects import (ADJECTIVE_TAGS, COLOUR_MODIFIERS, COLOURS,  # noqa: F401
                                      KEEP_COMPOUNDS, TAGGER_INSTALL, TAGGER_RESOURCE, Tagger,
                                      consistent_objects, object_canonical_map, require_tagger,
                                      standardise_object_name, strip_adjectives, strip_colours)
from data_prep.curate.predicates import (OverridesError, RelationOverrides,  # noqa: F401
                                         format_predicate_table, parse_overrides,
                                         predicate_map, predicate_table, read_overrides)
from data_prep.curate.relations import (SPATIAL_PREPOSITIONS, Triplet,  # noqa: F401
                                        canonical_triplet, canonicalise_image_relations,
                                        dedupe_triplets, normalise_predicate, relation_text,
                                        relation_vocabulary, spatial_phrases)
from data_prep.curate.text import (STOPWORDS, MissingNLTKData, fold_plurals,  # noqa: F401
                                   normalise_text, singular_candidates)


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
