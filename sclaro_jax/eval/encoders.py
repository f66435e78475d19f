"""Frozen dual encoders for retrieval evaluation, behind one small interface.

An `Encoder` turns one RGB uint8 image into the model's input view (`view`: uint8 [S, S, 3],
resized the way the model's own image processor does it), a batch of views into L2-normalised
float32 embeddings (`encode_views`, jitted, normalisation inside), and captions into
L2-normalised float32 embeddings (`encode_texts`). Batches are padded to a fixed size so each
tower compiles once.

`load_encoder(spec)` builds one from:
- a Hugging Face `CLIPModel` folder (model_type "clip"),
- a `SiglipModel` / `Siglip2Model` folder (model_type "siglip" / "siglip2"),
- a ScenarioCLIP training workdir (`config.json` + `checkpoints/`) with `level` = global /
  object / relation (student weights, or the EMA teacher with `teacher=True`),
- `planted-colours`: the transparent synthetic encoder of `sclaro_jax.eval.synthetic`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from sclaro_jax.data import augment


class EncoderError(ValueError):
    """An encoder that cannot be built from what was given; the message says what to pass."""


def _l2(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _folder_fingerprint(folder: Path, extra: str = "") -> str:
    """Config text + name, size and mtime of every weight file: enough to key a cache."""
    h = hashlib.sha256(extra.encode())
    for f in sorted(folder.iterdir()):
        if f.suffix in (".json", ".safetensors") and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class Encoder:
    """Base: subclasses set `name`, `fingerprint`, `image_size`, `view`, and the two jitted
    functions `_image_fn(views uint8 [B,S,S,3]) -> [B,D]` and `_text_fn(ids [B,L]) -> [B,D]`."""

    name: str = "encoder"
    fingerprint: str = ""
    image_size: int = 224
    batch_size: int = 64

    def view(self, image: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        raise NotImplementedError

    _image_fn: Callable
    _text_fn: Callable

    def encode_views(self, views: np.ndarray) -> np.ndarray:
        """uint8 [N, S, S, 3] -> float32 [N, D], L2-normalised; padded to `batch_size`."""
        return self._batched(self._image_fn, np.asarray(views))

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        """captions -> float32 [N, D], L2-normalised."""
        return self._batched(self._text_fn, self.tokenize(list(texts)))

    def _batched(self, fn, x: np.ndarray) -> np.ndarray:
        n, b = len(x), self.batch_size
        out = []
        for start in range(0, n, b):
            chunk = x[start:start + b]
            if len(chunk) < b:
                pad = np.zeros((b - len(chunk),) + chunk.shape[1:], chunk.dtype)
                chunk = np.concatenate([chunk, pad])
            out.append(np.asarray(fn(chunk))[:min(b, n - start)])
        if not out:
            return np.zeros((0, 0), np.float32)
        return np.concatenate(out).astype(np.float32)


def _jit_module_fn(module: nnx.Module, method: Callable) -> Callable:
    """jax.jit of `method(module, x)` with the module's state as an argument (no retracing)."""
    graphdef, state = nnx.split(module)

    @jax.jit
    def fn(state, x):
        return method(nnx.merge(graphdef, state), x)

    return lambda x: fn(state, x)


class ClipEncoder(Encoder):
    """A Hugging Face CLIP folder through `sclaro_jax.models.clip` (torch-free).

    Views: torchvision/CLIPImageProcessor's bicubic resize of the short side + centre crop;
    text: the OpenAI CLIP BPE (`ClipTokenizer`), 77 tokens.
    """

    def __init__(self, path: str | os.PathLike, *, batch_size: int = 64, dtype=jnp.float32):
        from sclaro_jax.models import clip

        folder = Path(path)
        model = clip.from_hf(folder, dtype=dtype)
        self.name = f"clip:{folder.name}"
        self.fingerprint = _folder_fingerprint(folder, f"clip:{jnp.dtype(dtype).name}")
        self._setup(model, model.config, batch_size)

    def _setup(self, module, config, batch_size: int) -> None:
        """Sizes, the CLIP tokenizer and the jitted towers of `module` (anything with
        `encode_image` / `encode_text`: a CLIP model or a ScenarioCLIP pair)."""
        from sclaro_jax.data.tokenizer import ClipTokenizer

        self.image_size = config.vision.image_size
        self.text_length = config.text.max_position_embeddings
        self.batch_size = batch_size
        self._tok = ClipTokenizer()
        mean, std = jnp.asarray(augment.CLIP_MEAN), jnp.asarray(augment.CLIP_STD)
        self._image_fn = _jit_module_fn(
            module, lambda m, v: _l2(m.encode_image((v.astype(jnp.float32) / 255 - mean) / std)))
        self._text_fn = _jit_module_fn(module, lambda m, ids: _l2(m.encode_text(ids)))

    def view(self, image: np.ndarray) -> np.ndarray:
        return np.asarray(augment.resize_centre_crop(Image.fromarray(image), self.image_size))

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        return self._tok(texts, length=self.text_length)


