"""CLIP byte-level BPE tokenizer, offline, with ids identical to Hugging Face `CLIPTokenizer`.

The vocabulary ships inside the package (`assets/bpe_simple_vocab_16e6.txt.gz`, OpenAI CLIP's BPE
merges, MIT licence). From it we build the vocabulary as OpenAI's tokenizer does (256 byte
symbols, the same with `</w>`, the 48,894 merges, then the two special tokens: 49,408 ids) and
the same Rust `tokenizers` pipeline transformers' `CLIPTokenizer` builds: NFC, whitespace
collapse and lower-casing; CLIP's split regex; byte-level BPE with the `</w>` word suffix;
`<|startoftext|> ... <|endoftext|>` around each text. Truncation keeps the end token (the text
is cut to `length - 2` tokens first); padding uses `<|endoftext|>`.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
from pathlib import Path
from importlib import resources
from typing import Sequence

import numpy as np

from sclaro_jax.files import write_replacing

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
DEFAULT_LENGTH = 77
_MERGES_FILE = "bpe_simple_vocab_16e6.txt.gz"
_NUM_MERGES = 49152 - 256 - 2  # the merges OpenAI CLIP uses from the file
_SPLIT_PATTERN = (r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|"""
                  r"""[\p{N}]|[^\s\p{L}\p{N}]+""")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP's reversible map from bytes to printable unicode characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


def load_bpe(path: str | os.PathLike | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) as in Hugging Face's CLIP `vocab.json` / `merges.txt`.

    `path`: an OpenAI-format gzipped merges file; the packaged one by default.
    """
    if path is None:
        raw = resources.files("sclaro_jax.data").joinpath("assets", _MERGES_FILE).read_bytes()
    else:
        with open(path, "rb") as f:
            raw = f.read()
    lines = gzip.decompress(raw).decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1:_NUM_MERGES + 1]]
    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m) for m in merges]
    tokens += [BOS, EOS]
    return {t: i for i, t in enumerate(tokens)}, merges


@functools.lru_cache(maxsize=None)
def _backend(path: str | None):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab, merges = load_bpe(path)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="</w>", fuse_unk=False, unk_token=EOS))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # The special tokens are matched in raw text, as Hugging Face does; they are put around each
    # text in `ClipTokenizer.__call__`, after truncation.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS)])
    return tok


class ClipTokenizer:
    """`ClipTokenizer()(texts, length=77)` -> int32 `[N, length]`.

    Same ids as `transformers.CLIPTokenizer(texts, padding="max_length", max_length=length,
    truncation=True)` on the OpenAI CLIP vocabulary. Batches run in parallel in Rust.
    """

    def __init__(self, merges_path: str | os.PathLike | None = None):
        self._merges_path = None if merges_path is None else os.fspath(merges_path)
        self._tok = _backend(self._merges_path)
        self.bos_token_id = self._tok.token_to_id(BOS)
        self.eos_token_id = self._tok.token_to_id(EOS)
        self.pad_token_id = self.eos_token_id
        self.vocab_size = self._tok.get_vocab_size()

    def __call__(self, texts: str | Sequence[str], length: int = DEFAULT_LENGTH) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        if length < 2:
            raise ValueError(f"length must leave room for the start and end tokens, got {length}")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"text {i} is {type(t).__name__}, not str: {t!r}")
        out = np.full((len(texts), length), self.pad_token_id, dtype=np.int32)
        if not texts:
            return out
        # Truncation is done here rather than through the backend's global truncation state so
        # one cached backend serves callers with different lengths; cutting the content to
        # `length - 2` tokens before adding the specials is what Hugging Face does.
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        for row, enc in zip(out, encodings):
            ids = enc.ids[:length - 2]
            row[0] = self.bos_token_id
            row[1:len(ids) + 1] = ids
            row[len(ids) + 1] = self.eos_token_id
        return out

    def save_pretrained(self, path: str | os.PathLike, length: int = DEFAULT_LENGTH) -> Path:
        """Write Hugging Face's CLIP tokenizer files (`vocab.json`, `merges.txt`,
        `tokenizer_config.json`, `special_tokens_map.json`) to `path`, so
        `transformers.CLIPTokenizer.from_pretrained(path)(texts, padding="max_length",
        truncation=True)` gives `self(texts, length)`'s ids (`model_max_length` = `length`, the
        pad token `<|endoftext|>`)."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        vocab, merges = load_bpe(self._merges_path)
        specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": EOS}
        files = {
            "vocab.json": json.dumps(vocab, ensure_ascii=False),
            "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
            "tokenizer_config.json": json.dumps(
                {**specials, "model_max_length": length, "tokenizer_class": "CLIPTokenizer"},
                indent=2),
            "special_tokens_map.json": json.dumps(specials, indent=2),
        }
        for name, text in files.items():
            write_replacing(folder / name, lambda f, text=text: f.write(text), text=True)
        return folder

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a row of ids, without the special tokens."""
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
        return text.replace("</w>", " ").strip()
