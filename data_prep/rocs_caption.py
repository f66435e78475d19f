"""ROCS construction (MINER section 3), the last two steps: a class-aware caption per rare
object, and the output dataset in the layout `python -m sclaro_jax.eval.rocs` reads.

Captions: the VLM is asked (`caption_prompt`) for one or two sentences describing the scene
that explicitly name the rare object. A reply that does not name it (`rocs_select.caption_names`)
is asked again once, with a firmer prompt; a second miss drops the object with the reason
`caption_missing_object` (and the reply), an image without a reply with `vlm_no_reply`.
`recaption` takes any `ask(image, prompt) -> reply or None`: a transformers image-text-to-text
model, or replies from a file keyed by `reply_key(image_id, instance_id, attempt)`.

Output (`write_rocs`): a `datasets` folder written with `save_to_disk`, one row per kept
(image, rare object) caption: `image` (a `datasets.Image`), `caption`, `image_id` (rows of one
photograph share it, so they are one gallery image with several queries), `object` (the class
name) and `box` (x0, y0, x1, y1 in pixels).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from data_prep.rocs_select import caption_names
from data_prep.vlm import load_replies

NO_REPLY = "vlm_no_reply"
MISSING_OBJECT = "caption_missing_object"


RETRY_NOTE = "Your previous description did not mention the {name}"


def caption_prompt(name: str, retry: bool = False) -> str:
    """The class-aware re-captioning prompt for the rare object `name`."""
    prompt = (f"Describe this image in one or two sentences. Describe the scene as a whole, and "
              f"mention the {name} in it explicitly, by the word \"{name}\". Return only the "
              "description.")
    if retry:
        prompt += (" " + RETRY_NOTE.format(name=name) + f": the description must contain the "
                   f"word \"{name}\".")
    return prompt


def clean_caption(reply: str) -> str:
    """A reply as a caption: a JSON {"caption": ...} unwrapped, surrounding quotes and a
    leading "Caption:" dropped, whitespace collapsed."""
    text = reply.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            for key in ("caption", "description", "text"):
                if isinstance(data.get(key), str):
                    text = data[key]
                    break
    text = re.sub(r"^\s*(caption|description)\s*:\s*", "", text, flags=re.IGNORECASE)
    text = text.strip().strip("\"'").strip()
    return re.sub(r"\s+", " ", text)


@dataclass(frozen=True)
class Captioned:
    caption: str | None  # None: dropped
    reason: str | None   # why it was dropped
    attempts: int        # prompts sent (1 or 2)
    replies: tuple[str, ...] = ()


def recaption(ask: Callable[[object, str], str | None], image, name: str) -> Captioned:
    """Ask for a caption naming `name`; once more if the first does not; drop otherwise."""
    replies = []
    for attempt in (0, 1):
        reply = ask(image, caption_prompt(name, retry=attempt == 1))
        if reply is None:
            return Captioned(None, NO_REPLY, attempt + 1, tuple(replies))
        replies.append(reply)
        caption = clean_caption(reply)
        if caption_names(caption, name):
            return Captioned(caption, None, attempt + 1, tuple(replies))
    return Captioned(None, MISSING_OBJECT, 2, tuple(replies))


def reply_key(image_id, instance_id, attempt: int) -> str:
    """The key of a reply in a `--vlm-replies` file: "<image id>/<instance id>" for the first
    prompt, with "/retry" for the second."""
    return f"{image_id}/{instance_id}" + ("/retry" if attempt else "")


class CaptionReplies:
    """`ask` for `recaption` from a JSON file {reply_key: reply text}; `image` is the pair
    (image_id, instance_id); a missing key is no reply."""

    def __init__(self, path: str | Path):
        self.replies = load_replies(path, '{"<image id>/<instance id>[/retry]": reply text}')

    def __call__(self, image, prompt: str) -> str | None:
        image_id, instance_id = image
        retry = RETRY_NOTE.split("{name}")[0] in prompt
        return self.replies.get(reply_key(image_id, instance_id, retry))


def write_rocs(out: str | Path, rows: Sequence[dict]) -> Path:
    """Rows {image: path or encoded bytes, caption, image_id, object, box} -> a `save_to_disk`
    folder in the ROCS layout (see the module docstring). Needs `datasets` (extra `eval`)."""
    try:
        import datasets
    except ImportError:
        raise ImportError("writing a ROCS split needs the `datasets` package: "
                          "pip install \"sclaro-jax[eval]\"") from None
    if not rows:
        raise ValueError("no caption survived the selection: nothing to write (see the "
                         "reasons in summary.json)")
    images = []  # the encoded bytes go into the folder: it does not depend on the sources
    for row in rows:
        image = row["image"]
        if isinstance(image, (str, Path)):
            images.append({"path": Path(image).name, "bytes": Path(image).read_bytes()})
        else:
            images.append({"path": None, "bytes": bytes(image)})
    columns = {"image": images, "caption": [r["caption"] for r in rows],
               "image_id": [str(r["image_id"]) for r in rows],
               "object": [r["object"] for r in rows],
               "box": [[float(v) for v in r["box"]] for r in rows]}
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string"),
                                  "image_id": datasets.Value("string"),
                                  "object": datasets.Value("string"),
                                  "box": datasets.Sequence(datasets.Value("float32"))})
    ds = datasets.Dataset.from_dict(columns, features=features)
    out = Path(out)
    ds.save_to_disk(str(out))
    return out
