"""`python -m data_prep rocs`: build a ROCS-style retrieval split (rare objects in cluttered scenes)
from a COCO instances file.

MINER section 3: the top --top-fraction of images by object count; in each, the objects whose class
appears once; of those, the ones whose SAM mask covers at most --max-mask-area of the image; a VLM
caption of each, one COCO-style sentence (the paper's appendix J prompts) that names it in
--caption-words words (asked again once if it does not, then dropped). Writes OUT/rocs (a datasets
folder that python -m sclaro_jax.eval.rocs reads), OUT/summary.json (every drop with its reason)
and OUT/stats.json (the paper's Figure 3 numbers). Masks and captions are cached in --work: a rerun
after a crash redoes only what is missing.
"""

import argparse
import os
import re

from data_prep.cli import command, write_flags
from sclaro_jax.cli import writable
from sclaro_jax.files import own_folder


def add_parser(sub) -> argparse.ArgumentParser:
    """`rocs`: its flags."""
    rocs = command(sub, "rocs", run, __doc__)
    rocs.add_argument("--images", required=True, help="image folder (the file_names of the "
                      "instances file are relative to it)")
    rocs.add_argument("--instances", default="", help="COCO instances JSON")
    rocs.add_argument("--detector", default="", help="for images without annotations: a "
                      "grounding-dino-base folder (save_pretrained); with --classes")
    rocs.add_argument("--classes", default="", help="class names to prompt --detector with: "
                      "coco80 (the 80 COCO class names, the MINER paper's SAM 3 prompts), "
                      "'cat,dog,...' or @FILE (one per line)")
    rocs.add_argument("--out", required=True, type=writable,
                      help="output folder: new or empty, or an earlier run's")
    rocs.add_argument("--work", default="", help="cache folder (default: OUT/work): new or "
                      "empty, or an earlier run's")
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
    write_flags(rocs, overwrite=False)
    return rocs


def run(args) -> int:
    from data_prep.rocs import selection as rocs_select
    from data_prep.rocs.caption import CaptionReplies, need_datasets
    from data_prep.rocs.pipeline import build_rocs, class_list
    from sclaro_jax.data.schema import file_sha256

    check_flags(args)
    need_datasets()  # the split's writer, before any model loads
    own_folder(args.out, flag="--out")  # before the work folder in it: a folder it made
    classes = class_list(args.classes) if args.detector else []
    words = _word_range(args.caption_words)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = args.work or os.path.join(args.out, "work")
    if args.instances:
        images = rocs_select.read_instances(args.instances)
    else:
        from data_prep.detect import GroundingDetector
        from data_prep.rocs.pipeline import detect_instances
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


def check_flags(args) -> None:
    """The flag combinations `run` refuses, before any model loads."""
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


def _word_range(value: str) -> tuple[int, int]:
    """--caption-words "LO-HI" -> (LO, HI)."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
    if not match or not 0 < int(match[1]) <= int(match[2]):
        raise ValueError(f"--caption-words {value!r}: expected LO-HI with 0 < LO <= HI, "
                         "e.g. 8-18")
    return int(match[1]), int(match[2])
