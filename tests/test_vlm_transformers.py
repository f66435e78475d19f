"""TransformersVLM end to end on a tiny random LLaVA (CLIP vision + Llama text) written with
save_pretrained: its batched replies equal a hand-written greedy decoding per image. Kept apart
from test_vlm.py because importing torch + transformers takes ~10 s on a small CPU."""

import pytest
from PIL import Image

from data_prep.vlm import PROMPT, TransformersVLM

TINY_WORDS = ["<unk>", "<pad>", "<s>", "</s>", "<image>", "user", "assistant", "{", "}", ",",
              "objects"] + [f"w{i}" for i in range(40)]
TINY_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {% for c in m['content'] %}"
                 "{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}"
                 "{% endfor %}{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    """A random-initialised LlavaForConditionalGeneration (CLIP vision + Llama text) with a
    word-level tokenizer, written with save_pretrained."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(TINY_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
        eos_token="</s>")
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(
            size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
        tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
        chat_template=TINY_TEMPLATE, image_token="<image>", num_additional_image_tokens=1)
    config = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, image_size=16,
                           patch_size=8, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, initializer_range=0.5),
        text_config=dict(model_type="llama", vocab_size=len(TINY_WORDS), hidden_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=32, bos_token_id=2, eos_token_id=3, pad_token_id=1,
                         initializer_range=0.5),
        image_token_index=vocab["<image>"], vision_feature_layer=-1,
        vision_feature_select_strategy="default")
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_llava")
    transformers.LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _greedy(model, processor, image, max_new_tokens, prompt=PROMPT, system=None):
    """Greedy decoding by repeated full forward passes, prompt written out by hand."""
    import torch

    turn = "" if system is None else f"system {system} "
    inputs = processor(text=[f"{turn}user <image> {prompt} assistant"], images=[image],
                       return_tensors="pt")
    ids = inputs["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"],
                           attention_mask=torch.ones_like(ids)).logits
            token = int(logits[0, -1].argmax())
            if token == processor.tokenizer.eos_token_id:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return processor.tokenizer.decode(new, skip_special_tokens=True)


def test_transformers_vlm_greedy_continuation(tiny_llava):
    import numpy as np

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (20 + 4 * i, 30, 3), dtype=np.uint8))
              for i in range(3)]
    vlm = TransformersVLM(str(tiny_llava), device="cpu", dtype="float32", max_new_tokens=6,
                          batch_size=2)
    replies = vlm(images)
    expected = [_greedy(vlm.model, vlm.processor, image, 6) for image in images]
    assert replies == expected
    assert len(set(replies)) > 1  # the images matter, so the batch order is checked


def test_another_prompt_and_rocs_captions_through_the_model(tiny_llava):
    """The prompt is an argument (ROCS's class-aware captions ask their own, with a system
    turn); a random model's replies never name the object, so the caption is asked twice and
    dropped with its reason."""
    import numpy as np

    from data_prep.rocs.caption import (MISSING_OBJECT, SYSTEM_PROMPT, caption_prompt,
                                        recaption)

    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (24, 24, 3), np.uint8))
    vlm = TransformersVLM(str(tiny_llava), device="cpu", dtype="float32", max_new_tokens=5)
    prompt = "w1 w2 w3 objects"
    assert vlm([image], prompt) == [_greedy(vlm.model, vlm.processor, image, 5, prompt)]
    assert vlm([image], prompt, "w4 w5") == [
        _greedy(vlm.model, vlm.processor, image, 5, prompt, "w4 w5")]
    got = recaption(lambda im, p, system: vlm([im], p, system)[0], image, "cup")
    assert (got.caption, got.reason, got.attempts) == (None, MISSING_OBJECT, 2)
    assert list(got.replies) == [
        _greedy(vlm.model, vlm.processor, image, 5, caption_prompt("cup", retry=r),
                SYSTEM_PROMPT)
        for r in (None, MISSING_OBJECT)]
