"""Parameter counts and forward FLOPs of ScenarioCLIP / PyramidCLIP (appendix Table A1).

The appendix reports, per ViT-B/32 image-text pair, 151.28M parameters and 14.55 GFLOPs per
(image, caption) forward at batch 1, and 453.83M parameters for ScenarioCLIP's three pairs.

Parameters (`param_counts`), counted from the models' shapes (abstract models from
`nnx.eval_shape` work; nothing is initialised):

- `towers`: the CLIP vision + text transformers of a pair (ViT-B/32: 87,456,000 + 63,165,952
  = 150,621,952).
- `clip_model`: what Hugging Face's `CLIPModel` counts for the same towers: towers + CLIP's two
  projection matrices (768x512 + 512x512 = 655,360) + the logit scale (1) = 151,277,313
  = **151.28M**; three of them are 453,831,939 = **453.83M**. This is the count that reproduces
  both of the appendix's numbers, so Table A1 counts "a CLIP ViT-B/32 pair" as a Hugging Face
  CLIPModel.
- `pair`: what our `CLIPPair` holds: towers + ScenarioCLIP's Linear+LayerNorm heads
  (768*512+512+2*512 = 394,752 and 512*512+512+2*512 = 263,680) = 151,280,384, also 151.28M
  when rounded; three pairs are 453,841,152 = 453.84M (CLIP's projections are not part of the
  model: the heads replace them, and are 3,072 parameters larger per pair).
- `model`: every `nnx.Param` of the model, i.e. the pairs plus the per-level logit scales (3)
  and, for ScenarioCLIP, the KD temperature (1): 453,841,156 for ScenarioCLIP at ViT-B/32.

FLOPs (`pair_flops`): XLA's cost analysis (`jax.jit(...).lower(...).cost_analysis()["flops"]`,
no compilation) of one pair's `encode_image` + `encode_text` at batch 1. XLA counts a multiply-add
as 2 FLOPs and also counts elementwise work (LayerNorm, softmax, activations). Our towers run
the last transformer layer on the pooled token only (`VisionTransformer.pooled`,
`TextTransformer.pooled`: same outputs), which the default `full_last_layer=False` measures;
`full_last_layer=True` runs every token through the last layer as Hugging Face does.

Measured at ViT-B/32, image 224, text 77 tokens (jax 0.10.2, XLA:CPU lowering):
`full_last_layer=True` 14.83 G (image 8.84 + text 5.99), our pooled-only forward 13.83 G
(image 8.25 + text 5.57). `analytic_flops` counts the same network by hand: 2 x the
multiply-adds of every matmul is 14.78 G (XLA's extra ~0.05 G is elementwise work); 2 x the
multiply-adds of the Linear / patch-convolution layers alone, with CLIP's projections, is
14.54 G; adding the LayerNorms' scale-and-shift (2 FLOPs per element, about 8 M) gives
14.547 G, which rounds to 14.55. The appendix's 14.55 G is therefore consistent with a
module-hook profiler count (2 FLOPs per multiply-add of nn.Linear / nn.Conv2d, full 77-token
text, every token through every layer) that leaves out the attention score and
attention-times-value matmuls (0.24 G at these sizes; functional calls, not modules, so such
profilers do not see them). That is our reading; the appendix does not name its tool. XLA
counts those matmuls, hence 14.83 G (+1.9%).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sclaro_jax.models.scenarioclip import LEVELS, CLIPPair


def _size(tree: Any) -> int:
    return int(sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree)))


def _params(module: nnx.Module) -> int:
    return _size(nnx.state(module, nnx.Param))


def _pairs(model: nnx.Module) -> list[CLIPPair]:
    """The distinct CLIPPairs of a model (PyramidCLIP: one, shared; ScenarioCLIP: three)."""
    if isinstance(model, CLIPPair):
        return [model]
    if not hasattr(model, "pair"):
        raise TypeError(f"{type(model).__name__} is neither a CLIPPair nor a model with "
                        "`.pair(level)` (ScenarioCLIP / PyramidCLIP)")
    out: list[CLIPPair] = []
    for level in LEVELS:
        p = model.pair(level)
        if all(p is not q for q in out):
            out.append(p)
    return out


def pair_param_counts(pair: CLIPPair) -> dict[str, int]:
    """Parameter counts of one pair: `vision_tower`, `text_tower`, `towers`, `heads`, `pair`
    (towers + heads), `clip_projections` (what CLIP's two projection matrices would hold) and
    `clip_model` (towers + projections + logit scale: Hugging Face CLIPModel's count)."""
    vision, text = _params(pair.vision_model), _params(pair.text_model)
    heads = _params(pair.vision_head) + _params(pair.text_head)
    cfg = pair.config
    projections = (cfg.vision.hidden_size + cfg.text.hidden_size) * cfg.projection_dim
    return {"vision_tower": vision, "text_tower": text, "towers": vision + text,
            "heads": heads, "pair": vision + text + heads, "clip_projections": projections,
            "clip_model": vision + text + projections + 1}


def param_counts(model: nnx.Module) -> dict[str, int]:
    """Parameter counts of a ScenarioCLIP / PyramidCLIP model (or a single CLIPPair).

    Keys: `num_pairs` (distinct pairs), `per_pair` (the first pair's `pair_param_counts`),
    `towers`, `heads`, `pairs` (towers + heads over the distinct pairs), `clip_model` (the
    Hugging Face CLIPModel count summed over the distinct pairs: the appendix's convention),
    `other` (logit scales, KD temperature) and `model` (every nnx.Param; shared pairs once).
    """
    pairs = _pairs(model)
    per = [pair_param_counts(p) for p in pairs]
    total = _params(model)
    summed = {k: sum(c[k] for c in per) for k in ("towers", "heads", "pair", "clip_model")}
    return {"num_pairs": len(pairs), "per_pair": per[0], "towers": summed["towers"],
            "heads": summed["heads"], "pairs": summed["pair"], "clip_model": summed["clip_model"],
            "other": total - summed["pair"], "model": total}


def _abstract_state(module: nnx.Module):
    graphdef, state = nnx.split(module)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
    return graphdef, shapes


def _flops(lowered) -> float:
    cost = lowered.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    if flops is None:
        raise RuntimeError("XLA's cost analysis reported no 'flops' for this backend")
    return float(flops)


def pair_flops(pair: CLIPPair, image_size: int | None = None, text_length: int | None = None,
               *, full_last_layer: bool = False, parts: bool = False
               ) -> float | dict[str, float]:
    """FLOPs of one (image, caption) forward of `pair` at batch 1, as XLA's cost analysis of
    the lowered (not compiled) jitted `encode_image` + `encode_text` counts them.

    `image_size` / `text_length` default to the towers' config (224 and 77 at ViT-B/32).
    `full_last_layer=True` runs every token through the last layer (Hugging Face's forward)
    instead of only the pooled token (our `encode_*`). With `parts=True` returns
    `{"image": ..., "text": ..., "total": ...}`. Works on abstract models (`nnx.eval_shape`).
    """
    cfg = pair.config
    image_size = cfg.vision.image_size if image_size is None else image_size
    text_length = cfg.text.max_position_embeddings if text_length is None else text_length
    graphdef, state = _abstract_state(pair)

    def image_fn(state, pixels):
        p = nnx.merge(graphdef, state)
        if full_last_layer:
            return p.vision_head(p.vision_model(pixels)[1])
        return p.encode_image(pixels)

    def text_fn(state, ids):
        p = nnx.merge(graphdef, state)
        if full_last_layer:
            return p.text_head(p.text_model(ids)[1])
        return p.encode_text(ids)

    pixels = jax.ShapeDtypeStruct((1, image_size, image_size, cfg.vision.num_channels),
                                  jnp.float32)
    ids = jax.ShapeDtypeStruct((1, text_length), jnp.int32)
    image = _flops(jax.jit(image_fn).lower(state, pixels))
    text = _flops(jax.jit(text_fn).lower(state, ids))
    if parts:
        return {"image": image, "text": text, "total": image + text}
    return image + text


def analytic_flops(config, image_size: int | None = None, text_length: int | None = None
                   ) -> dict[str, float]:
    """Hand count of one (image, caption) forward of a CLIP pair of `config` (a `CLIPConfig`),
    every token through every layer, 2 FLOPs per multiply-add, matmuls only.

    Keys: `linear` (patch convolution + q/k/v/out + MLP Linears of both towers), `attention`
    (q.k and weights.v matmuls), `projections` (image and text projection / head matmul),
    `linear_and_projections` (the module-hook convention of the appendix), `matmul` (all)."""
    v, t = config.vision, config.text
    image_size = v.image_size if image_size is None else image_size
    n_text = t.max_position_embeddings if text_length is None else text_length
    n_patch = (image_size // v.patch_size) ** 2
    n_img = n_patch + 1
    patch = n_patch * v.patch_size ** 2 * v.num_channels * v.hidden_size

    def tower(n: int, d: int, ff: int, layers: int) -> tuple[int, int]:
        return (layers * n * (4 * d * d + 2 * d * ff), layers * 2 * n * n * d)

    vl, va = tower(n_img, v.hidden_size, v.intermediate_size, v.num_hidden_layers)
    tl, ta = tower(n_text, t.hidden_size, t.intermediate_size, t.num_hidden_layers)
    proj = (v.hidden_size + t.hidden_size) * config.projection_dim
    out = {"linear": 2.0 * (patch + vl + tl), "attention": 2.0 * (va + ta),
           "projections": 2.0 * proj}
    out["linear_and_projections"] = out["linear"] + out["projections"]
    out["matmul"] = out["linear_and_projections"] + out["attention"]
    return out


def _fmt_m(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def cost_table(models: Mapping[str, nnx.Module], *, image_size: int | None = None,
               text_length: int | None = None) -> tuple[str, dict[str, dict]]:
    """Table A1 for `models` (e.g. {"PyramidCLIP": ..., "ScenarioCLIP w/o KD": ...,
    "ScenarioCLIP": ...}; abstract models from `nnx.eval_shape` are enough).

    Returns (markdown, rows). Per model: `pairs` (distinct CLIP pairs), `params_clip_model`
    (appendix convention: Hugging Face CLIPModel count per pair, summed), `params_model`
    (every parameter of our model), `params_per_pair`, `gflops_per_pair` (XLA, our pooled-only
    forward) and `gflops_per_pair_full` (every token through the last layer).
    """
    rows: dict[str, dict] = {}
    flops_cache: dict[tuple, tuple[float, float]] = {}
    for name, model in models.items():
        counts = param_counts(model)
        pair = _pairs(model)[0]
        key = (pair.config, image_size, text_length)
        if key not in flops_cache:
            flops_cache[key] = (pair_flops(pair, image_size, text_length),
                                pair_flops(pair, image_size, text_length, full_last_layer=True))
        pooled, full = flops_cache[key]
        rows[name] = {"pairs": counts["num_pairs"],
                      "params_clip_model": counts["clip_model"],
                      "params_model": counts["model"],
                      "params_per_pair": counts["per_pair"]["pair"],
                      "params_per_pair_clip_model": counts["per_pair"]["clip_model"],
                      "gflops_per_pair": pooled / 1e9, "gflops_per_pair_full": full / 1e9}
    lines = ["| Model | Pairs | Params (CLIPModel convention) | Params (our model) "
             "| GFLOPs / (image, caption) | GFLOPs, full last layer |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['pairs']} | {_fmt_m(r['params_clip_model'])} "
                     f"| {_fmt_m(r['params_model'])} | {r['gflops_per_pair']:.2f} "
                     f"| {r['gflops_per_pair_full']:.2f} |")
    lines += ["", "Params (CLIPModel convention): per pair, CLIP towers + CLIP's projections + "
              "logit scale, as Hugging Face's CLIPModel counts (the appendix's 151.28M / "
              "453.83M). Params (our model): towers + ScenarioCLIP's Linear+LayerNorm heads + "
              "logit scales (+ KD temperature). GFLOPs: XLA cost analysis of one pair's jitted "
              "forward at batch 1 (a multiply-add is 2 FLOPs; elementwise ops counted too); "
              "at inference a task runs one pair, so per-task cost is the same for every "
              "model."]
    return "\n".join(lines), rows
