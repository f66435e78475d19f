"""Stage 2 of the annotation pipeline: GroundingDINO boxes for the Stage-1 objects.

SCLARO appendix, Stage 2: the Stage-1 object list is concatenated into one period-separated,
lowercased prompt (`make_prompt`); GroundingDINO (grounding-dino-base, through transformers)
keeps boxes whose score exceeds the box threshold 0.25 and, per box, the prompt tokens whose
probability exceeds the text threshold 0.25; NMS at IoU 0.4 then removes duplicates
(`postprocess`). Dropping images with no objects or no relations is the orchestrator's job.

Both thresholds are strict (`>`), as in transformers'
`GroundingDinoProcessor.post_process_grounded_object_detection`, which applies the text
threshold (it decides which prompt tokens make up a box's phrase).
"""

from __future__ import annotations

import os
import re
import time
import unicodedata
from collections import defaultdict
from dataclasses import dataclass

import torch
from PIL import Image

from sclaro_jax.files import write_replacing

BOX_THRESHOLD = 0.25
TEXT_THRESHOLD = 0.25
NMS_IOU = 0.4

_SPECIAL_TOKEN = re.compile(r"\[(?:CLS|SEP|PAD|UNK|MASK)\]", re.IGNORECASE)
_WORDPIECE_FRAGMENT = re.compile(r"##\w*")


@dataclass(frozen=True)
class Detection:
    """One box: (x0, y0, x1, y1) in pixels of the original image, clipped to it; `label` is the
    Stage-1 object name as spelled there; `phrase` is GroundingDINO's raw phrase."""
    box: tuple[float, float, float, float]
    score: float
    label: str
    phrase: str


def _clean_name(name: str) -> str:
    return " ".join(name.replace(".", "").lower().split())


def make_prompt(objects: list[str]) -> str:
    """Appendix Stage 2 prompt: ["Man", "red Car"] -> "man. red car." (empty names skipped)."""
    names = [n for n in (_clean_name(o) for o in objects) if n]
    return ". ".join(names) + "." if names else ""


def _words(text: str) -> list[str]:
    """Lowercased words of a name or phrase, as BERT-uncased sees them: accents stripped,
    special tokens and lone wordpiece fragments ("##s") dropped, punctuation ignored."""
    text = _WORDPIECE_FRAGMENT.sub(" ", _SPECIAL_TOKEN.sub(" ", text))
    text = unicodedata.normalize("NFKD", text.lower())
    text = "".join(c for c in text if not unicodedata.combining(c))
    return re.findall(r"[^\W_]+", text)


def map_phrase(phrase: str, objects: list[str]) -> str | None:
    """The Stage-1 object a GroundingDINO phrase names: the one whose words equal the phrase's,
    else the one sharing the most words with it (ties: the earliest), else None."""
    words = _words(phrase)
    if not words:
        return None
    names = [_words(o) for o in objects]
    for obj, name in zip(objects, names):
        if name == words:
            return obj
    wanted = set(words)
    best, best_overlap = None, 0
    for obj, name in zip(objects, names):
        overlap = len(wanted & set(name))
        if overlap > best_overlap:
            best, best_overlap = obj, overlap
    return best


def postprocess(boxes, scores, phrases: list[str], objects: list[str], *,
                box_threshold: float = BOX_THRESHOLD, nms_iou: float = NMS_IOU,
                class_agnostic: bool = False,
                image_size: tuple[int, int] | None = None) -> list[Detection]:
    """Detections of one image from xyxy pixel `boxes` [N, 4], `scores` [N] and `phrases` [N].

    Keeps scores > box_threshold, maps phrases to objects (`map_phrase`; unmapped ones are
    dropped), clips boxes to `image_size` (width, height) when given, drops boxes without area,
    runs NMS at `nms_iou` (IoU > nms_iou suppresses) per label, or across labels when
    `class_agnostic`, and sorts by score, highest first.
    """
    boxes = torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4).cpu()
    scores = torch.as_tensor(scores, dtype=torch.float32).reshape(-1).cpu()
    if not (len(boxes) == len(scores) == len(phrases)):
        raise ValueError(f"postprocess: {len(boxes)} boxes, {len(scores)} scores and "
                         f"{len(phrases)} phrases; expected one of each per detection")
    labels = [map_phrase(p, objects) if s > box_threshold else None
              for p, s in zip(phrases, scores.tolist())]
    keep = [i for i, label in enumerate(labels) if label is not None]
    if image_size is not None:
        width, height = image_size
        boxes = torch.stack([boxes[:, 0].clamp(0, width), boxes[:, 1].clamp(0, height),
                             boxes[:, 2].clamp(0, width), boxes[:, 3].clamp(0, height)], dim=1)
    keep = [i for i in keep if boxes[i, 2] > boxes[i, 0] and boxes[i, 3] > boxes[i, 1]]
    if not keep:
        return []
    index = torch.tensor(keep)
    kept_boxes, kept_scores = boxes[index], scores[index]
    if class_agnostic:
        from torchvision.ops import nms
        survivors = nms(kept_boxes, kept_scores, nms_iou)
    else:
        from torchvision.ops import batched_nms
        label_ids = torch.tensor([objects.index(labels[i]) for i in keep])
        survivors = batched_nms(kept_boxes, kept_scores, label_ids, nms_iou)
    order = sorted(survivors.tolist(), key=lambda k: -float(kept_scores[k]))
    return [Detection(box=tuple(float(v) for v in kept_boxes[k].tolist()),
                      score=float(kept_scores[k]), label=labels[keep[k]],
                      phrase=phrases[keep[k]])
            for k in order]


