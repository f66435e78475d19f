"""The action word of an image from its captions, by a fixed rule (no VLM).

The rule: the captions in the dataset's order (COCO: by caption id; Visual Genome: region
descriptions in file order); each is split into words (letters, with an inner apostrophe) and
tagged with NLTK's POS tagger; the main verb of a caption is its first word tagged as a verb
(VB, VBD, VBG, VBN, VBP, VBZ) that is not an auxiliary (`AUXILIARIES`: be, have, do and the
modals, in every form); the action is the main verb of the first caption that has one,
lowercased and lemmatised as a verb by NLTK's WordNet lemmatiser ("A man riding a horse" ->
"ride", "Two dogs are sitting on a couch" -> "sit"). That caption becomes the record's caption
(so caption and action agree); when no caption has a main verb the action is "" (such images are
kept, as annotate keeps a reply without an action) and the caption is the first one.

The tagger needs `averaged_perceptron_tagger_eng`, the lemmatiser `wordnet`; `require_rule`
checks both before any work and raises one `MissingNLTKData` naming every download missing.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from data_prep.nltk_data import (TAGGER_INSTALL, TAGGER_RESOURCE, WORDNET_INSTALL,
                                 WORDNET_RESOURCE, require_nltk)

VERB_TAGS = frozenset({"VB", "VBD", "VBG", "VBN", "VBP", "VBZ"})
AUXILIARIES = frozenset("""
    be am is are was were been being 's 're 'm have has had having 've 'd do does did doing
    can could may might must shall should will would 'll
""".split())
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
NO_ACTIONS = ", or import without action words: --no-actions (every action is then \"\")"

Tagger = Callable[[list[str]], list[tuple[str, str]]]


def words(caption: str) -> list[str]:
    """The caption's words: runs of letters, with an apostrophe only inside a word."""
    return _WORD.findall(caption)


def main_verb(caption: str, tagger: Tagger) -> str | None:
    """The first word tagged as a verb that is not an auxiliary, lowercased; None if none."""
    for word, tag in tagger(words(caption)):
        if tag in VERB_TAGS and word.lower() not in AUXILIARIES:
            return word.lower()
    return None


def action_and_caption(captions: Sequence[str], tagger: Tagger,
                       lemmatize: Callable[[str], str]) -> tuple[str, str]:
    """(action, caption) of one image by the module's rule; ("", first caption) when no
    caption has a main verb, ("", "") without captions."""
    for caption in captions:
        verb = main_verb(caption, tagger)
        if verb:
            return lemmatize(verb), caption
    return "", captions[0] if captions else ""


def require_rule() -> tuple[Tagger, Callable[[str], str]]:
    """NLTK's POS tagger and a WordNet verb lemmatiser, both checked to be installed; else one
    `MissingNLTKData` naming the downloads."""
    nltk = require_nltk("the action word from captions (POS tagging, WordNet lemmas), which",
                        {TAGGER_RESOURCE: TAGGER_INSTALL, WORDNET_RESOURCE: WORDNET_INSTALL},
                        NO_ACTIONS)
    from nltk.stem import WordNetLemmatizer
    wordnet = WordNetLemmatizer()
    return nltk.pos_tag, lambda word: wordnet.lemmatize(word, "v")
