"""Faster R-CNN + FPN over the project's CLIP vision towers, as Flax NNX modules.

The network, input to outputs (NHWC throughout, static shapes, float32 parameters; `dtype` sets
the compute dtype of the backbone and the convolutions, bfloat16 on a GPU):

- `ViTBackbone`: a CLIP `VisionTransformer`'s patch tokens as a feature map `[B, h, w, D]` at
  stride = patch size. The learned position table is resized (bicubic) to the detection grid
  when the detection image size differs from the pretraining size, as ViTDet does.
- `SimpleFeaturePyramid` (ViTDet's): from that single map, strides 4, 8, 16 and 32 by 2x2
  stride-2 deconvolutions (with LayerNorm + GELU between), identity or 2x2 max-pooling, each
  followed by a 1x1 and a 3x3 convolution with LayerNorm.
- `FPN`: torchvision's `FeaturePyramidNetwork` (1x1 laterals, nearest top-down additions, 3x3
  outputs) with `LastLevelMaxPool` (an extra level at stride 64 for the RPN).
- `RPNHead` (3x3 conv + ReLU, objectness and box deltas per anchor), `BoxHead` (torchvision's
  `TwoMLPHead`: two fully connected layers of `representation_size` with ReLU) and
  `BoxPredictor` (class logits over background + the classes, per-class box deltas).
- `Detector`: one backbone + pyramid for both the RPN and the RoI heads (CLIP, PyramidCLIP), or
  two (ScenarioCLIP: the global encoder's pyramid for proposals, the object encoder's for the
  RoI heads).

The anchors, proposal selection, targets, losses and post-processing are functions of
`sclaro_jax.detection.rcnn`; the geometric kernels (RoIAlign, NMS, box coding) are in
`sclaro_jax.detection.ops`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from sclaro_jax.recipes import DetectorConfig
from sclaro_jax.models import clip

Array = jax.Array


# --------------------------------------------------------------------------------------------
# Backbone and pyramids
# --------------------------------------------------------------------------------------------


class ViTBackbone(nnx.Module):
    """A CLIP ViT's last-layer patch tokens as a map `[B, S/p, S/p, D]` (float32)."""

    def __init__(self, vision: clip.VisionTransformer, patch_size: int):
        self.vision = vision
        self.patch_size = patch_size

    @property
    def width(self) -> int:
        return self.vision.embeddings.class_embedding.shape[0]

    def __call__(self, pixels: Array) -> Array:
        vt = self.vision
        b, height, width, _ = pixels.shape
        h, w = height // self.patch_size, width // self.patch_size
        patches = vt.embeddings.patch_embedding(pixels).astype(jnp.float32)
        table = vt.embeddings.position_embedding.embedding[...]
        side = math.isqrt(table.shape[0] - 1)
        grid = table[1:]
        if (h, w) != (side, side):
            grid = jax.image.resize(grid.reshape(side, side, -1), (h, w, grid.shape[-1]),
                                    "bicubic").reshape(h * w, -1)
        cls = vt.embeddings.class_embedding[...] + table[0]
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, cls.shape[-1])), patches + grid], 1)
        x = vt.encoder(vt.pre_layrnorm(x).astype(vt.dtype)).astype(jnp.float32)
        return x[:, 1:].reshape(b, h, w, -1)


def _conv(cin, cout, k, *, dtype, rngs, bias=True, strides=1, init=None):
    return nnx.Conv(cin, cout, (k, k), strides=(strides, strides), padding="SAME",
                    use_bias=bias, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                    **({"kernel_init": init} if init is not None else {}))


