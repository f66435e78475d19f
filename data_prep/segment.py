"""Stage 3 of the annotation pipeline (SCLARO appendix A): SAM masks from the Stage-2 boxes, and
the focused-region image of each relation triplet.

SAM (the `segment-anything` package, sam-vit-huge in the paper) is prompted with every detection
box of an image, one mask per box, from one image embedding. For a relation (object1, relation,
object2) the closest pair of object1 and object2 instances by box-centre distance is chosen
(`focus.closest_instance_pair`) and its two masks give the focused region (`focus.focused_region`).

Weights are read with `torch.load(weights_only=True)` into an architecture built without a
checkpoint: a checkpoint file never runs code. `model_type="tiny"` is a small random SAM built
from segment_anything's own modules (`build_tiny_sam`), for tests and benchmarks without the
released checkpoint.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from segment_anything import SamPredictor, sam_model_registry
from segment_anything.modeling import (ImageEncoderViT, MaskDecoder, PromptEncoder, Sam,
                                       TwoWayTransformer)

from data_prep import focus
from sclaro_jax.files import write_replacing

SAM_RELEASE_FILE = "sam_vit_h_4b8939.pth"
# SAM's patch and prompt sizes (segment_anything.build_sam._build_sam). The tiny model's input is
# 256 px, not 1024: SamPredictor and Sam.preprocess / postprocess_masks all take the size from
# `image_encoder.img_size`, so the resize of the long side, the padding, the 16x16 embedding grid
# and the mask upsampling follow it (tested against SamPredictor.predict), 16x less encoder work.
PATCH_SIZE = 16
PROMPT_EMBED_DIM = 256
TINY = dict(img_size=256, embed_dim=48, depth=2, num_heads=2, global_attn_indexes=(1,),
            window_size=14, decoder_depth=1, decoder_mlp_dim=256, iou_head_hidden_dim=64)
# Width of `image_encoder.patch_embed.proj.weight` per model type: tells which model a file holds.
ENCODER_WIDTHS = {"vit_h": 1280, "vit_l": 1024, "vit_b": 768, "tiny": TINY["embed_dim"]}
WIDTH_KEY = "image_encoder.patch_embed.proj.weight"


def build_tiny_sam(seed: int = 0) -> Sam:
    """A random-initialised SAM with a 256 px input, a 2-block, 48-wide image encoder (one
    windowed block, one global block) and a 1-layer two-way transformer; patch size, prompt width
    and pixel normalisation are those of the released models. Eval mode, on the CPU."""
    torch.manual_seed(seed)
    size = TINY["img_size"]
    grid = size // PATCH_SIZE
    sam = Sam(
        image_encoder=ImageEncoderViT(
            depth=TINY["depth"], embed_dim=TINY["embed_dim"], img_size=size, mlp_ratio=4,
            norm_layer=partial(torch.nn.LayerNorm, eps=1e-6), num_heads=TINY["num_heads"],
            patch_size=PATCH_SIZE, qkv_bias=True, use_rel_pos=True,
            global_attn_indexes=TINY["global_attn_indexes"], window_size=TINY["window_size"],
            out_chans=PROMPT_EMBED_DIM),
        prompt_encoder=PromptEncoder(
            embed_dim=PROMPT_EMBED_DIM, image_embedding_size=(grid, grid),
            input_image_size=(size, size), mask_in_chans=16),
        mask_decoder=MaskDecoder(
            num_multimask_outputs=3,
            transformer=TwoWayTransformer(depth=TINY["decoder_depth"],
                                          embedding_dim=PROMPT_EMBED_DIM,
                                          mlp_dim=TINY["decoder_mlp_dim"], num_heads=8),
            transformer_dim=PROMPT_EMBED_DIM, iou_head_depth=3,
            iou_head_hidden_dim=TINY["iou_head_hidden_dim"]),
        pixel_mean=[123.675, 116.28, 103.53],
        pixel_std=[58.395, 57.12, 57.375],
    )
    return sam.eval()


def save_tiny_sam(path: str, seed: int = 0) -> Sam:
    """Write `build_tiny_sam(seed)`'s state dict (tensors only) to `path`, for
    `load_sam(path, model_type="tiny")`. Returns the model."""
    sam = build_tiny_sam(seed)
    write_replacing(path, lambda f: torch.save(sam.state_dict(), f))
    return sam


# Architectures without weights; "default" is vit_h, as in segment_anything's registry.
ARCHITECTURES = {**{name: partial(build, checkpoint=None)
                    for name, build in sam_model_registry.items()},
                 "tiny": build_tiny_sam}


def _expected_width(model_type: str) -> int:
    return ENCODER_WIDTHS["vit_h" if model_type == "default" else model_type]


def load_sam(checkpoint: str, model_type: str = "vit_h", device: str = "cpu") -> Sam:
    """SAM of `model_type` (vit_h, vit_l, vit_b, default = vit_h, or tiny) with the state dict in
    `checkpoint`, in eval mode on `device`. Raises FileNotFoundError for a missing file and
    ValueError for an unknown type or a file that does not match the type."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unknown SAM model_type {model_type!r}; choose one of "
                         f"{sorted(ARCHITECTURES)}")
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(
            f"SAM checkpoint {checkpoint!r} not found: pass --sam PATH to {SAM_RELEASE_FILE} "
            f"from the segment-anything release (or a file written by save_tiny_sam with "
            f"model_type='tiny')")
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise ValueError(f"{checkpoint}: not a plain state dict of tensors (torch.load with "
                         f"weights_only=True refused it): {err}") from err
    if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{checkpoint}: expected a state dict of tensors, got "
                         f"{type(state).__name__}")
    if WIDTH_KEY not in state:
        raise ValueError(f"{checkpoint}: not a SAM checkpoint (no {WIDTH_KEY!r} among its "
                         f"{len(state)} keys)")
    width = state[WIDTH_KEY].shape[0]
    expected = _expected_width(model_type)
    if width != expected:
        guesses = [name for name, w in ENCODER_WIDTHS.items() if w == width]
        looks = f"it looks like model_type={guesses[0]!r}" if guesses else "no known model type"
        raise ValueError(f"{checkpoint}: image encoder width {width} does not match "
                         f"model_type={model_type!r} (width {expected}); {looks}")
    sam = ARCHITECTURES[model_type]()
    try:
        sam.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{checkpoint}: state dict does not fit SAM model_type="
                         f"{model_type!r}: {err}") from err
    return sam.to(device).eval()


