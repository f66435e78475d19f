"""Scripted stage-1 material for tests and benchmarks: scikit-image's sample photographs with
hand-written action / objects / relations, and a reply in the shape the appendix's prompt asks
for (its own example's missing commas and a code fence included); the writers of scene-graph
fixtures in their released formats (`write_json`, COCO panoptic's `rgb_encode`)."""

from __future__ import annotations

import json
import os

import numpy as np

from sclaro_jax.files import write_replacing

SCENES = {  # skimage.data name -> (action, objects, relations)
    "astronaut": ("posing", ["woman", "flag", "helmet"],
                  [("woman", "holding", "helmet"), ("flag", "behind", "woman")]),
    "coffee": ("drinking", ["cup", "saucer", "spoon"],
               [("cup", "on", "saucer"), ("spoon", "on", "saucer")]),
    "chelsea": ("resting", ["cat", "wall"], [("cat", "in front of", "wall")]),
    "rocket": ("launching", ["rocket", "tower", "smoke"],
               [("rocket", "next to", "tower"), ("smoke", "below", "rocket")]),
    "stereo_motorcycle": ("parking", ["motorcycle", "wall", "box"],
                          [("motorcycle", "next to", "box")]),
    "immunohistochemistry": ("staining", ["cell", "tissue"], [("cell", "in", "tissue")]),
}

_REPLY = """```json
{
"action": "%s"
"objects": [%s],
"relations": [
%s
]
"dense caption": "The image shows %s."
}
```"""


def scripted_reply(action: str, objects, relations, caption: str) -> str:
    """A VLM reply as the prompt's example lays it out (no commas after "action" and after the
    relations list), inside a ```json fence."""
    objs = ", ".join(f'"{o}"' for o in objects)
    rels = ",\n".join("[" + ", ".join(f'"{t}"' for t in r) + "]" for r in relations)
    return _REPLY % (action, objs, rels, caption)


def photograph(name: str) -> np.ndarray:
    """uint8 [H, W, 3] of a scikit-image sample (the left view of stereo pairs, grey as RGB)."""
    from skimage import data as skdata
    pixels = getattr(skdata, name)()
    pixels = pixels[0] if isinstance(pixels, tuple) else pixels
    return np.repeat(pixels[..., None], 3, -1) if pixels.ndim == 2 else pixels[..., :3]


# A long-tailed count law for tests and benchmarks of the packed crop layout
# (sclaro_jax.data.packing): objects 1-10 and relations 0-16 per image, most images with few
# (P(n) falls by 0.8 per extra object and 0.85 per extra relation: about half the images have
# at most 3 of each).
LONG_TAIL_OBJECTS = np.r_[0.0, 0.8 ** np.arange(10)] / np.sum(0.8 ** np.arange(10))
LONG_TAIL_RELATIONS = 0.85 ** np.arange(17) / np.sum(0.85 ** np.arange(17))
_NAMES = ("person", "dog", "cat", "car", "tree", "ball", "chair", "table", "cup", "bag")
_PREDICATES = ("on", "near", "holding", "behind", "under")


