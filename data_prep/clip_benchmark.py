"""Evaluate an exported ScenarioCLIP level with LAION's CLIP_benchmark (the `clip-benchmark`
package), as any CLIP model is evaluated there.

    python -m sclaro_jax.train.export --workdir RUN --level global --out EXPORT
    python -m sclaro_jax.export.wds --data DATASET --split test --out WDS/sclaro_actions
    python -m data_prep.clip_benchmark eval --model_type sclaro --model sclaro \
        --pretrained EXPORT --dataset wds/sclaro_actions --dataset_root WDS/sclaro_actions \
        --task zeroshot_classification --no_amp --output actions.json

This is clip_benchmark's own command line (`clip_benchmark.cli.main`, every flag of
`clip_benchmark eval --help`) with one more `--model_type`, `sclaro`, registered in its
`TYPE2FUNC` / `MODEL_TYPES`: `--pretrained` (or `--model`) is the export folder, and
`load_sclaro` returns
- a torch module whose `encode_image` / `encode_text` give our embeddings (the level's head
  outputs): `ScenarioCLIPModel.get_image_features` / `get_text_features`, the class of this
  checkout's own `sclaro_jax/models/remote/modeling_scenarioclip.py` (loaded by its path) with
  the export's config.json and model.safetensors. The export carries a copy of that file for
  transformers' `trust_remote_code` (`sclaro_jax.export.hf`); this loader never runs the
  export's copy, so an export folder from anyone is data. `--trust-remote-code` (this
  command's flag, taken out before clip_benchmark parses the rest) loads the export with
  `AutoModel.from_pretrained(EXPORT, trust_remote_code=True)` instead, which runs the Python
  files of the export folder with your permissions: pass it only for exports you trust
  (it prints a line saying so for each export it loads);
- our evaluation view as the transform: `sclaro_jax.data.augment.resize_centre_crop` (bicubic
  short-side resize + centre crop, at the export's crop size; from the photograph's box when the
  image is a tagged downscale, `sclaro_jax.export.photo_size.photo_size_of`) and CLIP's
  normalisation (the export's preprocessor_config.json mean / std, `sclaro_jax.ops.normalize`'s
  arithmetic);
- our tokenizer (`sclaro_jax.data.tokenizer.ClipTokenizer`) at the export's context length.

It runs from a checkout in a PyTorch venv without this project's dependencies (docs/exports.md:
`pip install -c constraints.txt torch transformers open_clip_torch clip-benchmark requests`;
clip-benchmark imports `requests` without declaring it), as `python -m data_prep.clip_benchmark`
in the checkout's root: of `sclaro_jax` it imports only `data.augment`, `export.photo_size`
and `data.tokenizer` (numpy, PIL, and transformers' `tokenizers`). The export and the
webdataset are written in the project's venv. tests/test_clip_benchmark.py runs this command
line with every other installed distribution hidden.

Pass `--no_amp` for our numbers: clip_benchmark's default mixed precision runs the towers and
the scores in bfloat16 on a CPU (float16 on a GPU). Without `--output`, the result file is named
after the export folder's name (clip_benchmark's default template would put its whole path in
the file name). A local `wds/` dataset gets at most one loader worker per shard (webdataset
fails a worker without one). clip_benchmark 1.6.2's top-k accuracy fails under NumPy >= 2.3;
`register` replaces it with the same computation when it does.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Sequence

import numpy as np
import torch
from PIL import Image

EXPORT_MODEL_TYPE = "scenarioclip"  # sclaro_jax.models.clip.EXPORT_MODEL_TYPE
REMOTE_CODE = "modeling_scenarioclip.py"  # the model code an export carries
WEIGHTS_FILE = "model.safetensors"
TRUST_FLAG = "--trust-remote-code"
PREPROCESSOR_FILE = "preprocessor_config.json"
MODEL_TYPE = "sclaro"
DEFAULT_OUTPUT = "{dataset}_{pretrained}_{model}_{language}_{task}.json"  # clip_benchmark's


class ExportError(ValueError):
    """A folder that is not a ScenarioCLIP export; the message names the file and the fix."""


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ExportError(f"{path} not found: {os.path.dirname(path)} is not a ScenarioCLIP "
                          "export; write one with `python -m sclaro_jax.train.export --workdir "
                          "RUN --level LEVEL --out DIR`") from None
    except json.JSONDecodeError as e:
        raise ExportError(f"{path} is not valid JSON ({e}); export the level again") from None


def _features(out) -> torch.Tensor:
    """A `get_*_features` result: a tensor, or transformers 5's output with `pooler_output`."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("pooler_output", "image_embeds", "text_embeds"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot read features from a {type(out).__name__}")