class GroundingDetector:
    """GroundingDINO (transformers) on PIL images with their Stage-1 object lists.

    Images are batched only with images of the same processed size: padding changes the Swin
    features of a padded image, so a padded batch would not give the single-image result.
    Each call holds the pixels of all its images at once; pass a few dozen images per call.
    `timings` accumulates seconds spent in "preprocess", "model" and "postprocess".

    Each batch is tokenized in one call and its text encoder (BERT) runs once per row.
    `text_once=True` runs the text encoder once per distinct prompt of a batch instead (rows with
    the same prompt share its features: `DistinctRows`); `bf16=True` runs the model under
    `torch.autocast(bfloat16)` (boxes and scores then differ from float32 by bf16 rounding).
    `model`: a GroundingDinoForObjectDetection already built, used instead of the folder's
    weights (benchmarks of random full-size models; the processor still comes from the folder).
    """

    def __init__(self, model_path: str, *, device: str = "cpu",
                 box_threshold: float = BOX_THRESHOLD, text_threshold: float = TEXT_THRESHOLD,
                 nms_iou: float = NMS_IOU, batch_size: int = 4, text_once: bool = False,
                 bf16: bool = False, model=None):
        from transformers import GroundingDinoForObjectDetection, GroundingDinoProcessor

        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise FileNotFoundError(
                f"{model_path}: no config.json there; pass --detector PATH: a local folder of "
                f"IDEA-Research/grounding-dino-base saved with save_pretrained")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        try:
            self.processor = GroundingDinoProcessor.from_pretrained(model_path,
                                                                    local_files_only=True)
        except OSError as e:
            raise FileNotFoundError(
                f"{model_path}: the GroundingDINO processor (image processor and tokenizer "
                f"files) could not be loaded: save the processor of "
                f"IDEA-Research/grounding-dino-base there with save_pretrained ({e})") from e
        self.device = torch.device(device)
        try:  # safetensors only: a pickled pytorch_model.bin can run code when it is loaded
            if model is None:
                model = GroundingDinoForObjectDetection.from_pretrained(
                    model_path, local_files_only=True, use_safetensors=True)
        except OSError as e:
            raise FileNotFoundError(
                f"{model_path}: no GroundingDINO weights in safetensors form (model.safetensors;"
                f" a pickled pytorch_model.bin is never loaded: it can run code): save the "
                f"model there with save_pretrained, whose default is safetensors ({e})") from e
        self.model = model.to(self.device).eval()
        if text_once:
            self.model.model.text_backbone = DistinctRows(self.model.model.text_backbone)
        self.bf16 = bf16
        self.box_threshold = box_threshold
        self.text_threshold = text_threshold
        self.nms_iou = nms_iou
        self.batch_size = batch_size
        self.timings = {"preprocess": 0.0, "model": 0.0, "postprocess": 0.0}

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, images: list[Image.Image],
                 objects: list[list[str]]) -> list[list[Detection]]:
        """Detections per image, highest score first; [] for an image without object names."""
        if len(images) != len(objects):
            raise ValueError(f"{len(images)} images but {len(objects)} object lists")
        start = time.perf_counter()
        prompts, pixels = {}, {}
        groups = defaultdict(list)
        for i, (image, names) in enumerate(zip(images, objects)):
            if not isinstance(image, Image.Image):
                raise TypeError(f"image {i}: expected a PIL.Image.Image, "
                                f"got {type(image).__name__}")
            prompt = make_prompt(names)
            if not prompt:
                continue
            prompts[i] = prompt
            pixels[i] = self.processor.image_processor(
                images=image.convert("RGB"), return_tensors="pt")["pixel_values"][0]
            groups[tuple(pixels[i].shape)].append(i)
        self.timings["preprocess"] += time.perf_counter() - start

        results: list[list[Detection]] = [[] for _ in images]
        for members in groups.values():
            for b in range(0, len(members), self.batch_size):
                chunk = members[b:b + self.batch_size]
                for i, found in zip(chunk, self._run(chunk, images, objects, prompts, pixels)):
                    results[i] = found
        return results

    def _run(self, chunk, images, objects, prompts, pixels) -> list[list[Detection]]:
        start = time.perf_counter()
        text = self.processor.tokenizer([prompts[i] for i in chunk], padding="longest",
                                        return_token_type_ids=True, return_tensors="pt")
        max_len = self.model.config.max_text_len
        for i, length in zip(chunk, text["attention_mask"].sum(1).tolist()):
            if length > max_len:
                raise ValueError(f"image {i}: the prompt {prompts[i]!r} is {length} tokens, "
                                 f"more than GroundingDINO's max_text_len {max_len}")
        pixel_values = torch.stack([pixels[i] for i in chunk])
        inputs = {k: v.to(self.device) for k, v in text.items()}
        inputs["pixel_values"] = pixel_values.to(self.device)
        inputs["pixel_mask"] = torch.ones((len(chunk), *pixel_values.shape[2:]),
                                          dtype=torch.long, device=self.device)
        self._sync()
        self.timings["preprocess"] += time.perf_counter() - start

        start = time.perf_counter()
        with torch.inference_mode(), torch.autocast(self.device.type, torch.bfloat16,
                                                     enabled=self.bf16):
            outputs = self.model(**inputs)
        if self.bf16:  # the post-processing in float32, as without autocast
            outputs.logits = outputs.logits.float()
            outputs.pred_boxes = outputs.pred_boxes.float()
        self._sync()
        self.timings["model"] += time.perf_counter() - start

        start = time.perf_counter()
        raw = self.processor.post_process_grounded_object_detection(
            outputs, inputs["input_ids"], threshold=self.box_threshold,
            text_threshold=self.text_threshold,
            target_sizes=[(images[i].height, images[i].width) for i in chunk])
        found = [postprocess(r["boxes"], r["scores"], r["text_labels"], objects[i],
                             box_threshold=self.box_threshold, nms_iou=self.nms_iou,
                             image_size=(images[i].width, images[i].height))
                 for i, r in zip(chunk, raw)]
        self.timings["postprocess"] += time.perf_counter() - start
        return found


