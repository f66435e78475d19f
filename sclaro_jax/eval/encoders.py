"""Frozen dual encoders for retrieval evaluation, behind one small interface.

An `Encoder` turns one RGB uint8 image into the model's input view (`view`: uint8 [S, S, 3],
resized the way the model's own image processor does it), a batch of views into L2-normalised
float32 embeddings (`encode_views`, jitted, normalisation inside), and captions into
L2-normalised float32 embeddings (`encode_texts`). Batches are padded to a fixed size so each
tower compiles once.

The encoding stack is written once here and shared by both evaluation families, MINER / ROCS
retrieval (`sclaro_jax.eval.retrieval`) and the ScenarioCLIP protocols
(`sclaro_jax.eval.protocols.embedding`): `towers(module, ...)` gives the jitted image and text
functions of any module with `encode_image` / `encode_text` (pixels normalised by
`ops.normalize`, output L2-normalised by `ops.l2_normalize`, with its norm before normalising),
and `Batcher` feeds them fixed-size batches.

`load_encoder(spec)` builds one from:
- a Hugging Face `CLIPModel` folder (model_type "clip"; one whose projections are zeros is
  refused: `clip.from_hf`'s `CheckpointError`),
- a level exported by `sclaro_jax.train.export` (model_type "scenarioclip"), read with its
  Linear+LayerNorm heads (`ExportEncoder`),
- a `SiglipModel` / `Siglip2Model` folder (model_type "siglip" / "siglip2"),
- a ScenarioCLIP training workdir (`config.json` + `checkpoints/`) with `level` = global /
  object / relation (student weights, or the EMA teacher with `teacher=True`),
- a name registered with `register_encoder` (`planted-colours`: the transparent synthetic
  encoder of `sclaro_jax.eval.retrieval.synthetic`, which registers itself; `ENCODER_MODULES`
  says which module to import for a built-in name, so this module imports none of them and
  neither family reaches the other through it).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from sclaro_jax import bounds, ops
from sclaro_jax.data import augment


class EncoderError(ValueError):
    """An encoder that cannot be built from what was given; the message says what to pass."""


def l2_with_norm(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(`ops.l2_normalize(x)`, the L2 norm of x along the last axis), both float32."""
    x = jnp.asarray(x).astype(jnp.float32)
    return ops.l2_normalize(x), jnp.linalg.norm(x, axis=-1)


# Pixel statistics as hashable (mean, std, max_value) triples: a static argument of the jit.
CLIP_PIXELS = (tuple(ops.CLIP_MEAN.tolist()), tuple(ops.CLIP_STD.tolist()), 255.0)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _image_embed(graphdef, state, views, pixels):
    mean, std, max_value = pixels
    module = nnx.merge(graphdef, state)
    return l2_with_norm(module.encode_image(ops.normalize(
        views, np.asarray(mean, np.float32), np.asarray(std, np.float32), max_value)))


@functools.partial(jax.jit, static_argnums=0)
def _text_embed(graphdef, state, ids):
    return l2_with_norm(nnx.merge(graphdef, state).encode_text(ids))


def towers(module: nnx.Module, pixels=CLIP_PIXELS) -> tuple[Callable, Callable]:
    """(image_fn, text_fn) of a module with `encode_image` / `encode_text` (a CLIP or SigLIP
    model, a ScenarioCLIP pair): views uint8 [B, S, S, 3] / token ids [B, L] -> (L2-normalised
    float32 [B, D], norms [B]). `pixels` = (mean, std, max_value) of `ops.normalize`. Jitted
    once per module structure and shape (the weights are an argument, not constants)."""
    graphdef, state = nnx.split(module)
    return (lambda v: _image_embed(graphdef, state, v, pixels),
            lambda ids: _text_embed(graphdef, state, ids))