class SamSegmenter:
    """One boolean mask per box: `segmenter(image uint8 [H, W, 3], boxes [N, 4] xyxy pixels)
    -> bool [N, H, W]`. One image embedding per image; boxes go through the mask decoder
    `box_batch` at a time (`SamPredictor.predict_torch`, single-mask output).

    `sam` is moved to `device` in place. `timings` accumulates seconds: "preprocess" (resize of
    the long side to the encoder's input size, 1024 for the released models; box transform),
    "model" (normalise + image encoder, prompt encoder + mask decoder, and the upsampling of the
    masks to the image size, which `predict_torch` does), "postprocess" (device -> host copy).

    Switches, each changing `sam` in place: `sdpa=True` computes the image encoder's attention
    with `torch.nn.functional.scaled_dot_product_attention` (the relative-position terms as its
    additive mask: `use_sdpa`); `compile=True` compiles the image encoder with `torch.compile`;
    `bf16=True` runs the model calls under `torch.autocast(bfloat16)`.
    """

    def __init__(self, sam: Sam, *, device: str = "cpu", box_batch: int = 64,
                 sdpa: bool = False, compile: bool = False, bf16: bool = False):
        if box_batch < 1:
            raise ValueError(f"box_batch must be >= 1, got {box_batch}")
        self.device = torch.device(device)
        if sdpa:
            use_sdpa(sam)
        if compile:
            sam.image_encoder.compile()
        self.autocast = partial(torch.autocast, self.device.type, torch.bfloat16, enabled=bf16)
        self.predictor = SamPredictor(sam.to(self.device).eval())
        self.box_batch = box_batch
        self.timings = {"preprocess": 0.0, "model": 0.0, "postprocess": 0.0}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _lap(self, key: str, start: float) -> float:
        self._sync()
        now = time.perf_counter()
        self.timings[key] += now - start
        return now

    def __call__(self, image: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        image = np.asarray(image)
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"image must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
        boxes = _check_boxes(boxes)
        size = image.shape[:2]
        masks = np.zeros((len(boxes), *size), dtype=bool)
        if len(boxes) == 0:
            return masks
        transform = self.predictor.transform
        start = time.perf_counter()
        pixels = torch.as_tensor(transform.apply_image(image), device=self.device)
        pixels = pixels.permute(2, 0, 1).contiguous()[None]
        # The numpy box transform, as SamPredictor.predict does for a single box.
        prompts = torch.as_tensor(transform.apply_boxes(boxes, size), dtype=torch.float,
                                  device=self.device)
        start = self._lap("preprocess", start)
        try:
            with self.autocast():
                self.predictor.set_torch_image(pixels, size)
            start = self._lap("model", start)
            for lo in range(0, len(boxes), self.box_batch):
                with self.autocast():
                    batch, _, _ = self.predictor.predict_torch(
                        point_coords=None, point_labels=None,
                        boxes=prompts[lo:lo + self.box_batch], multimask_output=False)
                start = self._lap("model", start)
                masks[lo:lo + len(batch)] = batch[:, 0].cpu().numpy()
                start = self._lap("postprocess", start)
        finally:
            self.predictor.reset_image()
        return masks


def _sdpa_attention(self, x: torch.Tensor) -> torch.Tensor:
    """`segment_anything.modeling.image_encoder.Attention.forward` with the attention in one
    `scaled_dot_product_attention` call: the same scale (head_dim ** -0.5), the decomposed
    relative-position terms (from the unscaled queries, as `add_decomposed_rel_pos` adds them)
    as the additive mask."""
    from segment_anything.modeling.image_encoder import get_rel_pos
    B, H, W, _ = x.shape
    q, k, v = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
    bias = None
    if self.use_rel_pos:
        r_q = q.reshape(B, self.num_heads, H, W, -1)
        rel_h = torch.einsum("bnhwc,hkc->bnhwk", r_q, get_rel_pos(H, H, self.rel_pos_h))
        rel_w = torch.einsum("bnhwc,wkc->bnhwk", r_q, get_rel_pos(W, W, self.rel_pos_w))
        bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(B, self.num_heads, H * W,
                                                                  H * W)
    x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    x = x.view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
    return self.proj(x)


def use_sdpa(sam: Sam) -> int:
    """Switch every attention block of `sam`'s image encoder to `_sdpa_attention`, in place;
    returns how many."""
    from types import MethodType

    from segment_anything.modeling.image_encoder import Attention
    blocks = [m for m in sam.image_encoder.modules() if isinstance(m, Attention)]
    for m in blocks:
        m.forward = MethodType(_sdpa_attention, m)
    return len(blocks)


def _check_boxes(boxes) -> np.ndarray:
    boxes = np.asarray(boxes, dtype=np.float64)
    if boxes.size == 0:
        return boxes.reshape(0, 4)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise ValueError(f"boxes must be [N, 4] (x0, y0, x1, y1), got shape {boxes.shape}")
    bad = ~np.isfinite(boxes).all(1) | (boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1])
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"box {i} is not a finite (x0, y0, x1, y1) box with x0 <= x1, "
                         f"y0 <= y1: {boxes[i].tolist()}")
    return boxes


