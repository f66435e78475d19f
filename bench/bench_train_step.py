"""One ScenarioCLIP training step: our jitted JAX step vs a PyTorch step written the way the
reference implementation works (Hugging Face CLIP towers, flattened crops, per-image Python loops
for KD, an EMA teacher copy, AdamW groups, fp32), same config and batch, in one process.

    python bench/bench_train_step.py --preset tiny --batch 32 --rounds 10
    python bench/bench_train_step.py --preset ViT-B/32 --batch 8 --rounds 3
    python bench/bench_train_step.py --preset tiny --batch 32 --torch-batched-kd  # + PyTorch's floor
    python bench/bench_train_step.py --layouts --preset tiny --batch 32 --rounds 10
    python bench/bench_train_step.py --layouts --preset ViT-B/32 --batch 8 --rounds 4

`--layouts` times our step on the two crop layouts instead, in one process, each round on the
same crops (per-image counts drawn from the bundled demo's photographs): the caps layout at the
recipe's 10 objects / 8 relations per image against the packed layout at its planned sizes
(every size compiled before timing). It prints examples/s, useful crops/s (real crops, no
padding) and each layout's peak memory, from a child process that runs each of its shapes:
the process's peak (compilation included; XLA:CPU keeps each compiled size's code, about 0.2 GB
for the tiny step) and the steps' own peak (every shape run again after the peak is reset).

Both start from the same weights (a random transformers CLIPModel written with save_pretrained,
loaded by `clip.from_hf`; our heads copied into the PyTorch heads), so the first step's losses
are printed side by side as a check that both compute the same thing. Each batch has 4 objects
and 4 relations per image (all valid), texts of 32 tokens on both sides. Peak memory: each side
alone in a child process (VmHWM after 3 steps; both children import jax, torch and
transformers, which is part of the figure; see bench/README.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N_OBJ = N_REL = 4
TEXT_LEN = 32
EMBED = 512


def make_batch(preset: str, batch: int, seed: int = 0, n_obj: int = N_OBJ, n_rel: int = N_REL,
               text_len: int = TEXT_LEN, counts=None) -> dict:
    """A synthetic caps batch of n_obj / n_rel slots per image, every slot valid, or with
    `counts` [batch, 2] the first counts[i] of image i's slots (also used by bench_gpu_train)."""
    from sclaro_jax.models.clip import PRESETS
    size = PRESETS[preset].vision.image_size
    rng = np.random.default_rng(seed)

    def ids(shape):
        x = rng.integers(300, 40000, shape + (text_len,)).astype(np.int32)
        x[..., 0], x[..., 5], x[..., 6:] = 49406, 49407, 49407
        return x

    from sclaro_jax.data import batch as fields
    obj, rel = fields.LEVEL_FIELDS["object"], fields.LEVEL_FIELDS["relation"]
    out = {
        fields.IMAGE: rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8),
        fields.ACTION_TOKENS: ids((batch,)),
        fields.HAS_ACTION: np.ones((batch,), bool), fields.VALID: np.ones((batch,), bool),
    }
    for k, (f, n) in enumerate(((obj, n_obj), (rel, n_rel))):
        mask = np.ones((batch, n), bool) if counts is None else \
            np.arange(n)[None, :] < np.asarray(counts)[:, k, None]
        out[f.pixels] = rng.integers(0, 256, (batch, n, size, size, 3), dtype=np.uint8) * \
            mask[..., None, None, None].astype(np.uint8)
        out[f.tokens] = ids((batch, n)) * mask[..., None]
        out[f.mask] = mask
        out[f.labels] = np.where(mask, 0, -1).astype(np.int32)
    for name in (fields.BAD_RECORD, fields.DROPPED_OBJECTS, fields.DROPPED_RELATIONS):
        out[name] = np.zeros((batch,), np.int32)
    return out


