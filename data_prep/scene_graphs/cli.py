"""`python -m data_prep import`: write SCLARO records from a public scene-graph dataset
(OpenPSG or Visual Genome) as released, without any model.

Objects, boxes and relations come from the dataset; each relation's focused region (appendix
Eqs. 4-7) from its masks: PSG's panoptic segments, or Visual Genome's boxes (mask_kind box);
the action word is the lemma of the main verb of the first caption that has one (NLTK POS
tagger and WordNet: python -m nltk.downloader averaged_perceptron_tagger_eng wordnet), the
caption that one (PSG: COCO captions; VG: region descriptions); the split is the dataset's
(PSG: its test ids; VG: a hash of the image id, 20% test). Images that cannot be used are
skipped and counted by reason. Parallel (--workers processes, blocks of --block-size images)
and resumable: each finished block is kept in the work folder (default OUT.work), so a killed
import resumes where it stopped when the same command is rerun; the dataset is published
atomically at the end (the same records for any number of workers or kills) and the work
folder removed. See docs/data.md, "From PSG or Visual Genome", for the layouts.
"""

import argparse
import os

from data_prep.cli import command, view_flags, write_flags
from sclaro_jax.cli import INTERRUPTS, ctrl_c, positive_int, writable


def add_parser(sub) -> argparse.ArgumentParser:
    imp = command(sub, "import", run, __doc__)
    imp.add_argument("--source", required=True, choices=("psg", "vg"),
                     help="psg: OpenPSG (psg.json, COCO images, panoptic PNGs and captions); "
                          "vg: Visual Genome (image_data, objects, relationships and "
                          "region_descriptions json)")
    imp.add_argument("--root", required=True, metavar="DIR",
                     help="the dataset's folder as released (layouts in docs/data.md)")
    imp.add_argument("--out", required=True, type=writable, help="dataset folder to write")
    imp.add_argument("--captions", action="append", default=[], metavar="FILE",
                     help="psg: a COCO captions json (repeatable; default "
                          "ROOT/coco/annotations/captions_*.json)")
    imp.add_argument("--no-actions", action="store_true",
                     help="no action words (every action \"\"): needs no NLTK data")
    imp.add_argument("--limit", type=int, default=0, metavar="N",
                     help="only the first N images of the dataset (0 = all)")
    imp.add_argument("--records-per-shard", type=int, default=1000, metavar="N",
                     help="records per ArrayRecord shard (default 1000)")
    imp.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1, metavar="N",
                     help=f"worker processes (default: one per core, {os.cpu_count()} here)")
    imp.add_argument("--block-size", type=positive_int, default=256, metavar="N",
                     help="images per block: the unit a worker does, keeps and resumes "
                          "(default 256)")
    imp.add_argument("--work", default="", type=writable, metavar="DIR",
                     help="work folder of the finished blocks (default: OUT.work): new or "
                          "empty, or an earlier import's; removed once the dataset is written")
    view_flags(imp, keep_default=False)
    write_flags(imp)
    return imp


def run(args) -> int:
    from data_prep.scene_graphs.pipeline import format_summary, import_scene_graphs
    try:
        manifest = import_scene_graphs(
            args.source, args.root, args.out, captions=tuple(args.captions),
            with_actions=not args.no_actions, limit=args.limit,
            records_per_shard=args.records_per_shard, overwrite=args.overwrite,
            image_size=args.image_size, keep_originals=args.keep_originals,
            progress=not args.no_progress, workers=args.workers, block_size=args.block_size,
            work=args.work or None)
    except INTERRUPTS as e:  # a Ctrl-C: the import said what it kept
        if not ctrl_c(e):
            raise
        return 130
    print(format_summary(manifest["import"]))
    print(f"wrote {manifest['records']} records to {args.out}")
    return 0
