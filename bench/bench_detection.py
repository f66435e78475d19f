"""One Faster R-CNN + FPN training step over a CLIP ViT: our jitted JAX step
(`sclaro_jax.detection`) vs torchvision's `FasterRCNN` with the same backbone, simple feature
pyramid, FPN, heads and hyper-parameters, same batch, in one process.

    python bench/bench_detection.py --rounds 6               # CPU fp32, 224 px
    python bench/bench_detection.py --rounds 5 --parts       # + where the time goes
    python bench/bench_detection.py --batch 16 --rounds 10 --bf16 --json /tmp/det.json  # GPU

The ViT is a random transformers `CLIPModel` (vision config from the arguments, a tiny text
tower) written with `save_pretrained`, loaded by `clip.from_hf(folder).vision_model` and by
`transformers.CLIPVisionModel.from_pretrained(folder)`: the same weights on both sides. All
after the ViT is randomly initialised on each side, so the first-step losses are not expected
to be equal. The torch model mirrors `sclaro_jax.detection.model`: patch tokens as an NCHW map,
ViTDet's simple feature pyramid (ConvTranspose2d 2x2/2 chains with channel LayerNorm + GELU
between, or MaxPool2d(2); then 1x1 and 3x3 convolutions without bias, each + channel LayerNorm),
`FeaturePyramidNetwork` + `LastLevelMaxPool`, `FasterRCNN`'s RPN and RoI heads with
`DetectorConfig`'s numbers. A step is forward + backward + AdamW (lr 1e-4, weight decay 0.05).
JAX uses its default device, torch CUDA when available; `--bf16`: JAX compute dtype bfloat16,
torch bf16 autocast. Timing: `timing.paired_timings` (interleaved rounds after two warm-up calls);
a ratio is JAX time / torch time in the same round. `--parts` times the parts of a step apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LR, WEIGHT_DECAY = 1e-4, 0.05


def hf_folder(args, tmp: str) -> str:
    """A random transformers CLIPModel with the benchmark's vision config, saved to `tmp`."""
    import torch
    import transformers
    vision = dict(hidden_size=args.width, intermediate_size=4 * args.width,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  patch_size=args.patch, image_size=args.image)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    cfg = transformers.CLIPConfig(vision_config=vision, text_config=text, projection_dim=32)
    folder = os.path.join(tmp, "clip")
    transformers.CLIPModel(cfg).save_pretrained(folder)
    return folder


def detector_config(args):
    from sclaro_jax.detection.model import DetectorConfig
    return DetectorConfig(
        num_classes=args.classes, image_size=args.image, fpn_dim=args.fpn_dim,
        representation_size=args.representation, rpn_pre_nms_top_n_train=args.pre_nms,
        rpn_post_nms_top_n_train=args.post_nms, rpn_batch_size_per_image=args.rpn_batch,
        box_batch_size_per_image=args.roi_batch)


def make_batch(args, max_boxes: int, seed: int = 0) -> dict:
    """uint8 images [B, S, S, 3]; per image `--boxes` boxes (sides >= 16 px) and labels in [0, C),
    padded to `max_boxes` (`detection.data.pad_targets`)."""
    from sclaro_jax.detection import data
    rng = np.random.default_rng(seed)
    s, n = args.image, args.boxes
    out, fields = {"image": rng.integers(0, 256, (args.batch, s, s, 3), dtype=np.uint8)}, []
    for _ in range(args.batch):
        x0 = rng.uniform(0, s - 16, (n, 2))  # (x0, y0); sides in [16 px, to the border]
        boxes = np.concatenate([x0, x0 + rng.uniform(16, s - x0)], 1).astype(np.float32)
        fields.append(data.pad_targets(boxes, rng.integers(0, args.classes, n), max_boxes))
    out["boxes"], out["labels"], out["valid"] = (np.stack(f) for f in zip(*fields))
    return out


