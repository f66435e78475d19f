"""ScenarioCLIP, the paper recipe (docs/design.md, section 2); `:demo` trains on the bundled demo.

    python launch/train.py --config configs/scenarioclip.py --workdir DIR \\
        --config.data.dir=/data/sclaro --config.model.init=/models/clip-vit-base-patch32
    python launch/train.py --config configs/scenarioclip.py:demo --workdir /tmp/sclaro_demo
    python launch/train.py --config configs/scenarioclip.py:psg --workdir DIR \\
        --config.data.dir=/data/sclaro-psg   # from `python -m data_prep import --source psg`

(`--config scenarioclip[:demo]` names the same recipe from any folder.)
"""

import dataclasses

import ml_collections

from sclaro_jax.config import Range, field_ranges
from sclaro_jax.recipes import TrainConfig

# `--config NAME:<variant>` or `configs/NAME.py:<variant>`: the variants get_config takes
# ("" = none).
VARIANTS = {"": "the paper recipe (ViT-B/32, 224 px, batch 128, 12 epochs)",
            "demo": "minutes on a CPU: tiny model, 32 px, the bundled demo data, 60 steps",
            "psg": "the full recipe on PSG, as written by `python -m data_prep import --source "
                   "psg` (--config.data.dir; no val split: evaluated on test)"}

