"""`python -m data_prep curate`: raw SCLARO labels -> shared canonical vocabularies (appendix
"label curation"), applied to a dataset's records and written as a new dataset.

Objects: (1) the names both the VLM and GroundingDINO produced (a record's objects are the
detections of stage-1 names, so that intersection is what the records hold), unioned over
samples; (2) colour words and adjectives stripped, plurals folded into singulars when both
occur (`data_prep.curate.rules`); (3) the standardised names embedded (MiniLM / BERT) and
clustered with HDBSCAN (`data_prep.curate.cluster`) into a clusters file that a person labels.
Relations: subject and object replaced by their cluster labels, stopwords removed from the
predicate; the relation vocabulary is the set of distinct canonical triplets, while repeated
instances inside an image stay separate objects and relations. Every run writes the predicate
table (`*.predicate_table.tsv` beside the clusters file: each predicate, its count, the raw
predicates merged into it, flagged where they differ by a spatial preposition) for the manual
pass, whose keep / rename / merge lines (`relation_overrides`, `data_prep.curate.predicates`)
are applied after the rule and recorded with the file's sha256 in the log and the manifest;
`keep_prepositions` keeps spatial prepositions after the verb. Actions: a user-curated map
(`surface form<TAB>class`); Multi-Moments in Time's ground truth is kept as given. Label spaces
are shared by all sources.

Two passes: the first run writes `clusters.json` (with a table `clusters.md`, hdbscan's
condensed tree `clusters.tree.png`, and `action_candidates.tsv`) and stops so the clusters can
be labelled; the second applies them and keeps `OUT/object_curation/` (names, labels, their
embeddings: plain data, from which `--extend` refits the clusterer). `--extend` an earlier
output maps a new source onto its vocabulary: curated names keep their labels, new names are
suggested into curated clusters or clustered anew (`data_prep.curate.extend`). Every decision
(raw -> standardised -> label, predicate maps, actions) goes to `OUT/curation_log.json`, and
per-source statistics in the form of appendix Table A3 to `OUT/statistics.json`. Only labels
change: the output has the input's schema version, view size, originals policy and creation
time (so the same inputs write the same bytes), and every record's images and views pass
through unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Iterator

import numpy as np
from tqdm import tqdm

from data_prep.curate import rules
from sclaro_jax import bounds
from sclaro_jax.data import schema
from sclaro_jax.files import write_replacing

# Cosine similarity at which two actions are suggested for merging. With all-MiniLM-L6-v2,
# "taking photos" / "taking a photo" 0.92, "eating" / "having a meal" 0.78, "running" /
# "jogging" 0.80, "talking" / "chatting" 0.82, while "reading" / "writing" is 0.64 and
# "sleeping" / "resting" 0.61. Suggestions are only suggestions: the curator decides.
ACTION_SIMILARITY = 0.7


class NeedsLabels(Exception):
    """The clusters file was just written; label it and rerun."""

    def __init__(self, path: str, clusters: int, names: int):
        super().__init__(f"wrote {clusters} clusters of {names} object names to {path}: give "
                         f"each cluster a \"label\" (empty = its suggested_label; to take "
                         f"every suggestion unlabelled, add --accept-suggested), then rerun "
                         f"the same command")
        self.path = path


def iter_samples(data_dir: str, progress: bool = True) -> Iterator[schema.Sample]:
    """Every record of a dataset folder (all splits, in shard order), one at a time
    (`ShardedDataset.samples`: a record that does not decode raises `DatasetError` naming its
    shard and index)."""
    from sclaro_jax.data.dataset import open_dataset
    ds = open_dataset(data_dir)
    for split in sorted(ds.manifest["splits"]):
        yield from tqdm(ds.samples(split), desc=f"reading {split}", unit="record",
                        total=ds.num_records(split), disable=not progress)


def read_samples(data_dir: str, progress: bool = True) -> tuple[list[schema.Sample], dict]:
    """Every record of a dataset folder in memory, with its manifest (small datasets, tests)."""
    from sclaro_jax.data.dataset import open_dataset
    return list(iter_samples(data_dir, progress)), open_dataset(data_dir).manifest


class Curator:
    """Applies the maps to one sample at a time: raw object name -> standardised (`standard`)
    -> cluster label (`object_labels`), predicates through `predicate_map` (raw -> vocabulary
    predicate, `curate_predicates.predicate_map`; default: stopwords removed), actions through
    `action_map`; keeps what the log and the statistics need (names, not images)."""

    def __init__(self, object_labels: dict[str, str], standard: dict[str, str],
                 action_map: dict[str, str], predicate_map: dict[str, str] | None = None):
        self.object_labels, self.standard, self.action_map = object_labels, standard, action_map
        self.predicate_map = predicate_map
        self.predicates: dict[str, str] = {}
        self.actions: dict[str, str] = {}
        self.rows: list[dict] = []  # per sample: source, action, object labels, triplet texts

    def label(self, raw: str) -> str:
        std = self.standard[raw]
        return self.object_labels.get(std, std)

    def __call__(self, s: schema.Sample) -> schema.Sample:
        objects = tuple(dataclasses.replace(o, name=self.label(o.name)) for o in s.objects)
        relations = []
        for r in s.relations:
            pred = self.predicates.get(r.predicate)
            if pred is None:
                pred = self.predicates[r.predicate] = (
                    self.predicate_map[r.predicate] if self.predicate_map is not None
                    else rules.normalise_predicate(r.predicate))
            text = schema.triplet_text(objects[r.subject].name, pred, objects[r.object].name)
            relations.append(dataclasses.replace(r, predicate=pred, text=text))
        action = rules.canonical_action(s.action, self.action_map,
                                        ground_truth=s.action if s.source == "mmit" else None)
        self.actions[s.action] = rules.canonical_action(s.action, self.action_map)
        self.rows.append({"source": s.source, "action": action,
                          "objects": [o.name for o in objects],
                          "triplets": [r.text for r in relations]})
        return dataclasses.replace(s, objects=objects, relations=tuple(relations), action=action)

    def log(self) -> dict:
        rows = self.rows
        return {
            "objects": {raw: {"standardised": self.standard[raw], "label": self.label(raw)}
                        for raw in sorted(self.standard)},
            "predicates": dict(sorted(self.predicates.items())),
            "actions": dict(sorted(self.actions.items())),
            "vocabulary": {
                "actions": len({r["action"] for r in rows} - {""}),
                "objects": len({o for r in rows for o in r["objects"]}),
                "relations": len({t for r in rows for t in r["triplets"]}),
                "predicates": len(set(self.predicates.values())),
            },
        }

    def statistics(self) -> dict:
        return rules.source_statistics(self.rows)


def curate(data_dir: str, out_dir: str, *, clusters: str = "", action_map: str = "",
           encoder: str | None = None, min_cluster_size: int | None = None,
           min_samples: int | None = None, extend: str = "", min_strength: float | None = None,
           tagger=None, use_tagger: bool = True, action_lemmatizer: str = "wordnet",
           action_similarity: float = ACTION_SIMILARITY, relation_overrides: str = "",
           keep_prepositions: bool = False, accept_suggested: bool = False,
           overwrite: bool = False, progress: bool = True) -> dict:
    """Curate `data_dir` into `out_dir`. Raises NeedsLabels after writing the clusters file
    on the first pass; the second refuses a clusters file in which no new cluster has a label
    (`report.UnlabelledClusters`, listing the clusters that most need a look) unless
    `accept_suggested`. `tagger` (tokens -> [(token, tag)]) replaces NLTK's POS tagger;
    `use_tagger=False` skips adjective stripping (recorded in the log).

    The first pass also writes the action candidates (`*.action_candidates.tsv`): actions
    whose lemmatised content words agree (`action_lemmatizer`: "wordnet", "porter" or "none",
    see `curate_rules.require_lemmatizer`), then actions whose embeddings (the object
    encoder's) have cosine similarity >= `action_similarity` (0 turns this off).

    Predicates: the appendix's stopword rule, with `keep_prepositions` spatial prepositions
    after the verb kept, then the keep / rename / merge lines of the `relation_overrides` file
    (`data_prep.curate.predicates`; checked against the dataset's predicates before any slow
    work). Every run writes the predicate table beside the clusters file
    (`*.predicate_table.tsv`); the second also as `OUT/predicate_table.tsv`, and the rule and
    the overrides (file, sha256, entries) under "relation_curation" in the manifest and the log.

    `extend`: an earlier curated output folder. Its names keep their labels; only this
    dataset's new names go to the clusters file, as suggestions into curated clusters
    (strength >= `min_strength`) or new clusters (`data_prep.curate.extend`). Without new
    names there is no first pass. Either way the output keeps `object_curation/` for the next
    extension."""
    from data_prep.curate import cluster as curate_cluster, extend as curate_extend
    from data_prep.curate import predicates as curate_predicates
    from sclaro_jax.data.dataset import open_dataset
    manifest = open_dataset(data_dir).manifest
    ids, raw_names, actions, raw_predicates = _scan_labels(data_dir, progress)
    clusters = clusters or out_dir.rstrip("/") + ".clusters.json"
    overrides = (curate_predicates.read_overrides(relation_overrides) if relation_overrides
                 else None)
    predicate_map = curate_predicates.predicate_map(
        raw_predicates, keep_prepositions=keep_prepositions, overrides=overrides)
    relation_doc = relation_curation_doc(keep_prepositions, overrides)
    table = predicate_table_text(data_dir, raw_predicates, predicate_map, relation_doc)
    tagger, tagger_name = _adjective_tagger(tagger, use_tagger)
    standard = rules.object_canonical_map(sorted(raw_names), tagger=tagger)
    std_names = sorted(set(standard.values()))
    os.makedirs(os.path.dirname(os.path.abspath(clusters)), exist_ok=True)
    write_replacing(os.path.splitext(clusters)[0] + ".predicate_table.tsv",
                    lambda f: f.write(table.encode("utf-8")))
    text_encoder, prev, params = _previous_curation(extend, encoder, min_cluster_size,
                                                    min_samples)
    min_strength = curate_extend.MIN_STRENGTH if min_strength is None else min_strength
    new_names = [n for n in std_names if prev is None or n not in prev.labels]
    if not os.path.exists(clusters) and new_names:
        _first_pass(clusters, actions, std_names, new_names, prev, text_encoder, encoder,
                    params, action_lemmatizer=action_lemmatizer,
                    action_similarity=action_similarity, min_strength=min_strength,
                    progress=progress)
    labels = _read_labels(clusters, prev, new_names, std_names, accept_suggested)
    curator = Curator(labels, standard,
                      rules.load_action_map(action_map) if action_map else {}, predicate_map)
    _write_records(curator, data_dir, out_dir, manifest, ids, relation_doc,
                   overwrite=overwrite, progress=progress)
    text_encoder = text_encoder or curate_cluster.TextEncoder(
        encoder or curate_cluster.default_model_path())
    save_object_curation(out_dir, prev, std_names, new_names, labels, text_encoder, params,
                         progress)
    inputs = {"data": os.path.abspath(data_dir),
              "clusters": os.path.abspath(clusters) if new_names else "",
              "extends": str(prev.folder.resolve()) if prev else "",
              "action_map": os.path.abspath(action_map) if action_map else "",
              "adjective_tagger": tagger_name,
              "relation_overrides": overrides.path if overrides else "",
              "accept_suggested": bool(accept_suggested and new_names),
              "records": len(ids)}
    log, statistics = _write_logs(out_dir, curator, inputs, relation_doc, table)
    return {"records": len(ids), "vocabulary": log["vocabulary"], "statistics": statistics}


def _adjective_tagger(tagger, use_tagger: bool):
    """(the tagger that strips adjectives, its name for the log)."""
    tagger_name = "none" if not use_tagger else ("custom" if tagger is not None else "nltk")
    if use_tagger and tagger is None:
        tagger = rules.require_tagger()  # MissingNLTKData names the install command
    if not use_tagger:
        tagger = _no_adjectives
    return tagger, tagger_name


def _first_pass(clusters: str, actions, std_names: list[str], new_names: list[str], prev,
                text_encoder, encoder: str | None, params: dict, *, action_lemmatizer: str,
                action_similarity: float, min_strength: float, progress: bool):
    """Write the action candidates and the clusters file to label, then raise NeedsLabels.
    `text_encoder`: the extended curation's, or None to load `encoder` (or the default)."""
    from data_prep.curate import cluster as curate_cluster
    lemmatize = rules.require_lemmatizer(action_lemmatizer)  # before any slow work
    text_encoder = text_encoder or curate_cluster.TextEncoder(
        encoder or curate_cluster.default_model_path())
    rows = action_candidate_rows(actions, lemmatize, text_encoder, action_similarity,
                                 progress=progress)
    _write_action_candidates(clusters, rows, action_lemmatizer, action_similarity)
    if prev is None:
        info = curate_cluster.cluster_object_names(std_names, clusters, encoder=text_encoder,
                                                   progress=progress, **params)
        raise NeedsLabels(clusters, len(info.get("clusters", [])), len(std_names))
    doc = extend_clusters_file(prev, new_names, clusters, text_encoder, params,
                               min_strength, progress)
    raise NeedsLabels(clusters, len(doc["clusters"]), len(new_names))


def _write_records(curator: "Curator", data_dir: str, out_dir: str, manifest: dict, ids: list,
                   relation_doc: dict, *, overwrite: bool, progress: bool) -> None:
    """Pass B: every record rewritten by `curator`, streamed into the writer; the output keeps
    the input's schema version, views, split rule and creation time."""
    from data_prep.shards import write_dataset
    rule = manifest.get("split_rule", {})
    v1 = manifest["schema_version"] == 1
    write_dataset((curator(s) for s in iter_samples(data_dir, progress=False)), out_dir,
                  ids=ids, split_seed=int(rule.get("seed", 42)),
                  fractions=tuple(rule.get("fractions", (0.7, 0.1, 0.2))),
                  overwrite=overwrite, progress=progress,
                  view_size=None if v1 else manifest["view_size"],
                  keep_originals=v1 or bool(manifest.get("originals")),
                  view_quality=manifest.get("view_quality", schema.VIEW_QUALITY),
                  created=manifest.get("created"),
                  manifest_extra={"relation_curation": relation_doc})


def _scan_labels(data_dir: str, progress: bool):
    """Pass A over the records, the labels only (images are never all held in memory): ids,
    raw object names, action counts, raw predicate counts."""
    ids, raw_names, actions = [], set(), collections.Counter()
    raw_predicates = collections.Counter()
    for s in iter_samples(data_dir, progress):
        ids.append(s.id)
        raw_names.update(o.name for o in s.objects)
        actions[s.action] += 1
        raw_predicates.update(r.predicate for r in s.relations)
    if not ids:
        raise ValueError(f"{data_dir}: the dataset has no records")
    return ids, raw_names, actions, raw_predicates


def _previous_curation(extend: str, encoder, min_cluster_size, min_samples):
    """(text encoder or None, the `extend` curation or None, HDBSCAN params): an extension
    is refused (other encoder, other hdbscan) before any slow work."""
    from data_prep.curate import cluster as curate_cluster, extend as curate_extend
    text_encoder, prev = None, None
    if extend:
        saved = curate_extend.read_saved(extend)  # a bad folder: refused before the model loads
        text_encoder = curate_cluster.TextEncoder(encoder or curate_cluster.default_model_path())
        prev = curate_extend.load_curation(extend, text_encoder, saved)
        params = prev.meta["params"]
    else:
        params = {"min_cluster_size": curate_cluster.MIN_CLUSTER_SIZE,
                  "min_samples": curate_cluster.MIN_SAMPLES}
    params = {"min_cluster_size": min_cluster_size or params["min_cluster_size"],
              "min_samples": min_samples or params["min_samples"]}
    return text_encoder, prev, params


def _write_action_candidates(clusters: str, rows, action_lemmatizer: str,
                             action_similarity: float) -> None:
    cand_path = os.path.splitext(clusters)[0] + ".action_candidates.tsv"
    text = (f"# surface form\tsuggested class\treason (review; copy the lines you accept "
            f"into your action map). lemmatiser {action_lemmatizer}, similarity "
            f"threshold {action_similarity}\n") + "".join("\t".join(row) + "\n" for row in rows)
    write_replacing(cand_path, lambda f: f.write(text), text=True)


def _read_labels(clusters: str, prev, new_names: list[str], std_names: list[str],
                 accept_suggested: bool = False) -> dict:
    """The labelled clusters file (with `prev`, the extended curation's labels and the new
    names' ones); refused if it misses any of the dataset's names, or if no new cluster has
    a label and not `accept_suggested`."""
    from data_prep.curate import cluster as curate_cluster, extend as curate_extend
    from data_prep.curate.report import check_labelled
    if prev is None:
        labels = curate_cluster.read_curated(clusters)
        if "extends" in bounds.read_json(clusters):
            raise ValueError(f"{clusters} was written by `--extend`; pass the same --extend "
                             f"folder, or delete it to cluster this dataset on its own")
    else:
        labels = dict(prev.labels)
        if new_names:
            labels.update(curate_extend.read_extension(clusters, prev))
    unknown = [n for n in std_names if n not in labels]
    if unknown:
        raise ValueError(f"{clusters} does not list {len(unknown)} of the dataset's object "
                         f"names (e.g. {unknown[:5]}): it was made for other data; delete it "
                         f"to cluster again")
    if new_names:
        check_labelled(clusters, accept_suggested=accept_suggested)
    return labels


def _write_logs(out_dir: str, curator: "Curator", inputs: dict, relation_doc: dict,
                table: str) -> tuple[dict, dict]:
    """curation_log.json, statistics.json and the predicate table into `out_dir`."""
    log = curator.log()
    log["inputs"] = inputs
    log["relation_curation"] = relation_doc
    statistics = curator.statistics()
    for name, doc in (("curation_log.json", log), ("statistics.json", statistics)):
        text = json.dumps(doc, indent=1, sort_keys=True)
        write_replacing(os.path.join(out_dir, name), lambda f: f.write(text.encode("utf-8")))
    write_replacing(os.path.join(out_dir, PREDICATE_TABLE),
                    lambda f: f.write(table.encode("utf-8")))
    return log, statistics


PREDICATE_TABLE = "predicate_table.tsv"


def relation_curation_doc(keep_prepositions: bool, overrides) -> dict:
    """How the predicates were curated, as the manifest and the log record it."""
    return {"rule": "stopwords removed from the predicate (NLTK English list, the appendix's "
                    "rule)" + ("; spatial prepositions after the verb kept"
                               if keep_prepositions else ""),
            "keep_prepositions": bool(keep_prepositions),
            "overrides": overrides.as_dict() if overrides else None,
            "predicate_table": PREDICATE_TABLE}


def predicate_table_text(data_dir: str, raw_counts, predicate_map: dict[str, str],
                         relation_doc: dict) -> str:
    """The predicate table (`curate_predicates.format_predicate_table`) with a header naming
    the data, the rule and the overrides file."""
    from data_prep.curate import predicates as curate_predicates
    rows = curate_predicates.predicate_table(raw_counts, predicate_map)
    ov = relation_doc["overrides"]
    return curate_predicates.format_predicate_table(rows, header=(
        f"predicate table of {os.path.abspath(data_dir)}: {sum(raw_counts.values())} "
        f"relations, {len(raw_counts)} raw predicates -> {len(rows)} predicates",
        f"rule: {relation_doc['rule']}",
        f"overrides: {ov['file']} (sha256 {ov['sha256']}, {len(ov['entries'])} entries)" if ov
        else "overrides: none (keep / rename / merge lines in a file given to "
             "--relation-overrides; see data_prep.curate.predicates)",
        "rows whose raw predicates differ by a spatial preposition come first, with the "
        "prepositions merged in the last column"))


def extend_clusters_file(prev, new_names: list[str], clusters: str, encoder, params: dict,
                         min_strength: float, progress: bool = True) -> dict:
    """An extension's first pass: suggestions for `new_names` into `prev`'s curated clusters,
    the rest clustered among themselves; the clusters file and its report. Returns the doc."""
    from data_prep.curate import cluster as curate_cluster, extend as curate_extend
    from data_prep.curate.report import write_report
    emb = encoder.encode(new_names, progress=progress)
    suggestions, unfit = curate_extend.suggest(prev, new_names, emb, min_strength)
    at = {n: i for i, n in enumerate(new_names)}
    unfit_emb = emb[[at[n] for n in unfit]]
    clusterer, unfit_labels = curate_cluster.fit_labels(unfit_emb, **params)
    doc = curate_cluster.write_json(clusters, curate_extend.extension_doc(
        prev, suggestions, unfit, unfit_labels, unfit_emb, min_strength))
    write_report(clusters, doc, unfit, unfit_labels, clusterer, header=(
        f"Extending {prev.folder}: {len(suggestions)} of {len(new_names)} new names suggested "
        f"into curated clusters (strength >= {min_strength}); the other {len(unfit)} clustered "
        f"among themselves{' (the figure)' if clusterer is not None else ''}.\n\n"))
    return doc


def save_object_curation(out_dir: str, prev, std_names: list[str], new_names: list[str],
                         labels: dict[str, str], encoder, params: dict,
                         progress: bool = True) -> None:
    """OUT/object_curation: this curation's names (and an extended one's earlier names), their
    labels and their embeddings (the clusterer is fit on all of them when saved and refit
    from them by the next `--extend`)."""
    from data_prep.curate import extend as curate_extend
    if prev is None:
        names, emb = list(std_names), encoder.encode(std_names, progress=progress)
    else:
        names = prev.names + new_names
        emb = np.concatenate([prev.emb, encoder.encode(new_names, progress=progress)]
                             if new_names else [prev.emb])
    curate_extend.save_curation(os.path.join(out_dir, curate_extend.STATE_DIR), names, emb,
                                {n: labels[n] for n in names}, encoder, params)


def action_candidate_rows(actions: collections.Counter, lemmatize, encoder,
                          similarity: float = ACTION_SIMILARITY, *,
                          progress: bool = False) -> list[tuple[str, str, str]]:
    """Rows of the action candidates file: `curate_rules.action_candidates` (lemmatised
    content words) first, then `similar_action_candidates` for the actions those left alone
    (skipped when `similarity` is 0). `actions` counts raw phrases per image."""
    counts = collections.Counter()
    for action, n in actions.items():
        counts[rules.normalise_text(action)] += n
    counts.pop("", None)
    rows = rules.action_candidates(counts, lemmatize=lemmatize)
    if similarity and counts:
        names = sorted(counts)
        emb = encoder.encode(names, progress=progress)
        rows += rules.similar_action_candidates(names, counts, emb, similarity,
                                                skip={r[0] for r in rows})
    return rows


def _no_adjectives(tokens):
    return [(t, "NN") for t in tokens]


def format_statistics(stats: dict) -> str:
    lines = ["| source | images | actions | objects | triplets | occurrences per triplet |",
             "|---|---|---|---|---|---|"]
    for source, row in sorted(stats.items()):
        lines.append(f"| {source} | {row['images']} | {row['actions']} | {row['objects']} | "
                     f"{row['triplets']} | {row['occurrences_per_triplet']:.2f} |")
    return "\n".join(lines)

