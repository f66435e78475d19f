"""What a curator reads beside a clusters file: a per-cluster table (`*.clusters.md`: id,
label, size, stability, example names) and hdbscan's condensed-tree plot (`*.tree.png`),
its selected clusters circled and numbered with the clusters file's ids.

Stability is the quantity HDBSCAN's "eom" selection maximises, in the units of the fit
(lambda = 1 / cosine distance): for a cluster C born at lambda_birth(C),
sum over the names and sub-clusters leaving C of (lambda_leave - lambda_birth(C)) x size.
Bigger means the names stay together over a longer range of distances.

A clusters file that comes back with no label at all is refused (`check_labelled`), listing
the clusters to read first (`needing_a_look`), unless the curator accepts every suggestion.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from sclaro_jax import bounds
from sclaro_jax.files import write_replacing

EXAMPLES = 6  # names shown per cluster in the table
LOOK, LOOK_NAMES = 5, 8  # clusters, and names of each, listed when an unlabelled file is refused


def report_paths(clusters_path) -> tuple[Path, Path]:
    """(table, figure) paths beside `clusters_path`: X.json -> X.md, X.tree.png."""
    stem = os.path.splitext(str(clusters_path))[0]
    return Path(stem + ".md"), Path(stem + ".tree.png")


def selected_nodes(clusterer) -> list[int]:
    """The condensed-tree node of each hdbscan label (index = label): hdbscan numbers its
    clusters in the order of their sorted selected nodes, as its plot and prediction do."""
    return sorted(int(c) for c in clusterer.condensed_tree_._select_clusters())


def cluster_stability(clusterer) -> dict[int, float]:
    """{hdbscan label: eom stability} from the condensed tree (see the module docstring)."""
    raw = clusterer.condensed_tree_.to_numpy()
    birth = dict(zip(raw["child"].tolist(), raw["lambda_val"].tolist()))
    out = {}
    for label, node in enumerate(selected_nodes(clusterer)):
        rows = raw[raw["parent"] == node]
        out[label] = float(np.sum((rows["lambda_val"] - birth.get(node, 0.0))
                                  * rows["child_size"]))
    return out


def _file_ids(doc: dict, names: list[str], labels: np.ndarray) -> dict[int, int]:
    """hdbscan label -> the clusters file's id (a cluster's first member decides)."""
    at = {n: i for i, n in enumerate(names)}
    out = {}
    for c in doc["clusters"]:
        first = at.get(c["members"][0]) if c.get("members") else None
        if first is not None and labels[first] >= 0:
            out[int(labels[first])] = c["id"]
    return out


def format_table(doc: dict, stability: dict[int, float] | None = None) -> str:
    """Markdown rows for every cluster of a clusters document; `stability` by file id."""
    stability = stability or {}
    lines = ["| id | label | size | stability | example names |", "|---|---|---|---|---|"]
    for c in doc["clusters"]:
        label = c.get("label") or c.get("suggested_label", "")
        members = c.get("members", [])
        strength = c.get("strength", {})
        shown = [f"{m} ({strength[m]:.2f})" if m in strength else m
                 for m in members[:EXAMPLES]]
        more = f" +{len(members) - EXAMPLES}" if len(members) > EXAMPLES else ""
        if c.get("curated"):
            value = "curated"
        elif c["id"] in stability:
            value = f"{stability[c['id']]:.3g}"
        else:
            value = "-"
        lines.append(f"| {c['id']} | {label} | {len(members)} | {value} | "
                     f"{', '.join(shown)}{more} |")
    lines.append(f"\n{len(doc['clusters'])} clusters; {len(doc.get('noise', []))} names in "
                 f"noise.")
    return "\n".join(lines) + "\n"


def plot_tree(path, clusterer, file_ids: dict[int, int], title: str) -> list[str]:
    """hdbscan's condensed-tree (icicle) plot, selected clusters circled and numbered with
    the clusters file's ids. Returns the numbers drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Ellipse

    n = len(file_ids)
    fig, ax = plt.subplots(figsize=(min(40.0, 10.0 + 0.12 * n), 7.0))
    clusterer.condensed_tree_.plot(select_clusters=True, label_clusters=True, axis=ax,
                                   colorbar=True)
    for text in ax.texts:  # hdbscan writes the label index; the curator reads file ids
        label = int(text.get_text())
        text.set_text(str(file_ids.get(label, label)))
        # hdbscan 0.8.40 places the label of a cluster with an infinite lambda (names at
        # cosine distance 0) at a 1-element array, which matplotlib cannot draw
        text.xyann = tuple(float(np.ravel(v)[0]) for v in text.xyann)
    for patch in ax.patches:
        if isinstance(patch, Ellipse):
            patch.height = float(np.ravel(patch.height)[0])
    ax.set_title(title)
    fig.tight_layout()
    write_replacing(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)
    return [t.get_text() for t in ax.texts]