class Batcher:
    """Feeds arrays to a jitted function in fixed-size batches (the last one zero-padded), so it
    compiles once per shape. `fn` returns an array or a tuple of arrays with one row per input
    row (an embedding function: (L2-normalised [B, D], norms [B])); `result(dim)` gives the
    rows of every input pushed, float32, in that structure (nothing pushed: an embedding
    function's empty pair, [0, dim] and [0])."""

    def __init__(self, fn: Callable, batch_size: int):
        self.fn, self.batch_size = fn, batch_size
        self.pending: list[np.ndarray] = []
        self.count = 0
        self.out: list[tuple] = []

    def push(self, x: np.ndarray) -> None:
        if len(x):
            self.pending.append(x)
            self.count += len(x)
        while self.count >= self.batch_size:
            self._run(self.batch_size)

    def _run(self, n: int) -> None:
        x = np.concatenate(self.pending)
        batch, rest = x[:n], x[n:]
        if n < self.batch_size:
            batch = np.concatenate([batch, np.zeros((self.batch_size - n,) + batch.shape[1:],
                                                   batch.dtype)])
        self.out.append((self.fn(batch), n))  # device arrays: the host keeps preparing inputs
        self.pending = [rest] if len(rest) else []
        self.count = len(rest)

    def result(self, dim: int = 0):
        if self.count:
            self._run(self.count)
        if not self.out:
            return np.zeros((0, dim), np.float32), np.zeros((0,), np.float32)
        parts = [jax.tree.map(lambda a, n=n: np.asarray(a)[:n], out) for out, n in self.out]
        return jax.tree.map(lambda *xs: np.concatenate(xs).astype(np.float32), *parts)


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
    functions `_image_fn(views uint8 [B,S,S,3])` and `_text_fn(ids [B,L])`, each returning
    (L2-normalised [B,D], norms [B]) as `towers` does."""

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
        batcher = Batcher(fn, self.batch_size)
        batcher.push(x)
        return batcher.result()[0]


class ClipEncoder(Encoder):
    """A Hugging Face CLIP folder through `sclaro_jax.models.clip` (torch-free).

    Views: torchvision/CLIPImageProcessor's bicubic resize of the short side + centre crop;
    text: the OpenAI CLIP BPE (`ClipTokenizer`), 77 tokens.
    """

    PREFIX, KIND = "clip", "clip"  # the name's prefix, the fingerprint's kind

    def __init__(self, path: str | os.PathLike, *, batch_size: int = 64, dtype=jnp.float32):
        folder = Path(path)
        module = self._load(folder, dtype)
        self.name = f"{self.PREFIX}:{folder.name}"
        self.fingerprint = _folder_fingerprint(folder, f"{self.KIND}:{jnp.dtype(dtype).name}")
        self._setup(module, module.config, batch_size)

    @staticmethod
    def _load(folder: Path, dtype):
        from sclaro_jax.models import clip

        return clip.from_hf(folder, dtype=dtype)

    def _setup(self, module, config, batch_size: int) -> None:
        """Sizes, the CLIP tokenizer and the jitted towers of `module` (anything with
        `encode_image` / `encode_text`: a CLIP model or a ScenarioCLIP pair)."""
        from sclaro_jax.data.tokenizer import ClipTokenizer

        self.image_size = config.vision.image_size
        self.text_length = config.text.max_position_embeddings
        self.batch_size = batch_size
        self._tok = ClipTokenizer()
        self._image_fn, self._text_fn = towers(module)

    def view(self, image: np.ndarray) -> np.ndarray:
        return np.asarray(augment.resize_centre_crop(Image.fromarray(image), self.image_size))

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        return self._tok(texts, length=self.text_length)


class ScenarioClipEncoder(ClipEncoder):
    """One level (global / object / relation) of a trained ScenarioCLIP / PyramidCLIP workdir:
    that level's towers and Linear+LayerNorm heads, L2-normalised."""

    def __init__(self, workdir: str | os.PathLike, level: str, *, teacher: bool = False,
                 step: int | None = None, batch_size: int = 64):
        from sclaro_jax.checkpoint import load_checkpoint
        from sclaro_jax.models.scenarioclip import LEVELS

        if level not in LEVELS:
            raise EncoderError(f"level must be one of {LEVELS}, got {level!r}")
        model, step = load_checkpoint(os.fspath(workdir), step, teacher=teacher)
        pair = model.pair(level)
        who = "teacher" if teacher else "student"
        self.name = f"scenarioclip:{Path(workdir).name}:{level}:{who}@{step}"
        self.fingerprint = hashlib.sha256(
            f"{Path(workdir).resolve()}:{level}:{who}:{step}".encode()).hexdigest()[:16]
        self._setup(pair, pair.config, batch_size)


