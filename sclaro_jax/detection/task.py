"""The detector as a task (`sclaro_jax.run.task`), from a config alone (configs/detection.py):
the dataset of `config.data.dir`, the encoders of `config.backbone` (`backbones.from_config`),
the Detector, trained by `train.train` in the workdir, then evaluated on `config.eval_split`
with COCO-style AP, AP50, AP75 and AP over rare / common / frequent classes (pycocotools; the
groups by the number of training images that hold the class, LVIS's rule: 1-10 rare, 11-100
common, more frequent), in the pixels of the loaded images: detections are mapped back from the
detection input (`input_resize`: squash, or ViTDet's long-side resize + pad).

`launch/train.py --config configs/detection.py --workdir W` trains and evaluates;
`python -m sclaro_jax.eval.detect --workdir W` evaluates W's newest checkpoint alone. Both write
W/results.json (every number and setting) and W/results.md (the paper's table: Model | AP |
AP50 | AP75 | APr | APc | APf).
"""

from __future__ import annotations

import dataclasses
import json
import os

from sclaro_jax.detection import backbones, data, evaluate, train
from sclaro_jax.detection.model import Detector
from sclaro_jax.files import write_replacing
from sclaro_jax.run.task import Evaluated, Fitted


@dataclasses.dataclass
class Prepared:
    model: Detector
    examples: list  # the training examples at the detection size
    classes: list[str]
    name: str  # the backbone, for the results table
    shared: bool  # one encoder feeds both the RPN and the RoI heads
    dtype: object


def prepare(config, *, verify_data: bool = False) -> Prepared:
    """The detector and its training examples for `config` (ValueError: a split without boxes;
    with `verify_data`, every shard's sha256 is checked against the manifest first)."""
    if verify_data:
        from sclaro_jax.data.dataset import open_dataset
        open_dataset(config.data.dir, verify=True).check_files(config.train_split)
    dtype = train.compute_dtype(config.dtype)
    rpn, roi, patch, name = backbones.from_config(config, dtype)
    examples, classes = data.load_examples(config.data.dir, config.train_split)
    if not examples:
        raise ValueError(f"{config.data.dir}: the {config.train_split!r} split holds no boxes")
    cfg = train.detector_config(config, len(classes))
    examples = [data.resize_for_detection(ex, cfg.image_size, config.input_resize)
                for ex in examples]
    model = Detector(cfg, rpn, patch, roi, dtype=dtype, seed=config.seed)
    return Prepared(model, examples, classes, name, roi is None, dtype)


def original_detections(detections, examples) -> list[tuple]:
    """Detections (boxes, scores, labels) per resized example -> the same in the pixels of the
    images they were resized from (`data.boxes_to_original`: clipped to the content region,
    boxes under 1e-2 detection pixels dropped, scaled back)."""
    import numpy as np

    out = []
    for (boxes, scores, labels), ex in zip(detections, examples, strict=True):
        boxes, keep = data.boxes_to_original(boxes, ex)
        out.append((boxes[keep], np.asarray(scores)[keep], np.asarray(labels)[keep]))
    return out


class Detection:
    name = "detection"

    def check(self, config) -> None:
        """The recipe's values (`train.check_recipe`: each key in its range, `config.validate`
        over configs/detection.py's RANGES), before anything is read or written; COCO AP's
        package too, so a machine without it hears so before minutes of training."""
        train.check_recipe(config)
        evaluate.require_pycocotools()

    def demo_view_size(self, config) -> int | None:
        """The demo configs (a small detector at a demo's batch) train on the originals."""
        demo = config.detector.image_size <= 128 and config.batch_size <= 16
        return 0 if demo else None

    def fit(self, config, workdir: str, *, progress: bool = True,
            allow_config_change: bool = False, verify_data: bool = False,
            stop_at: int | None = None) -> Fitted:
        prepared = prepare(config, verify_data=verify_data)
        _, state, info = train.train(config, workdir, prepared.model, prepared.examples,
                                     len(prepared.classes), progress=progress, stop_at=stop_at,
                                     allow_config_change=allow_config_change)
        return Fitted(state, int(state["step"]), info["steps"])

    def evaluate(self, config, workdir: str, *, progress: bool = True,
                 step: int | None = None, fitted: Fitted | None = None) -> Evaluated:
        """COCO AP of a checkpoint in `workdir` (`step`, default the newest; a damaged one is
        refused: DamagedRunError) on `config.eval_split`. The detector is always read back from
        the checkpoint (`fitted` is not used)."""
        step = evaluate.newest_step(workdir, step)  # a run to evaluate, before the model is built
        prepared = prepare(config)
        graphdef, params, step = evaluate.restore_params(workdir, prepared.model, step)
        cfg = prepared.model.cfg
        originals, _ = data.load_examples(config.data.dir, config.eval_split,
                                          classes=prepared.classes)
        resized = [data.resize_for_detection(ex, cfg.image_size, config.input_resize)
                   for ex in originals]
        detections = original_detections(
            evaluate.predict(graphdef, params, resized, config.eval_batch_size), resized)
        classes = prepared.classes
        groups = data.class_frequency_groups(data.class_image_counts(prepared.examples,
                                                                     len(classes)))
        metrics = evaluate.coco_evaluate([(ex.boxes, ex.labels) for ex in originals],
                                         detections, len(classes), groups=groups,
                                         max_dets=cfg.detections_per_img)
        results = {"model": prepared.name, "metrics": metrics, "split": config.eval_split,
                   "images": len(resized), "classes": len(classes),
                   "workdir": os.path.abspath(workdir), "steps": step,
                   "backbone": config.backbone.workdir or "tiny (random)",
                   "data": os.path.abspath(config.data.dir), "config": config.to_dict(),
                   "class_groups": {g: int((groups == g).sum()) for g in "rcf"}}
        table = evaluate.markdown_table({prepared.name: metrics})
        write_replacing(os.path.join(workdir, "results.json"), lambda f: f.write(
            json.dumps(results, indent=2, default=str) + "\n"), text=True)
        path = os.path.join(workdir, "results.md")
        write_replacing(path, lambda f: f.write(table + "\n"), text=True)
        return Evaluated(results, table, path)


TASK = Detection()
