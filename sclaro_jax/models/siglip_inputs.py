"""SigLIP / SigLIP 2 inputs without transformers: image preprocessing and tokenizers.

`image_config` + `preprocess`: PIL resize to S x S, rescale, normalise, as `SiglipImageProcessor`.
`load_tokenizer`: `tokenizer.json` through `tokenizers`, or SigLIP 1's `spiece.model` through
`sentencepiece`; padded to max_length=64 and truncated, as the SigLIP processors are called.
`siglip` re-exports these names (`siglip.preprocess`, `siglip.load_tokenizer`, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import string
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from sclaro_jax import bounds
from sclaro_jax.models.hf_weights import CheckpointError

# --------------------------------------------------------------------------------------------
# Preprocessing
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """What `SiglipImageProcessor` does: resize to `size` (H, W) with PIL `resample`, rescale,
    normalise. No crop."""

    size: tuple[int, int] = (224, 224)
    resample: int = 3  # PIL.Image.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)


def image_config(path: str | os.PathLike, size: int | None = None) -> ImageConfig:
    """`ImageConfig` from a folder's preprocessor_config.json.

    SigLIP: `size` {"height", "width"} from the file. SigLIP 2 NaFlex (`max_num_patches`,
    `patch_size`, no fixed size): square images of `size` pixels, by default the largest square
    grid within `max_num_patches` (256 patches of 16 -> 256 px), which is what
    `Siglip2ImageProcessor` gives a square image. `size` overrides either."""
    file = Path(path) / "preprocessor_config.json"
    if not file.is_file():
        raise CheckpointError(f"{Path(path)} has no preprocessor_config.json")
    raw = bounds.read_json(file)
    if size is not None:
        hw = (int(size), int(size))
    elif "max_num_patches" in raw:
        patch = int(raw.get("patch_size", 16))
        grid = int(np.floor(np.sqrt(raw["max_num_patches"])))
        hw = (grid * patch, grid * patch)
    else:
        s = raw.get("size") or {}
        if "height" in s and "width" in s:
            hw = (int(s["height"]), int(s["width"]))
        elif "shortest_edge" in s:
            hw = (int(s["shortest_edge"]),) * 2
        else:
            raise CheckpointError(f"{file}: no usable 'size' ({s!r})")
    defaults = ImageConfig()
    return ImageConfig(
        size=hw,
        resample=int(raw.get("resample", defaults.resample)),
        do_resize=bool(raw.get("do_resize", True)),
        do_rescale=bool(raw.get("do_rescale", True)),
        rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
        do_normalize=bool(raw.get("do_normalize", True)),
        image_mean=tuple(float(x) for x in raw.get("image_mean", defaults.image_mean)),
        image_std=tuple(float(x) for x in raw.get("image_std", defaults.image_std)),
    )


def preprocess(images: Sequence[np.ndarray], cfg: ImageConfig) -> np.ndarray:
    """uint8 `[H, W, 3]` images -> float32 `[B, S, S, 3]` model input (NHWC)."""
    from PIL import Image

    out = []
    for img in images:
        img = np.asarray(img)
        if img.ndim == 2:
            img = np.repeat(img[..., None], 3, axis=-1)
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] not in (3, 4):
            raise ValueError(f"expected uint8 [H, W, 3] images, got {img.dtype} {img.shape}")
        img = img[..., :3]
        if cfg.do_resize and img.shape[:2] != cfg.size:
            img = np.asarray(Image.fromarray(img).resize(cfg.size[::-1], resample=cfg.resample))
        x = img.astype(np.float32)
        if cfg.do_rescale:
            x = x * np.float32(cfg.rescale_factor)
        if cfg.do_normalize:
            x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std,
                                                                          np.float32)
        out.append(x)
    return np.stack(out).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _canonicalize(text: str, lower: bool) -> str:
    """`SiglipTokenizer.canonicalize_text`: lowercase, drop ASCII punctuation, squeeze spaces.
    The SentencePiece SigLIP tokenizer does this in Python, outside any tokenizer.json."""
    if lower:
        text = text.lower()
    text = text.translate(str.maketrans("", "", string.punctuation))
    return re.sub(r"\s+", " ", text).strip()


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _text_max_length(folder: Path, max_length: int | None) -> int:
    """`max_length`, or 64 capped by the text tower's `max_position_embeddings`."""
    if max_length is None and (folder / "config.json").is_file():
        raw = bounds.read_json(folder / "config.json")
        positions = (raw.get("text_config") or {}).get("max_position_embeddings")
        if positions:
            max_length = min(64, int(positions))
    return max_length or 64