class ExportEncoder(ClipEncoder):
    """One level exported by `python -m sclaro_jax.train.export`: the folder's CLIP towers with
    its Linear+LayerNorm heads (`scenarioclip.from_export`), L2-normalised."""

    PREFIX, KIND = "scenarioclip-export", "export"

    @staticmethod
    def _load(folder: Path, dtype):
        from sclaro_jax.models import scenarioclip

        return scenarioclip.from_export(folder, dtype=dtype)


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
        mean = tuple(map(float, cfg.image_mean)) if cfg.do_normalize else (0.0,) * 3
        std = tuple(map(float, cfg.image_std)) if cfg.do_normalize else (1.0,) * 3
        self._image_fn, self._text_fn = towers(model, (mean, std, 1.0 / scale))

    def view(self, image: np.ndarray) -> np.ndarray:
        """`siglip.preprocess`'s resize, kept as uint8 (rescale and normalise run in jit)."""
        cfg = self._cfg
        if cfg.do_resize and image.shape[:2] != tuple(cfg.size):
            image = np.asarray(Image.fromarray(image).resize(cfg.size[::-1],
                                                              resample=cfg.resample))
        return image

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        return self._tok(texts)


# Encoders by name: `register_encoder(name)` on a factory with no arguments. A built-in name is
# imported by module name when asked for (as `registry.BUILTIN`), so this module imports none of
# them and they can all import it.
ENCODERS: dict[str, Callable[[], Encoder]] = {}
ENCODER_MODULES = {"planted-colours": "sclaro_jax.eval.retrieval.synthetic"}


def _source(obj) -> str | None:
    import inspect
    try:
        return inspect.getsourcefile(obj)
    except TypeError:
        return None


def register_encoder(name: str) -> Callable:
    """Decorator: make a no-argument `Encoder` factory (e.g. the class) loadable by `name`.
    The same factory again (its module run as `python -m` after an import by name) replaces
    the first; another factory under a taken name is a ValueError."""
    def wrap(factory):
        old = ENCODERS.get(name)
        if old is not None and (getattr(old, "__qualname__", None), _source(old)) != (
                getattr(factory, "__qualname__", None), _source(factory)):
            raise ValueError(f"an encoder named {name!r} is registered already")
        ENCODERS[name] = factory
        return factory
    return wrap


def model_type(folder: Path) -> str:
    config = folder / "config.json"
    try:
        return bounds.read_json(config).get("model_type", "")
    except (OSError, json.JSONDecodeError) as e:
        raise EncoderError(f"cannot read {config}: {e}") from None


def load_encoder(spec: str, *, level: str | None = None, teacher: bool = False,
                 batch_size: int | None = None, dtype=jnp.float32,
                 step: int | None = None) -> Encoder:
    """An `Encoder` from a registered name (`planted-colours`), a model folder, or a
    ScenarioCLIP workdir (+ `level`; its checkpoint `step`, default the newest: a damaged one
    is refused with `checkpoint.DamagedRunError`)."""
    if spec in ENCODER_MODULES and spec not in ENCODERS:
        importlib.import_module(ENCODER_MODULES[spec])
    if spec in ENCODERS:
        return ENCODERS[spec]()
    folder = Path(spec)
    if not folder.is_dir():
        raise EncoderError(
            f"model not found: {spec}. Pass a Hugging Face CLIPModel / SiglipModel / "
            "Siglip2Model folder (config.json + model.safetensors; no hub download is made), "
            f"a ScenarioCLIP training workdir with --level, or one of {sorted(ENCODER_MODULES)}")
    kw = {} if batch_size is None else {"batch_size": batch_size}
    from sclaro_jax.checkpoint import is_run

    if is_run(folder):  # a run without checkpoints/ is named as one (check_run)
        if level is None:
            raise EncoderError(f"{folder} is a ScenarioCLIP workdir: choose a level "
                               "(--level global|object|relation)")
        return ScenarioClipEncoder(folder, level, teacher=teacher, step=step, **kw)
    if step is not None:
        raise EncoderError(f"--step is for a ScenarioCLIP workdir; {folder} is not one")
    if not (folder / "config.json").is_file():
        raise EncoderError(f"{folder} has no config.json: not a Hugging Face model folder")
    kind = model_type(folder)
    if kind == "clip":
        return ClipEncoder(folder, dtype=dtype, **kw)  # refuses zero projections
    if kind == "scenarioclip":  # clip.EXPORT_MODEL_TYPE
        return ExportEncoder(folder, dtype=dtype, **kw)
    if kind in ("siglip", "siglip2"):
        return SiglipEncoder(folder, dtype=dtype, **kw)
    raise EncoderError(f"{folder}/config.json has model_type {kind!r}; supported: clip, "
                       "scenarioclip (an export of sclaro_jax.train.export), siglip, siglip2")
