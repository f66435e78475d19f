"""Curation that grows with the data: a curated object vocabulary saved with its fitted
clusterer, and new names placed onto it (`python -m data_prep curate --extend PREVIOUS`).

A curated dataset folder keeps, in `object_curation/`:
  - `curation.json`: every curated name with its label and hdbscan cluster, the clustering
    settings, the text encoder (folder, pooling, width) and the hdbscan version;
  - `embeddings.npy`: the names' unit embeddings (float32, in `curation.json`'s order);
  - `clusterer.pkl`: the fitted `hdbscan.HDBSCAN` with its prediction data
    (`curate_cluster.fit_clusterer`).

Extending: names already curated keep their label (they never reach the clusters file).
Each new name gets its nearest curated cluster from `hdbscan.approximate_predict` (the
cluster, and a membership strength in [0, 1]); inside that hdbscan cluster the curated label
of the nearest curated name is the suggestion, so a cluster the curator split or relabelled
suggests what the curator decided. Suggestions with strength >= `min_strength` are written
into the clusters file under their curated label, with the strength, for the curator to
accept (leave them) or move; the other new names are clustered among themselves into new
clusters to label, or noise.

`clusterer.pkl` is a pickle: extend only curations you made or trust.

A curation saved by another hdbscan version, or embedded by another text encoder, is refused:
a pickled clusterer is only read by the version that wrote it, and new names embedded by
another model do not live in the saved names' space. The encoder is checked by what it does:
a sample of the saved names is embedded again and must match the saved vectors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import pickle
from pathlib import Path

import numpy as np

from data_prep.curate import cluster as cc
from data_prep.durable_logs import write_replacing

FORMAT = 1
STATE_DIR = "object_curation"
MIN_STRENGTH = 0.3
"""Default `min_strength`. On the 101-name quality list with MiniLM (tests/
test_curate_extend.py), left out one name at a time and predicted, every suggestion into the
right cluster had strength >= 0.335; 0.3 keeps them all."""
PROBES = 16          # saved names embedded again to recognise the encoder
PROBE_COSINE = 0.999  # the same encoder on another device or batch stays above this


class CurationMismatch(ValueError):
    """A saved curation that this run cannot extend (other encoder, other hdbscan, ...)."""


def hdbscan_version() -> str:
    return importlib.metadata.version("hdbscan")


@dataclasses.dataclass
class Curation:
    """A saved curation: names, their unit embeddings, curated labels, the fitted clusterer."""
    folder: Path
    names: list[str]
    emb: np.ndarray              # float32 [N, D], unit rows
    labels: dict[str, str]       # name -> curated label
    clusters: np.ndarray         # int64 [N], the clusterer's labels (-1 = noise)
    clusterer: object            # hdbscan.HDBSCAN with CosinePredictionData (or None)
    meta: dict
    digest: str = ""             # sha256 of curation.json: what an extension file names


def encoder_info(encoder) -> dict:
    return {"path": encoder.path, "pooling": encoder.pooling,
            "dim": int(encoder.model.config.hidden_size), "max_length": encoder.max_length}


def save_curation(folder, names: list[str], emb: np.ndarray, labels: dict[str, str],
                  clusterer, encoder, params: dict) -> Path:
    """Write `folder` (see the module docstring). `clusterer` was fit on `emb` (None when
    fewer than two names); `params` are its settings (min_cluster_size, min_samples)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(names)
    cc._check_unique(names, str(folder))
    unit = cc._unit_rows(emb).astype(np.float32)
    missing = [n for n in names if n not in labels]
    if missing:
        raise ValueError(f"{folder}: no curated label for {len(missing)} names, e.g. "
                         f"{missing[:5]}")
    clusters = (np.full(len(names), -1) if clusterer is None
                else np.asarray(clusterer.labels_))
    if len(clusters) != len(names) or len(unit) != len(names):
        raise ValueError(f"{folder}: {len(names)} names, {len(unit)} embeddings and "
                         f"{len(clusters)} clustered points")
    # plain pickle keeps the arrays the clusterer shares shared (joblib's does not)
    write_replacing(folder / "clusterer.pkl", lambda f: pickle.dump(clusterer, f, protocol=5))
    write_replacing(folder / "embeddings.npy", lambda f: np.save(f, unit))
    meta = {"format": FORMAT, "hdbscan": hdbscan_version(), "encoder": encoder_info(encoder),
            "params": {k: int(v) for k, v in params.items()},
            "names": names, "labels": [labels[n] for n in names],
            "clusters": [int(k) for k in clusters]}
    cc.write_json(folder / "curation.json", meta)
    return folder


