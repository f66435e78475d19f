"""MINER / ROCS text-to-image retrieval evaluation (docs/design.md, section 4).

    python -m sclaro_jax.eval.rocs --model MODEL_DIR --split rocs_coco=ROCS_DIR:coco \
        --split coco5k=dataset_coco.json --image-root COCO_DIR --out results/

For each split: the gallery's global and crop embeddings are computed once (cached under
`--cache-dir`), then four scorings are ranked and reported, text-to-image R@1/5/10 (each
caption one query, one ground-truth image) and hubness statistics:

- `Global`: cosine of the caption with the global image embedding.
- `Global+crops`: the fused score (1 - alpha) T.G + alpha * pool_r T.C_r, no rescoring.
- `Global+<rescore>`: the global matrix rescored (two-sided CSLS by default).
- `MINER`: the fused matrix rescored: the paper's method.

`--rescore` picks the rescoring: `csls` (transductive, k neighbours on both sides), `csls-bank`
(inductive: the image-side term from the queries of `--bank`), `shortlist` (CSLS on each
query's top-M global candidates only), `qbnorm` (dynamic inverted softmax over the `--bank`
queries), `sinkhorn`, `dual-softmax`, `none`. Results go to stdout, `OUT/results.json` (every
number and every setting) and `OUT/results.md` (the paper's table layout).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from sclaro_jax import cli, miner
from sclaro_jax.eval import data as data_lib
from sclaro_jax.eval import encoders as enc_lib
from sclaro_jax.eval.gallery import CropSpec, GalleryEmbeddings, embed_split

RESCORES = ("csls", "csls-bank", "shortlist", "qbnorm", "sinkhorn", "dual-softmax", "none")


@dataclasses.dataclass(frozen=True)
class Settings:
    alpha: float = 0.4
    pool: str = "max"
    k: int = 10
    rescore: str = "csls"
    shortlist_m: int = 25
    qbnorm_beta: float = 20.0
    sinkhorn_tau: float = 0.02
    sinkhorn_iters: int = 1
    dual_softmax_tau: float = 0.01
    ks: tuple = (1, 5, 10)

    def __post_init__(self):
        if self.rescore not in RESCORES:
            raise ValueError(f"rescore must be one of {RESCORES}, got {self.rescore!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.pool not in ("max", "mean"):
            raise ValueError(f"pool must be 'max' or 'mean', got {self.pool!r}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")


def _rescore(scores, settings: Settings, *, bank_scores=None, global_scores=None):
    """Apply the chosen rescoring to a [Q, G] matrix (`global_scores` feeds the shortlist)."""
    r = settings.rescore
    k = min(settings.k, scores.shape[0], scores.shape[1])
    if r == "none":
        return scores
    if r == "csls":
        return miner.csls(scores, k=k)
    if r in ("csls-bank", "qbnorm") and bank_scores is None:
        raise ValueError(f"--rescore {r} needs a query bank (--bank)")
    if r == "csls-bank":
        return miner.csls(scores, k=min(k, bank_scores.shape[0]), bank_scores=bank_scores)
    if r == "qbnorm":
        return miner.qbnorm(scores, bank_scores, beta=settings.qbnorm_beta)
    if r == "shortlist":
        return miner.csls_shortlist(scores if global_scores is None else global_scores, scores,
                                    m=min(settings.shortlist_m, scores.shape[1]), k=k)
    if r == "sinkhorn":
        return miner.sinkhorn(scores, tau=settings.sinkhorn_tau, iters=settings.sinkhorn_iters)
    return miner.dual_softmax(scores, tau=settings.dual_softmax_tau)


def _metrics(scores, gt, settings: Settings) -> dict:
    recall = miner.recall_at_k(scores, gt, ks=settings.ks)
    hub = miner.hubness(scores, k=min(settings.k, scores.shape[1]))
    out = {f"R@{k}": float(v) for k, v in recall.items()}
    out.update({key: (int(v) if key in ("worst_hub", "worst_hub_count") else float(v))
                for key, v in hub.items()})
    return out


def evaluate(emb: GalleryEmbeddings, gt: np.ndarray, settings: Settings = Settings(),
             bank: np.ndarray | None = None) -> dict[str, dict]:
    """The four scorings of one split -> {method: {"R@1", "R@5", "R@10", "skewness",
    "never_retrieved", ...}}. `bank`: float32 [Qb, D] query-bank text embeddings."""
    text = jnp.asarray(emb.texts, jnp.float32)
    gallery = jnp.asarray(emb.images)
    gallery32 = gallery.astype(jnp.float32)
    gt = np.asarray(gt)
    global_scores = text @ gallery32.T
    bank_global = bank_fused = None
    if bank is not None:
        bank = jnp.asarray(bank, jnp.float32)
        bank_global = bank @ gallery32.T
    label = "Global+" + {"csls": "CSLS", "csls-bank": "CSLS(bank)", "shortlist": "CSLS(top-M)",
                         "qbnorm": "QBNorm", "sinkhorn": "Sinkhorn",
                         "dual-softmax": "DualSoftmax", "none": "none"}[settings.rescore]
    results = {"Global": _metrics(global_scores, gt, settings)}
    if settings.rescore != "none":
        results[label] = _metrics(_rescore(global_scores, settings, bank_scores=bank_global,
                                           global_scores=global_scores), gt, settings)
    if emb.crops is not None:
        crops = jnp.asarray(emb.crops)
        fused = miner.fused_scores(text, gallery, crops, alpha=settings.alpha, pool=settings.pool)
        results["Global+crops"] = _metrics(fused, gt, settings)
        if bank is not None:
            bank_fused = miner.fused_scores(bank, gallery, crops, alpha=settings.alpha,
                                            pool=settings.pool)
        results["MINER"] = _metrics(_rescore(fused, settings, bank_scores=bank_fused,
                                             global_scores=global_scores), gt, settings)
    return results


def evaluate_streaming(emb: GalleryEmbeddings, gt: np.ndarray, settings: Settings = Settings(),
                       bank: np.ndarray | None = None, chunk: int = 65536) -> dict[str, dict]:
    """`evaluate` for galleries whose [Q, G] matrix should not be formed: the same four rows
    through `miner.stream.search` (chunked, float16 gallery). Rescoring: csls (transductive),
    csls-bank or none. Recall from exact ground-truth ranks; hubness from the top-k lists."""
    from sclaro_jax.miner import stream

    if settings.rescore not in ("csls", "csls-bank", "none"):
        raise ValueError(f"--stream supports --rescore csls, csls-bank or none, not "
                         f"{settings.rescore!r}")
    if settings.rescore == "csls-bank" and bank is None:
        raise ValueError("--rescore csls-bank needs a query bank (--bank)")
    gt = np.asarray(gt)
    n_images = emb.images.shape[0]
    k = min(settings.k, n_images)
    top = max(k, max(settings.ks))
    label = {"csls": "Global+CSLS", "csls-bank": "Global+CSLS(bank)"}.get(settings.rescore)
    rows = [("Global", False, "none")]
    if label:
        rows.append((label, False, "csls"))
    if emb.crops is not None:
        rows.append(("Global+crops", True, "none"))
        rows.append(("MINER", True, "csls" if label else "none"))
    results = {}
    for name, with_crops, rescore in rows:
        res = stream.search(emb.texts, emb.images, emb.crops if with_crops else None,
                            alpha=settings.alpha, pool=settings.pool, k=k, rescore=rescore,
                            bank=bank if (rescore == "csls" and settings.rescore == "csls-bank")
                            else None, top=min(top, n_images), chunk=chunk, gt=gt)
        recall = miner.recall_from_ranks(res.gt_rank, settings.ks)
        out = {f"R@{kk}": v for kk, v in recall.items()}
        out.update(miner.hubness_from_topk(res.indices[:, :k], n_images))
        results[name] = out
    return results


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

def markdown(results: dict[str, dict[str, dict]], title: str = "") -> str:
    """The paper's layout: one row per method, R@1/5/10 per split; then hubness per split."""
    splits = list(results)
    methods = list(dict.fromkeys(m for s in splits for m in results[s]))
    ks = sorted({int(key[2:]) for s in splits for m in results[s].values() for key in m
                 if key.startswith("R@")})
    lines = [f"### {title}", ""] if title else []
    head = "| method | " + " | ".join(f"{s} R@{k}" for s in splits for k in ks) + " |"
    lines += [head, "|---|" + "---:|" * (len(splits) * len(ks))]
    for m in methods:
        cells = [f"{results[s][m][f'R@{k}']:.2f}" if m in results[s] else "-"
                 for s in splits for k in ks]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "| method | " + " | ".join(
        f"{s} skewness | {s} never retrieved % | {s} worst hub (count)" for s in splits) + " |",
        "|---|" + "---:|" * (3 * len(splits))]
    for m in methods:
        cells = []
        for s in splits:
            r = results[s].get(m)
            cells += (["-"] * 3 if r is None else
                      [f"{r['skewness']:.2f}", f"{100 * r['never_retrieved']:.1f}",
                       f"{r.get('worst_hub', '-')} ({r.get('worst_hub_count', '-')})"])
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = cli.parser(
        "python -m sclaro_jax.eval.rocs",
        __doc__.split("\n\n")[0].rstrip(".") + ": Global, Global+CSLS and MINER "
        "R@1/5/10 and hubness on ROCS, COCO 5K and Flickr30K 1K.")
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True,
                   help="Hugging Face CLIPModel / SiglipModel / Siglip2Model folder, a "
                        "ScenarioCLIP training workdir (with --level), or 'planted-colours' "
                        "(the synthetic benchmark's encoder)")
    g.add_argument("--level", choices=("global", "object", "relation"),
                   help="ScenarioCLIP level to evaluate (workdir models only)")
    g.add_argument("--teacher", action="store_true",
                   help="use the EMA teacher instead of the student (ScenarioCLIP workdirs)")
    g.add_argument("--bf16", action="store_true", help="bfloat16 compute in the towers")
    g.add_argument("--batch-size", type=int, default=None,
                   help="views per encoder call (default: the encoder's own)")
    d = p.add_argument_group("data")
    d.add_argument("--split", action="append", required=True, metavar="[NAME=]PATH[:SPLIT]",
                   help="a split to evaluate (repeatable): a datasets save_to_disk folder "
                        "(ROCS; ':SPLIT' picks a split of a DatasetDict), a COCO captions JSON, "
                        "or a Karpathy JSON (dataset_coco.json / dataset_flickr30k.json; "
                        "':SPLIT' defaults to test, images under --image-root)")
    d.add_argument("--image-root", help="image folder for Karpathy / COCO captions files")
    d.add_argument("--image-column", help="image column of a datasets folder (auto)")
    d.add_argument("--caption-column", help="caption column of a datasets folder (auto)")
    d.add_argument("--id-column", help="image-id column of a datasets folder (auto)")
    d.add_argument("--max-images", type=int, default=None,
                   help="evaluate only the first N gallery images of each split (quick runs)")
    m = p.add_argument_group("MINER")
    m.add_argument("--crops", choices=("fixed5", "grid3x3", "random"), default="fixed5",
                   help="region generator")
    m.add_argument("--num-crops", type=int, default=None, help="crops per image (random)")
    m.add_argument("--ratio", type=float, default=0.6,
                   help="fixed5: crop width / image width and crop height / image height "
                        "(--crop-shape square: crop side / short image side)")
    m.add_argument("--crop-shape", choices=("aspect", "square"), default="aspect",
                   help="aspect: the MINER authors' aspect-keeping crops (each fixed crop "
                        "0.6 w x 0.6 h, 36%% of the image); square: their earlier squares of "
                        "side ratio x the short side, for comparison")
    m.add_argument("--crop-seed", type=int, default=0, help="seed of the random crops")
    m.add_argument("--alpha", type=float, default=0.4, help="weight of the crop score")
    m.add_argument("--pool", choices=("max", "mean"), default="max", help="pooling over crops")
    m.add_argument("--k", type=int, default=10, help="CSLS neighbourhood size (and hubness k)")
    m.add_argument("--rescore", choices=RESCORES, default="csls", help="rescoring method")
    m.add_argument("--bank", metavar="SPLIT_OR_TXT",
                   help="query bank for csls-bank / qbnorm: a split spec (its captions) or a "
                        ".txt file with one query per line")
    m.add_argument("--shortlist-m", type=int, default=25, help="shortlist size M")
    m.add_argument("--qbnorm-beta", type=float, default=20.0, help="QBNorm inverse temperature")
    m.add_argument("--sinkhorn-tau", type=float, default=0.02, help="Sinkhorn temperature")
    m.add_argument("--sinkhorn-iters", type=int, default=1, help="Sinkhorn iterations")
    m.add_argument("--dual-softmax-tau", type=float, default=0.01,
                   help="dual-softmax temperature")
    m.add_argument("--stream", choices=("auto", "on", "off"), default="auto",
                   help="score in gallery chunks without forming the [queries x images] matrix "
                        "(miner.stream); auto: when that matrix would exceed --stream-above")
    m.add_argument("--stream-above", type=float, default=200_000_000,
                   help="matrix entries above which --stream auto streams")
    m.add_argument("--chunk", type=int, default=65536, help="gallery chunk when streaming")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="rocs_results", help="folder for results.json / results.md")
    o.add_argument("--cache-dir", default=None,
                   help="embedding cache (default: OUT/cache); reruns reuse it")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _bank_texts(spec: str, args) -> list[str]:
    if spec.endswith(".txt"):
        path = Path(spec)
        if not path.is_file():
            raise data_lib.SplitError(f"query bank file not found: {path}")
        texts = [t.strip() for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]
        if not texts:
            raise data_lib.SplitError(f"query bank {path} has no queries")
        return texts
    return data_lib.load_split(spec, image_root=args.image_root).queries


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = Settings(alpha=args.alpha, pool=args.pool, k=args.k, rescore=args.rescore,
                            shortlist_m=args.shortlist_m, qbnorm_beta=args.qbnorm_beta,
                            sinkhorn_tau=args.sinkhorn_tau, sinkhorn_iters=args.sinkhorn_iters,
                            dual_softmax_tau=args.dual_softmax_tau)
        crops = CropSpec(args.crops, args.ratio, args.num_crops, args.crop_seed,
                         args.crop_shape)
        crops.boxes(100, 100)  # validates kind / ratio / n before any work
        if settings.rescore in ("csls-bank", "qbnorm") and not args.bank:
            raise ValueError(f"--rescore {settings.rescore} needs --bank")
        columns = {k: v for k, v in (("image_column", args.image_column),
                                     ("caption_column", args.caption_column),
                                     ("id_column", args.id_column)) if v}
        splits = [data_lib.load_split(s, image_root=args.image_root, **columns)
                  for s in args.split]
        if args.max_images:
            splits = [s.subset(args.max_images) for s in splits]
        encoder = enc_lib.load_encoder(args.model, level=args.level, teacher=args.teacher,
                                       batch_size=args.batch_size,
                                       dtype=jnp.bfloat16 if args.bf16 else jnp.float32)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache_dir) if args.cache_dir else out / "cache"
    bank = None
    if args.bank:
        bank = encoder.encode_texts(_bank_texts(args.bank, args))
    results, info = {}, {}
    for split in splits:
        t0 = time.perf_counter()
        emb = embed_split(encoder, split, crops, cache_dir=cache, progress=not args.no_progress)
        t1 = time.perf_counter()
        big = len(split.queries) * split.num_images > args.stream_above
        if args.stream == "on" or (args.stream == "auto" and big):
            results[split.name] = evaluate_streaming(emb, split.gt, settings, bank=bank,
                                                     chunk=args.chunk)
        else:
            results[split.name] = evaluate(emb, split.gt, settings, bank=bank)
        info[split.name] = {"images": split.num_images, "queries": len(split.queries),
                            "source": split.source, "embed_s": round(t1 - t0, 3),
                            "score_s": round(time.perf_counter() - t1, 3)}
    record = {"model": encoder.name, "settings": dataclasses.asdict(settings),
              "crops": dataclasses.asdict(crops), "splits": info, "results": results}
    (out / "results.json").write_text(json.dumps(record, indent=1))
    table = markdown(results, f"{encoder.name}: text-to-image retrieval")
    (out / "results.md").write_text(table)
    print(table)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
