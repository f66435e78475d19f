"""Object detection with a run's encoders as Faster R-CNN backbones (the appendix protocol).

    python -m sclaro_jax.eval.detect --workdir RUN --data DIR [--level-rpn global --level-roi object]

Trains a Faster R-CNN + FPN (`sclaro_jax.detection`) on the SCLARO dataset DIR's training
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
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

LEVELS = ("global", "object", "relation")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sclaro_jax.eval.detect",
        description="Faster R-CNN + FPN detection with a run's encoders as backbones: train on "
                    "a SCLARO dataset's boxes, evaluate COCO-style AP (appendix protocol).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workdir", required=True,
                   help="a ScenarioCLIP / PyramidCLIP training workdir, or a Hugging Face "
                        "CLIPModel folder")
    p.add_argument("--data", required=True, help="SCLARO dataset folder (manifest.json, shards)")
    p.add_argument("--level-rpn", choices=LEVELS, default="global",
                   help="the workdir's encoder that feeds the RPN")
    p.add_argument("--level-roi", choices=LEVELS, default="object",
                   help="the workdir's encoder that feeds the RoI heads")
    p.add_argument("--teacher", action="store_true", help="the EMA teacher's encoders")
    p.add_argument("--out", default=None, help="run folder (default: under WORKDIR/detection)")
    p.add_argument("--config", default="default",
                   help="the recipe: 'default' (the appendix protocol), 'demo' (CPU minutes on "
                        "the demo data) or a config file PATH[:variant] defining get_config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set epochs=2 --set detector.image_size="
                        "448 (repeatable)")
    p.add_argument("--split", default=None, help="evaluation split (default: the recipe's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="tracebacks on errors")
    return p


def load_config(spec: str, overrides: Sequence[str]):
    from sclaro_jax.detection import train

    if spec in ("default", "demo"):
        config = train.default_config(None if spec == "default" else spec)
    else:
        from sclaro_jax.config import load_config as load_file
        config = load_file(spec)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        parent = config
        parts = key.split(".")
        for part in parts[:-1]:
            if part not in parent:
                raise ValueError(f"--set {item!r}: unknown key {key!r}")
            parent = parent[part]
        if parts[-1] not in parent:
            known = sorted(k for k in parent.keys())
            raise ValueError(f"--set {item!r}: unknown key {key!r}; known here: {known}")
        old = parent[parts[-1]]
        try:
            parent[parts[-1]] = type(old)(json.loads(value)) if not isinstance(old, str) \
                else value
        except (ValueError, TypeError) as e:
            raise ValueError(f"--set {item!r}: {e}") from None
    return config


def backbones(workdir: str, level_rpn: str, level_roi: str, teacher: bool, dtype=None):
    """(rpn vision tower, roi vision tower or None when one encoder feeds both, patch size,
    model name for the table); the towers compute in `dtype` (default: float32)."""
    import jax.numpy as jnp

    from sclaro_jax.models import clip

    dtype = jnp.dtype(dtype or jnp.float32)

    folder = Path(workdir)
    cfg_path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"--workdir {workdir} does not exist")
    if (folder / "checkpoints").is_dir():
        from sclaro_jax.checkpoint import load_checkpoint, run_config

        config = run_config(str(folder))
        config.model.dtype = dtype.name
        model, step = load_checkpoint(str(folder), teacher=teacher, config=config)
        rpn, roi = model.pair(level_rpn), model.pair(level_roi)
        patch = rpn.config.vision.patch_size
        kind = type(model).__name__
        if roi is rpn:
            return rpn.vision_model, None, patch, f"{kind} ({level_rpn}, step {step})"
        return (rpn.vision_model, roi.vision_model, patch,
                f"{kind} ({level_rpn} -> RPN, {level_roi} -> RoI, step {step})")
    if cfg_path.exists() and json.loads(cfg_path.read_text()).get("model_type") == "clip":
        model = clip.from_hf(folder, dtype=dtype)
        return model.vision_model, None, model.config.vision.patch_size, f"CLIP ({folder.name})"
    raise FileNotFoundError(f"--workdir {workdir} is neither a training workdir (config.json + "
                            "checkpoints/) nor a Hugging Face CLIPModel folder")


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
    import jax.numpy as jnp

    from sclaro_jax.detection import data, evaluate, train
    from sclaro_jax.detection.model import Detector

    config = load_config(args.config, args.set)
    split = args.split or config.eval_split
    dtype = train.compute_dtype(config.dtype)
    rpn, roi, patch, name = backbones(args.workdir, args.level_rpn, args.level_roi,
                                      args.teacher, dtype)
    tag = "clip" if name.startswith("CLIP") else (
        args.level_rpn if roi is None else f"{args.level_rpn}-{args.level_roi}")
    out = Path(args.out or Path(args.workdir) / "detection" / tag)
    out.mkdir(parents=True, exist_ok=True)
    train_examples, classes = data.load_examples(args.data, config.train_split)
    eval_examples, _ = data.load_examples(args.data, split, classes=classes)
    if not train_examples:
        raise ValueError(f"{args.data}: the {config.train_split!r} split holds no boxes")
    cfg = train.detector_config(config, len(classes))
    size, mode = cfg.image_size, config.input_resize
    train_examples = [data.resize_for_detection(ex, size, mode) for ex in train_examples]
    originals = eval_examples
    eval_examples = [data.resize_for_detection(ex, size, mode) for ex in eval_examples]
    model = Detector(cfg, rpn, patch, roi, dtype=dtype, seed=config.seed)
    graphdef, state, info = train.train(config, str(out), model, train_examples, len(classes),
                                        progress=not args.no_progress)
    detections = original_detections(
        train.predict(graphdef, state["params"], eval_examples, config.eval_batch_size),
        eval_examples)
    groups = data.class_frequency_groups(data.class_image_counts(train_examples, len(classes)))
    metrics = evaluate.coco_evaluate([(ex.boxes, ex.labels) for ex in originals],
                                     detections, len(classes), groups=groups,
                                     max_dets=cfg.detections_per_img)
    results = {"model": name, "metrics": metrics, "split": split,
               "images": len(eval_examples), "classes": len(classes),
               "out": str(out.resolve()), "steps": int(state["step"]), "train_step_compiles": info["compiles"], "workdir": str(Path(args.workdir).resolve()),
               "data": str(Path(args.data).resolve()), "config": config.to_dict(),
               "class_groups": {g: int((groups == g).sum()) for g in "rcf"}}
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "results.md").write_text(evaluate.markdown_table({name: metrics}) + "\n")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sclaro_jax").setLevel(logging.INFO)
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's per-save INFO lines
    try:
        results = run(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
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