def hf_folder(preset: str, tmp: str) -> str:
    import torch
    import transformers

    from sclaro_jax.models.clip import PRESETS, _config_to_hf
    folder = os.path.join(tmp, "clip")
    if not os.path.exists(os.path.join(folder, "config.json")):
        cfg = transformers.CLIPConfig(**_config_to_hf(PRESETS[preset]))
        torch.manual_seed(0)
        transformers.CLIPModel(cfg).save_pretrained(folder)
    return folder


TRAIN = dict(lr=2e-5, ema_warmup_steps=0, frozen_vision_layers=6, frozen_text_layers=10)


def jax_side(folder: str, preset: str, embed: int, share_frozen_text: bool = True,
             gradient_forms: str = "auto"):
    from sclaro_jax.models import scenarioclip
    from sclaro_jax.run import sharding
    from sclaro_jax.train import core
    model = scenarioclip.build("scenarioclip", preset=preset, init=folder, embed_dim=embed,
                               gradient_forms=gradient_forms)
    layers = model.global_pair.config.vision.num_hidden_layers
    cfg = core.TrainConfig(total_steps=1000, **{**TRAIN, **_frozen(layers)})
    graphdef, state, tx = core.init_state(model, cfg)
    step, state = sharding.jit_step(
        core.make_train_step(graphdef, tx, cfg, share_frozen_text=share_frozen_text),
        state, None, "none")  # what the trainer runs on one device
    holder = {"state": state}

    def run(batch):
        holder["state"], metrics = step(holder["state"], batch)
        return float(metrics["loss"])  # waits for the step to finish

    def step_bytes(batch) -> int:
        """What XLA's buffer assignment gives the compiled step at `batch`'s shapes: its
        arguments, temporaries and outputs (the outputs that alias the donated state once)."""
        m = step.lower(holder["state"], batch).compile().memory_analysis()
        return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
                - m.alias_size_in_bytes)
    run.step_bytes = step_bytes
    return run, model


