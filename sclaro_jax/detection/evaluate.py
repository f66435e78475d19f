"""COCO box AP for detections (pycocotools) and the paper's results table.

`coco_evaluate` takes ground truth and detections per image as numpy arrays, boxes as
(x0, y0, x1, y1) pixels and labels as class indices 0..C-1, builds the COCO dictionaries in
memory (boxes as x, y, w, h, area = w * h, iscrowd 0, category id = label + 1) and runs
`pycocotools.cocoeval.COCOeval(iouType="bbox")` with `maxDets = [1, 10, max_dets]`. From the
accumulated precision array it reads, for area "all" at `max_dets` detections per image, the
means that `COCOeval.summarize()` prints (entries of -1, i.e. classes without ground truth, left
out): AP (IoU .50:.05:.95), AP50, AP75, and LVIS's APr / APc / APf, the same mean restricted to
the rare / common / frequent classes (`sclaro_jax.detection.data.class_frequency_groups`).
Values are fractions in [0, 1]; a group with no evaluated class is NaN. (`summarize()` itself
is not used: its AP row reads maxDets == 100 only and prints -1 for any other limit.)

pycocotools is an optional dependency (the `eval` extra), imported when
`coco_evaluate` runs.

A trained detector, read back and run (as torchvision's detection references keep
`engine.evaluate` beside `train`): `newest_step` (the checkpoint to evaluate), `restore_params`
(its parameters alone, through `sclaro_jax.checkpoint.read_params`, the reader of every run's
checkpoints) and `predict` (detections per example).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from typing import Mapping, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from sclaro_jax import ops as pixel_ops
from sclaro_jax.checkpoint import check_run, read_params
from sclaro_jax.detection import rcnn
from sclaro_jax.detection.model import Detector
from sclaro_jax.run.complete import DamagedRunError, steps

COLUMNS = ("AP", "AP50", "AP75", "APr", "APc", "APf")
GROUPS = {"APr": "r", "APc": "c", "APf": "f"}


def _coco_classes():
    """pycocotools' COCO and COCOeval; without them `cli.MissingExtra` naming the `eval`
    extra."""
    from sclaro_jax import cli

    coco = cli.need("pycocotools.coco", "eval", "COCO AP")
    cocoeval = cli.need("pycocotools.cocoeval", "eval", "COCO AP")
    return coco.COCO, cocoeval.COCOeval


def require_pycocotools() -> None:
    """`cli.MissingExtra` (one line naming the `eval` extra and the pip command) unless
    pycocotools imports: checked before any work."""
    _coco_classes()


def _xywh(boxes: np.ndarray) -> np.ndarray:
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    return np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], axis=1)


def _check_labels(labels: np.ndarray, num_classes: int, what: str) -> np.ndarray:
    labels = np.asarray(labels, np.int64).reshape(-1)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"{what}: labels must lie in [0, {num_classes}), got "
                         f"[{labels.min()}, {labels.max()}]")
    return labels


def coco_dicts(ground_truth: Sequence[tuple[np.ndarray, np.ndarray]],
               detections: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
               num_classes: int) -> tuple[dict, list[dict]]:
    """(COCO ground-truth dataset dict, list of COCO result dicts) for the per-image arrays;
    image ids are 1..N in order, annotation ids 1..K."""
    if len(ground_truth) != len(detections):
        raise ValueError(f"{len(ground_truth)} images of ground truth but {len(detections)} "
                         "of detections")
    images = [{"id": i + 1} for i in range(len(ground_truth))]
    annotations, results = [], []
    for i, (boxes, labels) in enumerate(ground_truth):
        labels = _check_labels(labels, num_classes, f"ground truth of image {i}")
        for (x, y, w, h), c in zip(_xywh(boxes), labels):
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1,
                                "category_id": int(c) + 1, "bbox": [x, y, w, h],
                                "area": w * h, "iscrowd": 0})
    for i, (boxes, scores, labels) in enumerate(detections):
        labels = _check_labels(labels, num_classes, f"detections of image {i}")
        scores = np.asarray(scores, np.float64).reshape(-1)
        for (x, y, w, h), s, c in zip(_xywh(boxes), scores, labels):
            results.append({"image_id": i + 1, "category_id": int(c) + 1,
                            "bbox": [x, y, w, h], "score": float(s)})
    categories = [{"id": c + 1, "name": str(c)} for c in range(num_classes)]
    return {"images": images, "annotations": annotations, "categories": categories}, results


def _mean_valid(values: np.ndarray) -> float:
    values = values[values > -1]
    return float(values.mean()) if values.size else math.nan


def coco_evaluate(ground_truth: Sequence[tuple[np.ndarray, np.ndarray]],
                  detections: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
                  num_classes: int, groups: np.ndarray | None = None,
                  max_dets: int = 300) -> dict[str, float]:
    """COCO box AP of `detections` against `ground_truth`.

    ground_truth: per image (boxes [K, 4] x0 y0 x1 y1, labels [K]); detections: per image
    (boxes [D, 4], scores [D], labels [D]); labels in [0, num_classes). groups: optional 'r' /
    'c' / 'f' per class. Returns {"AP", "AP50", "AP75"} (and "APr", "APc", "APf" when `groups`
    is given) as fractions in [0, 1] at `max_dets` detections per image, area "all"; NaN where
    nothing was evaluated. An image without detections is fine; no ground-truth box at all is
    a ValueError.
    """
    COCO, COCOeval = _coco_classes()
    if groups is not None:
        groups = np.asarray(groups).reshape(-1)
        if len(groups) != num_classes:
            raise ValueError(f"groups has {len(groups)} entries for {num_classes} classes")
    gt_dict, results = coco_dicts(ground_truth, detections, num_classes)
    if not gt_dict["annotations"]:
        raise ValueError(f"coco_evaluate: no ground-truth box in any of the {len(ground_truth)} "
                         "images; COCO AP is undefined")
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = gt_dict
        gt.createIndex()
        dt = COCO()
        dt.dataset = {"images": gt_dict["images"], "categories": gt_dict["categories"],
                      "annotations": [dict(r, id=j + 1, area=r["bbox"][2] * r["bbox"][3],
                                           iscrowd=0) for j, r in enumerate(results)]}
        dt.createIndex()
        ev = COCOeval(gt, dt, iouType="bbox")
        ev.params.maxDets = [1, 10, int(max_dets)]
        ev.evaluate()
        ev.accumulate()
    # precision: [T iou thresholds, R recall thresholds, K classes, A area ranges, M maxDets]
    precision = ev.eval["precision"][:, :, :, ev.params.areaRngLbl.index("all"), -1]
    thresholds = np.asarray(ev.params.iouThrs)
    at = {thr: int(np.argmin(np.abs(thresholds - thr))) for thr in (0.5, 0.75)}
    out = {"AP": _mean_valid(precision), "AP50": _mean_valid(precision[at[0.5]]),
           "AP75": _mean_valid(precision[at[0.75]])}
    if groups is not None:
        # the K axis follows params.catIds (sorted category ids = label + 1)
        order = np.asarray(ev.params.catIds) - 1
        for key, group in GROUPS.items():
            out[key] = _mean_valid(precision[:, :, groups[order] == group])
    return out


def _cell(value) -> str:
    if value is None or not np.isfinite(value):
        return "-"
    return f"{100 * float(value):.1f}"


def markdown_table(rows: Mapping[str, Mapping[str, float]]) -> str:
    """A Markdown table, one row per model: | Model | AP | AP50 | AP75 | APr | APc | APf |,
    metrics (fractions) shown in percent with one decimal; a missing or NaN value is "-".
    Lines joined with newlines, ending with one."""
    lines = ["| Model | " + " | ".join(COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for name, metrics in rows.items():
        lines.append(f"| {name} | " + " | ".join(_cell(metrics.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def newest_step(workdir: str, step: int | None = None) -> int:
    """The step of WORKDIR/checkpoints to read (`step`, or the newest), checked complete
    (`checkpoint.check_run`); DamagedRunError naming the folder and the command that trains it
    when there is none, or the damaged checkpoint and the step to use instead."""
    if not steps(os.path.abspath(os.path.join(workdir, "checkpoints"))):
        raise DamagedRunError(f"no checkpoint in {os.path.join(workdir, 'checkpoints')}: "
                              f"{workdir} holds no trained detector; train it with "
                              f"launch/train.py --config configs/detection.py --workdir {workdir}")
    return check_run(workdir, step)


def restore_params(workdir: str, model: Detector, step: int | None = None):
    """(graphdef, params, step) of a checkpoint in WORKDIR/checkpoints (the newest by
    default), into the structure of `model` (only the parameters are read, not the optimiser
    state: `checkpoint.read_params`)."""
    step = newest_step(workdir, step)
    graphdef, params = nnx.split(model, nnx.Param)
    item = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(params))}
    restored = read_params(workdir, step, item, composite=False)
    return graphdef, restored["params"], int(step)


def predict(graphdef, params, examples: list, batch_size: int) -> list[tuple]:
    """Detections per example: (boxes [D, 4], scores [D], labels [D]) in the example's pixels."""
    detect = jax.jit(lambda p, images: rcnn.detect(nnx.merge(graphdef, p),
                                                   pixel_ops.normalize(images)))
    out = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        images = np.stack([ex.image for ex in chunk])
        pad = batch_size - len(chunk)
        if pad:
            images = np.concatenate([images, np.zeros((pad,) + images.shape[1:], images.dtype)])
        res = jax.device_get(detect(params, images))
        for i in range(len(chunk)):
            keep = res["valid"][i]
            out.append((res["boxes"][i][keep], res["scores"][i][keep], res["labels"][i][keep]))
    return out
