"""The recipes' dataclasses, without JAX: ScenarioCLIP's training recipe (`TrainConfig`, the
`c.train` of a config) and the detector's shapes and hyper-parameters (`DetectorConfig`, its
`c.detector`), with the constants they check. A config file (`sclaro_jax.configs`) reads its
defaults and ranges from them, so loading a recipe, applying its overrides and refusing a
command line with one `error:` line (an unknown key or flag, a value not of the key's type)
import no JAX, flax or optax: those refusals and the launcher's `--help` take about 0.15 s on a
CPU. The range checks come with the task, after JAX loads. `sclaro_jax.train.core`,
`sclaro_jax.detection.model` and `sclaro_jax.losses` use them under the same names."""

from __future__ import annotations

import dataclasses

from sclaro_jax.config import check_fields, ranged

# The reference clamps the KD teacher's probabilities at 1e-8 before its KLDivLoss (0: Eq. 8 as
# written, no floor).
TEACHER_PROB_FLOOR = 1e-8
KD_DIRECTIONS = ("both", "vision", "text")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training recipe; `c.train` of a config holds these fields (plus `epochs` / `steps`,
    which give `total_steps`)."""
    total_steps: int
    # each field's range (`config.ranged`) is checked with the recipe's (`config.validate`)
    lr: float = ranged(2e-5, gt=0)
    b1: float = ranged(0.9, ge=0, lt=1)
    b2: float = ranged(0.999, ge=0, lt=1)
    eps: float = ranged(1e-8, gt=0)
    weight_decay: float = ranged(0.2, ge=0)
    warmup_fraction: float = ranged(0.1, ge=0, le=1)
    warmup_init_factor: float = ranged(1e-3, ge=0, le=1)
    grad_clip: float = ranged(1.0, gt=0)
    kd_lr_factor: float = ranged(0.1, ge=0)
    ema_decay: float = ranged(0.9995, ge=0, le=1)
    ema_warmup_steps: int = ranged(2000, ge=0)
    lambda_ca: float = ranged(1.0, ge=0)
    lambda_kd: float = ranged(1.0, ge=0)  # 0 gives ScenarioCLIP w/o KD
    kd_direction: str = "both"  # "both", "vision" (global->crops) or "text" (crops->global)
    # the teacher probabilities' floor in the KD loss, as the reference (0: Eq. 8 as written)
    kd_teacher_floor: float = ranged(TEACHER_PROB_FLOOR, ge=0, lt=1)
    duplicate_aware: bool = False  # same-label crops are not negatives of each other
    frozen_vision_layers: int = ranged(6, ge=0)
    frozen_text_layers: int = ranged(10, ge=0)
    freeze_pre_layernorm: bool = False
    # weight decay on the contrastive logit scales, as the reference code does (False: exempt
    # them, as open_clip does); the KD temperature never decays
    decay_logit_scales: bool = True

    def __post_init__(self):
        check_fields(self, "train.")  # config.RangeError naming the key
        if self.kd_direction not in KD_DIRECTIONS:
            raise ValueError(f"kd_direction {self.kd_direction!r} is not one of "
                             f"{KD_DIRECTIONS}")
        if self.total_steps < 1:
            raise ValueError("total_steps must be at least 1")


@dataclasses.dataclass(frozen=True)
class DetectorConfig:
    """The detector's shapes and the Faster R-CNN hyper-parameters (torchvision's defaults,
    except where the appendix protocol fixes them: score threshold 1e-4, NMS 0.5, 300
    detections per image)."""

    # each field's range (`config.ranged`) is checked with the recipe's (`config.validate`)
    num_classes: int = ranged(ge=1)       # foreground classes; logit 0 is the background
    image_size: int = ranged(224, ge=1)   # detection input, square (squashed, or long side + pad)
    strides: tuple = ranged((4, 8, 16, 32), ge=1)  # RoI levels P2-P5; the RPN also sees P6 (64)
    pyramid_dim: int = ranged(256, ge=1)  # simple feature pyramid channels
    fpn_dim: int = ranged(256, ge=1)
    anchor_sizes: tuple = ranged((32, 64, 128, 256, 512), gt=0)  # one per RPN level P2-P6
    aspect_ratios: tuple = ranged((0.5, 1.0, 2.0), gt=0)
    rpn_pre_nms_top_n_train: int = ranged(2000, ge=1)  # per level
    rpn_post_nms_top_n_train: int = ranged(2000, ge=1)
    rpn_pre_nms_top_n_test: int = ranged(1000, ge=1)
    rpn_post_nms_top_n_test: int = ranged(1000, ge=1)
    rpn_nms_thresh: float = ranged(0.7, ge=0, le=1)  # IoU above which NMS drops a proposal
    # anchor sampling: IoU with a box above fg for a positive, below bg a negative, between
    # them ignored; `rpn_batch_size_per_image` anchors per image for the RPN losses, at most
    # `rpn_positive_fraction` of them positive
    rpn_fg_iou_thresh: float = ranged(0.7, ge=0, le=1)
    rpn_bg_iou_thresh: float = ranged(0.3, ge=0, le=1)
    rpn_batch_size_per_image: int = ranged(256, ge=1)
    rpn_positive_fraction: float = ranged(0.5, ge=0, le=1)
    box_fg_iou_thresh: float = ranged(0.5, ge=0, le=1)  # proposal sampling for the RoI heads,
    box_bg_iou_thresh: float = ranged(0.5, ge=0, le=1)  #   the same rule (equal: none ignored)
    box_batch_size_per_image: int = ranged(512, ge=1)  # proposals sampled per image,
    box_positive_fraction: float = ranged(0.25, ge=0, le=1)  # at most this fraction positive
    roi_output_size: int = ranged(7, ge=1)  # RoIAlign output, per side
    representation_size: int = ranged(1024, ge=1)  # the two-layer MLP box head's width
    box_score_thresh: float = ranged(1e-4, ge=0, le=1)  # inference: scores kept above this,
    box_nms_thresh: float = ranged(0.5, ge=0, le=1)  #   per-class NMS at this IoU,
    detections_per_img: int = ranged(300, ge=1)  #   and at most this many per image
    # Per-class NMS at inference takes the `box_candidates` best (proposal, class) scores of an
    # image (a static size; torchvision keeps every score above the threshold instead).
    box_candidates: int = ranged(4000, ge=1)
    max_boxes: int = ranged(64, ge=1)     # ground-truth boxes per image (padded)

    def __post_init__(self):
        check_fields(self, "detector.")  # config.RangeError naming the key
        if len(self.anchor_sizes) != len(self.strides) + 1:
            raise ValueError(f"anchor_sizes needs one size per RPN level ({len(self.strides) + 1}:"
                             f" strides {self.strides} + the max-pooled level), got "
                             f"{self.anchor_sizes}")
        if self.image_size % self.strides[-1]:
            raise ValueError(f"image_size {self.image_size} must be a multiple of the coarsest "
                             f"stride {self.strides[-1]}")

    def feature_sizes(self) -> list[tuple[int, int]]:
        """The RPN levels' map sizes: image_size / stride, then the max-pooled extra level
        (kernel 1, stride 2: ceil of half the coarsest, 4 x 4 after 7 x 7 at 224 px)."""
        sizes = [self.image_size // s for s in self.strides]
        sizes.append(-(-sizes[-1] // 2))
        return [(n, n) for n in sizes]

    @property
    def rpn_strides(self) -> tuple:
        """Anchor strides per RPN level as torchvision's AnchorGenerator takes them: image size
        // map size (56 for the extra level at 224 px)."""
        return tuple(self.image_size // h for h, _ in self.feature_sizes())
