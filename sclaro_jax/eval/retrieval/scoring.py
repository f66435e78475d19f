"""The scorings of a retrieval split and their tables (`python -m sclaro_jax.eval.rocs` runs them
on each split; docs/design.md, section 4).

`evaluate` ranks the four scorings of one split (Global, Global + rescoring, Global + crops,
MINER) from its gallery embeddings; `evaluate_streaming` gives the same rows from gallery chunks
(`miner.stream`) when the [queries x images] matrix should not be formed; `markdown` lays the
results out as the paper's tables. `Settings` holds MINER's and the rescorings' parameters.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sclaro_jax import miner
from sclaro_jax.eval.retrieval.gallery import GalleryEmbeddings

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
    """The paper's layout: one row per method, R@1/5/10 per split; then hubness per split.
    Split names (file or folder names) are shown with control characters escaped."""
    from sclaro_jax.bounds import printable

    splits = list(results)
    methods = list(dict.fromkeys(m for s in splits for m in results[s]))
    ks = sorted({int(key[2:]) for s in splits for m in results[s].values() for key in m
                 if key.startswith("R@")})
    lines = [f"### {printable(title)}", ""] if title else []
    head = "| method | " + " | ".join(f"{printable(s)} R@{k}" for s in splits for k in ks) \
        + " |"
    lines += [head, "|---|" + "---:|" * (len(splits) * len(ks))]
    for m in methods:
        cells = [f"{results[s][m][f'R@{k}']:.2f}" if m in results[s] else "-"
                 for s in splits for k in ks]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    names = [printable(s) for s in splits]
    lines += ["", "| method | " + " | ".join(
        f"{s} skewness | {s} never retrieved % | {s} worst hub (count)" for s in names) + " |",
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
