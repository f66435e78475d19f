"""Scene graphs -> SCLARO records: each `Graph` a reader gives becomes a `schema.Sample` with its
objects, its relations' focused regions (appendix Eqs. 4-7, `data_prep.focus.focused_region`)
from the dataset's masks (PSG's panoptic segments) or from the boxes (Visual Genome, as
`data_prep.demo` does), the action word and caption of `actions`, and the dataset's own split;
a `ShardWriter` writes them as annotate's do.

What cannot be used is skipped and counted, never fatal. An image is skipped (`skipped`) for:
    missing_image        the photograph is missing or does not decode
    bad_panoptic_png     PSG: the panoptic PNG is missing, unreadable or of another size
    no_caption           no caption (COCO caption, VG region description) names the image
    no_relations         no relation is left (the dataset gave none, or all were dropped)
a relation is dropped (`relations_dropped`) for:
    index_out_of_range   its subject or object index lies past the object list (VG: an object
                         neither listed nor boxed)
    object_dropped       its subject or object was dropped (below)
    empty_mask           a mask is empty: PSG's segment id is absent from the PNG (or a box
                         covers no pixel centre)
    no_predicate         the predicate is empty
and an object (`objects_dropped`) for an empty name (no_name) or a box with no area inside the
photograph (bad_box); boxes are clipped to the photograph.

Atomic, so a rerun is the resume: the shards go to a hidden folder that is published only
when every image is done (`data_prep.shards`), so a killed import leaves no dataset and the
rerun removes the leftovers and writes the same records (the manifest's creation time aside).
The summary (counts above, action coverage, the rule and files read) goes into the
manifest's "import" entry.
"""

from __future__ import annotations

import collections
import errno
import io
import os

import numpy as np
from PIL import Image
from tqdm import tqdm

from data_prep import focus
from data_prep.demo import box_mask, encode_jpeg
from data_prep.scene_graphs import actions as action_rule
from data_prep.scene_graphs import psg, vg
from data_prep.scene_graphs.graph import Graph, SceneGraphs
from data_prep.shards import ShardWriter
from data_prep.source_items import SourceError, SourceItem, read_image
from sclaro_jax.data import schema

READERS = {"psg": psg.read, "vg": vg.read}
REGION_QUALITY = 95  # JPEG quality of the focused regions, as annotate's


def panoptic_ids(path: str, size: tuple[int, int]) -> np.ndarray:
    """The segment id of every pixel of a COCO panoptic PNG: R + 256 G + 256^2 B."""
    with open(path, "rb") as f:
        png = Image.open(io.BytesIO(f.read()))
        png.load()
    if png.size != size:
        raise ValueError(f"{path} is {png.size[0]}x{png.size[1]}, the photograph "
                         f"{size[0]}x{size[1]}")
    rgb = np.asarray(png.convert("RGB"), np.uint32)
    return rgb[..., 0] + 256 * rgb[..., 1] + 65536 * rgb[..., 2]


def mask_box(mask: np.ndarray):
    """The (x0, y0, x1, y1) box of a mask's pixels (x1, y1 exclusive); None if empty."""
    rows, cols = np.nonzero(mask)
    if rows.size == 0:
        return None
    return (float(cols.min()), float(rows.min()), float(cols.max() + 1), float(rows.max() + 1))


class Counts:
    """The import's tallies: images kept and skipped, relations and objects dropped, actions."""

    def __init__(self):
        self.images = self.kept = self.with_action = 0
        self.skipped, self.relations_dropped, self.objects_dropped = (
            collections.Counter(), collections.Counter(), collections.Counter())
        self.splits = collections.Counter()

    def summary(self, data: SceneGraphs, with_actions: bool) -> dict:
        return {
            "source": data.source, "files": data.files, "images": self.images,
            "kept": self.kept, "splits": dict(sorted(self.splits.items())),
            "skipped": dict(sorted(self.skipped.items())),
            "relations_dropped": dict(sorted(self.relations_dropped.items())),
            "objects_dropped": dict(sorted(self.objects_dropped.items())),
            "actions": {"rule": "main verb of the first caption with one, WordNet lemma "
                                "(data_prep.scene_graphs.actions)" if with_actions else "none",
                        "with_action": self.with_action,
                        "coverage": round(self.with_action / self.kept, 4) if self.kept else 0.0},
        }


class Masks:
    """Each object's mask (by its index in the graph), made when first asked: the pixels of
    its PSG segment (`ids`: the panoptic PNG's segment ids) or, without `ids`, of its box
    (`boxes`: {index: clipped box}, filled in once the objects are checked)."""

    def __init__(self, graph: Graph, ids: np.ndarray | None, size: tuple[int, int]):
        self.graph, self.ids, self.size = graph, ids, size
        self.boxes: dict[int, tuple] = {}
        self._made: dict[int, np.ndarray] = {}

    def __getitem__(self, k: int) -> np.ndarray:
        if k not in self._made:
            self._made[k] = (self.ids == self.graph.segments[k] if self.ids is not None
                             else box_mask(self.boxes[k], *self.size))
        return self._made[k]


def _objects(graph: Graph, masks: Masks, counts: Counts) -> tuple[list, dict]:
    """The kept objects (name, clipped box) and {given index: kept index}."""
    width, height = masks.size
    kept, index = [], {}
    for k, (name, box) in enumerate(graph.objects):
        if box is None and masks.ids is not None:
            box = mask_box(masks[k])
        if not name:
            counts.objects_dropped["no_name"] += 1
            continue
        if box is None:
            counts.objects_dropped["bad_box"] += 1
            continue
        x0, y0, x1, y1 = max(0.0, box[0]), max(0.0, box[1]), min(width, box[2]), \
            min(height, box[3])
        if not (x0 < x1 and y0 < y1):
            counts.objects_dropped["bad_box"] += 1
            continue
        index[k] = len(kept)
        kept.append(schema.Object(name, (x0, y0, float(x1), float(y1))))
    masks.boxes = {k: kept[i].box for k, i in index.items()}
    return kept, index