@dataclass(frozen=True, eq=False)
class RegionResult:
    """The focused region of one relation: detection indices of its subject and object."""
    subject: int
    predicate: str
    object: int
    region: np.ndarray


@dataclass(frozen=True)
class DroppedRelation:
    """A relation without a focused region, and why (one of DROP_REASONS)."""
    relation: tuple[str, str, str]
    reason: str


DROP_REASONS = ("no_subject_detection", "no_object_detection", "no_pair", "empty_mask")


def relation_regions(image: np.ndarray, boxes: np.ndarray, labels: list[str], masks: np.ndarray,
                     relations: list[tuple[str, str, str]]
                     ) -> tuple[list[RegionResult], list[DroppedRelation]]:
    """Focused regions of the relations of one image (appendix Stage 3).

    Detection i has box `boxes[i]`, label `labels[i]` and mask `masks[i]`; a relation's subject and
    object names match labels exactly. The subject/object instances are the closest pair by box
    centres, never one detection with itself. A relation is dropped, in this order of checks, when
    no detection has the subject's label, none has the object's, no distinct pair exists (e.g.
    "person next to person" with one person), or a chosen mask is empty ("empty_mask": SAM found
    nothing in the box; no other pair is tried, no box is used instead).
    """
    boxes = _check_boxes(boxes)
    masks = np.asarray(masks, dtype=bool)
    image = np.asarray(image)
    if len(labels) != len(boxes) or masks.shape != (len(boxes), *image.shape[:2]):
        raise ValueError(f"{len(boxes)} boxes, {len(labels)} labels and masks of shape "
                         f"{masks.shape} do not match an image of shape {image.shape}")
    labels = np.asarray(labels, dtype=object)
    regions, dropped = [], []
    focused = focus.Regions(image)  # the blurred background once, for all the relations
    for relation in relations:
        subject, predicate, obj = relation
        subject_ids = np.flatnonzero(labels == subject)
        object_ids = np.flatnonzero(labels == obj)
        pair = focus.closest_instance_pair(boxes, subject_ids, object_ids)
        if subject_ids.size == 0:
            reason = "no_subject_detection"
        elif object_ids.size == 0:
            reason = "no_object_detection"
        elif pair is None:
            reason = "no_pair"
        elif not (masks[pair[0]].any() and masks[pair[1]].any()):
            reason = "empty_mask"
        else:
            i, j = pair
            regions.append(RegionResult(i, predicate, j, focused(masks[i], masks[j])))
            continue
        dropped.append(DroppedRelation(tuple(relation), reason))
    return regions, dropped