def _sentencepiece_tokenizer(folder: Path, max_length: int | None
                             ) -> Callable[[Sequence[str]], np.ndarray]:
    """transformers' `SiglipTokenizer` ids from `spiece.model`, with the `sentencepiece` package,
    step for step as transformers runs it (legacy mode, its default): `"\u2581" + text`; split
    around the special tokens (eos / unk / pad strings, whitespace beside them dropped); each
    other piece canonicalised (lowercase unless `do_lower_case` is false, ASCII punctuation
    removed, whitespace squeezed) and encoded as `unk + piece` with the unk's own pieces cut
    off; a lone leading "\u2581" before a special token dropped; then cut to `max_length - 1`,
    `</s>` appended, padded with the pad id to `max_length`."""
    try:
        import sentencepiece
    except ImportError:
        raise CheckpointError(
            f"{folder} has a SentencePiece tokenizer (spiece.model) and no tokenizer.json; "
            "reading it needs the sentencepiece package: pip install -e \".[eval]\" from the "
            "sclaro-jax checkout") from None
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
    tcfg_file = folder / "tokenizer_config.json"
    tcfg = bounds.read_json(tcfg_file) if tcfg_file.is_file() else {}
    names = {key: _token_str(tcfg.get(key)) or default for key, default in
             (("eos_token", "</s>"), ("unk_token", "<unk>"), ("pad_token", "</s>"))}
    special = {}
    for key, token in names.items():
        i = sp.piece_to_id(token)
        if sp.id_to_piece(i) != token:
            raise CheckpointError(f"{folder}/spiece.model has no {key} {token!r}")
        special[token] = i
    unk, eos, pad = names["unk_token"], special[names["eos_token"]], special[names["pad_token"]]
    unk_pieces = len(sp.encode(unk, out_type=str))
    lower = bool(tcfg.get("do_lower_case", True))
    split = re.compile(r"\s*(" + "|".join(re.escape(t) for t in sorted(special, key=len,
                                                                       reverse=True)) + r")\s*")
    length = _text_max_length(folder, max_length)

    def pieces(text: str) -> list[str]:
        out: list[str] = []
        for part in split.split("\u2581" + text.replace("\u2581", " ")):
            if part in special:
                out.append(part)
            elif part:
                encoded = sp.encode(unk + _canonicalize(part, lower), out_type=str)
                out.extend(encoded[unk_pieces:] if len(encoded) >= unk_pieces else encoded)
        if len(out) > 1 and out[0] == "\u2581" and out[1] in special:
            out = out[1:]
        return out

    def encode(text: str) -> list[int]:
        ids = [special.get(p, sp.piece_to_id(p)) for p in pieces(text)][:length - 1] + [eos]
        return ids + [pad] * (length - len(ids))

    def tokenize(texts: Sequence[str] | str) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        return np.asarray([encode(t) for t in texts], np.int32).reshape(len(texts), length)

    return tokenize