def _frozen(layers: int) -> dict:
    # the recipe freezes 6 of 12 vision and 10 of 12 text blocks; scale for smaller towers
    return dict(frozen_vision_layers=layers // 2, frozen_text_layers=max(0, layers - 2)) \
        if layers < 12 else {}


def torch_side(folder: str, jax_model, embed: int, kd_loops: bool = True):
    """The reference implementation's step, written the way it works; with `kd_loops=False`
    the same KD terms as batched tensor ops instead of per-image Python loops (not how the
    reference works: a floor for what PyTorch's step costs without them)."""
    import torch
    import torch.nn.functional as F
    import transformers
    from torch import nn

    from sclaro_jax.data import batch as fields

    torch.manual_seed(0)

    class Pair(nn.Module):
        def __init__(self, jax_pair):
            super().__init__()
            clip = transformers.CLIPModel.from_pretrained(folder)
            self.vision, self.text = clip.vision_model, clip.text_model
            self.vhead = nn.Sequential(nn.Linear(clip.config.vision_config.hidden_size, embed),
                                       nn.LayerNorm(embed))
            self.thead = nn.Sequential(nn.Linear(clip.config.text_config.hidden_size, embed),
                                       nn.LayerNorm(embed))
            for head, ours in (((self.vhead, jax_pair.vision_head),
                                (self.thead, jax_pair.text_head)) if jax_pair else ()):
                head[0].weight.data = torch.tensor(np.asarray(ours.linear.kernel[...]).T.copy())
                head[0].bias.data = torch.tensor(np.asarray(ours.linear.bias[...]))
                head[1].weight.data = torch.tensor(np.asarray(ours.norm.scale[...]))
                head[1].bias.data = torch.tensor(np.asarray(ours.norm.bias[...]))
            self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

        def img(self, x):
            return self.vhead(self.vision(pixel_values=x).pooler_output)

        def txt(self, ids):
            return self.thead(self.text(input_ids=ids).pooler_output)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.pairs = nn.ModuleDict({k: Pair(jax_model.pair(k) if jax_model else None)
                                        for k in ("global", "object", "relation")})
            self.kd_log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    model = Model()
    layers_v = len(model.pairs["global"].vision.encoder.layers)
    frozen = {**dict(frozen_vision_layers=6, frozen_text_layers=10), **_frozen(layers_v)}
    for pair in model.pairs.values():
        for tower, count in ((pair.vision, frozen["frozen_vision_layers"]),
                             (pair.text, frozen["frozen_text_layers"])):
            for p in tower.embeddings.parameters():
                p.requires_grad = False
            for layer in tower.encoder.layers[:count]:
                for p in layer.parameters():
                    p.requires_grad = False
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad = False
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if p.ndim >= 2], "weight_decay": 0.2},
        {"params": [p for n, p in params if p.ndim < 2 and n != "kd_log_scale"],
         "weight_decay": 0.0},
        {"params": [model.kd_log_scale], "weight_decay": 0.0, "lr": 0.1 * TRAIN["lr"]},
    ]
    opt = torch.optim.AdamW(groups, lr=TRAIN["lr"], betas=(0.9, 0.999), eps=1e-8)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)

    def pixels(x):
        x = torch.from_numpy(x.reshape(-1, *x.shape[-3:])).permute(0, 3, 1, 2).float() / 255
        return (x - mean) / std

    def clip_loss(i, t, s):
        scale = s.exp().clamp(max=100)
        logits = scale * F.normalize(i, dim=-1) @ F.normalize(t, dim=-1).T
        y = torch.arange(len(i))
        return 0.5 * (F.cross_entropy(logits, y) + F.cross_entropy(logits.T, y))

    def kd(student_vec, teacher_vec, t_s):
        return F.kl_div(F.log_softmax(student_vec / t_s, -1), F.softmax(teacher_vec / 0.07, -1),
                        reduction="batchmean") * t_s ** 2

    def run(batch):
        b = len(batch["image"])
        images = pixels(batch["image"])
        crops = {"object": pixels(batch["objects"]), "relation": pixels(batch["relations"])}
        ids = {"global": torch.from_numpy(batch["action_tokens"]).long(),
               "object": torch.from_numpy(batch["object_tokens"].reshape(-1, TEXT_LEN)).long(),
               "relation": torch.from_numpy(batch["relation_tokens"].reshape(-1, TEXT_LEN)).long()}
        counts = {"object": batch["object_mask"].sum(1), "relation": batch["relation_mask"].sum(1)}
        emb = {"global": (model.pairs["global"].img(images), model.pairs["global"].txt(ids["global"]))}
        for level in ("object", "relation"):
            emb[level] = (model.pairs[level].img(crops[level]), model.pairs[level].txt(ids[level]))
        loss_ca = sum(clip_loss(*emb[k], model.pairs[k].logit_scale) for k in emb)
        with torch.no_grad():
            t_img = teacher.pairs["global"].img(images)
            t_txt = {k: teacher.pairs[k].txt(ids[k]) for k in ("object", "relation")}
        t_s = 1.0 / model.kd_log_scale.exp().clamp(1, 100)
        loss_kd = 0.0
        if kd_loops:
            for level in ("object", "relation"):
                start = 0
                vision_terms, text_terms = [], []
                for i in range(b):  # per-image Python loops, as the reference code does
                    n = int(counts[level][i])
                    if n:
                        vision_terms.append(torch.stack(
                            [kd(emb[level][0][start + j], t_img[i], t_s)
                             for j in range(n)]).mean())
                        text_terms.append(torch.stack(
                            [kd(emb["global"][1][i], t_txt[level][start + j], t_s)
                             for j in range(n)]).mean())
                    start += n
                loss_kd = loss_kd + torch.stack(vision_terms).mean() \
                    + torch.stack(text_terms).mean()
        else:
            for level in ("object", "relation"):
                mask = torch.from_numpy(batch[fields.LEVEL_FIELDS[level].mask]).float()  # [b, n]
                seen = mask.sum(1) > 0

                def kd_rows(student, teacher):  # kd() of each row pair: batchmean of 1-D is / dim
                    log_p = F.log_softmax(teacher / 0.07, -1)
                    return (log_p.exp() * (log_p - F.log_softmax(student / t_s, -1))).sum(-1) \
                        / student.shape[-1] * t_s ** 2

                def image_means(per_slot):  # mean over each image's crops, then over images
                    full = per_slot.view(mask.shape) * mask
                    return (full.sum(1)[seen] / mask.sum(1)[seen]).mean()

                owner = torch.arange(b).repeat_interleave(mask.shape[1])  # image of each slot
                loss_kd = loss_kd + image_means(kd_rows(emb[level][0], t_img[owner])) \
                    + image_means(kd_rows(emb["global"][1][owner], t_txt[level]))
        loss = loss_ca + loss_kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        with torch.no_grad():
            for tp, p in zip(teacher.parameters(), model.parameters()):
                tp.mul_(0.9995).add_(p, alpha=1 - 0.9995)
        return float(loss.detach())
    return run