# ------------------------------------------------------------------------------------ JAX side
def jax_side(args, folder: str):
    """(run(batch) -> loss, jitted step, graphdef, {"state": state})."""
    import jax.numpy as jnp

    from sclaro_jax import compile as sc_compile
    from sclaro_jax.config import load_config
    from sclaro_jax.detection import train
    from sclaro_jax.detection.model import Detector
    from sclaro_jax.models import clip
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    model = Detector(detector_config(args), clip.from_hf(folder, dtype=dtype).vision_model,
                     args.patch, dtype=dtype, seed=0)
    config = load_config("detection")
    config.update(backbone_lr=LR, head_lr=LR, weight_decay=WEIGHT_DECAY)
    graphdef, state, tx = train.init_state(model, config, steps=1000)
    step = sc_compile.jit(train.make_train_step(graphdef, tx, 0), donate_argnums=0)
    holder = {"state": state}

    def run(batch):
        holder["state"], metrics = step(holder["state"], batch)
        return float(metrics["loss"])  # waits for the step
    return run, step, graphdef, holder


# ---------------------------------------------------------------------------------- torch side
def torch_model(args, folder: str):
    import torch
    import transformers
    from torch import nn
    from torchvision.models.detection.faster_rcnn import (
        AnchorGenerator, FasterRCNN, FastRCNNPredictor, MultiScaleRoIAlign, TwoMLPHead)
    from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork, LastLevelMaxPool

    from sclaro_jax.ops import CLIP_MEAN, CLIP_STD
    cfg = detector_config(args)

    class ChannelNorm(nn.LayerNorm):  # LayerNorm over C of an NCHW map (ViTDet's LayerNorm)
        def forward(self, x):
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def stage(width: int, patch: int, stride: int, dim: int) -> nn.Sequential:
        layers, cin = [], width
        if stride <= patch:
            ups = int(np.log2(patch // stride))
            for i in range(ups):
                cout = max(width // 2 ** (i + 1), 16)
                layers.append(nn.ConvTranspose2d(cin, cout, 2, stride=2))
                if i < ups - 1:
                    layers += [ChannelNorm(cout, eps=1e-6), nn.GELU()]
                cin = cout
        else:
            layers += [nn.MaxPool2d(2)] * int(np.log2(stride // patch))
        return nn.Sequential(*layers, nn.Conv2d(cin, dim, 1, bias=False),
                             ChannelNorm(dim, eps=1e-6),
                             nn.Conv2d(dim, dim, 3, padding=1, bias=False),
                             ChannelNorm(dim, eps=1e-6))

    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.vit = transformers.CLIPVisionModel.from_pretrained(folder)
            self.sfp = nn.ModuleList([stage(args.width, args.patch, s, cfg.pyramid_dim)
                                      for s in cfg.strides])
            self.fpn = FeaturePyramidNetwork([cfg.pyramid_dim] * len(cfg.strides), cfg.fpn_dim,
                                             extra_blocks=LastLevelMaxPool())
            self.out_channels = cfg.fpn_dim

        def forward(self, x):
            tokens = self.vit(pixel_values=x).last_hidden_state[:, 1:]
            b, _, h, w = x.shape
            fmap = tokens.transpose(1, 2).reshape(b, -1, h // args.patch, w // args.patch)
            return self.fpn({str(i): st(fmap) for i, st in enumerate(self.sfp)})

    torch.manual_seed(0)
    anchors = AnchorGenerator(tuple((a,) for a in cfg.anchor_sizes),
                              (tuple(cfg.aspect_ratios),) * len(cfg.anchor_sizes))
    same = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__  # torchvision's names
            if k.startswith(("rpn_", "box_")) and k != "box_candidates"}
    rep = cfg.representation_size
    return FasterRCNN(
        Backbone(), min_size=cfg.image_size, max_size=cfg.image_size,
        image_mean=CLIP_MEAN.tolist(), image_std=CLIP_STD.tolist(), rpn_anchor_generator=anchors,
        box_roi_pool=MultiScaleRoIAlign([str(i) for i in range(len(cfg.strides))],
                                        cfg.roi_output_size, 2),
        box_head=TwoMLPHead(cfg.fpn_dim * cfg.roi_output_size ** 2, rep),
        box_predictor=FastRCNNPredictor(rep, cfg.num_classes + 1),
        box_detections_per_img=cfg.detections_per_img, **same)


def torch_inputs(batch: dict, device):
    import torch
    images = [torch.from_numpy(im).permute(2, 0, 1).float().div(255).to(device)
              for im in batch["image"]]
    targets = [{"boxes": torch.from_numpy(b[v]).to(device),
                "labels": torch.from_numpy(lab[v].astype(np.int64) + 1).to(device)}
               for b, lab, v in zip(batch["boxes"], batch["labels"], batch["valid"])]
    return images, targets


def torch_side(args, folder: str):
    """(run(batch) -> loss, model)."""
    import torch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torch_model(args, folder).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def run(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = sum(model(*torch_inputs(batch, device)).values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())  # waits for the step
    return run, model


def time_parts(graphdef, params, tmodel, batch: dict, rounds: int) -> dict:
    """Median seconds of each part of a step, JAX and torch, paired rounds. A part's inputs
    (earlier parts' outputs, computed once) are arguments: closed-over arrays would be constant-
    folded. Each JAX part is jitted alone and differentiates its parameters and input maps."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from sclaro_jax import compile as sc_compile, ops as pixel_ops
    from sclaro_jax.detection import rcnn
    from timing import paired_timings
    cfg = nnx.merge(graphdef, params).cfg

    def net(**part):
        return nnx.merge(graphdef, {**params, **part})

    def features(p, a):
        return net(rpn_pyramid=p).features(pixel_ops.normalize(a["image"]))[0]

    def f_backbone(p, a):  # pyramid forward + backward (sum of the maps as the loss)
        return jax.grad(lambda q: sum(f.sum() for f in features(q, a)))(p)

    def rpn_loss(q, fs, a):
        out = rcnn.rpn_losses(cfg, *net(rpn_head=q).rpn_head(fs), a["boxes"], a["valid"], a["key"])
        return out["loss_objectness"] + out["loss_rpn_box_reg"]

    def f_proposals(o, d):  # top-k per level, decode, NMS per level
        return jax.vmap(lambda x, y: rcnn.select_proposals(cfg, x, y, training=True))(o, d)

    def f_rpn(p, a):  # RPN head + RPN loss forward + backward, and the proposals
        obj, deltas = net(rpn_head=p).rpn_head(a["feats"])
        return jax.grad(rpn_loss, (0, 1))(p, a["feats"], a), f_proposals(obj, deltas)

    def roi_loss(q, fs, a):
        keys = jax.random.split(a["key"], a["proposals"].shape[0])
        rois, labels, weight, targets = jax.vmap(
            lambda pr, v, g, lab, gv, k: rcnn.roi_targets(cfg, pr, v, g, lab, gv, k))(
            a["proposals"], a["kept"], a["boxes"], a["labels"], a["valid"], keys)
        logits, box_deltas = net(box_head=q).box_head(rcnn.pool(cfg, fs, rois))
        out = rcnn.fast_rcnn_losses(logits, box_deltas, labels.reshape(-1), weight.reshape(-1),
                                    targets.reshape(-1, 4))
        return out["loss_classifier"] + out["loss_box_reg"]

    def f_roi(p, a):  # RoI sampling + RoIAlign + box head forward + backward
        return jax.grad(roi_loss, (0, 1))(p, a["feats"][:-1], a)

    def f_align(a):  # MultiScaleRoIAlign alone, fwd + bwd
        return jax.vjp(lambda f: rcnn.pool(cfg, f, a["rois"]), a["feats"][:-1])[1](a["ct"])

    def f_head(p, a):  # TwoMLPHead + predictor on pooled RoIs, fwd + bwd
        return jax.grad(lambda q, y: sum(o.sum() for o in net(box_head=q).box_head(y)),
                        (0, 1))(p, a["pooled"])

    a = {k: jnp.asarray(batch[k]) for k in ("image", "boxes", "labels", "valid")}
    a["key"] = jax.random.key(0)
    a["feats"] = jax.jit(features)(params["rpn_pyramid"], a)
    obj, deltas = jax.jit(lambda p, f: net(rpn_head=p).rpn_head(f))(params["rpn_head"], a["feats"])
    a["proposals"], a["kept"], _ = jax.jit(f_proposals)(obj, deltas)
    a["rois"] = a["proposals"][:, :cfg.box_batch_size_per_image]
    a["ct"] = jax.random.normal(a["key"], (a["rois"].size // 4, cfg.roi_output_size,
                                           cfg.roi_output_size, cfg.fpn_dim))
    a["pooled"] = jax.jit(lambda f, r: rcnn.pool(cfg, f, r))(a["feats"][:-1], a["rois"])
    jax_calls = {name: (lambda f=sc_compile.jit(fn), xs=xs: f(*xs)) for name, fn, xs in (
        ("backbone", f_backbone, (params["rpn_pyramid"], a)),
        ("rpn", f_rpn, (params["rpn_head"], a)),
        ("roi", f_roi, (params["box_head"], a)), ("roi_align", f_align, (a,)),
        ("box_head", f_head, (params["box_head"], a)))}

    # torch: the same cuts through torchvision's GeneralizedRCNN.forward
    device = next(tmodel.parameters()).device
    images, targets = torch_inputs(batch, device)
    images, targets = tmodel.transform(images, targets)
    with torch.no_grad():
        t_feats = tmodel.backbone(images.tensors)
        t_props, _ = tmodel.rpn(images, t_feats, targets)
    roi_names = list(t_feats)[:-1]
    t_rois = [p[:cfg.box_batch_size_per_image] for p in t_props]
    t_ct = torch.from_numpy(np.asarray(a["ct"])).permute(0, 3, 1, 2).to(device)
    t_pooled = torch.from_numpy(np.asarray(a["pooled"])).permute(0, 3, 1, 2).to(device)

    def t_backbone():
        sum(f.sum() for f in tmodel.backbone(images.tensors).values()).backward()

    def leaves(names=tuple(t_feats)):  # the maps as leaves that take gradients
        return {k: t_feats[k].detach().requires_grad_() for k in names}

    def t_rpn():  # RPN forward (with its proposals) + loss backward
        sum(tmodel.rpn(images, leaves(), targets)[1].values()).backward()

    def t_roi():
        heads = tmodel.roi_heads
        sum(heads(leaves(), t_props, images.image_sizes, targets)[1].values()).backward()

    def t_align():
        pooled = tmodel.roi_heads.box_roi_pool(leaves(roi_names), t_rois, images.image_sizes)
        (pooled * t_ct).sum().backward()

    def t_head():
        heads, x = tmodel.roi_heads, t_pooled.detach().requires_grad_()
        sum(o.sum() for o in heads.box_predictor(heads.box_head(x))).backward()

    torch_calls = {"backbone": t_backbone, "rpn": t_rpn, "roi": t_roi,
                   "roi_align": t_align, "box_head": t_head}
    names = list(jax_calls)
    times = paired_timings([fn for name in names for fn in (
        lambda f=jax_calls[name]: jax.block_until_ready(f()), torch_calls[name])], rounds, 0.1)
    med = np.median(times, 0)
    result = {}
    print("| part (forward + backward unless said) | JAX s median | torch s median | JAX/torch |")
    print("|---|---|---|---|")
    for i, name in enumerate(names):
        j, t = med[2 * i], med[2 * i + 1]
        result[name] = {"jax": j, "torch": t}
        print(f"| {name} | {j:.4f} | {t:.4f} | {j / t:.2f} |")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("width", 192), ("layers", 4), ("heads", 3), ("patch", 16),
                          ("image", 224), ("batch", 2), ("classes", 20), ("boxes", 6),
                          ("rounds", 5), ("fpn-dim", 256), ("representation", 1024),
                          ("pre-nms", 2000), ("post-nms", 2000), ("rpn-batch", 256),
                          ("roi-batch", 512)):
        parser.add_argument(f"--{name}", type=int, default=default)
    for flag, text in (("--bf16", "bfloat16 compute: JAX Detector dtype, torch autocast"),
                       ("--parts", "also time backbone / RPN / RoI parts apart, both sides")):
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("--json", default="", help="write the figures to this path")
    args = parser.parse_args()

    import jax
    import torch

    from timing import paired_timings
    torch.set_num_threads(os.cpu_count())
    folder = hf_folder(args, tempfile.mkdtemp(prefix="bench_det_"))
    jax_run, jax_step, graphdef, holder = jax_side(args, folder)
    torch_run, tmodel = torch_side(args, folder)
    n_jax = sum(x.size for x in jax.tree.leaves(holder["state"]["params"]))
    n_torch = sum(p.numel() for p in tmodel.parameters())
    print(f"parameters: JAX {n_jax:,}, torch {n_torch:,}")
    batch = make_batch(args, detector_config(args).max_boxes)
    t0, first = time.perf_counter(), [jax_run(batch)]
    first_call = time.perf_counter() - t0
    runs, names = [jax_run, torch_run], ["JAX", "torch"]
    first += [run(batch) for run in runs[1:]]
    print("first-step loss (heads randomly initialised on each side: JAX and torch not expected "
          "equal): " + ", ".join(f"{n} {x:.4f}" for n, x in zip(names, first)))
    times = paired_timings([lambda run=run: run(batch) for run in runs], args.rounds)
    med, low = np.median(times, 0), times.min(0)
    ratios = times / times[:, -1:]
    cache, device = jax_step._cache_size(), "cuda" if torch.cuda.is_available() else "cpu"
    print(f"JAX backend {jax.default_backend()}, torch {device} ({torch.get_num_threads()} "
          f"threads), {'bf16' if args.bf16 else 'fp32'}, batch {args.batch}, {args.image} px, "
          f"{args.rounds} paired rounds")
    print(f"JAX first call (compile + step) {first_call:.1f} s, compile ~"
          f"{first_call - med[0]:.1f} s; jit cache size after the rounds: {cache}"
          f" ({'no recompilation' if cache == 1 else 'RECOMPILED'})")
    print("| step | s/step median (min) | / torch, median over rounds | examples/s |")
    print("|---|---|---|---|")
    for i, name in enumerate(names):
        print(f"| {name} | {med[i]:.3f} ({low[i]:.3f}) | {np.median(ratios[:, i]):.2f} | "
              f"{args.batch / med[i]:.2f} |")
    print("JAX/torch per round:", " ".join(f"{r:.2f}" for r in ratios[:, 0]))
    out = dict(args=vars(args), params={"jax": n_jax, "torch": n_torch}, names=names,
               first_loss=first, jax_first_call_s=first_call, jax_cache_size=cache,
               times=times.tolist(), median=med.tolist(), min=low.tolist(),
               ratio_to_torch=ratios.tolist(), ratio_median=np.median(ratios, 0).tolist(),
               examples_per_s=(args.batch / med).tolist(),
               backend={"jax": jax.default_backend(), "torch": device})
    for part in ("step", "parts") if args.parts else ("step",):
        if part == "parts":
            out["parts"] = time_parts(graphdef, holder["state"]["params"], tmodel, batch,
                                      max(3, args.rounds))
        if args.json:  # written after each stage
            Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
