"""Curation that grows with the data: a curated object vocabulary saved as plain data, and
new names placed onto it (`python -m data_prep curate --extend PREVIOUS`).

A curated dataset folder keeps, in `object_curation/`:
  - `curation.json`: every curated name with its label and hdbscan cluster, the clustering
    settings, the text encoder (folder, pooling, width) and the hdbscan version;
  - `embeddings.npy`: the names' unit embeddings (float32, in `curation.json`'s order).
No fitted object is stored (no pickle, nothing that runs code when read): the clusterer is
fit on `embeddings.npy` when saving (`save_curation`) and refit from the same file with the
same settings when extending (`load_curation`). The fit is deterministic, so the refit
gives the saved clusters; `load_curation` checks that it does, label for label.

Extending: names already curated keep their label (they never reach the clusters file).
Each new name gets its nearest curated cluster from `hdbscan.approximate_predict` (the
cluster, and a membership strength in [0, 1]); inside that hdbscan cluster the curated label
of the nearest curated name is the suggestion, so a cluster the curator split or relabelled
suggests what the curator decided. Suggestions with strength >= `min_strength` are written
into the clusters file under their curated label, with the strength, for the curator to
accept (leave them) or move; the other new names are clustered among themselves into new
clusters to label, or noise.

A curation embedded by another text encoder is refused: new names embedded by another model
do not live in the saved names' space. The encoder is checked by what it does: a sample of
the saved names is embedded again and must match the saved vectors. The hdbscan version is
recorded but not required to match: the refit is what is checked, so another hdbscan version
is refused only when it clusters the saved names differently. A curation of format 1 (earlier
versions, with a pickled `clusterer.pkl`) is refused, never unpickled: curating its source
again writes this format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from pathlib import Path

import numpy as np

from data_prep.curate import cluster as cc
from sclaro_jax.files import write_replacing

FORMAT = 2
PICKLED_FORMAT = 1  # curation.json + embeddings.npy + clusterer.pkl: refused, never read
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
                  encoder, params: dict) -> Curation:
    """Write `folder` (see the module docstring) and return it as `load_curation` reads it.
    The clusterer is fit here, with `params` (min_cluster_size, min_samples), on the float32
    unit rows written to embeddings.npy, so that a later refit starts from the same numbers
    (fewer than two names: no clusterer, all noise)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(names)
    cc._check_unique(names, str(folder))
    unit = cc._unit_rows(emb).astype(np.float32)
    missing = [n for n in names if n not in labels]
    if missing:
        raise ValueError(f"{folder}: no curated label for {len(missing)} names, e.g. "
                         f"{missing[:5]}")
    if len(unit) != len(names):
        raise ValueError(f"{folder}: {len(names)} names and {len(unit)} embeddings")
    params = {k: int(v) for k, v in params.items()}
    clusterer, clusters = cc.fit_labels(unit, **params)
    write_replacing(folder / "embeddings.npy", lambda f: np.save(f, unit, allow_pickle=False))
    meta = {"format": FORMAT, "hdbscan": hdbscan_version(), "encoder": encoder_info(encoder),
            "params": params, "names": names, "labels": [labels[n] for n in names],
            "clusters": [int(k) for k in clusters]}
    cc.write_json(folder / "curation.json", meta)
    digest = hashlib.sha256((folder / "curation.json").read_bytes()).hexdigest()
    return Curation(folder, names, unit, dict(zip(names, meta["labels"])), clusters, clusterer,
                    meta, digest)


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
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found == PICKLED_FORMAT:
        raise CurationMismatch(
            f"{path}: a curation of format {PICKLED_FORMAT}, from an earlier version, which "
            f"keeps its clusterer as a pickle ({folder / 'clusterer.pkl'}); pickles are never "
            f"loaded (unpickling a file runs code). Run the `python -m data_prep curate` that "
            f"wrote it again, with --overwrite (its labelled clusters file is reused), to save "
            f"it as format {FORMAT}, then --extend it")
    if found != FORMAT:
        raise CurationMismatch(f"{path}: saved curation format {found!r}, this version reads "
                               f"format {FORMAT}")
    _check_meta(path, meta)
    meta["sha256"] = hashlib.sha256(raw).hexdigest()
    return meta


