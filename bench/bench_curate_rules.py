"""`data_prep.curate.rules` on synthetic raw labels: objects (colours, adjectives, plurals, two
stages per image), relations and actions, --n of each (default 100,000), one run, seconds per
step. The adjective step uses a dict-based fake tagger, not nltk.pos_tag (its data is not
installed here), so the figure excludes the real tagger's cost (one call per distinct name).
Action candidates: Porter-lemmatised content words, then embedding similarity over random unit
vectors standing in for the encoder's (embedding time excluded).

    python bench/bench_curate_rules.py [--n 100000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


NOUNS = """car truck bus bicycle dog cat horse person man woman child tree house window door table
chair cup glass bottle plate knife fork spoon bench lamp sign road building boat bird shoe hat
shirt jacket bag box phone laptop screen book flower plant fence wall floor sky cloud mountain
river beach wave rock ball kite umbrella clock pillow bed sofa shelf leaf pizza sandwich banana
apple orange cake""".split() + ["traffic light", "fire hydrant", "stop sign", "parking meter",
                                  "air conditioner", "garbage truck", "trash can", "white board"]
ADJECTIVES = "small large big old new wooden shiny tall short wet dry empty broken plastic metal".split()
COLOURS = ["red", "blue", "green", "dark blue", "light grey", "black and white", "golden", "navy",
           "white", "yellow", "pale pink", "dark-green"]
PREDICATES = ["on", "sitting on", "is holding", "holding a", "next to", "in front of", "near",
              "mounted on", "mounted", "riding", "under", "looking at", "parked on", "beside"]
ACTIONS = ["taking a photo", "taking photos", "taking a photograph", "Taking a selfie", "running",
           "eating food", "eating", "cooking", "driving a car", "driving cars", "playing football",
           "playing with a dog", "walking the dogs", "", "reading books", "reading a book"]
VERBS = ("taking holding eating riding driving walking carrying playing reading watching pushing "
         "pulling cleaning cutting throwing catching washing painting fixing selling").split()
FAKE_TAGS = {a: "JJ" for a in ADJECTIVES}


def fake_tagger(tokens):
    return [(t, FAKE_TAGS.get(t, "NN")) for t in tokens]


def plural(noun: str) -> str:
    word = noun.split()[-1]
    if word.endswith(("s", "x", "ch", "sh")):
        word += "es"
    elif word.endswith("y") and word[-2] not in "aeiou":
        word = word[:-1] + "ies"
    elif word == "knife":
        word = "knives"
    elif word in ("man", "woman"):
        word = word[:-2] + "en"
    elif word == "child":
        word = "children"
    else:
        word += "s"
    return " ".join(noun.split()[:-1] + [word])


def raw_object(rng: random.Random) -> str:
    parts = []
    if rng.random() < 0.3:
        parts.append(rng.choice(ADJECTIVES))
    if rng.random() < 0.4:
        parts.append(rng.choice(COLOURS))
    noun = rng.choice(NOUNS)
    parts.append(plural(noun) if rng.random() < 0.3 else noun)
    name = " ".join(parts)
    return name.title() if rng.random() < 0.1 else name


def main():
    from data_prep.curate import rules as cr

    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100_000, help="labels of each kind")
    args = parser.parse_args()
    rng = random.Random(0)
    per_image = 4
    images = args.n // per_image
    samples = []  # (VLM objects, detections): detections miss about one name in eight
    for _ in range(images):
        vlm = [raw_object(rng) for _ in range(per_image)]
        samples.append((vlm, [n for n in vlm if rng.random() > 0.125]))
    relations = [[(rng.choice(vlm), rng.choice(PREDICATES), rng.choice(vlm))
                  for _ in range(per_image)] for vlm, _ in samples]
    # half the fixed phrases, half "verb [a|the] noun[s]": about 4,000 distinct actions
    actions = [rng.choice(ACTIONS) if rng.random() < 0.5 else
               f"{rng.choice(VERBS)} {rng.choice(['', 'a ', 'the '])}"
               f"{rng.choice(NOUNS)}{rng.choice(['', 's'])}" for _ in range(args.n)]

    times = {}
    t0 = time.perf_counter()
    kept = cr.consistent_objects(samples)
    times["objects step 1 (consistent_objects)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    object_map = cr.object_canonical_map(kept, fake_tagger)
    times["objects step 2 (object_canonical_map)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    per_image_triplets = [cr.canonicalise_image_relations(r, object_map) for r in relations]
    vocabulary = cr.relation_vocabulary(per_image_triplets)
    times["relations (canonicalise + vocabulary)"] = time.perf_counter() - t0
    stem = cr.require_lemmatizer("porter")  # imports nltk: not timed
    t0 = time.perf_counter()
    candidates = cr.action_candidates(actions, lemmatize=stem)
    times["actions: lemma candidates (Porter)"] = time.perf_counter() - t0
    counts = Counter(cr.normalise_text(a) for a in actions)
    counts.pop("", None)
    distinct = sorted(counts)
    # random unit vectors stand in for the encoder (embedding time is excluded)
    emb = np.random.default_rng(0).standard_normal((len(distinct), 384)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    t0 = time.perf_counter()
    candidates += cr.similar_action_candidates(distinct, counts, emb, 0.7,
                                               skip={c[0] for c in candidates})
    times[f"actions: similarity candidates ({len(distinct)} distinct, D=384)"] = (
        time.perf_counter() - t0)
    t0 = time.perf_counter()
    action_map = {surface: target for surface, target, _ in candidates}
    canonical_actions = [cr.canonical_action(a, action_map) for a in actions]
    times["actions: canonical map"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    stats = cr.source_statistics(
        {"source": f"source{i % 5}", "action": canonical_actions[i],
         "objects": [object_map.get(cr.normalise_text(n), "") for n in vlm],
         "triplets": [cr.relation_text(t) for t in per_image_triplets[i]]}
        for i, (vlm, _) in enumerate(samples))
    times["source_statistics"] = time.perf_counter() - t0

    n_objects = sum(len(v) for v, _ in samples)
    print(f"{n_objects} raw object names ({len(kept)} distinct kept by step 1 -> "
          f"{len(set(object_map.values()))} standardised), {sum(map(len, relations))} relations "
          f"({len(vocabulary)} vocabulary entries), {len(actions)} actions "
          f"({len(set(canonical_actions))} classes), {len(stats)} sources")
    print("adjective tagger: dict-based FAKE (nltk averaged_perceptron_tagger_eng data is not "
          "installed here); nltk.pos_tag's own time is not included")
    print("| step | seconds |")
    print("|---|---|")
    for step, seconds in times.items():
        print(f"| {step} | {seconds:.3f} |")
    print(f"| total | {sum(times.values()):.3f} |")


if __name__ == "__main__":
    main()
