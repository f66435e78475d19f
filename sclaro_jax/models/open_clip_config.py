"""open_clip `model_cfg` <-> our `clip.CLIPConfig`: the settings our CLIP computes exactly
(anything else is refused, naming it), the sizes of a bare weights file read from its shapes,
and the `model_cfg` an export writes. Used by `sclaro_jax.models.open_clip_weights`."""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from sclaro_jax.models import clip
from sclaro_jax.models.hf_weights import CheckpointError

HEAD_WIDTH = 64  # a bare file's heads: width / 64

# Settings our CLIP computes exactly, each with the values we accept (None: any value, it does
# not change the weights or the embeddings).
_TOP_OK = {"embed_dim": None, "quick_gelu": None, "vision_cfg": None, "text_cfg": None,
           "init_logit_scale": None, "cast_dtype": None, "output_dict": None,
           "init_logit_bias": (None,), "custom_text": (False,),
           "nonscalar_logit_scale": (False,)}
_VISION_OK = {"layers": None, "width": None, "head_width": None, "mlp_ratio": None,
              "patch_size": None, "image_size": None, "patch_dropout": None,
              "output_tokens": None, "attn_pooler_queries": None, "attn_pooler_heads": None,
              "ls_init_value": (None,), "attentional_pool": (False,), "no_ln_pre": (False,),
              "pos_embed_type": ("learnable",), "final_ln_after_pool": (False,),
              "pool_type": ("tok",), "act_kwargs": (None, {}), "norm_kwargs": (None, {}),
              "block_type": (None, "default"), "qk_norm": (False,),
              "scaled_cosine_attn": (False,), "scale_heads": (False,),
              "scale_attn_inner": (False,), "scale_attn": (False,), "scale_fc": (False,),
              "timm_model_name": (None, ""), "timm_model_pretrained": None, "timm_pool": None,
              "timm_proj": None, "timm_proj_bias": None, "timm_drop": None,
              "timm_drop_path": None}
_TEXT_OK = {"context_length": None, "vocab_size": None, "width": None, "heads": None,
            "layers": None, "mlp_ratio": None, "output_tokens": None, "pad_id": None,
            "eos_id": None, "hf_model_pretrained": None, "hf_proj_type": None,
            "hf_pooler_type": None,
            "ls_init_value": (None,), "embed_cls": (False,), "no_causal_mask": (False,),
            "final_ln_after_pool": (False,), "pool_type": ("argmax", "eos"),
            "proj_bias": (False,), "proj_type": ("linear",), "act_kwargs": (None, {}),
            "norm_kwargs": (None, {}), "block_type": (None, "default"), "qk_norm": (False,),
            "scaled_cosine_attn": (False,), "scale_heads": (False,),
            "scale_attn_inner": (False,), "scale_attn": (False,), "scale_fc": (False,),
            "hf_model_name": (None, ""), "hf_tokenizer_name": (None, ""),
            "tokenizer_mode": (None,), "tokenizer_kwargs": (None, {})}


def _check_settings(section: Mapping[str, Any], allowed: Mapping[str, Any], where: str):
    for key, value in section.items():
        if key not in allowed:
            raise CheckpointError(f"{where}: the open_clip setting {key!r} is not one our CLIP "
                                  "can express (only plain ViT CLIP models load)")
        ok = allowed[key]
        if ok is not None and value not in ok:
            raise CheckpointError(
                f"{where}: open_clip setting {key}={value!r} is not supported (our CLIP needs "
                f"{' or '.join(repr(v) for v in ok)}): only plain ViT CLIP models load")


def config_from_open_clip(model_cfg: Mapping[str, Any], where: str) -> clip.CLIPConfig:
    """Our `CLIPConfig` from an open_clip `model_cfg`; settings we cannot compute are refused,
    naming them."""
    if not isinstance(model_cfg, Mapping):
        raise CheckpointError(f"{where} has no 'model_cfg' object")
    _check_settings(model_cfg, _TOP_OK, f"{where} model_cfg")
    vision, text = model_cfg.get("vision_cfg") or {}, model_cfg.get("text_cfg") or {}
    _check_settings(vision, _VISION_OK, f"{where} model_cfg.vision_cfg")
    _check_settings(text, _TEXT_OK, f"{where} model_cfg.text_cfg")
    if "embed_dim" not in model_cfg:
        raise CheckpointError(f"{where}: model_cfg has no embed_dim")
    layers = vision.get("layers", 12)
    if not isinstance(layers, int):
        raise CheckpointError(f"{where}: model_cfg.vision_cfg.layers={layers!r} is a ResNet "
                              "image tower; only ViT image towers load")
    image = vision.get("image_size", 224)
    if isinstance(image, (list, tuple)):
        if len(set(image)) != 1:
            raise CheckpointError(f"{where}: model_cfg.vision_cfg.image_size={image!r} is not "
                                  "square; only square images are supported")
        image = image[0]
    act = "quick_gelu" if model_cfg.get("quick_gelu", False) else "gelu"
    vw, tw = vision.get("width", 768), text.get("width", 512)
    head_width = vision.get("head_width", 64)
    if vw % head_width:
        raise CheckpointError(f"{where}: vision width {vw} is not a multiple of head_width "
                              f"{head_width}")
    pool = text.get("pool_type", "argmax")
    scale = model_cfg.get("init_logit_scale")  # only for a random init; the weights hold it
    extra = {} if scale is None else {"logit_scale_init_value": float(scale)}
    return clip.CLIPConfig(
        vision=clip.VisionConfig(
            hidden_size=vw, intermediate_size=int(vw * vision.get("mlp_ratio", 4.0)),
            num_hidden_layers=layers, num_attention_heads=vw // head_width,
            image_size=int(image), patch_size=vision.get("patch_size", 16), hidden_act=act),
        text=clip.TextConfig(
            hidden_size=tw, intermediate_size=int(tw * text.get("mlp_ratio", 4.0)),
            num_hidden_layers=text.get("layers", 12), num_attention_heads=text.get("heads", 8),
            vocab_size=text.get("vocab_size", 49408),
            max_position_embeddings=text.get("context_length", 77),
            # open_clip's argmax pooling (EOT = the largest id) is our legacy eos id 2
            eos_token_id=2 if pool == "argmax" else text.get("eos_id", 2), hidden_act=act),
        projection_dim=model_cfg["embed_dim"], **extra)


