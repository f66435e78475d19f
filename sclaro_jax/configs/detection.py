"""Faster R-CNN + FPN detection with a run's encoders as backbones (the appendix protocol).

    python launch/train.py --config configs/detection.py --workdir DIR \\
        --config.data.dir=/data/sclaro --config.backbone.workdir=/runs/scenarioclip
    python launch/train.py --config configs/detection.py:demo --workdir /tmp/detect_demo

The appendix protocol: 10 epochs of AdamW, the pretrained encoders at `backbone_lr` 1e-5 and
the pyramids, FPN and heads at `head_lr` 1e-4, 5% linear warm-up then cosine decay to 0;
training images drawn by the instance-aware sampler with class-targeted copy-paste for classes
with fewer than `copy_paste_threshold` (50) training instances, applied to each drawn image with
probability `copy_paste_prob` (0.5); the input made by `input_resize` ("squash" to image_size x
image_size, or ViTDet's "longest_side": long side to image_size, aspect kept, padded bottom /
right); inference with score threshold 1e-4, NMS 0.5 and 300 detections per image
(`sclaro_jax.recipes.DetectorConfig`, whose every field is a `detector` key).
The launcher trains, then evaluates on `eval_split` (COCO AP: WORKDIR/results.json and
results.md); `python -m sclaro_jax.eval.detect --workdir DIR` evaluates a run again.
"""

import ml_collections

from sclaro_jax.config import Range, field_ranges
from sclaro_jax.recipes import DetectorConfig

VARIANTS = {"": "the appendix protocol (10 epochs, encoders at 1e-5, heads at 1e-4)",
            "demo": "CPU minutes on the bundled demo boxes: a tiny random encoder, 96 px"}

# The range of every numeric and path key below (`config.Range`; config.detector's from
# DetectorConfig's fields), checked by the task before anything runs (`config.validate`; a key
# with none is refused by tests/test_config_ranges.py).
RANGES = {
    "epochs": Range(gt=0),
    "batch_size": Range(ge=1),
    "backbone_lr": Range(gt=0),
    "head_lr": Range(gt=0),
    "weight_decay": Range(ge=0),
    "warmup_fraction": Range(ge=0, le=1),
    "seed": Range(ge=0),
    "copy_paste_threshold": Range(ge=0, note="0: no class is pasted"),
    "copy_paste_prob": Range(ge=0, le=1),
    "copy_paste_max": Range(ge=1),
    "eval_batch_size": Range(ge=1),
    "log_every": Range(ge=1),
    "checkpoint_every": Range(ge=1),
    "keep_checkpoints": Range(ge=1),
    "compilation_cache": Range(path=True),  # "workdir", a folder (made), or "" (off)
    "data.dir": Range(path=True, exists=True, note="a dataset folder written by `python -m "
                      "data_prep`, e.g. the bundled demo: `python -m data_prep demo --out DIR`"),
    "backbone.workdir": Range(path=True, exists=True, note="a ScenarioCLIP / PyramidCLIP "
                              "training workdir or a Hugging Face CLIPModel folder"),
    **field_ranges(DetectorConfig, "detector."),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.trainer = "detection"  # the task (sclaro_jax.run.task): sclaro_jax.detection.task
    c.epochs = 10
    c.batch_size = 16
    c.backbone_lr = 1e-5
    c.head_lr = 1e-4
    c.weight_decay = 0.05
    c.warmup_fraction = 0.05
    c.seed = 0
    c.dtype = "auto"  # bfloat16 compute on a GPU / TPU, float32 on a CPU
    c.sharding = "none"  # none | dp | fsdp, as the trainer
    c.distributed = False
    c.input_resize = "squash"  # squash | longest_side (ViTDet's resize + pad); data.RESIZE_MODES
    c.copy_paste_threshold = 50  # classes with fewer training instances are pasted
    c.copy_paste_prob = 0.5  # P(a drawn training image receives 1..copy_paste_max pasted instances)
    c.copy_paste_max = 3
    c.train_split = "train"
    c.eval_split = "test"
    c.eval_batch_size = 8
    c.log_every = 10
    c.checkpoint_every = 500
    c.keep_checkpoints = 2
    c.checkpoint_async = True
    c.progress_bar = True
    c.compilation_cache = "workdir"  # JAX's persistent cache in OUT/jax_cache ("" for off)
    # the SCLARO dataset folder (boxes + canonical object labels); empty with :demo: the
    # bundled demo, written to WORKDIR/demo_data by launch/train.py
    c.data = ml_collections.ConfigDict({"dir": ""})
    # the encoders: a ScenarioCLIP / PyramidCLIP training workdir or a Hugging Face CLIPModel
    # folder; empty: the tiny preset's tower, randomly initialised (the demo)
    c.backbone = ml_collections.ConfigDict({"workdir": "", "level_rpn": "global",
                                            "level_roi": "object", "teacher": False})
    c.detector = ml_collections.ConfigDict({
        f.name: f.default for f in DetectorConfig.__dataclass_fields__.values()
        if f.name != "num_classes"})
    if arg == "demo":
        # An overfit check: evaluated on its own training images. Every demo class is rare
        # (under 50 instances), so copy-paste would paste into every image; it is off here.
        # 96 px and head_lr 2e-3: the AP of 128 px and 1e-3 (AP50 0.928 / 0.888 / 0.888 over
        # seeds 0-2, against 0.929 / 0.876 / 0.889) in 70% of the CPU time (57 s, was 80)
        c.epochs, c.batch_size, c.backbone_lr, c.head_lr = 100, 4, 1e-4, 2e-3
        c.eval_split, c.log_every, c.checkpoint_every = "train", 5, 100
        c.copy_paste_prob = 0.0
        c.detector.update(image_size=96, pyramid_dim=32, fpn_dim=32, representation_size=128,
                          rpn_pre_nms_top_n_train=256, rpn_post_nms_top_n_train=128,
                          rpn_pre_nms_top_n_test=256, rpn_post_nms_top_n_test=128,
                          rpn_batch_size_per_image=64, box_batch_size_per_image=64,
                          box_candidates=512, detections_per_img=100, max_boxes=16)
    elif arg is not None:
        raise ValueError(f"unknown detection config variant {arg!r}; known: demo")
    return c
