"""Tiny random-initialised Hugging Face SigLIP / SigLIP 2 folders for tests (needs torch and
transformers; nothing here reaches the network).

`save_tiny_siglip(folder, kind="siglip"|"siglip2")` writes config.json, model.safetensors,
preprocessor_config.json, tokenizer.json and tokenizer_config.json and returns the PyTorch model.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64, projection_size=48)
TINY_VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4)
# SigLIP: 32 px images of 8 px patches (4 x 4 grid). SigLIP 2: a 4 x 4 position grid of 8 px
# patches (num_patches 16); any grid works at run time.
TINY_SIGLIP_VISION = dict(TINY_VISION, image_size=32, patch_size=8)
TINY_SIGLIP2_VISION = dict(TINY_VISION, num_patches=16, patch_size=8)

_SENTENCES = [
    "a photo of a cat", "a photo of a dog sitting on a red sofa", "two people riding bicycles",
    "a chef cooking pasta in a busy kitchen", "children playing football in the park",
    "an old man reading a newspaper on a bench", "a woman painting a wall blue",
    "the quick brown fox jumps over the lazy dog", "cars waiting at a traffic light at night",
    "a group of friends having dinner together", "a musician playing guitar on stage",
]


def save_tiny_tokenizer(folder, kind: str = "siglip", vocab_size: int = 96):
    """Train a small Unigram tokenizer and save it as a transformers fast tokenizer.

    siglip: SentencePiece-like (Metaspace), specials <pad>=0 </s>=1 <unk>=2, "$A </s>", padded
    with </s> (SigLIP's pad token). siglip2: Gemma-like specials <pad>=0 <eos>=1 <bos>=2 <unk>=3,
    "<bos> $A <eos>", padded with <pad>, lowercasing normaliser."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "siglip":
        specials = ["<pad>", "</s>", "<unk>"]
        pad, eos, bos, unk = "</s>", "</s>", None, "<unk>"
    elif kind == "siglip2":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
        pad, eos, bos, unk = "<pad>", "<eos>", "<bos>", "<unk>"
    else:
        raise ValueError(f"kind must be 'siglip' or 'siglip2', not {kind!r}")
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Lowercase()] if kind == "siglip2" else [normalizers.NFKC()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      unk_token=unk, show_progress=False)
    tok.train_from_iterator(_SENTENCES * 4, trainer)
    if kind == "siglip":
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A <eos>", pair="<bos> $A <eos> $B <eos>",
            special_tokens=[("<bos>", 2), ("<eos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=eos,
                                   bos_token=bos, unk_token=unk, model_max_length=64)
    fast.save_pretrained(folder)
    return fast


def save_tiny_siglip(folder, kind: str = "siglip", seed: int = 0, text: dict | None = None,
                     vision: dict | None = None):
    """A random-initialised tiny `SiglipModel` (kind="siglip") or `Siglip2Model`
    (kind="siglip2") saved with `save_pretrained` (safetensors) plus a preprocessor config and
    an offline tokenizer. Returns the PyTorch model (eval mode)."""
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = ({"pad_token_id": 1, "bos_token_id": 1, "eos_token_id": 1} if kind == "siglip"
           else {"pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1})
    text = dict(TINY_TEXT, **ids, **(text or {}))
    if kind == "siglip":
        vision = dict(TINY_SIGLIP_VISION, **(vision or {}))
        config = transformers.SiglipConfig(text_config=text, vision_config=vision)
        cls = transformers.SiglipModel
        pre = {"image_processor_type": "SiglipImageProcessor", "do_resize": True,
               "size": {"height": vision["image_size"], "width": vision["image_size"]},
               "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
               "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    elif kind == "siglip2":
        vision = dict(TINY_SIGLIP2_VISION, **(vision or {}))
        config = transformers.Siglip2Config(text_config=text, vision_config=vision)
        cls = transformers.Siglip2Model
        pre = {"image_processor_type": "Siglip2ImageProcessor", "do_resize": True,
               "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
               "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
               "patch_size": vision["patch_size"], "max_num_patches": vision["num_patches"]}
    else:
        raise ValueError(f"kind must be 'siglip' or 'siglip2', not {kind!r}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial logit scale / bias and position tables
        model.logit_scale.fill_(2.3)
        model.logit_bias.fill_(-1.5)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    save_tiny_tokenizer(folder, kind, vocab_size=text["vocab_size"])
    return model