def _check_meta(path: Path, meta: dict) -> None:
    """ValueError naming the first field of curation.json that is missing or of the wrong
    kind (a folder from elsewhere is data: nothing in it is trusted)."""
    def wrong(key, what):
        return ValueError(f"{path}: the field {key!r} must be {what}")

    for key in ("hdbscan", "encoder", "params", "names", "labels", "clusters"):
        if key not in meta:
            raise ValueError(f"{path}: the field {key!r} is missing")
    for key in ("names", "labels"):
        if not isinstance(meta[key], list) or not all(
                isinstance(x, str) and x.strip() for x in meta[key]):
            raise wrong(key, "a list of non-empty strings")
    clusters = meta["clusters"]
    if not isinstance(clusters, list) or not all(type(k) is int for k in clusters):
        raise wrong("clusters", "a list of integers")
    params = meta["params"]
    if (not isinstance(params, dict) or set(params) != {"min_cluster_size", "min_samples"}
            or not all(type(v) is int for v in params.values())
            or params["min_cluster_size"] < 2 or params["min_samples"] < 1):
        raise wrong("params", "{\"min_cluster_size\": an integer >= 2, \"min_samples\": an "
                              "integer >= 1}")
    encoder = meta["encoder"]
    if not isinstance(encoder, dict) or not {"path", "pooling", "dim"} <= set(encoder):
        raise wrong("encoder", "an object with the encoder's path, pooling and dim")
    if not isinstance(meta["hdbscan"], str):
        raise wrong("hdbscan", "a version string")
    n = len(meta["names"])
    if len(meta["labels"]) != n or len(clusters) != n:
        raise ValueError(f"{path}: {n} names, {len(meta['labels'])} labels and "
                         f"{len(clusters)} clusters")
    cc._check_unique(meta["names"], str(path))


def _read_embeddings(folder: Path, n: int) -> np.ndarray:
    """embeddings.npy as float32 [n, D]: a plain .npy array, never a pickle (`allow_pickle`
    stays off), mapped first so that a header promising more than the file holds is refused
    before anything is allocated."""
    path = folder / "embeddings.npy"
    fix = "curate the data again without --extend"
    try:
        emb = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{path}: not a plain .npy array ({str(e).split('. ')[0]}); "
                         f"{fix}") from None
    if emb.dtype != np.float32 or emb.ndim != 2 or len(emb) != n or emb.shape[1] < 1:
        raise ValueError(f"{path}: {emb.dtype} array of shape {emb.shape}, but "
                         f"{folder / 'curation.json'} lists {n} names (float32 [{n}, D] "
                         f"expected); {fix}")
    emb = np.array(emb)
    if not np.isfinite(emb).all():
        raise ValueError(f"{path}: holds values that are not finite; {fix}")
    return emb


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


def read_saved(path) -> tuple[Path, dict, np.ndarray]:
    """(folder, curation.json's fields, embeddings) of the saved curation `state_folder(path)`,
    checked as data (format, fields, array): what is refused before any model is loaded."""
    folder = state_folder(path)
    meta = _read_meta(folder)
    return folder, meta, _read_embeddings(folder, len(meta["names"]))


def load_curation(path, encoder, saved: tuple | None = None) -> Curation:
    """Read and check a saved curation (`read_saved(path)`, or `saved`, what it returned) for
    extension with `encoder`: `encoder` must embed its names as they were (`check_encoder`),
    and the clusterer refit on embeddings.npy with the saved settings must give the saved
    clusters; otherwise `CurationMismatch` says which and why."""
    folder, meta, emb = saved or read_saved(path)
    check_encoder(folder, meta, emb, encoder)
    clusterer, clusters = cc.fit_labels(emb, **meta["params"])
    saved = np.asarray(meta["clusters"], np.int64)
    if not np.array_equal(clusters, saved):
        version, here = meta["hdbscan"], hdbscan_version()
        raise CurationMismatch(
            f"{folder}: hdbscan {here} refit on embeddings.npy with the saved settings "
            f"({meta['params']}) clusters {int(np.sum(clusters != saved))} of {len(saved)} "
            f"names differently from curation.json, which hdbscan {version} wrote: "
            + (f"install hdbscan=={version} to extend it, or " if version != here else
               "the folder was changed since it was saved; ")
            + "curate the data again without --extend")
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