def _count_blocks(state: Mapping[str, Any], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = {int(m.group(1)) for k in state if (m := pattern.match(k))}
    return max(found) + 1 if found else 0


def refuse_unsupported_keys(state: Mapping[str, Any], where: str) -> None:
    """Name the first key of an open_clip model our CLIP cannot express."""
    markers = [
        ("visual.trunk.", "a timm image tower"),
        ("visual.layer1.", "a ResNet image tower"),
        ("visual.attn_pool.", "attention pooling in the image tower"),
        ("text.", "a custom text tower (CustomTextCLIP: a Hugging Face or custom text "
                  "encoder)"),
        ("logit_bias", "SigLIP's logit bias"),
        (".ls_1.", "layer scale"),
        ("text_decoder.", "a CoCa text decoder"),
    ]
    for marker, what in markers:
        key = next((k for k in state if k.startswith(marker) or
                    (marker.startswith(".") and marker in k)), None)
        if key is not None:
            raise CheckpointError(f"{where}: key {key!r} belongs to {what}, which our CLIP "
                                  "cannot express; only plain ViT CLIP models load")
    for need in ("visual.conv1.weight", "visual.proj", "token_embedding.weight",
                 "text_projection", "visual.ln_pre.weight"):
        if need not in state:
            raise CheckpointError(f"{where}: no {need!r}: not a plain ViT open_clip CLIP state "
                                  "dict (a different image or text tower, or no projection)")


def config_from_state(state: Mapping[str, Any], act: str, where: str) -> clip.CLIPConfig:
    """Our `CLIPConfig` from an open_clip state dict's shapes (arrays or `_Shape`s) and the
    activation the user named; heads are width / 64."""
    refuse_unsupported_keys(state, where)
    conv = tuple(state["visual.conv1.weight"].shape)
    vw, patch = conv[0], conv[2]
    grid = math.isqrt(state["visual.positional_embedding"].shape[0] - 1)
    tw = state["token_embedding.weight"].shape[1]
    for name, width in (("vision", vw), ("text", tw)):
        if width % HEAD_WIDTH:
            raise CheckpointError(
                f"{where}: {name} width {width} is not a multiple of {HEAD_WIDTH}, so the heads "
                "cannot be read from the weights: put the model's open_clip_config.json beside "
                "the file")
    return clip.CLIPConfig(
        vision=clip.VisionConfig(
            hidden_size=vw,
            intermediate_size=state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            num_hidden_layers=_count_blocks(state, "visual.transformer.resblocks."),
            num_attention_heads=vw // HEAD_WIDTH, image_size=grid * patch, patch_size=patch,
            hidden_act=act),
        text=clip.TextConfig(
            hidden_size=tw,
            intermediate_size=state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            num_hidden_layers=_count_blocks(state, "transformer.resblocks."),
            num_attention_heads=tw // HEAD_WIDTH,
            vocab_size=state["token_embedding.weight"].shape[0],
            max_position_embeddings=state["positional_embedding"].shape[0],
            eos_token_id=2, hidden_act=act),
        projection_dim=state["visual.proj"].shape[1])


def model_config(config: clip.CLIPConfig, where: str = "the model") -> dict[str, Any]:
    """The open_clip `model_cfg` of our config; `CheckpointError` for one open_clip cannot
    express."""
    v, t = config.vision, config.text
    acts = {v.hidden_act, t.hidden_act}
    if len(acts) != 1 or not acts <= {"quick_gelu", "gelu"}:
        raise CheckpointError(
            f"{where}: hidden_act vision={v.hidden_act!r}, text={t.hidden_act!r}; open_clip "
            "needs both 'quick_gelu' or both 'gelu'")
    bad = [f"{name} {what}" for name, c in (("vision", v), ("text", t)) for what in
           ([f"layer_norm_eps={c.layer_norm_eps}"] if c.layer_norm_eps != 1e-5 else []) +
           ([f"intermediate_size={c.intermediate_size}"]
            if c.intermediate_size != int(c.hidden_size * (c.intermediate_size / c.hidden_size))
            else [])]
    if v.num_channels != 3:
        bad.append(f"vision num_channels={v.num_channels}")
    if bad:
        raise CheckpointError(f"{where}: open_clip cannot express {', '.join(bad)}")
    text = {"context_length": t.max_position_embeddings, "vocab_size": t.vocab_size,
            "width": t.hidden_size, "heads": t.num_attention_heads,
            "layers": t.num_hidden_layers, "mlp_ratio": t.intermediate_size / t.hidden_size}
    if t.eos_token_id != 2:  # pool at the first eos id, as our TextTransformer does
        text |= {"pool_type": "eos", "eos_id": t.eos_token_id}
    return {
        "embed_dim": config.projection_dim,
        "quick_gelu": v.hidden_act == "quick_gelu",
        "vision_cfg": {"image_size": v.image_size, "layers": v.num_hidden_layers,
                       "width": v.hidden_size, "head_width": v.hidden_size // v.num_attention_heads,
                       "mlp_ratio": v.intermediate_size / v.hidden_size,
                       "patch_size": v.patch_size},
        "text_cfg": text,
    }
