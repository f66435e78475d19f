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

`--index DIR` (one split; repeat it for each shard of a sharded index) adds a row `MINER (index)`:
the same split's queries searched through an ANN index of its gallery (`miner.index`, built
from this command's embedding cache), re-ranked by the exact MINER score with CSLS (r_i from the
index's query bank, r_q over the shortlist). An index built with another encoder, crop rule,
dimension, alpha, k or pooling is refused naming both values.
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

from sclaro_jax import cli
from sclaro_jax.eval import encoders as enc_lib
from sclaro_jax.files import write_replacing
from sclaro_jax.eval.retrieval import data as data_lib
from sclaro_jax.eval.retrieval.gallery import CropSpec, embed_split
from sclaro_jax.eval.retrieval.scoring import (RESCORES, Settings, evaluate, evaluate_streaming,
                                               markdown)


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
    g.add_argument("--step", type=int, default=None,
                   help="checkpoint step of a workdir --model (default: the newest)")
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
    from sclaro_jax.miner.index import settings as ix  # the index's ranges
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
    m.add_argument("--alpha", type=ix.ranged("alpha"), default=0.4, help="weight of the crop score")
    m.add_argument("--pool", choices=("max", "mean"), default="max", help="pooling over crops")
    m.add_argument("--k", type=ix.ranged("k"), default=10, help="CSLS neighbourhood and hubness k")
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
    _index_flags(m)
    o = p.add_argument_group("output")
    o.add_argument("--out", default="rocs_results", type=cli.writable,
                   help="folder for results.json / results.md")
    o.add_argument("--cache-dir", default=None, type=cli.writable,
                   help="embedding cache (default: OUT/cache); reruns reuse it")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _index_flags(m) -> None:
    """The MINER group's flags of `--index` (an ANN index of the split's gallery)."""
    from sclaro_jax.miner.index import settings as ix  # the index's ranges
    m.add_argument("--index", action="append", metavar="DIR",
                   help="also rank through this ANN index of the split's gallery (python -m "
                        "sclaro_jax.miner.index build; repeat for each shard): row MINER (index)")
    m.add_argument("--index-shortlist", type=ix.ranged("shortlist"),
                   help="--index: candidates per ANN index and shard (default: calibrated)")
    m.add_argument("--index-shortlist-global", type=ix.ranged("shortlist_global"),
                   help="--index: the global index's own candidates, where they differ from "
                        "--index-shortlist's (default: calibrated)")
    m.add_argument("--nprobe", type=ix.ranged("nprobe"),
                   help="--index: IVF lists visited in the crop index (default: calibrated)")
    m.add_argument("--nprobe-global", type=ix.ranged("nprobe_global"),
                   help="--index: IVF lists visited in the global index (default: calibrated)")


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


def _prepare_csls(settings: Settings) -> None:
    """On a CPU, CSLS runs numba kernels that are compiled once per machine (about 20 s, then
    cached on disk: `_cpu_csls.prepare`): said before the wait, and timed."""
    import jax

    from sclaro_jax.miner import _cpu_csls, kernels

    if settings.rescore not in ("csls", "csls-bank", "shortlist") or not kernels.CPU_KERNEL \
            or jax.default_backend() != "cpu":
        return
    print("CSLS kernels (numba): loading them, or on this machine's first run compiling them "
          "(about 20 s, once: cached) ...", file=sys.stderr, flush=True)
    seconds, compiled, cache = _cpu_csls.prepare()
    how = f"compiled and cached in {cache}" if compiled else "loaded from numba's cache"
    print(f"CSLS kernels: {how} ({seconds:.1f} s)", file=sys.stderr, flush=True)


def _open_index(args, encoder, crops: CropSpec, settings: Settings) -> list:
    """The `--index` folders, opened and checked against this run's encoder, crops and MINER
    settings (before any embedding work)."""
    from sclaro_jax.miner import index as index_lib

    expect = {"encoder": encoder.name, "crop_rule": crops.rule,
              "crops": dataclasses.asdict(crops), "alpha": float(settings.alpha),
              "k": int(settings.k), "pool": settings.pool}
    return index_lib.open_shards(args.index, expect=expect)


