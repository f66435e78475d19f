"""ScenarioCLIP and PyramidCLIP as Flax NNX modules (docs/design.md, section 2).

One `CLIPPair` (a CLIP vision tower and text tower, each pooled output followed by a new
Linear + LayerNorm head to `embed_dim`) is used three times by `ScenarioCLIP` (global, object,
relation levels: independent weights) and once, shared by the three levels, by `PyramidCLIP`.
Each level has its own learnable logit scale (init ln(1/0.07)); ScenarioCLIP also carries the
learnable KD temperature `kd_log_scale` (T_s = 1 / clip(exp(l), 1, 100), init ln(1/0.07)).
CLIP's own projection matrices and logit scale are not used.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sclaro_jax.models import clip, cpu_gradients, hf_weights, open_clip_weights
from sclaro_jax.models.layers import AttentionOptions, configure_attention

log = logging.getLogger(__name__)

LEVELS = ("global", "object", "relation")
INIT_LOG_SCALE = math.log(1 / 0.07)


class Head(nnx.Module):
    """Linear(in, out) + LayerNorm(out), in float32 (the embedding the losses see)."""

    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.norm = nnx.LayerNorm(dout, epsilon=1e-5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(self.linear(x.astype(jnp.float32)))


class CLIPPair(nnx.Module):
    """A CLIP image/text pair with ScenarioCLIP's heads: `encode_image`, `encode_text` -> [B, D]
    (LayerNormed, not L2-normalised)."""

    def __init__(self, towers: clip.CLIPModel, embed_dim: int = 512, *, rngs: nnx.Rngs):
        cfg = towers.config
        self.config = cfg  # the towers' CLIPConfig (export writes it back out)
        self.vision_model = towers.vision_model
        self.text_model = towers.text_model
        self.vision_head = Head(cfg.vision.hidden_size, embed_dim, rngs=rngs)
        self.text_head = Head(cfg.text.hidden_size, embed_dim, rngs=rngs)

    def encode_image(self, pixels: jax.Array) -> jax.Array:
        """[..., H, W, 3] CLIP-normalised pixels -> [..., D]."""
        lead = pixels.shape[:-3]
        out = self.vision_head(self.vision_model.pooled(pixels.reshape(-1, *pixels.shape[-3:])))
        return out.reshape(*lead, -1)

    def encode_text(self, input_ids: jax.Array) -> jax.Array:
        """[..., L] token ids -> [..., D]."""
        lead = input_ids.shape[:-1]
        out = self.text_head(self.text_model.pooled(input_ids.reshape(-1, input_ids.shape[-1])))
        return out.reshape(*lead, -1)

    @property
    def num_text_layers(self) -> int:
        """How many blocks the text tower has (the most `text_prefix` can run)."""
        return len(self.text_model.encoder.layers)

    def text_prefix(self, input_ids: jax.Array, layers: int
                    ) -> tuple[jax.Array, jax.Array | None]:
        """The text tower's embeddings and first `layers` blocks on [..., L] token ids:
        (hidden [N, L, d], padding mask), for `encode_text_from`."""
        return self.text_model.prefix(input_ids.reshape(-1, input_ids.shape[-1]), layers)

    def encode_text_from(self, prefix: tuple[jax.Array, jax.Array | None], input_ids: jax.Array,
                         start: int) -> jax.Array:
        """`encode_text(input_ids)` from `text_prefix(input_ids, start)`, which may come from
        another pair with the same embeddings and first `start` blocks."""
        lead = input_ids.shape[:-1]
        hidden, mask = prefix
        pooled = self.text_model.pooled_from(hidden, mask,
                                             input_ids.reshape(-1, input_ids.shape[-1]), start)
        return self.text_head(pooled).reshape(*lead, -1)


class ScenarioCLIP(nnx.Module):
    """Three disentangled CLIP pairs + per-level logit scales + the KD temperature."""

    has_kd = True

    def __init__(self, make_towers, embed_dim: int = 512, *, rngs: nnx.Rngs):
        self.global_pair = CLIPPair(make_towers(0), embed_dim, rngs=rngs)
        self.object_pair = CLIPPair(make_towers(1), embed_dim, rngs=rngs)
        self.relation_pair = CLIPPair(make_towers(2), embed_dim, rngs=rngs)
        for level in LEVELS:
            setattr(self, f"{level}_logit_scale", nnx.Param(jnp.float32(INIT_LOG_SCALE)))
        self.kd_log_scale = nnx.Param(jnp.float32(INIT_LOG_SCALE))

    def pair(self, level: str) -> CLIPPair:
        return getattr(self, f"{level}_pair")

    def logit_scale(self, level: str) -> jax.Array:
        return getattr(self, f"{level}_logit_scale")[...]


class PyramidCLIP(nnx.Module):
    """The PyramidCLIP baseline as the reference runs it: one pair shared by the three levels,
    three InfoNCE losses with their own scales, no KD."""

    has_kd = False

    def __init__(self, make_towers, embed_dim: int = 512, *, rngs: nnx.Rngs):
        self.shared_pair = CLIPPair(make_towers(0), embed_dim, rngs=rngs)
        for level in LEVELS:
            setattr(self, f"{level}_logit_scale", nnx.Param(jnp.float32(INIT_LOG_SCALE)))

    def pair(self, level: str) -> CLIPPair:
        return self.shared_pair

    def logit_scale(self, level: str) -> jax.Array:
        return getattr(self, f"{level}_logit_scale")[...]


MODELS = {"scenarioclip": ScenarioCLIP, "pyramidclip": PyramidCLIP}


def build(kind: str = "scenarioclip", *, preset: str = "ViT-B/32", init: str = "",
          dtype=jnp.float32, seed: int = 0, embed_dim: int = 512, gradient_forms: str = "auto",
          warn_random: bool = True, attention: AttentionOptions | None = None):
    """A ScenarioCLIP / PyramidCLIP model; towers from the pretrained CLIP `init` (each pair
    gets its own copy): a Hugging Face CLIPModel folder or an open_clip checkpoint (a hub folder
    with open_clip_config.json, or a weights file: `open_clip_weights`, which tells them apart),
    or randomly initialised from `preset` (a `clip.PRESETS` name or a `clip.CLIPConfig`) with a
    logged notice (`warn_random=False` drops it: for a model built only to restore trained
    weights into).
    `gradient_forms` ("auto", "cpu", "plain") as in `clip.create`, resolved once here;
    `attention` (`layers.AttentionOptions`: how every attention layer computes; None: the
    default einsums)."""
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; known: {sorted(MODELS)}")
    forms = cpu_gradients.resolve(gradient_forms)

    def make_towers(i: int) -> clip.CLIPModel:
        if init:
            return open_clip_weights.load_clip(init, dtype=dtype, gradient_forms=forms,
                                               towers_only=True)
        return clip.create(preset, seed=seed + 1 + i, dtype=dtype, gradient_forms=forms)

    if not init and warn_random:
        log.warning("model.init is empty: %s towers start from random weights (preset %s), "
                    "not from a pretrained CLIP; pass --config.model.init=PATH to a Hugging "
                    "Face CLIPModel folder (e.g. openai/clip-vit-base-patch32) or an open_clip "
                    "checkpoint", kind,
                    preset if isinstance(preset, str) else
                    f"{preset.vision.image_size} px, patch {preset.vision.patch_size}")
    model = MODELS[kind](make_towers, embed_dim, rngs=nnx.Rngs(seed))
    if attention is not None:
        configure_attention(model, attention)
    return model


def load_hf_into_level(model, level: str, path: str) -> None:
    """Replace one level's towers (vision + text) with a pretrained CLIP's weights (a Hugging
    Face `CLIPModel` folder or an open_clip checkpoint, as `build`'s `init`), in place; the
    level's Linear+LayerNorm heads and the other levels are untouched. The checkpoint must
    have the level's tower sizes and activation (`clip.CheckpointError` otherwise). With
    PyramidCLIP every level shares the one pair, so all levels change."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    pair = model.pair(level)
    towers = open_clip_weights.load_clip(path, dtype=pair.vision_model.dtype, towers_only=True)
    for tower in ("vision", "text"):
        ours, theirs = getattr(pair.config, tower), getattr(towers.config, tower)
        if ours.hidden_act != theirs.hidden_act:
            raise clip.CheckpointError(
                f"{path}: its {tower} tower uses {theirs.hidden_act}, the {level} level's "
                f"{ours.hidden_act}; the weights would be computed with the wrong activation")
    for name in ("vision_model", "text_model"):
        ours, theirs = nnx.state(getattr(pair, name)), nnx.state(getattr(towers, name))
        mismatch = [f"{jax.tree_util.keystr(k)}: {a.shape} vs {b.shape}" for (k, a), (_, b) in
                    zip(jax.tree_util.tree_flatten_with_path(ours)[0],
                        jax.tree_util.tree_flatten_with_path(theirs)[0]) if a.shape != b.shape]
        if jax.tree.structure(ours) != jax.tree.structure(theirs) or mismatch:
            raise clip.CheckpointError(
                f"{path}: the {name} does not fit the {level} level's towers "
                f"({'; '.join(mismatch[:5]) or 'different layers'})")
        nnx.update(getattr(pair, name), theirs)


# --------------------------------------------------------------------------------------------
# One level as a Hugging Face folder with its heads (`sclaro_jax.train.export`)
# --------------------------------------------------------------------------------------------

# Our head -> the CLIPModel attribute it stands in for in an export (`clip.PROJECTIONS`).
EXPORT_HEAD_NAMES = {"vision_head": "visual_projection", "text_head": "text_projection"}


def export_heads(pair: CLIPPair) -> dict[str, np.ndarray]:
    """A pair's Linear+LayerNorm heads in torch `nn.Sequential` key names under the names of an
    export's model.safetensors (`visual_projection.0.weight`, ...: `EXPORT_HEAD_NAMES`), the
    keys the export's transformers remote code and `from_export` read."""
    out = {}
    for ours, theirs in EXPORT_HEAD_NAMES.items():
        head = getattr(pair, ours)
        out[f"{theirs}.0.weight"] = np.asarray(head.linear.kernel[...]).T
        out[f"{theirs}.0.bias"] = np.asarray(head.linear.bias[...])
        out[f"{theirs}.1.weight"] = np.asarray(head.norm.scale[...])
        out[f"{theirs}.1.bias"] = np.asarray(head.norm.bias[...])
    return {k: np.array(v, np.float32, order="C") for k, v in out.items()}


def from_export(path: str | os.PathLike, *, dtype=jnp.float32, gradient_forms: str = "auto"
                ) -> CLIPPair:
    """One exported level (`python -m sclaro_jax.train.export`): the folder's CLIP towers with
    its Linear+LayerNorm heads (model.safetensors' `visual_projection.0.weight`, ...: see
    `export_heads`), so `encode_image` / `encode_text` give the level's embeddings.
    `CheckpointError` when the folder holds no heads or they do not fit the towers."""
    folder = Path(path)
    towers, tensors = clip.load_with_heads(folder, dtype=dtype, gradient_forms=gradient_forms)
    if not tensors:
        old = (folder / clip.HEADS_FILE).is_file()
        raise clip.CheckpointError(
            f"{folder}: its model.safetensors holds no ScenarioCLIP heads "
            "(visual_projection.0.weight, ...): " +
            (f"a level exported by an older sclaro_jax ({clip.HEADS_FILE}); export it again"
             if old else "not a ScenarioCLIP export") +
            " with python -m sclaro_jax.train.export")
    bias = tensors.get("visual_projection.0.bias")
    pair = CLIPPair(towers, bias.shape[0] if bias is not None and bias.ndim == 1 else 1,
                    rngs=nnx.Rngs(0))
    want = export_heads(pair)
    bad = sorted(set(want) ^ set(tensors)) + [
        f"{k}: file {tuple(tensors[k].shape)}, model {want[k].shape}"
        for k in sorted(set(want) & set(tensors)) if tensors[k].shape != want[k].shape]
    if bad:
        raise clip.CheckpointError(f"{folder / hf_weights.WEIGHTS_NAME}: its heads do not fit "
                                   f"the towers: {', '.join(bad)}")
    for ours, theirs in EXPORT_HEAD_NAMES.items():
        head = getattr(pair, ours)
        head.linear.kernel[...] = jnp.asarray(tensors[f"{theirs}.0.weight"].T)
        head.linear.bias[...] = jnp.asarray(tensors[f"{theirs}.0.bias"])
        head.norm.scale[...] = jnp.asarray(tensors[f"{theirs}.1.weight"])
        head.norm.bias[...] = jnp.asarray(tensors[f"{theirs}.1.bias"])
    return pair
