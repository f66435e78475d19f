"""Figures of the ScenarioCLIP evaluation (appendix Figs. A5, A6 and training curves), as PNGs.

- `attention_overlays`: patch-to-CLS similarity maps of the object visual encoder (Fig. A5).
  Each image is brought to the encoder's input size S by the evaluation view (Resize(S) +
  CenterCrop(S), bicubic) and fed whole through the `object` pair's vision tower. From the
  tower's last hidden state (the final encoder layer's output for every token, before the
  post-LayerNorm: Hugging Face's `last_hidden_state`) the cosine similarity between each patch
  token and the CLS token is taken, laid out as the h x w patch grid (row-major, as
  `clip.patchify` orders patches), bilinearly upsampled to S x S (half-pixel centres), min-max
  scaled to [0, 1] per image, and drawn with the jet colour map at alpha 0.5 over that same
  S x S view. Rows are images; the first column is the view alone, then one column per model.
  Every panel is exactly `panel_px` x `panel_px` pixels at a known place in the PNG (returned),
  so the overlay is aligned with the image pixel for pixel.
- `tsne_plot`: 2-D t-SNE (scikit-learn) of embeddings coloured by class, the `top_k` most
  frequent classes in the legend and the rest grey (Fig. A6).
- `training_curves`: loss, loss_ca, loss_kd, lr and kd_temperature against step from a
  training workdir's `metrics.jsonl` (fields per API.md).

matplotlib runs on the Agg backend; nothing is shown on screen.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from sclaro_jax import bounds, ops  # noqa: E402
from sclaro_jax.data import augment  # noqa: E402
from sclaro_jax.eval.protocols.localise import patch_grid, vision_tower  # noqa: E402
from sclaro_jax.files import write_replacing  # noqa: E402

CURVE_FIELDS = ("loss", "loss_ca", "loss_kd", "lr", "kd_temperature")


class FigureError(ValueError):
    """A figure that cannot be drawn from what was given; the message says why."""


# --------------------------------------------------------------------------- attention maps

def eval_view(image: np.ndarray, image_size: int) -> np.ndarray:
    """uint8 [H, W, 3] -> the uint8 [S, S, 3] view the encoder sees (Resize + CenterCrop)."""
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
        raise FigureError(f"images must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
    return np.asarray(augment.resize_centre_crop(Image.fromarray(image), image_size))


def cls_similarity(tower, views: np.ndarray) -> np.ndarray:
    """uint8 views [B, S, S, 3] -> cosine similarity of each patch token to the CLS token of the
    tower's last hidden state, float32 [B, h, w] (row-major patch grid)."""
    hidden, _ = tower(jnp.asarray(ops.normalize(np.asarray(views))))
    hidden = jnp.asarray(hidden, jnp.float32)
    patches = patch_grid(hidden)
    cls = hidden[:, 0][:, None, None, :]
    return np.asarray(jnp.sum(ops.l2_normalize(patches) * ops.l2_normalize(cls), axis=-1))


def upsample_map(grid: np.ndarray, size: int) -> np.ndarray:
    """[B, h, w] -> [B, size, size] bilinear (half-pixel centres), then min-max scaled to
    [0, 1] per map (a constant map becomes 0)."""
    grid = jnp.asarray(grid, jnp.float32)
    up = np.asarray(jax.image.resize(grid, (grid.shape[0], size, size), method="bilinear"))
    lo = up.min(axis=(1, 2), keepdims=True)
    span = up.max(axis=(1, 2), keepdims=True) - lo
    return np.where(span > 0, (up - lo) / np.where(span > 0, span, 1.0), 0.0).astype(np.float32)


def _grid_figure(rows: int, cols: int, panel_px: int, title_px: int, dpi: int):
    """A figure of rows x cols panels of exactly panel_px pixels, a title band above; returns
    (fig, axes [rows][cols], panel boxes {(r, c): (x0, y0, x1, y1)} in PNG pixels)."""
    width, height = cols * panel_px, rows * panel_px + title_px
    fig = plt.figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    axes, boxes = [], {}
    for r in range(rows):
        row = []
        for c in range(cols):
            x0, y0 = c * panel_px, title_px + r * panel_px
            ax = fig.add_axes((x0 / width, 1 - (y0 + panel_px) / height,
                               panel_px / width, panel_px / height))
            ax.set_axis_off()
            row.append(ax)
            boxes[(r, c)] = (x0, y0, x0 + panel_px, y0 + panel_px)
        axes.append(row)
    return fig, axes, boxes


