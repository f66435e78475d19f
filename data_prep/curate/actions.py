"""SCLARO label curation, actions (appendix, label-curation paragraphs): Multi-Moments
ground-truth labels are kept as given; VLM phrases are normalised and mapped through a
user-curated table ("taking photos" -> "taking a photograph"); an empty action means "no
action" and is kept. Candidates for that table, for the curator to review, come from
lemmatised content words (`action_candidates`, `require_lemmatizer`) and from embedding
similarity (`similar_action_candidates`).
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from data_prep.curate.text import STOPWORDS, fold_plurals, normalise_text
from data_prep.nltk_data import WORDNET_INSTALL, WORDNET_RESOURCE, require_nltk


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
    if kind == "porter":
        require_nltk(f"the {kind} action lemmatiser")
        from nltk.stem import PorterStemmer
        return PorterStemmer().stem
    require_nltk("action candidates lemmatise words with NLTK's WordNet lemmatiser, which",
                 {WORDNET_RESOURCE: WORDNET_INSTALL},
                 ", or pass --action-lemmatizer porter (rules, no data) or none")
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