def state_folder(path) -> Path:
    """The `object_curation` folder of a curated dataset folder (or the folder itself)."""
    path = Path(path)
    if (path / STATE_DIR / "curation.json").is_file():
        return path / STATE_DIR
    if (path / "curation.json").is_file():
        return path
    raise FileNotFoundError(
        f"{str(path)!r} holds no saved curation ({STATE_DIR}/curation.json): --extend takes "
        f"the output folder of an earlier `python -m data_prep curate` (made by this version "
        f"or later)")


def _read_meta(folder: Path) -> dict:
    path = folder / "curation.json"
    raw = path.read_bytes()
    try:
        meta = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CurationMismatch(f"{path}: saved curation format {found!r}, this version reads "
                               f"format {FORMAT}")
    for key in ("hdbscan", "encoder", "params", "names", "labels", "clusters"):
        if key not in meta:
            raise ValueError(f"{path}: the field {key!r} is missing")
    n = len(meta["names"])
    if len(meta["labels"]) != n or len(meta["clusters"]) != n:
        raise ValueError(f"{path}: {n} names, {len(meta['labels'])} labels and "
                         f"{len(meta['clusters'])} clusters")
    meta["sha256"] = hashlib.sha256(raw).hexdigest()
    return meta


def check_encoder(folder: Path, meta: dict, emb: np.ndarray, encoder) -> None:
    """Refuse (`CurationMismatch`) unless `encoder` embeds the saved names as they were."""
    saved = meta["encoder"]
    dim = int(encoder.model.config.hidden_size)
    what = (f"{folder} was curated with the text encoder {saved['path']} ({saved['pooling']} "
            f"pooling, {saved['dim']}-d)")
    if dim != emb.shape[1]:
        raise CurationMismatch(f"{what}; the encoder given now, {encoder.path}, is {dim}-d: "
                               f"extending needs the same encoder (--encoder {saved['path']})")
    names = meta["names"]
    if not names:
        return  # nothing was curated: nothing to compare (the width matched)
    pick = np.unique(np.linspace(0, len(names) - 1, min(PROBES, len(names))).astype(int))
    again = encoder.encode([names[i] for i in pick], progress=False)
    cosine = np.sum(again.astype(np.float64) * emb[pick], axis=1)
    worst = int(np.argmin(cosine))
    if cosine[worst] < PROBE_COSINE:
        raise CurationMismatch(
            f"{what}; the encoder given now, {encoder.path} ({encoder.pooling} pooling), "
            f"embeds its names differently (cosine {cosine[worst]:.3f} for "
            f"{names[pick[worst]]!r}; the same encoder gives >= {PROBE_COSINE}): extending "
            f"needs the same encoder (--encoder {saved['path']})")


def load_curation(path, encoder) -> Curation:
    """Read and check a saved curation (`state_folder(path)`) for extension with `encoder`:
    the hdbscan version must be the one that saved it and `encoder` must embed its names as
    they were (`check_encoder`); otherwise `CurationMismatch` says which and why."""
    folder = state_folder(path)
    meta = _read_meta(folder)
    if meta["hdbscan"] != hdbscan_version():
        raise CurationMismatch(
            f"{folder} was saved by hdbscan {meta['hdbscan']}, this is hdbscan "
            f"{hdbscan_version()}: a clusterer pickled by one hdbscan version is not read by "
            f"another. Install hdbscan=={meta['hdbscan']} to extend it, or curate the data "
            f"again without --extend")
    emb_path = folder / "embeddings.npy"
    emb = np.load(emb_path)
    if emb.ndim != 2 or len(emb) != len(meta["names"]):
        raise ValueError(f"{emb_path}: shape {emb.shape}, but {folder / 'curation.json'} "
                         f"lists {len(meta['names'])} names")
    check_encoder(folder, meta, emb, encoder)
    with open(folder / "clusterer.pkl", "rb") as f:
        clusterer = pickle.load(f)
    clusters = np.asarray(meta["clusters"], np.int64)
    if clusterer is not None and not np.array_equal(clusterer.labels_, clusters):
        raise ValueError(f"{folder}: clusterer.pkl does not belong to curation.json "
                         f"(other cluster labels)")
    return Curation(folder, list(meta["names"]), emb,
                    dict(zip(meta["names"], meta["labels"])), clusters, clusterer, meta,
                    meta["sha256"])