def attention_overlays(models: Mapping[str, object], images: Sequence[np.ndarray],
                       out_png: str, image_size: int, *, level: str = "object",
                       panel_px: int = 224, title_px: int = 28, alpha: float = 0.5,
                       dpi: int = 100) -> dict:
    """Patch-to-CLS cosine maps of each model's `level` vision tower over each image, as a PNG
    grid: rows = images, columns = the view, then one per model (in `models` order).

    `models`: name -> ScenarioCLIP / PyramidCLIP / CLIPPair / vision tower (see
    `localise.vision_tower`). `images`: uint8 [H, W, 3]. Returns {"views": uint8 [N, S, S, 3],
    "maps": {name: float32 [N, S, S] in [0, 1]}, "grids": {name: raw cosine [N, h, w]},
    "panels": {(row, col): (x0, y0, x1, y1) pixel box in the PNG}, "size": (width, height)}.
    """
    if not models:
        raise FigureError("attention_overlays needs at least one model")
    if not images:
        raise FigureError("attention_overlays needs at least one image")
    views = np.stack([eval_view(img, image_size) for img in images])
    grids = {name: cls_similarity(vision_tower(m, level), views) for name, m in models.items()}
    maps = {name: upsample_map(g, image_size) for name, g in grids.items()}
    names = list(models)
    fig, axes, boxes = _grid_figure(len(views), len(names) + 1, panel_px, title_px, dpi)
    extent = (0, image_size, image_size, 0)  # pixel edges: the view fills its panel exactly
    for r, view in enumerate(views):
        for c in range(len(names) + 1):
            ax = axes[r][c]
            ax.imshow(view, extent=extent, aspect="auto", interpolation="nearest")
            if c:
                ax.imshow(maps[names[c - 1]][r], extent=extent, aspect="auto", cmap="jet",
                          vmin=0.0, vmax=1.0, alpha=alpha, interpolation="nearest")
            ax.set_xlim(0, image_size)
            ax.set_ylim(image_size, 0)
    height = len(views) * panel_px + title_px
    for c, title in enumerate(["image"] + names):
        fig.text((c + 0.5) * panel_px / ((len(names) + 1) * panel_px),
                 1 - 0.5 * title_px / height, title, ha="center", va="center",
                 fontsize=max(6, min(11, panel_px // 20)))
    _save(fig, out_png, dpi)
    return {"views": views, "maps": maps, "grids": grids, "panels": boxes,
            "size": ((len(names) + 1) * panel_px, height)}


def _save(fig, out_png: str, dpi: int) -> None:
    folder = os.path.dirname(os.path.abspath(out_png))
    os.makedirs(folder, exist_ok=True)
    write_replacing(out_png, lambda f: fig.savefig(f, dpi=dpi, format="png"))
    plt.close(fig)


# --------------------------------------------------------------------------- t-SNE

def tsne_plot(embeddings: np.ndarray, labels: Sequence[str], out_png: str, *, top_k: int = 10,
              perplexity: float = 30.0, seed: int = 0, max_iter: int = 1000, title: str = ""
              ) -> np.ndarray:
    """t-SNE (2-D, PCA init, `perplexity` clipped to n - 1, `max_iter` >= 250 optimisation
    iterations) of `embeddings` [N, D], points
    coloured by `labels`: the `top_k` most frequent classes get a colour and a legend entry,
    the rest are grey ("other"). Writes `out_png`; returns the 2-D coordinates [N, 2]."""
    from sklearn.manifold import TSNE

    x = np.asarray(embeddings, np.float32)
    labels = [str(lab) for lab in labels]
    if x.ndim != 2 or len(x) != len(labels):
        raise FigureError(f"embeddings {x.shape} and {len(labels)} labels do not match")
    if len(x) < 3:
        raise FigureError(f"t-SNE needs at least 3 points, got {len(x)}")
    perp = float(min(perplexity, len(x) - 1))
    coords = TSNE(n_components=2, perplexity=perp, init="pca", random_state=seed,
                  max_iter=max_iter).fit_transform(x)
    top = [lab for lab, _ in Counter(labels).most_common(top_k)]
    fig, ax = plt.subplots(figsize=(7, 6), dpi=100)
    arr = np.asarray(labels)
    rest = ~np.isin(arr, top)
    if rest.any():
        ax.scatter(coords[rest, 0], coords[rest, 1], s=6, c="lightgrey", label="other")
    cmap = plt.get_cmap("tab10" if len(top) <= 10 else "tab20")
    for i, lab in enumerate(top):
        sel = arr == lab
        ax.scatter(coords[sel, 0], coords[sel, 1], s=10, color=cmap(i % cmap.N), label=lab)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title or f"t-SNE of {len(x)} embeddings (perplexity {perp:g})")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, markerscale=2)
    fig.tight_layout()
    _save(fig, out_png, 100)
    return coords


# --------------------------------------------------------------------------- training curves

def read_metrics(metrics_jsonl: str) -> list[dict]:
    """The rows of a `metrics.jsonl` that carry a `step` (blank lines skipped)."""
    if not os.path.exists(metrics_jsonl):
        raise FigureError(f"{metrics_jsonl} not found")
    rows = []
    with open(metrics_jsonl, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = bounds.parse_json(line, f"{metrics_jsonl} line {i}")
            except json.JSONDecodeError as e:
                raise FigureError(f"{metrics_jsonl} line {i}: not JSON ({e})") from None
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def training_curves(metrics_jsonl: str, out_png: str,
                    fields: Sequence[str] = CURVE_FIELDS) -> list[str]:
    """One panel per field of `fields` (default loss, loss_ca, loss_kd, lr, kd_temperature)
    against step, from a workdir's `metrics.jsonl`. Fields that no row logs are drawn as an
    empty panel saying so. Writes `out_png`; returns the fields that had data."""
    rows = read_metrics(metrics_jsonl)
    if not rows:
        raise FigureError(f"{metrics_jsonl} has no rows with a 'step'")
    cols = min(3, len(fields))
    nrows = math.ceil(len(fields) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), dpi=100,
                             squeeze=False)
    plotted = []
    for i, field in enumerate(fields):
        ax = axes[i // cols][i % cols]
        pts = [(r["step"], r[field]) for r in rows
               if isinstance(r.get(field), (int, float)) and math.isfinite(r[field])]
        ax.set_title(field)
        ax.set_xlabel("step")
        if pts:
            steps, values = zip(*sorted(pts))
            ax.plot(steps, values, lw=1.2)
            plotted.append(field)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    for j in range(len(fields), nrows * cols):
        axes[j // cols][j % cols].set_axis_off()
    fig.tight_layout()
    _save(fig, out_png, 100)
    return plotted
