"""ROCS construction (MINER section 3), the last two steps: a class-aware caption per rare
object, and the output dataset in the layout `python -m sclaro_jax.eval.rocs` reads.

Captions: the VLM gets the system prompt `SYSTEM_PROMPT` and the user prompt `USER_PROMPT`
with the rare object's class name for its placeholder "{rare class}" (`caption_prompt`), the
MINER paper's appendix J.1 prompts: one neutral, factual MS COCO-style sentence that names the
object. A reply is checked (`check_caption`): it must name the object (`selection.
caption_names`) and have a word count within `CAPTION_WORDS` (8-18 by default, both ends
included: the union of the user prompt's "roughly 8-16" and the system prompt's "roughly
10-18"). A reply that fails is
asked again once, the user prompt followed by a note saying what to fix; a second failure drops
the object with the reason of that second reply (`caption_missing_object`, or
"caption_words:N (LO-HI)" with the reply's word count N) and the replies, an image without a
reply with `vlm_no_reply`. `recaption` takes any `ask(image, prompt, system) -> reply or None`:
a transformers image-text-to-text model, or replies from a file keyed by
`reply_key(image_id, instance_id, attempt)`.

Output (`write_rocs`): a `datasets` folder written with `save_to_disk`, one row per kept
(image, rare object) caption: `image` (a `datasets.Image`), `caption`, `image_id` (rows of one
photograph share it, so they are one gallery image with several queries), `object` (the class
name) and `box` (x0, y0, x1, y1 in pixels).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from data_prep.rocs.selection import caption_names
from data_prep.vlm import load_replies
from sclaro_jax import bounds

NO_REPLY = "vlm_no_reply"
MISSING_OBJECT = "caption_missing_object"
WORD_COUNT = "caption_words"  # the reason reads "caption_words:N (LO-HI)"
REASONS = (NO_REPLY, MISSING_OBJECT, WORD_COUNT)  # the kinds of caption drops

# MINER appendix J.1.1 and J.1.2 (Qwen3-VL captioning prompts). "{rare class}" is the
# paper's placeholder for the highlighted object's class name.
SYSTEM_PROMPT = (
    "You write image captions in the MS COCO style. Write one neutral, factual MS COCO-style "
    "sentence, roughly 10-18 words, that describes the image and naturally names the "
    "highlighted object. Avoid extra adjectives, lists, chained clauses and meta phrases such "
    "as \"this image shows\" or \"in this picture\". Return only the sentence.")
USER_PROMPT = (
    "Write one natural, neutral MS COCO-style sentence of roughly 8-16 words that clearly "
    "includes the {rare class}.")
PLACEHOLDER = "{rare class}"
CAPTION_WORDS = (8, 18)  # the accepted word counts, both ends included

RETRY_NOTE = "Your previous caption"  # how every retry note starts (CaptionReplies looks for it)


def caption_words(caption: str) -> int:
    """Words in a caption: runs of letters and digits, joined by an apostrophe or a hyphen
    ("a red-and-white bus" is 3, "A man's hat." is 3); punctuation does not count."""
    return len(re.findall(r"\w+(?:['\u2019-]\w+)*", caption))


def words_reason(count: int, words: tuple[int, int] = CAPTION_WORDS) -> str:
    return f"{WORD_COUNT}:{count} ({words[0]}-{words[1]})"


def reason_kind(reason: str) -> str:
    """The drop's kind (a `REASONS` entry): "caption_words:5 (8-18)" -> "caption_words"."""
    return reason.split(":", 1)[0]


def check_caption(caption: str, name: str, words: tuple[int, int] = CAPTION_WORDS) -> str | None:
    """None when `caption` is usable for the object `name`, else why not: MISSING_OBJECT when
    it does not name it (checked first), "caption_words:N (LO-HI)" when its word count N is
    outside `words`."""
    if not caption_names(caption, name):
        return MISSING_OBJECT
    count = caption_words(caption)
    if not words[0] <= count <= words[1]:
        return words_reason(count, words)
    return None


def caption_prompt(name: str, retry: str | None = None,
                   words: tuple[int, int] = CAPTION_WORDS) -> str:
    """The user prompt for the rare object `name` (`USER_PROMPT` with `name` in the
    placeholder); with `retry`, the first reply's reason (`check_caption`), a note saying
    what to fix."""
    prompt = USER_PROMPT.replace(PLACEHOLDER, name)
    if retry == MISSING_OBJECT:
        prompt += (f" {RETRY_NOTE} did not mention the {name}: the sentence must contain the "
                   f"word \"{name}\".")
    elif retry is not None and reason_kind(retry) == WORD_COUNT:
        count = retry.split(":", 1)[1].split()[0]
        prompt += (f" {RETRY_NOTE} had {count} words: write one sentence of {words[0]} to "
                   f"{words[1]} words.")
    elif retry is not None:
        raise ValueError(f"caption_prompt: no retry note for the reason {retry!r}")
    return prompt


def clean_caption(reply: str) -> str:
    """A reply as a caption: a JSON {"caption": ...} unwrapped, surrounding quotes and a
    leading "Caption:" dropped, whitespace collapsed."""
    text = reply.strip()
    if text.startswith("{"):
        try:
            data = bounds.parse_json(text, "the reply")
        except ValueError:  # not JSON, or nested too deep
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


def recaption(ask: Callable[[object, str, str], str | None], image, name: str, *,
              words: tuple[int, int] = CAPTION_WORDS) -> Captioned:
    """Ask for a caption of `name` (`caption_prompt`, `SYSTEM_PROMPT`); once more if the reply
    fails `check_caption`; drop the object with the second reply's reason otherwise."""
    if not (0 < words[0] <= words[1]):
        raise ValueError(f"caption words {words[0]}-{words[1]}: expected 0 < LO <= HI")
    replies, reason = [], None
    for attempt in (0, 1):
        reply = ask(image, caption_prompt(name, retry=reason, words=words), SYSTEM_PROMPT)
        if reply is None:
            return Captioned(None, NO_REPLY, attempt + 1, tuple(replies))
        replies.append(reply)
        caption = clean_caption(reply)
        reason = check_caption(caption, name, words)
        if reason is None:
            return Captioned(caption, None, attempt + 1, tuple(replies))
    return Captioned(None, reason, 2, tuple(replies))


def reply_key(image_id, instance_id, attempt: int) -> str:
    """The key of a reply in a `--vlm-replies` file: "<image id>/<instance id>" for the first
    prompt, with "/retry" for the second."""
    return f"{image_id}/{instance_id}" + ("/retry" if attempt else "")


class CaptionReplies:
    """`ask` for `recaption` from a JSON file {reply_key: reply text}; `image` is the pair
    (image_id, instance_id); a missing key is no reply."""

    def __init__(self, path: str | Path):
        self.replies = load_replies(path, '{"<image id>/<instance id>[/retry]": reply text}')

    def __call__(self, image, prompt: str, system: str | None = None) -> str | None:
        image_id, instance_id = image
        retry = RETRY_NOTE in prompt
        return self.replies.get(reply_key(image_id, instance_id, retry))


def need_datasets():
    """The `datasets` package, or `MissingExtra` naming the `eval` extra (checked before any
    work by the `rocs` command)."""
    from sclaro_jax import cli
    return cli.need("datasets", "eval", "writing a ROCS split")


def write_rocs(out: str | Path, rows: Sequence[dict]) -> Path:
    """Rows {image: path or encoded bytes, caption, image_id, object, box} -> a `save_to_disk`
    folder in the ROCS layout (see the module docstring). Needs `datasets` (extra `eval`)."""
    datasets = need_datasets()
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