# ---------------------------------------------------------------- caps against packed (--layouts)

CAPS = (10, 8)  # the recipe's per-image caps (objects, relations)


def demo_counts() -> np.ndarray:
    """[n, 2] (objects, relations) of the bundled demo's photographs (its annotations file)."""
    from data_prep.demo import load_annotations
    return np.array([(len(e["objects"]), len(e["relations"])) for e in load_annotations()])


def layout_batches(preset: str, batch: int, rounds: int, seed: int = 0):
    """(packed sizes, [(caps batch, packed batch)] * rounds): images' counts drawn from the
    demo's; caps at the recipe's 10 / 8 slots per image, packed at the smallest planned size
    that holds the batch (the same crops, pixels and texts)."""
    from sclaro_jax.data import packing
    per_image = np.minimum(demo_counts(), CAPS)
    sizes = packing.plan(*(packing.histogram(per_image[:, k]) for k in range(2)), batch)
    rng = np.random.default_rng(seed)
    out = []
    for r in range(rounds):
        counts = per_image[rng.integers(0, len(per_image), batch)]
        caps = make_batch(preset, batch, seed=r, n_obj=CAPS[0], n_rel=CAPS[1], counts=counts)
        out.append((caps, pack_planned(caps, sizes)))
    return sizes, out


def real_crops(batch: dict) -> tuple[int, int]:
    """Real crops (objects, relations) of a batch of either layout."""
    from sclaro_jax.data import batch as fields
    return tuple(int(batch[fields.LEVEL_FIELDS[level].mask].sum()) for level in fields.CROP_LEVELS)


def pack_planned(caps: dict, sizes) -> dict:
    """A caps batch packed at the smallest planned size that holds its crops."""
    from sclaro_jax.data import packing
    tier = sizes.tier(*real_crops(caps))
    return packing.pack(caps, {level: sizes.slots(level, tier) for level in ("object", "relation")})


def resized(packed: dict, slots: dict[str, int]) -> dict:
    """`packed` cut or grown (its crops repeated) to `slots[level]` slots: a batch of that
    shape to compile or lower, not to train on."""
    from sclaro_jax.data import batch as fields
    out = dict(packed)
    for level, n in slots.items():
        f = fields.LEVEL_FIELDS[level]
        for name in (f.pixels, f.tokens, f.labels, f.mask, f.segments):
            x = np.asarray(packed[name])
            out[name] = np.resize(x, (n, *x.shape[1:]))
    return out


def every_size(sizes, packed: dict) -> list[dict]:
    """A packed batch at each planned size (to compile them all before timing): grown with
    padding to the larger sizes, cut to the smaller ones."""
    from sclaro_jax.data import packing
    have = sizes.tier_of(packed)
    return [packing.grow(packed, sizes, t) for t in range(have, sizes.tiers)] + [
        resized(packed, {level: sizes.slots(level, t) for level in ("object", "relation")})
        for t in range(have)]


