"""Stage 1 of the SCLARO annotation pipeline (appendix A): ask a VLM for an action, objects,
relation triplets and a caption per image. The prompt and the VLMs live here; the reply parser
is `data_prep.vlm_reply` (`parse_response`, `ParseError`, `RECOVERY_NOTES`, re-exported here).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from data_prep.vlm_reply import (FIELDS, MAX_OBJECTS, RECOVERY_NOTES, ParseError,  # noqa: F401
                                 parse_response)
from sclaro_jax import bounds

if TYPE_CHECKING:
    from PIL import Image

PROMPT = """\
Given the image, return only the following information:
1. A list of major unique objects in the image (limit to 10 objects).
2. The relations between those objects in the form of relation triplets: <object1> <relation> <object2>.
3. Action should be a single word of a broad class, like "playing", "eating", "running", "talking", "driving" etc. Avoid specific actions like "serving", "gulping", "steering" etc.
4. The description tag should be one or two sentences long, describing the image in general terms.
Do not provide any extra information or descriptions.
Give the output in a json format, example:
{
"action": "<some action>"
"objects": ["object1", "object2", ...],
"relations": [
["object1", "relation", "object2"],
...
]
"dense caption": "The image shows a... <description>"
}"""


class VLM(Protocol):
    """Anything that answers PROMPT for a batch of images, one reply per image."""

    def __call__(self, images: list[Image.Image]) -> list[str]: ...


class ScriptedVLM:
    """Canned replies for tests and demos: `replies(index, image)` with a running image index,
    or a sequence indexed by it."""

    def __init__(self, replies: Callable[[int, Image.Image], str] | Sequence[str]):
        self.replies = replies
        self.count = 0

    def __call__(self, images: list[Image.Image]) -> list[str]:
        out = []
        for image in images:
            if callable(self.replies):
                out.append(self.replies(self.count, image))
            else:
                if self.count >= len(self.replies):
                    raise IndexError(f"ScriptedVLM has {len(self.replies)} replies, asked for "
                                     f"image {self.count}")
                out.append(self.replies[self.count])
            self.count += 1
        return out


# The image ids `--vlm-replies` is keyed by, per source (`data_prep.sources`). Path parts are
# '/'-separated, with spaces and other characters percent-encoded as in URLs ("%20").
REPLY_IDS = {
    "folder": "'folder/<path under --root, extension included>' (e.g. 'folder/park/dog 1.jpg' "
              "-> 'folder/park/dog%201.jpg')",
    "mmit": "'mmit/<video path without extension>/<frame file stem>'",
    "cc3m": "'cc3m/<shard>/<key>' (img2dataset) or 'cc3m/<TSV filename without extension>'",
    "openpsg": "'openpsg/<image_id>'",
    "pvsg": "'pvsg/<video_id>/<frame:04d>'",
    "kitti2015": "'kitti2015/<subset>/<camera>/NNNNNN_10'",
    "webdataset": "'<name>/<tar file name without .tar>/<key>' (name: the source option name=, "
                  "default 'webdataset'; name=cc3m gives the cc3m ids)",
    "hf": "'<name>/<id column value or zero-padded row>' (name: the source option name=, "
          "default 'hf')",
}


def load_replies(path, layout: str) -> dict[str, str]:
    """A `--vlm-replies` JSON file: an object of reply texts (`layout` describes its keys in
    the error when it is not one)."""
    try:
        replies = bounds.read_json(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"--vlm-replies {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--vlm-replies {path}: not valid JSON ({e})") from None
    if not isinstance(replies, dict) or not all(isinstance(v, str) for v in replies.values()):
        raise ValueError(f"--vlm-replies {path}: expected a JSON object {layout}")
    return replies


class RepliesFile:
    """Stage 1 from replies obtained elsewhere (a batch API, another machine): a JSON object
    {image id: reply text} (ids: `REPLY_IDS`). Called with the chunk's items rather than
    images; an image the file has no reply for gets None (annotate excludes it as
    `vlm_no_reply`)."""
    wants_items = True

    def __init__(self, path: str):
        self.replies = load_replies(path, "{image id: reply text}")
        self.path = path

    def __call__(self, items: list) -> list[str | None]:
        return [self.replies.get(it.id) for it in items]


class TransformersVLM:
    """A local transformers image-text-to-text model asked PROMPT with greedy decoding.

    The paper's Stage-1 model is Ovis-Gemma 9B (e.g. a local copy of "AIDC-AI/Ovis2-9B"); Ovis
    ships its own modelling code, so it needs `trust_remote_code=True`
    (`--vlm-trust-remote-code`), which is never turned on by default.

    Images go `batch_size` at a time through one left-padded `generate` call; `static_cache=True`
    decodes with transformers' static KV cache (`cache_implementation="static"`: preallocated
    to the prompt plus `max_new_tokens`, the shapes CUDA graphs and torch.compile need) instead
    of the dynamic one. `TransformersVLM.of` wraps a model and processor built elsewhere.
    """

    def __init__(self, model_path: str, *, device: str = "cuda", dtype: str = "bfloat16",
                 max_new_tokens: int = 512, batch_size: int = 8,
                 trust_remote_code: bool = False, static_cache: bool = False):
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"VLM folder {str(model_path)!r} has no config.json: pass a local folder of a "
                "transformers image-text-to-text model (the paper uses Ovis-Gemma 9B, e.g. a "
                "download of AIDC-AI/Ovis2-9B; Ovis needs --vlm-trust-remote-code)")
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        # safetensors only: a pickled pytorch_model.bin can run code when it is loaded
        self.model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code,
            use_safetensors=True)
        self._setup(self.model.to(device).eval(), self.processor, max_new_tokens=max_new_tokens,
                    batch_size=batch_size, static_cache=static_cache)

    @classmethod
    def of(cls, model, processor, *, max_new_tokens: int = 512, batch_size: int = 8,
           static_cache: bool = False) -> "TransformersVLM":
        """The VLM of an already built `model` (on its device, in eval mode) and `processor`:
        benchmarks of random-initialised models never saved to disk."""
        vlm = cls.__new__(cls)
        vlm._setup(model, processor, max_new_tokens=max_new_tokens, batch_size=batch_size,
                   static_cache=static_cache)
        return vlm

    def _setup(self, model, processor, *, max_new_tokens, batch_size, static_cache) -> None:
        if batch_size < 1 or max_new_tokens < 1:
            raise ValueError(f"batch_size and max_new_tokens must be at least 1, got "
                             f"{batch_size} and {max_new_tokens}")
        self.model, self.processor = model, processor
        # Batched generation continues every row from its last token: pad on the left.
        self.processor.tokenizer.padding_side = "left"
        self.device = model.device
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.generate_options = {"cache_implementation": "static"} if static_cache else {}
        self.generated_tokens = 0  # new tokens of every row, padding after an early end included

    def __call__(self, images: list[Image.Image], prompt: str = PROMPT,
                 system: str | None = None) -> list[str]:
        """One reply per image to `prompt` (the user turn, after the image), with `system` as
        a system turn before it when given (ROCS captions have one; Stage 1 has none)."""
        import torch

        message = [{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": prompt}]}]
        if system is not None:
            message.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
        chat = self.processor.apply_chat_template(message, add_generation_prompt=True,
                                                  tokenize=False)
        replies: list[str] = []
        for start in range(0, len(images), self.batch_size):
            chunk = [image.convert("RGB") for image in images[start:start + self.batch_size]]
            inputs = self.processor(text=[chat] * len(chunk), images=chunk, padding=True,
                                    return_tensors="pt")
            inputs = inputs.to(self.model.device, dtype=self.model.dtype)  # floats only
            with torch.inference_mode():
                out = self.model.generate(**inputs, do_sample=False,
                                          max_new_tokens=self.max_new_tokens,
                                          **self.generate_options)
            new_tokens = out[:, inputs["input_ids"].shape[1]:]
            self.generated_tokens += new_tokens.numel()
            replies.extend(self.processor.batch_decode(new_tokens, skip_special_tokens=True))
        return replies
