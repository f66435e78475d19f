"""Object detection with a run's encoders as Faster R-CNN backbones (the appendix protocol).

    python -m sclaro_jax.eval.detect --workdir RUN --data DIR [--level-rpn global --level-roi object]
        [--config configs/detection.py[:demo]] [--config.x.y=V ...]

Trains (delegated to `sclaro_jax.detection.trainer`, the trainer `python launch/train.py
--config configs/detection.py` runs, with this command's workdir, data and levels as
`config.backbone` and `config.data.dir`) a Faster R-CNN + FPN (`sclaro_jax.detection`) on the SCLARO dataset DIR's training
split (boxes + canonical object labels) and evaluates it on `--split` with COCO-style AP, AP50,
AP75 and AP over rare / common / frequent classes (pycocotools; the groups by the number of
training images that hold the class, LVIS's rule: 1-10 rare, 11-100 common, more frequent),
in the pixels of the loaded images: detections are mapped back from the detection input
(`input_resize`: squash, or ViTDet's long-side resize + pad).

Backbones, from `--workdir`:
- a ScenarioCLIP training workdir: the `--level-rpn` encoder (global by default) feeds the RPN,
  the `--level-roi` encoder (object by default) the RoI heads;
- a PyramidCLIP workdir: its one visual encoder feeds both;
- a Hugging Face `CLIPModel` folder (the CLIP baseline): its visual encoder feeds both.

Outputs in `--out` (default WORKDIR/detection/RPN-ROI, or WORKDIR/detection/clip):
`checkpoints/` (rerunning the command resumes; SIGINT / SIGTERM stop after a step with a
checkpoint), `metrics.jsonl`, `results.json` (every number and setting) and `results.md` (the
paper's table: Model | AP | AP50 | AP75 | APr | APc | APf).

Recipe overrides use the trainer's grammar, `--config.x.y=V` (e.g. `--config.epochs=2
--config.detector.image_size=448`); `--set x.y=V` is a deprecated alias for the same keys.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from sclaro_jax import cli

LEVEL_CHOICES = ("global", "object", "relation")  # the levels whose encoders serve as backbones


def _parser() -> argparse.ArgumentParser:
    p = cli.parser(
        "python -m sclaro_jax.eval.detect",
        "Faster R-CNN + FPN detection with a run's encoders as backbones: train on "
        "a SCLARO dataset's boxes, evaluate COCO-style AP (appendix protocol). "
        "Recipe overrides: --config.KEY=VALUE (repeatable), as launch/train.py.")
    p.add_argument("--workdir", required=True,
                   help="a ScenarioCLIP / PyramidCLIP training workdir, or a Hugging Face "
                        "CLIPModel folder")
    p.add_argument("--data", required=True, help="SCLARO dataset folder (manifest.json, shards)")
    p.add_argument("--level-rpn", choices=LEVEL_CHOICES, default="global",
                   help="the workdir's encoder that feeds the RPN")
    p.add_argument("--level-roi", choices=LEVEL_CHOICES, default="object",
                   help="the workdir's encoder that feeds the RoI heads")
    p.add_argument("--teacher", action="store_true", help="the EMA teacher's encoders")
    p.add_argument("--out", default=None, help="run folder (default: under WORKDIR/detection)")
    p.add_argument("--config", default="default",
                   help="the recipe: 'default' (configs/detection.py, the appendix protocol), "
                        "'demo' (configs/detection.py:demo, CPU minutes on the demo data) or a "
                        "config file PATH[:variant] defining get_config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="deprecated alias of --config.KEY=VALUE")
    p.add_argument("--split", default=None, help="evaluation split (default: the recipe's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--allow-config-change", action="store_true",
                   help="continue the --out run with a recipe that differs from the one it was "
                        "trained with (both are kept), as launch/train.py")
    p.add_argument("--verbose", action="store_true", help="tracebacks on errors")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The arguments; `--config.KEY=VALUE` (or `--config.KEY VALUE`) overrides are gathered, in
    order with the deprecated `--set KEY=VALUE` ones, as `args.overrides` ("KEY=VALUE")."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            key, sep, value = arg[len("--config."):].partition("=")
            if not sep and i + 1 < len(argv):
                value, sep, i = argv[i + 1], "=", i + 1
            overrides.append(f"{key}{sep}{value}")
        elif arg == "--set" and i + 1 < len(argv):
            overrides.append(argv[i + 1])
            i += 1
        else:
            rest.append(arg)
        i += 1
    args = _parser().parse_args(rest)
    args.overrides = overrides
    return args


def load_config(spec: str, overrides: Sequence[str]):
    """The recipe of `spec` ("default", "demo" or PATH[:variant]) with `overrides` ("KEY=VALUE",
    `sclaro_jax.config.apply_overrides`) applied."""
    from sclaro_jax.config import apply_overrides, load_config as load_file
    from sclaro_jax.detection import train

    if spec in ("default", "demo"):
        config = train.default_config(None if spec == "default" else spec)
    else:
        config = load_file(spec)
    apply_overrides(config, overrides)
    return config


def backbones(workdir: str, level_rpn: str, level_roi: str, teacher: bool, dtype=None):
    """`sclaro_jax.detection.backbones.backbones` (kept here for older imports)."""
    from sclaro_jax.detection.backbones import backbones as load

    return load(workdir, level_rpn, level_roi, teacher, dtype)


def original_detections(detections, examples) -> list[tuple]:
    """Detections (boxes, scores, labels) per resized example -> the same in the pixels of the
    images they were resized from (`data.boxes_to_original`: clipped to the content region,
    boxes under 1e-2 detection pixels dropped, scaled back)."""
    from sclaro_jax.detection import data

    out = []
    for (boxes, scores, labels), ex in zip(detections, examples, strict=True):
        boxes, keep = data.boxes_to_original(boxes, ex)
        out.append((boxes[keep], np.asarray(scores)[keep], np.asarray(labels)[keep]))
    return out


def run(args) -> dict:
    from sclaro_jax.detection import evaluate

    evaluate.require_pycocotools()  # before minutes of training end in a missing package
    from sclaro_jax.detection import data, train, trainer

    config = load_config(args.config, args.overrides)
    split = args.split or config.eval_split
    config.data.dir = args.data
    config.backbone.update(workdir=args.workdir, level_rpn=args.level_rpn,
                           level_roi=args.level_roi, teacher=args.teacher)
    prepared = trainer.prepare(config)
    tag = "clip" if prepared.name.startswith("CLIP") else (
        args.level_rpn if prepared.shared else f"{args.level_rpn}-{args.level_roi}")
    out = Path(args.out or Path(args.workdir) / "detection" / tag)
    out.mkdir(parents=True, exist_ok=True)
    graphdef, state, info = trainer.fit(config, str(out), prepared,
                                        progress=not args.no_progress,
                                        allow_config_change=args.allow_config_change)
    eval_examples, _ = data.load_examples(args.data, split, classes=prepared.classes)
    cfg = prepared.model.cfg
    originals = eval_examples
    eval_examples = [data.resize_for_detection(ex, cfg.image_size, config.input_resize)
                     for ex in eval_examples]
    detections = original_detections(
        train.predict(graphdef, state["params"], eval_examples, config.eval_batch_size),
        eval_examples)
    classes = prepared.classes
    groups = data.class_frequency_groups(data.class_image_counts(prepared.examples, len(classes)))
    metrics = evaluate.coco_evaluate([(ex.boxes, ex.labels) for ex in originals],
                                     detections, len(classes), groups=groups,
                                     max_dets=cfg.detections_per_img)
    results = {"model": prepared.name, "metrics": metrics, "split": split,
               "images": len(eval_examples), "classes": len(classes),
               "out": str(out.resolve()), "steps": int(state["step"]),
               "train_step_compiles": info["compiles"],
               "workdir": str(Path(args.workdir).resolve()),
               "data": str(Path(args.data).resolve()), "config": config.to_dict(),
               "class_groups": {g: int((groups == g).sum()) for g in "rcf"}}
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "results.md").write_text(evaluate.markdown_table({prepared.name: metrics}) + "\n")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sclaro_jax").setLevel(logging.INFO)
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's per-save INFO lines
    try:
        results = run(args)
    except (ValueError, FileNotFoundError, KeyError, ImportError) as e:
        if args.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = results["metrics"]
    print(f"{results['model']}: " + ", ".join(
        f"{k} {100 * v:.1f}" if v == v else f"{k} - (no class in the group)"
        for k, v in m.items() if isinstance(v, float)))
    print(f"results: {Path(results['out']) / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