def _through_index(args, shards: list, emb, split, settings: Settings) -> dict:
    """R@k and hubness of the split's queries searched through the `--index` shards."""
    from sclaro_jax import miner
    from sclaro_jax.miner import index as index_lib

    index_lib.open_shards([], expect={"dim": int(emb.texts.shape[1])}, opened=shards)
    if shards[0].meta["total"] != split.num_images:
        raise index_lib.IndexMismatchError(
            f"{shards[0].path / 'meta.json'}: the index was built with {shards[0].meta['total']} "
            f"images, not {split.num_images}")
    top = min(max(max(settings.ks), settings.k), split.num_images)
    res = index_lib.search(emb.texts, shards, top=top, shortlist=args.index_shortlist,
                           shortlist_global=args.index_shortlist_global,
                           nprobe=args.nprobe, nprobe_global=args.nprobe_global,
                           progress=not args.no_progress)
    ranks = index_lib.gt_ranks(res.indices, split.gt)
    out = {f"R@{k}": v for k, v in miner.recall_from_ranks(ranks, settings.ks).items()}
    hits = res.indices[:, :min(settings.k, top)]
    out.update(miner.hubness_from_topk(hits[hits >= 0], split.num_images))
    return out


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
        for split in splits:  # images a JSON or dataset row names outside their folder
            for reason, n in split.skipped.items():
                print(f"{split.name}: {n} images left out of the gallery unread ({reason}: "
                      f"their paths resolve outside their folder)", file=sys.stderr)
        if args.max_images:
            splits = [s.subset(args.max_images) for s in splits]
        if args.index and len(splits) != 1:
            raise ValueError(f"--index searches one split's gallery; {len(splits)} splits given")
        encoder = enc_lib.load_encoder(args.model, level=args.level, teacher=args.teacher,
                                       batch_size=args.batch_size, step=args.step,
                                       dtype=jnp.bfloat16 if args.bf16 else jnp.float32)
        shards = _open_index(args, encoder, crops, settings) if args.index else None
    except (*cli.USER_ERRORS, ImportError) as e:
        return cli.fail(e)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache_dir) if args.cache_dir else out / "cache"
    bank = None
    if args.bank:
        bank = encoder.encode_texts(_bank_texts(args.bank, args))
    _prepare_csls(settings)
    results, info = {}, {}
    for split in splits:
        t0 = time.perf_counter()
        try:  # the gallery's images are read here: one that cannot be is a user error
            emb = embed_split(encoder, split, crops, cache_dir=cache,
                              progress=not args.no_progress)
        except cli.USER_ERRORS as e:
            return cli.fail(e)
        t1 = time.perf_counter()
        big = len(split.queries) * split.num_images > args.stream_above
        if args.stream == "on" or (args.stream == "auto" and big):
            results[split.name] = evaluate_streaming(emb, split.gt, settings, bank=bank,
                                                     chunk=args.chunk)
        else:
            results[split.name] = evaluate(emb, split.gt, settings, bank=bank)
        if args.index:
            try:
                results[split.name]["MINER (index)"] = _through_index(args, shards, emb, split,
                                                                      settings)
            except (*cli.USER_ERRORS, ImportError) as e:
                return cli.fail(e)
        info[split.name] = {"images": split.num_images, "queries": len(split.queries),
                            "source": split.source, "skipped": split.skipped,
                            "embed_s": round(t1 - t0, 3),
                            "score_s": round(time.perf_counter() - t1, 3)}
    record = {"model": encoder.name, "settings": dataclasses.asdict(settings),
              "crops": dataclasses.asdict(crops), "splits": info, "results": results}
    write_replacing(out / "results.json", lambda f: json.dump(record, f, indent=1), text=True)
    table = markdown(results, f"{encoder.name}: text-to-image retrieval")
    write_replacing(out / "results.md", lambda f: f.write(table), text=True)
    print(table)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    from sclaro_jax.heap import freeze_for_process
    freeze_for_process()  # a command's process: its imports are not scanned again
    raise SystemExit(main())