def own_model_class():
    """`ScenarioCLIPModel` of this checkout's `sclaro_jax/models/remote/modeling_scenarioclip.py`
    (the file every export carries a copy of), executed from its place in the installed
    package: no file of an export folder runs. Loaded by path, so that `sclaro_jax`'s package
    (JAX) is not imported; once per process."""
    global _OWN_MODEL_CLASS
    if _OWN_MODEL_CLASS is None:
        import importlib.util

        package = importlib.util.find_spec("sclaro_jax")  # finds, does not import
        path = os.path.join(package.submodule_search_locations[0], "models", "remote",
                            REMOTE_CODE)
        spec = importlib.util.spec_from_file_location("_sclaro_own_modeling_scenarioclip",
                                                      path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _OWN_MODEL_CLASS = module.ScenarioCLIPModel
    return _OWN_MODEL_CLASS


_OWN_MODEL_CLASS = None


class SclaroClip(torch.nn.Module):
    """One exported ScenarioCLIP level with clip_benchmark's interface: `encode_image(pixels
    [N, 3, S, S])` and `encode_text(ids [N, L])` -> the level's embeddings (head outputs, not
    normalised; clip_benchmark normalises). The export's weights are read from its
    model.safetensors into `own_model_class()`; with `trust_remote_code`, transformers builds
    the model from the export's own Python instead (module docstring)."""

    def __init__(self, folder: str, trust_remote_code: bool = False):
        super().__init__()
        import transformers

        path = os.path.join(folder, "config.json")
        config = _read_json(path)
        if config.get("model_type") != EXPORT_MODEL_TYPE or not config.get("auto_map"):
            raise ExportError(
                f"{path}: model_type {config.get('model_type')!r}"
                f"{'' if config.get('auto_map') else ' without an auto_map'}, not a ScenarioCLIP "
                f"export ({EXPORT_MODEL_TYPE!r} with its model code); write one with `python -m "
                "sclaro_jax.train.export --workdir RUN --level LEVEL --out DIR` (exports made "
                "before the heads moved into model.safetensors need writing again)")
        code = os.path.join(folder, REMOTE_CODE)
        if not os.path.isfile(code):
            raise ExportError(f"{code} not found: the export's model code is missing; export "
                              "the level again with `python -m sclaro_jax.train.export`")
        weights = os.path.join(folder, WEIGHTS_FILE)
        if not os.path.isfile(weights):
            raise ExportError(f"{weights} not found: the export's weights are missing; export "
                              "the level again with `python -m sclaro_jax.train.export`")
        self.folder = folder
        if trust_remote_code:
            print(f"--trust-remote-code: running {code} and any Python it imports from "
                  f"{folder}, the export's own code, with your permissions", file=sys.stderr)
            self.model = transformers.AutoModel.from_pretrained(
                folder, trust_remote_code=trust_remote_code, local_files_only=True)
        else:
            self.model = own_model_class().from_pretrained(folder, use_safetensors=True,
                                                           local_files_only=True)

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return _features(self.model.get_image_features(pixel_values=pixel_values))

    def encode_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _features(self.model.get_text_features(input_ids=input_ids))


class EvalView:
    """PIL image -> float32 [3, S, S]: our evaluation view (`augment.resize_centre_crop`, from
    the photograph's box when the image carries `photo_size.photo_size_of`'s tag) normalised as
    `ops.normalize` does, with the export's mean and std."""

    def __init__(self, size: int, mean: Sequence[float], std: Sequence[float]):
        self.size = int(size)
        self.mean = np.asarray(mean, np.float32)
        self.std = np.asarray(std, np.float32)

    def pixels(self, img: Image.Image) -> np.ndarray:
        """The uint8 [S, S, 3] view, before normalising."""
        from sclaro_jax.data import augment
        from sclaro_jax.export.photo_size import photo_size_of

        photo = photo_size_of(img)
        return np.asarray(augment.resize_centre_crop(img.convert("RGB"), self.size, photo))

    def __call__(self, img: Image.Image) -> torch.Tensor:
        x = self.pixels(img).astype(np.float32) / np.float32(255.0)
        x = (x - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))

    def __repr__(self) -> str:
        return f"EvalView(size={self.size}, bicubic resize_centre_crop, CLIP normalisation)"


