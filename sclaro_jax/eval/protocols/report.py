"""Markdown tables of the ScenarioCLIP evaluators' results (docs/design.md, section 3)."""

from __future__ import annotations

from sclaro_jax.bounds import printable
from sclaro_jax.eval.protocols import metrics


def _fmt(v) -> str:
    return "—" if v is None else f"{v:.2f}"


def markdown_tables(result: dict) -> str:
    """The result of `evaluate_scenario` as Markdown tables: zero-shot (strict / lenient),
    zero-shot top-1 by source dataset (appendix Table A2 layout), linear probe, PredCls and
    SGCls. Names from the data (the model, split and source names) are shown with their
    control characters escaped (`bounds.printable`)."""
    ks = result.get("settings", {}).get("ks", list(metrics.DEFAULT_KS))
    top = [f"top{k}" for k in ks]
    parts = [f"Evaluation of {printable(result.get('settings', {}).get('model', 'model'))} on "
             f"{printable(result.get('split'))} ({result.get('num_images')} images, "
             f"{result.get('num_objects')} objects, {result.get('num_relations')} relations)"]
    zs = result.get("zero_shot")
    if zs:
        lines = ["| Task | Form | Classes | N | " + " | ".join(f"Top-{k}" for k in ks) + " |",
                 "|---|---|---:|---:|" + "---:|" * len(ks)]
        for task in ("action", "object", "relation"):
            for form in ("strict", "lenient"):
                if form in zs.get(task, {}):
                    a = zs[task][form]["all"]
                    lines.append(f"| {task} | {form} | {zs[task]['classes']} | {a['n']} | "
                                 + " | ".join(_fmt(a.get(t)) for t in top) + " |")
        parts.append("### Zero-shot retrieval\n\n" + "\n".join(lines))
        sources = sorted({s for t in zs.values() for s in t["strict"]["by_source"]})
        head = ["Source"] + [f"{t.capitalize()} {form} Top-{k}"
                             for t in ("action", "object", "relation")
                             for form in (("strict",) if t == "action" else
                                          ("strict", "lenient"))
                             for k in ks]
        lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for s in sources:
            row = [printable(s)]
            for t in ("action", "object", "relation"):
                for form in (("strict",) if t == "action" else ("strict", "lenient")):
                    g = zs[t][form]["by_source"].get(s, {})
                    row += [_fmt(g.get(x)) for x in top]
            lines.append("| " + " | ".join(row) + " |")
        parts.append("### Zero-shot retrieval by source (Table A2 layout)\n\n" + "\n".join(lines))
    lp = result.get("linear_probe")
    if lp:
        lines = ["| Task | Classes (train) | N test | Unseen in train | "
                 + " | ".join(f"Top-{k}" for k in ks) + " |",
                 "|---|---:|---:|---:|" + "---:|" * len(ks)]
        for task, r in lp.items():
            lines.append(f"| {task} | {r['classes']} | {r['n']} | {r['unseen_test']} | "
                         + " | ".join(_fmt(r.get(t)) for t in top) + " |")
        parts.append("### Linear probe\n\n" + "\n".join(lines))
    rows = [(name, result[name]) for name in ("predcls", "sgcls") if result.get(name)]
    if rows:
        lines = ["| Protocol | Predicates | Relations kept / total | "
                 + " | ".join(f"mR@{k}" for k in ks) + " | "
                 + " | ".join(f"R@{k}" for k in ks) + " |",
                 "|---|---:|---:|" + "---:|" * (2 * len(ks))]
        for name, r in rows:
            lines.append(f"| {name} | {r['predicates']} | {r['n']} / {r['relations_total']} | "
                         + " | ".join(_fmt(r.get(f"mR@{k}")) for k in ks) + " | "
                         + " | ".join(_fmt(r.get(f"R@{k}")) for k in ks) + " |")
            if name == "sgcls":
                lines.append(f"| sgcls (objects correct) | {r['predicates']} | {r['n']} / "
                             f"{r['relations_total']} | "
                             + " | ".join(_fmt(r.get(f"graph_mR@{k}")) for k in ks) + " | "
                             + " | ".join(_fmt(r.get(f"graph_R@{k}")) for k in ks) + " |")
        text = "### PredCls / SGCls\n\n" + "\n".join(lines)
        if result.get("sgcls"):
            text += (f"\n\nSGCls object classification top-1: "
                     f"{_fmt(result['sgcls']['object_top1'])} "
                     f"({result['sgcls']['object_classes']} train object classes)")
        parts.append(text)
    return "\n\n".join(parts) + "\n"


def localisation_table(res: dict) -> str:
    """The `localisation` evaluator's result ({variant: metrics}) as a Markdown table."""
    lines = ["| localisation | Dice | IoU | MAE | train / test relations |",
             "|---|---:|---:|---:|---|"]
    for variant, r in res.items():
        lines.append(f"| {variant} | {r['dice']:.4f} | {r['iou']:.4f} | {r['mae']:.4f} | "
                     f"{r['num_train']} / {r['num_test']} |")
    return "\n".join(lines) + "\n"