# The range of every numeric and path key below (`config.Range`; config.train's from
# TrainConfig's fields), checked by the task before anything runs (`config.validate`; a key
# with none is refused by tests/test_config_ranges.py).
RANGES = {
    "seed": Range(ge=0),
    "model.init": Range(path=True),  # a folder or FILE[:quickgelu|:gelu]: checked when loaded
    "model.embed_dim": Range(ge=1),
    "data.dir": Range(path=True, exists=True, note="a dataset folder written by `python -m "
                      "data_prep`, e.g. the bundled demo: `python -m data_prep demo --out DIR`"),
    "data.batch_size": Range(ge=1),
    "data.image_size": Range(ge=1),
    "data.max_packed_sizes": Range(ge=1, le=3),
    "data.max_objects": Range(ge=1),
    "data.max_relations": Range(ge=1),
    "data.text_length": Range(ge=1),
    "data.workers": Range(ge=0, note="0: batches made in the training process"),
    "train.epochs": Range(ge=0),
    "train.steps": Range(ge=0, note="0: train.epochs give the run's length"),
    **field_ranges(TrainConfig, "train."),
    "perf.packed_multiple": Range(ge=1),
    "log_every": Range(ge=1),
    "checkpoint_every": Range(ge=1),
    "keep_checkpoints": Range(ge=1),
    "compilation_cache": Range(path=True),  # "workdir", a folder (made), or "" (off)
    "compile_threads": Range(ge=0, note="0: one per four cores"),
    "evals.*.every": Range(ge=0, note="0: not while training"),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.trainer = "scenarioclip"  # the task (sclaro_jax.run.task): sclaro_jax.train.task
    c.seed = 42
    c.model = ml_collections.ConfigDict()
    c.model.kind = "scenarioclip"  # scenarioclip | pyramidclip
    c.model.preset = "ViT-B/32"  # sclaro_jax.models.clip.PRESETS, used for random init
    # The pretrained CLIP the towers start from ("": random, from the preset): a Hugging Face
    # CLIPModel folder (openai/clip-vit-base-patch32), or an open_clip checkpoint: a hub folder
    # (open_clip_config.json + open_clip_model.safetensors / open_clip_pytorch_model.bin), or a
    # weights file (.safetensors / .bin / .pt) with its open_clip_config.json beside it or its
    # activation named by a suffix, FILE:quickgelu or FILE:gelu (sclaro_jax.models.
    # open_clip_weights). Only plain ViT CLIP models load; others are refused.
    c.model.init = ""
    c.model.dtype = "float32"  # compute dtype of the towers' matmuls; "bfloat16" on GPU
    c.model.embed_dim = 512
    c.model.gradient_forms = "auto"  # scenarioclip.build's gradient_forms

    c.data = ml_collections.ConfigDict()
    c.data.dir = ""  # a dataset folder written by `python -m data_prep`
    c.data.batch_size = 128
    c.data.image_size = 224
    # Crop layout: "packed" (every crop of the batch in one buffer per level, sized from the
    # dataset's counts: nothing dropped, little padding) or "caps" (max_objects /
    # max_relations slots per image; crops past them are dropped). sclaro_jax.data.packing
    c.data.layout = "packed"
    c.data.max_packed_sizes = 3  # packed: compiled step sizes (1-3; the largest holds all)
    c.data.max_objects = 10  # caps layout only
    c.data.max_relations = 8  # caps layout only
    c.data.text_length = 32
    c.data.object_view = "crop"  # crop (the paper) | canvas (the reference code)
    c.data.workers = 8

    # The recipe's defaults come from TrainConfig (sclaro_jax.train.core); `steps` > 0
    # overrides `epochs`. Unknown keys are refused when training starts.
    c.train = ml_collections.ConfigDict({"epochs": 12, "steps": 0, **{
        f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name != "total_steps"}})

    # How the step is computed, never what it computes (sclaro_jax.perf.PerfConfig): each switch
    # gives the default step's numbers to rounding and may change when a run resumes. Off by
    # default; bench/bench_gpu_train.py measures them.
    c.perf = ml_collections.ConfigDict()
    c.perf.fused_qkv = False  # q, k, v from one [d, 3d] matmul per attention layer
    # Attention core: einsum | xla (jax.nn.dot_product_attention) | cudnn (its cuDNN fused
    # kernel: CUDA GPUs with model.dtype bfloat16)
    c.perf.attention = "einsum"
    c.perf.fused_update = False  # clipping, AdamW groups and EMA teacher in one elementwise pass
    # XLA options of the train step, "name=value ..." over sclaro_jax.compile's, e.g.
    # "xla_gpu_enable_command_buffer= xla_gpu_enable_triton_gemm=false"; XLA checks each
    # (an unknown name is an error), another backend's are left out (logged)
    c.perf.xla_options = ""
    c.perf.packed_multiple = 1  # packed crop sizes rounded up to a multiple of this (e.g. 64)

    c.sharding = "dp"  # none | dp | fsdp over all devices (sclaro_jax.run.sharding)
    c.distributed = False  # multi-host: call jax.distributed.initialize() first
    c.log_every = 10
    c.checkpoint_every = 1000
    c.keep_checkpoints = 3
    c.checkpoint_async = True  # write checkpoints in the background while training goes on
    c.progress_bar = True
    # Persistent XLA compilation cache: "workdir" (WORKDIR/jax_cache, so a rerun that resumes
    # skips compiling the step), a folder to share between runs, or "" (off). A cache folder
    # already set for JAX (JAX_COMPILATION_CACHE_DIR, jax.config) is left as it is.
    c.compilation_cache = "workdir"
    # The step's executables (one per packed size) are compiled before step 1, this many at a
    # time (0: one per four cores, at most one per executable).
    c.compile_threads = 0
    # Evaluators by name (sclaro_jax.eval.protocols.registry): each runs on the student every `every`
    # steps (0: not while training), appending to WORKDIR/eval.jsonl, and all of them on the
    # final checkpoint when launch/train.py ends (WORKDIR/results.json, results.md). Known:
    # zero_shot, linear_probe, predcls, sgcls, localisation; the whole protocol suite is
    # `python -m sclaro_jax.eval.suite`.
    c.evals = ml_collections.ConfigDict()
    c.evals.zero_shot = ml_collections.ConfigDict({"every": 0, "split": "val"})

    if arg == "demo":
        # Minutes on a CPU: the tiny preset (random init), small images, the bundled demo
        # shards (launch/train.py writes them into WORKDIR/demo_data when data.dir is empty).
        c.model.preset = "tiny"
        c.model.embed_dim = 64
        c.data.batch_size = 4
        c.data.image_size = 32
        c.data.max_objects = 8
        c.data.max_relations = 6
        # One packed size (batch x the largest counts): two more would save less in 60 steps
        # than they take to compile on a CPU.
        c.data.max_packed_sizes = 1
        c.data.workers = 0
        c.train.epochs = 0
        c.train.steps = 60
        c.train.lr = 5e-4
        c.train.ema_warmup_steps = 20
        c.train.ema_decay = 0.9
        c.train.frozen_vision_layers = 1
        c.train.frozen_text_layers = 1
        c.log_every = 5
        c.checkpoint_every = 20
    elif arg == "psg":
        # The paper recipe on public scene graphs (docs/data.md, "From PSG or Visual Genome"):
        # the import writes train and test (PSG's own test ids), no val, so the evaluators
        # read test. data.dir has no default: the launcher refuses an empty one, naming
        # `data.prepare`, the command that writes it.
        c.data.prepare = "python -m data_prep import --source psg --root PSG_ROOT --out DIR"
        c.evals.zero_shot.split = "test"
    elif arg not in (None, ""):
        raise ValueError(f"unknown config variant {arg!r}; known: "
                         f"{', '.join(v for v in VARIANTS if v)}")
    return c