class Tokenizer:
    """texts -> int64 [N, context_length]: `ClipTokenizer`'s ids (padded with <|endoftext|>,
    truncated keeping the end token), as our evaluators tokenize."""

    def __init__(self, context_length: int):
        from sclaro_jax.data.tokenizer import ClipTokenizer

        self.context_length = int(context_length)
        self._tok = ClipTokenizer()

    def __call__(self, texts) -> torch.Tensor:
        texts = [texts] if isinstance(texts, str) else list(texts)
        return torch.from_numpy(np.asarray(self._tok(texts, length=self.context_length),
                                           np.int64))


def export_folder(model_name: str, pretrained: str) -> str:
    """The export folder clip_benchmark's --pretrained (else --model) names."""
    for candidate in (pretrained, model_name):
        if candidate and os.path.isdir(candidate):
            return candidate
    raise ExportError(f"--pretrained {pretrained!r} (and --model {model_name!r}) is not a "
                      "folder: with --model_type sclaro pass an export folder, written by "
                      "`python -m sclaro_jax.train.export --workdir RUN --level LEVEL --out DIR`")


def view_settings(folder: str) -> tuple[int, list, list]:
    """(crop size, mean, std) of the export's preprocessor_config.json (our view's settings,
    `sclaro_jax.export.hf.image_processor_config`); refuses other resampling."""
    path = os.path.join(folder, PREPROCESSOR_FILE)
    config = _read_json(path)
    size = config.get("crop_size", {}).get("height")
    shortest = config.get("size", {}).get("shortest_edge")
    if (not size or shortest != size or config.get("resample") != 3
            or not config.get("do_center_crop", False)):
        raise ExportError(f"{path}: not our evaluation view (bicubic resize of the short side "
                          "to the crop size, then a centre crop); export the level again with "
                          "`python -m sclaro_jax.train.export`")
    return int(size), config["image_mean"], config["image_std"]


def context_length(folder: str) -> int:
    """The text tower's context length: tokenizer_config.json's `model_max_length`, else
    config.json's text_config.max_position_embeddings."""
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(path):
        length = _read_json(path).get("model_max_length")
        if isinstance(length, int) and 0 < length < 1 << 20:
            return length
    text = _read_json(os.path.join(folder, "config.json")).get("text_config", {})
    return int(text.get("max_position_embeddings", 77))


def load_sclaro(model_name: str = MODEL_TYPE, pretrained: str = "", cache_dir: str | None = None,
                device="cpu", trust_remote_code: bool = False):
    """clip_benchmark's loader for `--model_type sclaro`: (model, transform, tokenizer) of the
    export folder named by --pretrained (or --model); `trust_remote_code`: `SclaroClip`'s."""
    folder = export_folder(model_name, pretrained)
    size, mean, std = view_settings(folder)
    model = SclaroClip(folder, trust_remote_code).to(device).eval()
    return model, EvalView(size, mean, std), Tokenizer(context_length(folder))