class ScenarioClipEncoder(ClipEncoder):
    """One level (global / object / relation) of a trained ScenarioCLIP / PyramidCLIP workdir:
    that level's towers and Linear+LayerNorm heads, L2-normalised."""

    def __init__(self, workdir: str | os.PathLike, level: str, *, teacher: bool = False,
                 step: int | None = None, batch_size: int = 64):
        from sclaro_jax.models.scenarioclip import LEVELS
        from sclaro_jax.train.export import load_checkpoint

        if level not in LEVELS:
            raise EncoderError(f"level must be one of {LEVELS}, got {level!r}")
        model, step = load_checkpoint(os.fspath(workdir), step, teacher=teacher)
        pair = model.pair(level)
        who = "teacher" if teacher else "student"
        self.name = f"scenarioclip:{Path(workdir).name}:{level}:{who}@{step}"
        self.fingerprint = hashlib.sha256(
            f"{Path(workdir).resolve()}:{level}:{who}:{step}".encode()).hexdigest()[:16]
        self._setup(pair, pair.config, batch_size)


class SiglipEncoder(Encoder):
    """A Hugging Face SigLIP / SigLIP 2 folder through `sclaro_jax.models.siglip` (torch-free):
    the folder's preprocessor_config.json (plain resize to S x S with its resample filter,
    rescale, mean/std: SiglipImageProcessor's steps; SigLIP 2 NaFlex folders get a fixed square
    grid, see `siglip.image_config`) and tokenizer.json (padded to max_length, as SigLIP was
    trained)."""

    def __init__(self, path: str | os.PathLike, *, batch_size: int = 32, dtype=jnp.float32):
        from sclaro_jax.models import siglip

        folder = Path(path)
        model = siglip.from_hf(folder, dtype=dtype)
        self._cfg = cfg = siglip.image_config(folder)
        self._tok = siglip.load_tokenizer(folder)
        self.name = f"siglip:{folder.name}"
        self.fingerprint = _folder_fingerprint(folder, f"siglip:{jnp.dtype(dtype).name}")
        self.image_size = int(cfg.size[0])
        self.batch_size = batch_size
        scale = float(cfg.rescale_factor) if cfg.do_rescale else 1.0
        mean = jnp.asarray(cfg.image_mean if cfg.do_normalize else (0.0,) * 3, jnp.float32)
        std = jnp.asarray(cfg.image_std if cfg.do_normalize else (1.0,) * 3, jnp.float32)
        self._image_fn = _jit_module_fn(
            model, lambda m, v: _l2(m.encode_image((v.astype(jnp.float32) * scale - mean) / std)))
        self._text_fn = _jit_module_fn(model, lambda m, ids: _l2(m.encode_text(ids)))

    def view(self, image: np.ndarray) -> np.ndarray:
        """`siglip.preprocess`'s resize, kept as uint8 (rescale and normalise run in jit)."""
        cfg = self._cfg
        if cfg.do_resize and image.shape[:2] != tuple(cfg.size):
            image = np.asarray(Image.fromarray(image).resize(cfg.size[::-1],
                                                              resample=cfg.resample))
        return image

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        return self._tok(texts)


def model_type(folder: Path) -> str:
    config = folder / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type", "")
    except (OSError, json.JSONDecodeError) as e:
        raise EncoderError(f"cannot read {config}: {e}") from None


def load_encoder(spec: str, *, level: str | None = None, teacher: bool = False,
                 batch_size: int | None = None, dtype=jnp.float32) -> Encoder:
    """An `Encoder` from a model folder, a ScenarioCLIP workdir (+ `level`), or
    `planted-colours`."""
    if spec == "planted-colours":
        from sclaro_jax.eval.synthetic import PlantedColourEncoder
        return PlantedColourEncoder()
    folder = Path(spec)
    if not folder.is_dir():
        raise EncoderError(
            f"model not found: {spec}. Pass a Hugging Face CLIPModel / SiglipModel / "
            "Siglip2Model folder (config.json + model.safetensors; no hub download is made), "
            "a ScenarioCLIP training workdir with --level, or 'planted-colours'")
    kw = {} if batch_size is None else {"batch_size": batch_size}
    if (folder / "checkpoints").is_dir():
        if level is None:
            raise EncoderError(f"{folder} is a ScenarioCLIP workdir: choose a level "
                               "(--level global|object|relation)")
        return ScenarioClipEncoder(folder, level, teacher=teacher, **kw)
    if not (folder / "config.json").is_file():
        raise EncoderError(f"{folder} has no config.json: not a Hugging Face model folder")
    kind = model_type(folder)
    if kind == "clip":
        return ClipEncoder(folder, dtype=dtype, **kw)
    if kind in ("siglip", "siglip2"):
        return SiglipEncoder(folder, dtype=dtype, **kw)
    raise EncoderError(f"{folder}/config.json has model_type {kind!r}; supported: clip, "
                       "siglip, siglip2")