def suggest(cur: Curation, names: list[str], emb: np.ndarray,
            min_strength: float = MIN_STRENGTH) -> tuple[dict[str, tuple[str, float]], list[str]]:
    """({new name: (curated label, strength)} for strength >= min_strength, [the others]).

    `hdbscan.approximate_predict` gives each name an hdbscan cluster of the saved fit and a
    strength; the suggestion is the curated label of the nearest saved name in that cluster.
    """
    from hdbscan import approximate_predict

    if not 0.0 <= min_strength <= 1.0:
        raise ValueError(f"min_strength must be in [0, 1], got {min_strength}")
    names = list(names)
    clash = [n for n in names if n in cur.labels]
    if clash:
        raise ValueError(f"{len(clash)} names are already curated in {cur.folder}, e.g. "
                         f"{clash[:5]}: they keep their label and are not suggested again")
    if not names:
        return {}, []
    unit = cc._unit_rows(emb)
    if cur.clusterer is None or cur.clusters.max(initial=-1) < 0:
        return {}, names
    predicted, strength = approximate_predict(cur.clusterer, unit)
    saved = cur.emb.astype(np.float64)
    out, unfit = {}, []
    for i, (k, s) in enumerate(zip(predicted, strength)):
        if k < 0 or s < min_strength:
            unfit.append(names[i])
            continue
        members = np.flatnonzero(cur.clusters == k)
        nearest = members[int(np.argmax(saved[members] @ unit[i]))]
        out[names[i]] = (cur.labels[cur.names[nearest]], float(s))
    return out, unfit


def extension_doc(cur: Curation, suggestions: dict[str, tuple[str, float]],
                  unfit: list[str], unfit_labels: np.ndarray, unfit_emb: np.ndarray,
                  min_strength: float) -> dict:
    """The clusters file of an extension: first the curated clusters that received
    suggestions (label set, "curated": true, a few curated "examples", the suggested new
    names as "members" by falling strength, "strength" per name), then the new clusters of
    the unfit names (numbered on), then their noise. "curated_labels" lists every curated
    label, for moving a name into a curated cluster that got no suggestion."""
    by_label: dict[str, list[tuple[str, float]]] = {}
    for name, (label, s) in suggestions.items():
        by_label.setdefault(label, []).append((name, s))
    curated_names: dict[str, list[str]] = {}
    for name in cur.names:
        curated_names.setdefault(cur.labels[name], []).append(name)
    clusters = []
    for label, got in sorted(by_label.items(), key=lambda t: (-len(t[1]), t[0])):
        got.sort(key=lambda t: (-t[1], t[0]))
        clusters.append({"id": len(clusters), "curated": True, "label": label,
                         "suggested_label": label, "examples": curated_names[label][:6],
                         "members": [n for n, _ in got],
                         "strength": {n: round(s, 4) for n, s in got}})
    new = cc.clusters_doc(unfit, unfit_labels, unfit_emb) if unfit else {"clusters": [],
                                                                          "noise": []}
    for c in new["clusters"]:
        clusters.append({**c, "id": len(clusters)})
    return {"extends": str(cur.folder.resolve()), "extends_sha256": cur.digest,
            "min_strength": min_strength,
            "curated_labels": sorted(curated_names), "clusters": clusters,
            "noise": new["noise"]}


def read_extension(path, cur: Curation) -> dict[str, str]:
    """New name -> label from an extension clusters file after review (`read_curated`'s
    rules). A curated name in it is an error: curated names keep their label."""
    labels = cc.read_curated(path)
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if doc.get("extends_sha256") != cur.digest:  # content, not path: a moved folder is fine
        raise ValueError(f"{path} was not written for extending {cur.folder} (it extends "
                         f"{doc.get('extends') or 'nothing'}, curation.json sha256 "
                         f"{str(doc.get('extends_sha256'))[:12]}; this one is "
                         f"{cur.digest[:12]}): delete it to suggest again")
    clash = sorted(n for n in labels if n in cur.labels)
    if clash:
        raise ValueError(
            f"{path}: {clash[0]!r} is already curated as {cur.labels[clash[0]]!r} in "
            f"{cur.folder} ({len(clash)} such names): curated names keep their label; remove "
            f"them from this file")
    return labels