def long_tail_counts(n: int, seed: int = 0) -> np.ndarray:
    """[n, 2] (objects, relations) per image drawn from the long-tailed law."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(len(LONG_TAIL_OBJECTS), n, p=LONG_TAIL_OBJECTS),
                     rng.choice(len(LONG_TAIL_RELATIONS), n, p=LONG_TAIL_RELATIONS)], 1)


def write_long_tail_dataset(out_dir: str, records: int = 200, *, seed: int = 0,
                            view_size: int = 32, width: int = 48, height: int = 40) -> dict:
    """A train split of `records` synthetic samples (noise photographs, random boxes and
    triplets) whose object / relation counts follow the long-tailed law; returns the manifest.
    The relation regions are noise images standing in for focused regions."""
    import io

    from PIL import Image

    from data_prep import shards
    from sclaro_jax.data import schema

    rng = np.random.default_rng(seed)

    def image() -> bytes:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
            buf, "JPEG", quality=90)
        return buf.getvalue()

    with shards.ShardWriter(out_dir, view_size=view_size, records_per_shard=100) as writer:
        for i, (n_obj, n_rel) in enumerate(long_tail_counts(records, seed)):
            objects = []
            for _ in range(n_obj):
                x0, y0 = rng.integers(0, width - 8), rng.integers(0, height - 8)
                x1, y1 = rng.integers(x0 + 4, width + 1), rng.integers(y0 + 4, height + 1)
                objects.append(schema.Object(str(rng.choice(_NAMES)),
                                             (float(x0), float(y0), float(x1), float(y1))))
            relations = []
            for _ in range(n_rel):
                s, o = (int(k) for k in rng.integers(0, n_obj, 2))
                p = str(rng.choice(_PREDICATES))
                relations.append(schema.Relation(
                    s, p, o, schema.triplet_text(objects[s].name, p, objects[o].name), image()))
            writer.add(schema.Sample(
                id=f"long-tail-{i:05d}", source="synthetic", split="train", image=image(),
                width=width, height=height, action=str(rng.choice(("playing", "sitting"))),
                caption="", objects=tuple(objects), relations=tuple(relations),
                mask_kind="box"))
    return writer.manifest


def write_json(path, doc) -> None:
    """`doc` as a json file at `path`, its folder made."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_replacing(path, lambda f: json.dump(doc, f), text=True)


def rgb_encode(ids):
    """COCO panoptic's encoding of segment ids: id = R + 256 G + 256^2 B (the PNG's pixels)."""
    return np.stack([ids % 256, ids // 256 % 256, ids // 65536], -1).astype(np.uint8)


# A random Qwen2-VL (image-text-to-text, transformers classes) for tests and benchmarks of the
# stage-1 VLM path (`data_prep.vlm.TransformersVLM`): "7b" is Qwen2-VL-7B-Instruct's
# architecture (config.json of Qwen/Qwen2-VL-7B-Instruct, written out here: 28 layers of width
# 3584, GQA 28/4 heads, vocabulary 152,064; a 32-block, 1280-wide ViT with 14 px patches merged
# 2x2), "tiny" the same classes a few dozen wide. The tokenizer is word-level ("w0".."w199" and
# the chat's special tokens) with Qwen's chat layout; ids past it decode to nothing.
QWEN2_VL = {
    "7b": dict(text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         max_position_embeddings=32768, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [16, 24, 24]}),
               vision=dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16,
                           mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
               max_pixels=1280 * 28 * 28),
    "tiny": dict(text=dict(vocab_size=512, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           initializer_range=0.5,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                            "mrope_section": [1, 1, 2]}),
                 vision=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                             patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                             initializer_range=0.5),
                 max_pixels=16 * 28 * 28),
}
QWEN2_VL_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                    "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN2_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def random_qwen2_vl(size: str = "tiny", *, device: str = "cpu", dtype: str = "float32",
                    seed: int = 0):
    """(model, processor): a random-initialised Qwen2VLForConditionalGeneration of `size`
    (`QWEN2_VL`), created directly on `device` in `dtype` (the 7B model never exists on the
    host), in eval mode, and its processor."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if size not in QWEN2_VL:
        raise ValueError(f"unknown Qwen2-VL size {size!r}; choose one of {sorted(QWEN2_VL)}")
    spec = QWEN2_VL[size]
    words = ["<unk>"] + [f"w{i}" for i in range(200)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<|endoftext|>",
        eos_token="<|im_end|>", extra_special_tokens=list(QWEN2_VL_SPECIAL))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIAL}
    processor = transformers.Qwen2VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(max_pixels=spec["max_pixels"]),
        tokenizer=tokenizer, video_processor=transformers.Qwen2VLVideoProcessor(),
        chat_template=QWEN2_VL_TEMPLATE)
    config = transformers.Qwen2VLConfig(
        text_config={**spec["text"], "bos_token_id": None, "eos_token_id": ids["<|im_end|>"],
                     "pad_token_id": ids["<|endoftext|>"]},
        vision_config=spec["vision"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = transformers.Qwen2VLForConditionalGeneration._from_config(
            config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    return model.eval(), processor