def _relations(graph: Graph, rgb: np.ndarray, objects: list, index: dict, masks: Masks,
               counts: Counts, region_quality: int) -> list:
    relations = []
    n = len(graph.objects)
    for s, predicate, o in graph.relations:
        if not (0 <= s < n and 0 <= o < n):
            reason = "index_out_of_range"
        elif s not in index or o not in index:
            reason = "object_dropped"
        elif not predicate:
            reason = "no_predicate"
        elif not (masks[s].any() and masks[o].any()):
            reason = "empty_mask"
        else:
            region = focus.focused_region(rgb, masks[s], masks[o])
            i, j = index[s], index[o]
            relations.append(schema.Relation(
                i, predicate, j, schema.triplet_text(objects[i].name, predicate,
                                                     objects[j].name),
                encode_jpeg(region, region_quality)))
            continue
        counts.relations_dropped[reason] += 1
    return relations


def make_sample(graph: Graph, data: SceneGraphs, counts: Counts, rule,
                region_quality: int = REGION_QUALITY) -> schema.Sample | None:
    """The record of one graph, or None with the reason counted. `rule`: (tagger, lemmatize)
    of the action rule, None for no action words."""
    try:
        image, img = read_image(SourceItem(id=graph.id, source=data.source, path=graph.image))
    except SourceError:
        counts.skipped["missing_image"] += 1
        return None
    if not graph.captions:
        counts.skipped["no_caption"] += 1
        return None
    ids = None
    if graph.panoptic is not None:
        try:
            ids = panoptic_ids(graph.panoptic, img.size)
        except (OSError, ValueError):
            counts.skipped["bad_panoptic_png"] += 1
            return None
    masks = Masks(graph, ids, img.size)
    objects, index = _objects(graph, masks, counts)
    relations = _relations(graph, np.asarray(img), objects, index, masks, counts,
                           region_quality)
    if not relations:
        counts.skipped["no_relations"] += 1
        return None
    action, caption = (action_rule.action_and_caption(graph.captions, *rule) if rule
                       else ("", graph.captions[0]))
    counts.kept += 1
    counts.with_action += bool(action)
    counts.splits[graph.split] += 1
    return schema.Sample(
        id=graph.id, source=data.source, split=graph.split, image=image, width=img.width,
        height=img.height, action=action, caption=caption, objects=tuple(objects),
        relations=tuple(relations), mask_kind=data.mask_kind)


def import_scene_graphs(kind: str, root: str, out: str, *, captions: tuple[str, ...] = (),
                        with_actions: bool = True, limit: int = 0,
                        records_per_shard: int = 1000, overwrite: bool = False,
                        image_size: int | None = schema.DEFAULT_VIEW_SIZE,
                        keep_originals: bool = False, progress: bool = True,
                        rule=None) -> dict:
    """Import dataset `kind` ("psg" or "vg") from its released layout under `root` into the
    dataset folder `out`; returns the manifest (its "import" entry is the summary). `rule`:
    (tagger, lemmatize) in place of NLTK's (tests); checked before anything is read."""
    if kind not in READERS:
        raise ValueError(f"unknown scene-graph source {kind!r}; choose {', '.join(READERS)}")
    counts = Counts()
    # the writer first: a dataset already in `out` is refused before the json files are read,
    # then a missing root, then missing NLTK data
    with ShardWriter(out, records_per_shard=records_per_shard, overwrite=overwrite,
                     view_size=image_size, keep_originals=keep_originals) as writer:
        if not os.path.isdir(root):
            raise FileNotFoundError(errno.ENOENT, "no such dataset folder (--root)", root)
        if with_actions and rule is None:
            rule = action_rule.require_rule()
        data = READERS[kind](root, captions=tuple(captions))
        writer.split_rule = data.split_rule
        graphs = data.graphs[:limit] if limit else data.graphs
        for graph in tqdm(graphs, desc=f"importing {kind}", unit="image", disable=not progress):
            counts.images += 1
            sample = make_sample(graph, data, counts, rule if with_actions else None)
            if sample is not None:
                writer.add(sample)
        summary = counts.summary(data, with_actions)
        if not counts.kept:
            raise ValueError(f"no image of {root} could be imported: "
                             + format_summary(summary).replace("\n", ";"))
        writer.manifest_extra["import"] = summary
    return writer.manifest


def format_summary(summary: dict) -> str:
    """The summary in a few lines: images kept and skipped by reason, drops, action coverage."""
    lines = [f"{summary['images']} images: {summary['kept']} kept ("
             + ", ".join(f"{k} {v}" for k, v in summary["splits"].items()) + "), "
             f"{sum(summary['skipped'].values())} skipped"]
    for title, key in (("skipped", "skipped"), ("relations dropped", "relations_dropped"),
                       ("objects dropped", "objects_dropped")):
        if summary[key]:
            lines.append(f"  {title}: " + ", ".join(f"{k} {v}" for k, v in summary[key].items()))
    acts = summary["actions"]
    lines.append(f"  action words: {acts['with_action']} of {summary['kept']} images "
                 f"({100 * acts['coverage']:.1f}%)" + ("" if acts["rule"] != "none"
                                                       else " (--no-actions)"))
    return "\n".join(lines)