def child_memory(args, side: str) -> dict:
    """The peak-memory figures of `side` run alone in a child process (see `child`)."""
    out = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--batch",
                          str(args.batch), "--embed", str(args.embed), "--child", side,
                          "--tmp", args.tmp], capture_output=True, text=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if not line:
        print(out.stderr[-2000:])
    return json.loads(line[-1]) if line else {}


def compare_layouts(args) -> None:
    """Our step on the caps and the packed layout, the same crops each round, in one run."""
    folder = hf_folder(args.preset, args.tmp)
    mem = {}
    for side in ("caps", "packed"):  # each alone in a child process, before this one grows
        got = child_memory(args, side)
        mem[side] = [got.get(k, np.nan) for k in ("peak_rss_gb", "held_rss_gb",
                                                  "step_growth_gb", "xla_step_gb")]
    sizes, batches = layout_batches(args.preset, args.batch, args.rounds)
    steps = {}
    for side in ("caps", "packed"):
        run, _ = jax_side(folder, args.preset, args.embed)
        warm = [batches[0][0]] if side == "caps" else every_size(sizes, batches[0][1])
        for b in warm:
            run(b)  # compiles each shape once
        steps[side] = run
    times = np.zeros((args.rounds, 2))
    for r, (caps, packed) in enumerate(batches):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        for i in order:
            time.sleep(0.25)
            t0 = time.perf_counter()
            steps[("caps", "packed")[i]]((caps, packed)[i])
            times[r, i] = time.perf_counter() - t0
    crops = np.array([sum(real_crops(c)) for c, _ in batches])
    slots = {"caps": args.batch * sum(CAPS),
             "packed": np.mean([sizes.objects[sizes.tier_of(p)] + sizes.relations[
                 sizes.tier_of(p)] for _, p in batches])}
    print(f"{args.preset}, batch {args.batch}, counts drawn from the demo's photographs (caps "
          f"{CAPS[0]} objects / {CAPS[1]} relations per image; packed sizes "
          f"{sizes.describe()}), {args.rounds} paired rounds, {os.cpu_count()} cores")
    print("| preset | batch | layout | s/step median (min) | examples/s | useful crops/s | "
          "padding | peak RSS (GB) | held after compiling (GB) | step memory (GB): RSS growth / "
          "XLA |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, side in enumerate(("caps", "packed")):
        med = float(np.median(times[:, i]))
        print(f"| {args.preset} | {args.batch} | {side} | {med:.3f} ({times[:, i].min():.3f}) | "
              f"{args.batch / med:.2f} | {np.median(crops / times[:, i]):.1f} | "
              f"{1 - crops.mean() / slots[side]:.1%} | {mem[side][0]:.2f} | {mem[side][1]:.2f} | "
              f"{mem[side][2]:.3f} / {mem[side][3]:.3f} |")
    print(f"packed / caps examples/s: {np.median(times[:, 0] / times[:, 1]):.2f}x (median of "
          f"the rounds' ratios)")


def child(args) -> None:
    """Run one side alone for 3 steps and print its peak RSS."""
    if args.child not in ("caps", "packed"):  # the layouts' children leave torch out
        import torch
        torch.set_num_threads(os.cpu_count())
    folder = hf_folder(args.preset, args.tmp)
    batches = [make_batch(args.preset, args.batch)] * 3
    if args.child in ("caps", "packed"):  # the --layouts comparison: every size it compiles
        sizes, pairs = layout_batches(args.preset, args.batch, 1)
        batches = [pairs[0][0]] * 3 if args.child == "caps" else every_size(sizes, pairs[0][1])
    if args.child == "torch":  # random heads: the weights do not matter for memory
        run = torch_side(folder, None, args.embed)
    else:
        run, _ = jax_side(folder, args.preset, args.embed)
    for batch in batches:
        run(batch)
    out = {"peak_rss_gb": _hwm_gb()}
    if args.child in ("caps", "packed"):  # again, every shape compiled: the steps' own peak
        held = _rss_gb("VmRSS")  # the process with its state and compiled steps resident
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        for batch in batches:
            run(batch)
        out["held_rss_gb"] = held
        out["step_peak_rss_gb"] = _hwm_gb()
        out["step_growth_gb"] = out["step_peak_rss_gb"] - held
        out["xla_step_gb"] = max(run.step_bytes(b) for b in batches) / 2 ** 30
    print(json.dumps(out))


def _hwm_gb() -> float:
    # VmHWM, not ru_maxrss: the latter carries the forking parent's high-water mark over exec
    return _rss_gb("VmHWM")


def _rss_gb(field: str) -> float:
    import ctypes
    import gc
    if field == "VmRSS":  # what is held, not what the allocator kept of freed memory
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    line = [x for x in open("/proc/self/status") if x.startswith(field + ":")][0]
    return int(line.split()[1]) / 2 ** 20


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--embed", type=int, default=EMBED)
    parser.add_argument("--torch-batched-kd", action="store_true",
                        help="also time the PyTorch step with its KD terms as batched tensor "
                             "ops (not the reference's way; a floor for PyTorch's step)")
    parser.add_argument("--layouts", action="store_true",
                        help="instead: our step on the caps layout against the packed one, "
                             "batches with the demo's object / relation counts")
    parser.add_argument("--child", choices=("jax", "torch", "caps", "packed"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.layouts:
        args.tmp = args.tmp or tempfile.mkdtemp(prefix="bench_step_")
        return compare_layouts(args)
    import torch

    from timing import paired_timings
    torch.set_num_threads(os.cpu_count())
    args.tmp = args.tmp or tempfile.mkdtemp(prefix="bench_step_")
    folder = hf_folder(args.preset, args.tmp)
    mem = {}
    for side in ("jax", "torch"):  # each side alone, before this process grows
        mem[side] = child_memory(args, side).get("peak_rss_gb", np.nan)
    batch = make_batch(args.preset, args.batch)
    jax_run, jax_model = jax_side(folder, args.preset, args.embed)
    torch_run = torch_side(folder, jax_model, args.embed)
    runs = [jax_run, torch_run]
    if args.torch_batched_kd:
        runs.append(torch_side(folder, jax_model, args.embed, kd_loops=False))
    first = [run(batch) for run in runs]
    print("first-step loss: ours {:.6f}, PyTorch {:.6f}".format(*first)
          + (f", PyTorch with batched KD {first[2]:.6f}" if len(first) > 2 else ""))
    times = paired_timings([lambda run=run: run(batch) for run in runs], args.rounds,
                           pause=0.25)
    med = np.median(times, axis=0)
    ratio = np.median(times[:, 1] / times[:, 0])
    print(f"{args.preset}, batch {args.batch}, {N_OBJ} objects + {N_REL} relations per image, "
          f"{args.rounds} paired rounds, {os.cpu_count()} cores")
    print("| preset | batch | ours s/step median (min) | PyTorch s/step median (min) | speed-up |"
          " peak RSS ours / PyTorch (GB) |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.preset} | {args.batch} | {med[0]:.3f} ({times[:, 0].min():.3f}) | "
          f"{med[1]:.3f} ({times[:, 1].min():.3f}) | {ratio:.2f}x | "
          f"{mem['jax']:.2f} / {mem['torch']:.2f} |")
    if len(runs) > 2:
        print(f"PyTorch with batched KD: {med[2]:.3f} s/step median ({times[:, 2].min():.3f} "
              f"min), {np.median(times[:, 1] / times[:, 2]):.2f}x faster than the reference "
              f"way; ours {np.median(times[:, 2] / times[:, 0]):.2f}x faster than it")


if __name__ == "__main__":
    main()
