"""`python -m data_prep annotate`: run the three annotation stages (VLM, GroundingDINO, SAM) over a
source and write SCLARO shards; rerun the same command to resume.

Stage 1: the VLM's action, objects, relation triplets and caption. Stage 2: GroundingDINO boxes
(thresholds 0.25/0.25, NMS IoU 0.4). Stage 3: SAM masks and a focused-region image per relation.
Results are cached per chunk in the work folder: a killed run continues where it stopped. The
caches are keyed by content: an edited reply redoes its chunk, changed GroundingDINO / SAM / VLM
weight files redo their stage and the later ones (each file's sha256, remembered in
WORK/hashes.json by path, size, mtime and ctime); the run says what it redoes and why.
"""

import argparse
import json

from data_prep.cli import command, view_flags, write_flags
from sclaro_jax import bounds
from sclaro_jax.cli import writable


def add_parser(sub) -> argparse.ArgumentParser:
    """`annotate`: its flags, then the engine's (`engine_flags`)."""
    from data_prep.vlm import REPLY_IDS
    ann = command(sub, "annotate", run, __doc__)
    ann.add_argument("--source", default="folder",
                     choices=("folder", "mmit", "cc3m", "openpsg", "pvsg", "kitti2015",
                              "webdataset", "hf"),
                     help="layout of --root (default: a plain folder of images); webdataset: "
                          "uncompressed .tar shards read in place (img2dataset's webdataset "
                          "output); hf: a Hugging Face datasets folder (save_to_disk)")
    ann.add_argument("--root", required=True,
                     help="the source's root folder; for webdataset also one .tar or a brace "
                          "pattern such as 'DIR/{00000..00009}.tar' (quote it)")
    ann.add_argument("--source-option", action="append", default=[], metavar="KEY=VALUE",
                     help="an option of the source adapter (data_prep.sources), e.g. "
                          "frames_per_video=3 or skip_missing=true; webdataset: name=cc3m "
                          "(ids cc3m/<shard>/<key>, as the cc3m files layout); hf: split=train, "
                          "image_column=, id_column=, caption_column=, name=; repeatable")
    ann.add_argument("--out", required=True, type=writable, help="dataset folder to write")
    ann.add_argument("--work", default="", help="cache folder (default: OUT.work): new or "
                     "empty, or an earlier run's")
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
    ann.add_argument("--sam-type", default="vit_h",
                     help="SAM variant of --sam: vit_h (default), vit_l, vit_b, or tiny: the "
                          "small random SAM that `python -m data_prep demo-models` writes (with "
                          "the other models and photographs to try annotate on a CPU)")
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
    view_flags(ann, keep_default=False)
    write_flags(ann)
    speed_flags(ann)
    engine_flags(ann)
    return ann


def speed_flags(ann: argparse.ArgumentParser) -> None:
    """The speed switches of the models, all off by default (bench/bench_annotate_gpu.py times
    them; tests/test_annotate_switches.py checks their outputs)."""
    speed = ann.add_argument_group(
        "speed", "switches of how the models run; the first four give the same records as "
                 "without them (SDPA / compiled SAM: the same masks to float rounding)")
    for flag, what in SPEED_FLAGS:
        speed.add_argument(flag, action="store_true", help=what)


# (flag, help) of the speed switches; each is an AnnotateConfig field of the same name
SPEED_FLAGS = (
    ("--detector-text-once", "GroundingDINO: run the text encoder once per distinct prompt of a "
                             "batch (images with the same object list share it)"),
    ("--sam-sdpa", "SAM: the image encoder's attention through torch's "
                   "scaled_dot_product_attention (relative positions as its mask)"),
    ("--sam-compile", "SAM: torch.compile the image encoder (the first image waits for the "
                      "compile)"),
    ("--vlm-static-cache", "VLM: greedy generation with a static KV cache "
                           "(cache_implementation='static'); larger VLM batches come with a "
                           "larger --batch-size"),
    ("--bf16", "GroundingDINO and SAM under torch.autocast(bfloat16): faster on GPUs, boxes and "
               "masks differ by bf16 rounding (the VLM already runs in bfloat16)"),
)


def engine_flags(ann: argparse.ArgumentParser) -> None:
    """The --engine group: which engine runs the stages, and the Ray engine's resources."""
    eng = ann.add_argument_group(
        "engine", "--engine ray runs the stages as a Ray Data pipeline (the `cluster` "
                  "extra): a pool of actors per stage, each loading its model "
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
    eng.add_argument("--stage-cpus", type=stage_cpus, default="auto", metavar="C",
                     help="CPUs per stage actor, or auto (default): the cluster's CPUs less "
                          "0.25 for writing, shared by the stage actors, at most 1 each (so "
                          "the defaults start on 2 cores); its whole part, at least 1, is the "
                          "actor's torch threads")
    eng.add_argument("--stage-concurrency", action="append", default=[], metavar="STAGE=N",
                     help="actors of a stage (vlm, detector, sam), e.g. detector=2; N alone "
                          "sets every stage; repeatable (default 1 each)")
    eng.add_argument("--retries", type=int, default=2, metavar="N",
                     help="retries of a block whose stage raises or whose actor dies, before "
                          "the run stops (default 2)")


def stage_cpus(value: str):
    """--stage-cpus: "auto" or a number > 0."""
    if value == "auto":
        return value
    try:
        cpus = float(value)
    except ValueError:
        cpus = 0.0
    if not cpus > 0:
        raise argparse.ArgumentTypeError(f"expected auto or a number of CPUs > 0, got {value!r}")
    return cpus


def run(args) -> int:
    import logging

    from data_prep.annotate.pipeline import AnnotateConfig, annotate, format_summary
    from data_prep.annotate.ray_engine import parse_concurrency
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = []
    for item in args.source_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--source-option {item!r} is not KEY=VALUE")
        try:
            options.append((key, bounds.parse_json(value, f"--source-option {key}")))
        except json.JSONDecodeError:
            options.append((key, value))
    cfg = AnnotateConfig(
        source=args.source, root=args.root, source_options=tuple(options), out=args.out,
        work=args.work, vlm=args.vlm, vlm_replies=args.vlm_replies,
        vlm_trust_remote_code=args.vlm_trust_remote_code,
        detector=args.detector, sam=args.sam, sam_type=args.sam_type, device=args.device,
        batch_size=args.batch_size, box_threshold=args.box_threshold,
        text_threshold=args.text_threshold, nms_iou=args.nms_iou, limit=args.limit,
        split_seed=args.split_seed, records_per_shard=args.records_per_shard,
        overwrite=args.overwrite, progress=not args.no_progress, image_size=args.image_size,
        keep_originals=args.keep_originals, engine=args.engine, ray_address=args.ray_address,
        vlm_gpus=args.vlm_gpus, detector_gpus=args.detector_gpus, sam_gpus=args.sam_gpus,
        stage_cpus=args.stage_cpus, retries=args.retries,
        **{flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
           for flag, _ in SPEED_FLAGS},
        stage_concurrency=tuple(parse_concurrency(args.stage_concurrency).items()))
    if args.no_progress:  # transformers' and the hub's own bars too ("Loading weights")
        from data_prep.cli import quiet_model_bars
        quiet_model_bars()
    summary = annotate(cfg)
    print(format_summary(summary))
    print(f"wrote {summary['records']} records to {args.out}; caches and summary.json in "
          f"{cfg.work_dir}")
    return 0