def load_tokenizer(path: str | os.PathLike, max_length: int | None = None
                   ) -> Callable[[Sequence[str]], np.ndarray]:
    """`texts -> int32 [N, max_length]`, the ids of the HF tokenizer called with
    `padding="max_length", max_length=64, truncation=True` (SigLIP's convention).

    A folder with `spiece.model` and no `tokenizer.json` (SigLIP 1) goes through
    `_sentencepiece_tokenizer`. Otherwise: reads `tokenizer.json` (fast-tokenizer file) with
    `tokenizers`; its normaliser, pre-tokeniser
    and post-processor (special tokens) apply as written. On top, from tokenizer_config.json:
    pad token, padding / truncation side, explicit `add_bos_token` / `add_eos_token` (which
    transformers turns into the post-processor), and the class-specific text handling
    transformers adds in Python: `Siglip2Tokenizer` (model_type siglip2) lowercases,
    `SiglipTokenizer` canonicalises (lowercase, strip punctuation). `max_length` defaults to 64,
    capped by the text tower's `max_position_embeddings`.
    """
    from tokenizers import Tokenizer, normalizers, processors

    folder = Path(path)
    file = folder / "tokenizer.json"
    if not file.is_file():
        if (folder / "spiece.model").is_file():  # SigLIP 1 folders: SentencePiece only
            return _sentencepiece_tokenizer(folder, max_length)
        raise CheckpointError(
            f"{folder} has neither tokenizer.json (a fast-tokenizer file, as SigLIP 2 folders "
            "ship) nor spiece.model (SigLIP 1's SentencePiece model): copy the model's tokenizer "
            "files into the folder")
    tok = Tokenizer.from_file(str(file))
    tcfg_file = folder / "tokenizer_config.json"
    tcfg = bounds.read_json(tcfg_file) if tcfg_file.is_file() else {}
    model_type = None
    if (folder / "config.json").is_file():
        model_type = bounds.read_json(folder / "config.json").get("model_type")
    max_length = _text_max_length(folder, max_length)

    cls = tcfg.get("tokenizer_class")
    canonical = cls == "SiglipTokenizer"
    if cls == "Siglip2Tokenizer" or (model_type == "siglip2" and cls in (None, "GemmaTokenizer",
                                                                         "GemmaTokenizerFast")):
        norm = tok.normalizer
        tok.normalizer = (normalizers.Lowercase() if norm is None
                          else normalizers.Sequence([normalizers.Lowercase(), norm]))

    def tid(name: str) -> tuple[str, int] | None:
        token = _token_str(tcfg.get(name))
        if token is None:
            return None
        i = tok.token_to_id(token)
        if i is None:
            raise CheckpointError(f"{tcfg_file}: {name} {token!r} is not in tokenizer.json")
        return token, i

    if "add_bos_token" in tcfg or "add_eos_token" in tcfg:  # as TokenizersBackend rebuilds it
        bos = tid("bos_token") if tcfg.get("add_bos_token") else None
        eos = tid("eos_token") if tcfg.get("add_eos_token") else None
        single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"]
                          + ([f"{eos[0]}:0"] if eos else []))
        pair = single + " " + " ".join(([f"{bos[0]}:1"] if bos else []) + ["$B:1"]
                                       + ([f"{eos[0]}:1"] if eos else []))
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t])

    pad = tid("pad_token") or tid("eos_token")
    if pad is None:
        raise CheckpointError(f"{folder}: no pad_token in tokenizer_config.json")
    tok.enable_truncation(max_length, direction=tcfg.get("truncation_side", "right"))
    tok.enable_padding(direction=tcfg.get("padding_side", "right"), pad_id=pad[1],
                       pad_token=pad[0], length=max_length)
    lower = bool(tcfg.get("do_lower_case", True))

    def tokenize(texts: Sequence[str] | str) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        texts = [_canonicalize(t, lower) if canonical else t for t in texts]
        return np.asarray([e.ids for e in tok.encode_batch(list(texts))], np.int32).reshape(
            len(texts), max_length)

    tokenize.max_length = max_length  # type: ignore[attr-defined]
    tokenize.pad_id = pad[1]  # type: ignore[attr-defined]
    return tokenize