def write_report(clusters_path, doc: dict, names: list[str], labels: np.ndarray,
                 clusterer=None, *, header: str = "") -> tuple[Path, Path | None]:
    """Write the table (always) and the condensed-tree figure (when `clusterer` found a
    cluster; a stale figure is removed otherwise). `names`/`labels`: what `clusterer` was fit
    on, to map its labels onto `doc`'s ids. Returns (table, figure or None)."""
    table, figure = report_paths(clusters_path)
    labels = np.asarray(labels)
    file_ids = _file_ids(doc, list(names), labels)
    stability = {}
    if clusterer is not None and labels.max(initial=-1) >= 0:
        stability = {file_ids[k]: v for k, v in cluster_stability(clusterer).items()
                     if k in file_ids}
    text = f"# Clusters of {Path(clusters_path).name}\n\n{header}" + format_table(doc, stability)
    write_replacing(table, lambda f: f.write(text.encode("utf-8")))
    if not stability:
        figure.unlink(missing_ok=True)
        return table, None
    plot_tree(figure, clusterer, file_ids,
              f"condensed tree of {len(names)} names: {len(file_ids)} clusters (ovals, "
              f"numbered as in {Path(clusters_path).name})")
    return table, figure


class UnlabelledClusters(ValueError):
    """The second pass on a clusters file in which no cluster has a label: every cluster would
    take its suggested_label unread. `curate(accept_suggested=True)` (`--accept-suggested`)
    takes them as they are."""


def _head_words(members: list[str]) -> int:
    """Distinct last words: "dog", "small dog" share one; "wall", "tower", "pagoda" are three."""
    return len({m.split()[-1] for m in members})


def _fresh(doc: dict) -> list[dict]:
    """The new clusters (not an extension's curated ones), in file order, each with an "id"
    (its position where the file has none)."""
    return [{"id": i, **c} for i, c in enumerate(doc["clusters"]) if not c.get("curated")]


def needing_a_look(doc: dict, count: int = LOOK) -> list[dict]:
    """The new clusters a curator should read first: the most distinct head words
    (`_head_words`), then the most names, then in file order."""
    return sorted(_fresh(doc), key=lambda c: (-_head_words(c["members"]),
                                              -len(c["members"])))[:count]


def check_labelled(path, *, accept_suggested: bool = False) -> None:
    """UnlabelledClusters, listing the clusters that most need a look, unless a new cluster
    of the clusters file at `path` (already read by `cluster.read_curated`) has a "label",
    there is none, or `accept_suggested`."""
    doc = bounds.read_json(path)
    fresh = _fresh(doc)
    if accept_suggested or not fresh or any((c.get("label") or "").strip() for c in fresh):
        return
    lines = []
    for c in needing_a_look(doc):
        members = c["members"]
        more = f", +{len(members) - LOOK_NAMES} more" if len(members) > LOOK_NAMES else ""
        lines.append(f"  cluster {c['id']} ({len(members)} names, {_head_words(members)} head "
                     f"words) -> {c['suggested_label']!r}: "
                     f"{', '.join(members[:LOOK_NAMES])}{more}")
    raise UnlabelledClusters(
        f"{path}: no cluster has a \"label\", so each of the {len(fresh)} clusters would "
        f"take its suggested_label unread; label them (a cluster left empty takes its "
        f"suggestion), or pass --accept-suggested to take every suggestion as it is. The "
        f"clusters that most need a look (most distinct head words, then size; all in "
        f"{report_paths(path)[0]}):\n" + "\n".join(lines))