def _accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[float]:
    """clip_benchmark's `zeroshot_classification.accuracy` (the share of rows whose target is
    among the top-k logits), returning Python floats with NumPy 2 too."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [float(correct[:k].reshape(-1).float().sum().item()) / len(target) for k in topk]


def _fix_accuracy() -> None:
    """clip_benchmark 1.6.2's `accuracy` converts a one-element array with `float()`, which
    NumPy >= 2.3 refuses (TypeError after every image was encoded): use `_accuracy` when its
    own fails on a two-row example."""
    from clip_benchmark.metrics import zeroshot_classification as zc

    try:
        zc.accuracy(torch.eye(2), torch.arange(2), topk=(1,))
    except TypeError:
        zc.accuracy = _accuracy


def _cap_workers(args) -> None:
    """At most one data-loader worker per shard of a local `wds/` dataset: webdataset fails a
    worker that gets no shard ("No samples found ... fewer shards than workers")."""
    if not args.dataset.startswith("wds/") or args.num_workers <= 1:
        return
    name = args.dataset[len("wds/"):]
    root = args.dataset_root.format(dataset=name, dataset_cleaned=name.replace("/", "-"))
    path = os.path.join(root, args.split, "nshards.txt")
    try:
        with open(path, encoding="utf-8") as f:
            shards = int(f.read().strip())
    except (OSError, ValueError):
        return  # clip_benchmark reports a missing or bad nshards.txt itself
    if 0 < shards < args.num_workers:
        if args.verbose:
            print(f"{path}: {shards} shard(s): --num_workers {args.num_workers} -> {shards}")
        args.num_workers = shards


def register(trust_remote_code: bool = False) -> None:
    """Add `sclaro` to clip_benchmark's model types, in place (its parser reads MODEL_TYPES as
    it is built, `load_clip` looks TYPE2FUNC up), loading exports with `trust_remote_code` as
    given (`SclaroClip`), and name default result files after the export folder's name rather
    than its path."""
    from clip_benchmark import cli as cb_cli
    from clip_benchmark import models

    models.TYPE2FUNC[MODEL_TYPE] = functools.partial(load_sclaro,
                                                     trust_remote_code=trust_remote_code)
    if MODEL_TYPE not in models.MODEL_TYPES:
        models.MODEL_TYPES.append(MODEL_TYPE)
    _fix_accuracy()
    run = cb_cli.run
    if getattr(run, "_sclaro", False):
        return

    def run_with_names(args):
        _cap_workers(args)
        if args.model_type == MODEL_TYPE and args.output == DEFAULT_OUTPUT:
            names = {k: os.path.basename(os.path.normpath(getattr(args, k)))
                     for k in ("pretrained", "model")}
            args.output = DEFAULT_OUTPUT.replace("{pretrained}", names["pretrained"]).replace(
                "{model}", names["model"])
        return run(args)

    run_with_names._sclaro = True
    cb_cli.run = run_with_names


def main(argv: Sequence[str] | None = None) -> int:
    """clip_benchmark's command line with the `sclaro` model type and this command's own
    `--trust-remote-code` (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    trust = TRUST_FLAG in argv
    argv = [a for a in argv if a != TRUST_FLAG]
    if not argv or argv[0] in ("-h", "--help") or "-h" in argv or "--help" in argv:
        print(__doc__)
    register(trust)
    from clip_benchmark import cli as cb_cli

    old = sys.argv
    sys.argv = ["python -m data_prep.clip_benchmark", *argv]
    try:
        cb_cli.main()
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = old
    return 0


if __name__ == "__main__":
    from sclaro_jax.heap import freeze_for_process
    freeze_for_process()  # a command's process: its imports are not scanned again
    sys.exit(main())