class ChannelNorm(nnx.Module):
    """LayerNorm over channels in float32 (ViTDet's `LayerNorm` for NHWC maps)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, epsilon=1e-6, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.norm(x.astype(jnp.float32))


def max_pool2(x: Array) -> Array:
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


class SimpleFeaturePyramid(nnx.Module):
    """ViTDet's simple feature pyramid: one stride-`patch` map -> maps at `strides`."""

    def __init__(self, width: int, patch: int, strides: tuple, dim: int, *, dtype,
                 rngs: nnx.Rngs):
        stages = []
        for stride in strides:
            if patch % stride == 0 and patch // stride >= 1:
                ups = int(round(math.log2(patch // stride)))
                if 2 ** ups * stride != patch:
                    raise ValueError(f"stride {stride} is not patch {patch} / a power of 2")
                pool = 0
            elif stride % patch == 0:
                ups, pool = 0, int(round(math.log2(stride // patch)))
                if 2 ** pool * patch != stride:
                    raise ValueError(f"stride {stride} is not patch {patch} x a power of 2")
            else:
                raise ValueError(f"stride {stride} and patch size {patch} are not powers of 2 "
                                 "apart")
            deconvs, norms, cin = [], [], width
            for i in range(ups):
                cout = max(width // 2 ** (i + 1), 16)
                deconvs.append(nnx.ConvTranspose(cin, cout, (2, 2), strides=(2, 2),
                                                 padding="VALID", dtype=dtype,
                                                 param_dtype=jnp.float32, rngs=rngs))
                if i < ups - 1:
                    norms.append(ChannelNorm(cout, rngs=rngs))
                cin = cout
            stages.append(_Stage(deconvs, norms, pool, cin, dim, dtype=dtype, rngs=rngs))
        self.stages = nnx.List(stages)

    def __call__(self, x: Array) -> list[Array]:
        return [stage(x) for stage in self.stages]


class _Stage(nnx.Module):
    def __init__(self, deconvs, norms, pool: int, cin: int, dim: int, *, dtype, rngs):
        self.deconvs, self.norms, self.pool = nnx.List(deconvs), nnx.List(norms), pool
        self.lateral = _conv(cin, dim, 1, dtype=dtype, rngs=rngs, bias=False)
        self.lateral_norm = ChannelNorm(dim, rngs=rngs)
        self.output = _conv(dim, dim, 3, dtype=dtype, rngs=rngs, bias=False)
        self.output_norm = ChannelNorm(dim, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        for i, deconv in enumerate(self.deconvs):
            x = deconv(x)
            if i < len(self.norms):
                x = jax.nn.gelu(self.norms[i](x), approximate=False)
        for _ in range(self.pool):
            x = max_pool2(x)
        x = self.lateral_norm(self.lateral(x))
        return self.output_norm(self.output(x))


_kaiming_a1 = jax.nn.initializers.variance_scaling(1.0, "fan_in", "uniform")  # kaiming_uniform a=1


class FPN(nnx.Module):
    """torchvision's FeaturePyramidNetwork + LastLevelMaxPool on NHWC maps (finest first)."""

    def __init__(self, in_dims: list[int], dim: int, *, dtype, rngs: nnx.Rngs):
        self.inner = nnx.List([_conv(c, dim, 1, dtype=dtype, rngs=rngs, init=_kaiming_a1)
                          for c in in_dims])
        self.layer = nnx.List([_conv(dim, dim, 3, dtype=dtype, rngs=rngs, init=_kaiming_a1)
                          for _ in in_dims])

    def __call__(self, feats: list[Array]) -> list[Array]:
        last = self.inner[-1](feats[-1])
        outs = [self.layer[-1](last)]
        for i in range(len(feats) - 2, -1, -1):
            lateral = self.inner[i](feats[i])
            up = jnp.repeat(jnp.repeat(last, lateral.shape[1] // last.shape[1], 1),
                            lateral.shape[2] // last.shape[2], 2)
            last = lateral + up.astype(lateral.dtype)
            outs.insert(0, self.layer[i](last))
        outs.append(outs[-1][:, ::2, ::2])  # LastLevelMaxPool: max_pool2d(kernel 1, stride 2)
        return [o.astype(jnp.float32) for o in outs]


class Pyramid(nnx.Module):
    """Backbone -> simple feature pyramid -> FPN: the maps at the RPN strides, finest first."""

    def __init__(self, backbone: ViTBackbone, cfg: DetectorConfig, *, dtype, rngs: nnx.Rngs):
        self.backbone = backbone
        patch = backbone.patch_size
        # A patch size that is not a power of 2 (14) has its token map resized (bilinear) to
        # the stride-16 grid first, so that the pyramid's strides are exact.
        self.base = patch if patch & (patch - 1) == 0 else 16
        self.sfp = SimpleFeaturePyramid(backbone.width, self.base, cfg.strides,
                                        cfg.pyramid_dim, dtype=dtype, rngs=rngs)
        self.fpn = FPN([cfg.pyramid_dim] * len(cfg.strides), cfg.fpn_dim, dtype=dtype,
                       rngs=rngs)

    def __call__(self, pixels: Array) -> list[Array]:
        tokens = self.backbone(pixels)
        side = pixels.shape[1] // self.base
        if tokens.shape[1:3] != (side, side):
            tokens = jax.image.resize(tokens, (tokens.shape[0], side, side, tokens.shape[3]),
                                      "bilinear")
        return self.fpn(self.sfp(tokens))


# --------------------------------------------------------------------------------------------
# Heads
# --------------------------------------------------------------------------------------------

_normal = jax.nn.initializers.normal


class RPNHead(nnx.Module):
    """Shared over levels: 3x3 conv + ReLU, then objectness [A] and deltas [4A] per location."""

    def __init__(self, dim: int, anchors: int, *, dtype, rngs: nnx.Rngs):
        zeros = jax.nn.initializers.zeros
        kw = dict(padding="SAME", dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                  kernel_init=_normal(0.01), bias_init=zeros)
        self.conv = nnx.Conv(dim, dim, (3, 3), **kw)
        self.cls_logits = nnx.Conv(dim, anchors, (1, 1), **kw)
        self.bbox_pred = nnx.Conv(dim, 4 * anchors, (1, 1), **kw)

    def __call__(self, feats: list[Array]) -> tuple[Array, Array]:
        """-> objectness [B, sum h*w*A], deltas [B, sum h*w*A, 4] (location-major, anchor-minor,
        the order of `ops.anchor_grid`)."""
        logits, deltas = [], []
        for f in feats:
            t = jax.nn.relu(self.conv(f))
            b = f.shape[0]
            logits.append(self.cls_logits(t).astype(jnp.float32).reshape(b, -1))
            deltas.append(self.bbox_pred(t).astype(jnp.float32).reshape(b, -1, 4))
        return jnp.concatenate(logits, 1), jnp.concatenate(deltas, 1)


class BoxHead(nnx.Module):
    """torchvision's TwoMLPHead + FastRCNNPredictor: pooled RoIs [R, S, S, C] -> (class logits
    [R, K + 1], per-class deltas [R, K + 1, 4])."""

    def __init__(self, in_dim: int, representation: int, num_classes: int, *, dtype,
                 rngs: nnx.Rngs):
        self.fc6 = nnx.Linear(in_dim, representation, dtype=dtype, param_dtype=jnp.float32,
                              rngs=rngs)
        self.fc7 = nnx.Linear(representation, representation, dtype=dtype,
                              param_dtype=jnp.float32, rngs=rngs)
        self.cls_score = nnx.Linear(representation, num_classes + 1, dtype=dtype,
                                    param_dtype=jnp.float32, rngs=rngs)
        self.bbox_pred = nnx.Linear(representation, 4 * (num_classes + 1), dtype=dtype,
                                    param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, pooled: Array) -> tuple[Array, Array]:
        x = pooled.reshape(pooled.shape[0], -1)
        x = jax.nn.relu(self.fc7(jax.nn.relu(self.fc6(x))))
        logits = self.cls_score(x).astype(jnp.float32)
        return logits, self.bbox_pred(x).astype(jnp.float32).reshape(x.shape[0], -1, 4)


class Detector(nnx.Module):
    """Faster R-CNN with a pyramid for the RPN and one for the RoI heads (the same object when
    one encoder feeds both). `rpn_features` / `roi_features` give the maps; the training and
    inference computations are `rcnn.losses` and `rcnn.detect`."""

    def __init__(self, cfg: DetectorConfig, rpn_vision: clip.VisionTransformer, patch_size: int,
                 roi_vision: clip.VisionTransformer | None = None, *, dtype=jnp.float32,
                 seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.cfg = cfg
        self.rpn_pyramid = Pyramid(ViTBackbone(rpn_vision, patch_size), cfg, dtype=dtype,
                                   rngs=rngs)
        self.roi_pyramid = None if roi_vision is None else Pyramid(
            ViTBackbone(roi_vision, patch_size), cfg, dtype=dtype, rngs=rngs)
        self.rpn_head = RPNHead(cfg.fpn_dim, len(cfg.aspect_ratios), dtype=dtype, rngs=rngs)
        self.box_head = BoxHead(cfg.fpn_dim * cfg.roi_output_size ** 2, cfg.representation_size,
                                cfg.num_classes, dtype=dtype, rngs=rngs)

    @property
    def shared(self) -> bool:
        return self.roi_pyramid is None

    def features(self, pixels: Array) -> tuple[list[Array], list[Array]]:
        """(RPN maps at strides 4-64, RoI maps at strides 4-32) for CLIP-normalised pixels."""
        rpn = self.rpn_pyramid(pixels)
        roi = rpn[:-1] if self.roi_pyramid is None else self.roi_pyramid(pixels)[:-1]
        return rpn, roi


# The parameters of the pretrained encoders, by name ("/"-joined keys): they train at the
# backbone learning rate, everything else (pyramids, FPN, heads) at the head rate.
BACKBONE = r"(^|/)backbone/vision(/|$)"