class DistinctRows(torch.nn.Module):
    """A text encoder that encodes each distinct row of its batch once: GroundingDINO calls its
    text backbone with (input_ids, self-attention masks, token_type_ids, position_ids), all
    derived from the prompt; rows equal in all four share the hidden states of the first."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder
        self.rows_in = self.rows_encoded = 0  # counts, for tests and benchmarks

    def forward(self, input_ids, attention_mask, token_type_ids, position_ids, return_dict=True):
        from transformers.modeling_outputs import BaseModelOutput
        key = torch.cat([input_ids, token_type_ids, position_ids,
                         attention_mask.flatten(1).long()], 1)
        _, inverse = torch.unique(key, dim=0, return_inverse=True)
        # the first row of each distinct key, in batch order
        first = torch.full((int(inverse.max()) + 1,), len(key), device=key.device)
        first = first.scatter_reduce(0, inverse, torch.arange(len(key), device=key.device),
                                     "amin")
        self.rows_in += len(key)
        self.rows_encoded += len(first)
        if len(first) == len(key):
            return self.encoder(input_ids, attention_mask, token_type_ids, position_ids,
                                return_dict=return_dict)
        out = self.encoder(input_ids[first], attention_mask[first], token_type_ids[first],
                           position_ids[first], return_dict=True)
        hidden = out.last_hidden_state[inverse]
        return BaseModelOutput(last_hidden_state=hidden) if return_dict else (hidden,)


# Words of the tiny test model's vocabulary: common English words plus every word of the demo
# annotations (data_prep/demo/annotations.json) and of tests/test_detect.py.
_TINY_WORDS = """
a about above across admiral after against air airplane all along american an ancient and
animal apple are arm around at away baby back backdrop background backpack bad badge bag ball
banana bar base basket bathroom beach bear bed bedroom behind below bench bends beside between
bicycle big bin bird black blooming blooms blue blurred board boat boats body book boots bottle
bottom bowl box boxes boy branch bread bridge bright brown building buildings bus but by cake
camera cell campus can cap car cardboard carrot cars cat ceiling chair chinese chrome city clock close
cloud clouds cluttered coat coffee coin coins collins columns computer concrete contrast counter
cow crater craters crema cup cupped curtain dahlia dark deep desk diagonally dinner distance dog
domed door dotted down dress drink driving dusk eagle ear eating eileen elderly elephant
elongated engine entry espresso eye eyes face faces falcon fence field figures firearm fish flag
flanked floodlights floor flower food for fork four frame from front fruit fully garage giraffe
girl glass glasses glazed gloves glowing gold grace grass greek green grey ground guitar hair
hand hands handwriting handwritten hanging hat hazy head headlight heads heavily helmet her hill
his holding horse hopper horizontally house in ink inside is island it its jacket keyboard
kickstand kitchen kite knife lake lamp laptop lattice launch lawn leafy left leg lie light
lightning lines long look looking low lunar lying man mathematical metal mirror mission model
monitor moon motion motorcycle mountain mounted mouse mouth multi name nasa navy near next nose
nucleus ocean of officer official on open orange outside over overcoat overlooking pad pagoda pair pale
pants paper parked part partly patch path peach people person petals phone photograph
photographed photographing pillow pink pit pizza plain plant plate playing pocked pole pompeii
pompon portrait poses posing purple rear red resting ribbon ridge riding right river road rock
rocket roof roofs rough round rows ruled run running s sand sandwich saucer screen sea seat
second seen sharp sheep shelf shelves shining ship shirt shoe shoes showing shuttle sidewalk sign
silver sink sitting six skateboard ski sky slant small smeared smiling snow so sofa space
spacesuit spoon stacked stained standing stands staring stereo stone storage street sun sunlit surface
symbols table tabby tag talking tall tennis that the their through tie tiered tightly tile tissue to
toilet top topped toward tower towers track traffic train tree trees tripod truck tv twenty u
umbrella under uniform unreadable up upright vase view visible visored walking wall
water wearing wheel whiskers white wide window with woman wooden worn writing yamaha yellow zebra
""".split()
_TINY_SYMBOLS = [".", ",", "-", "'", "(", ")", "/", "&", ":", ";", "!", "?"] + list("0123456789")
_TINY_LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def save_tiny_model(path: str, seed: int = 0) -> str:
    """Write a random-initialised, tiny GroundingDINO (Swin + BERT, real transformers classes)
    and its processor (small images, a local word-level vocabulary) to `path`; returns `path`.
    For tests and benchmarks; its detections mean nothing."""
    from transformers import (BertConfig, BertTokenizer, GroundingDinoConfig,
                              GroundingDinoForObjectDetection, GroundingDinoImageProcessor,
                              GroundingDinoProcessor, SwinConfig)

    os.makedirs(path, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + _TINY_SYMBOLS + sorted(
        set(_TINY_WORDS) | set(_TINY_LETTERS))
    vocab_file = os.path.join(path, "vocab.txt")
    write_replacing(vocab_file, lambda f: f.write("\n".join(vocab) + "\n"), text=True)
    tokenizer = BertTokenizer(vocab=vocab_file, do_lower_case=True)
    image_processor = GroundingDinoImageProcessor(
        size={"shortest_edge": 256, "longest_edge": 384})
    GroundingDinoProcessor(image_processor=image_processor,
                           tokenizer=tokenizer).save_pretrained(path)

    config = GroundingDinoConfig(
        backbone_config=SwinConfig(image_size=224, patch_size=4, embed_dim=16,
                                   depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=7,
                                   out_indices=[2, 3, 4]),
        text_config=BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64,
                               max_position_embeddings=64),
        # Two decoder layers: transformers ties the shared box head of layer 0 to later layers.
        d_model=32, num_queries=30, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2,
        max_text_len=64)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GroundingDinoForObjectDetection(config).eval()
    model.save_pretrained(path)
    return path
