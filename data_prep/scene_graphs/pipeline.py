"""Scene graphs -> SCLARO records: each `Graph` a reader gives becomes a `schema.Sample` with its
objects, its relations' focused regions (appendix Eqs. 4-7, `data_prep.focus.focused_region`)
from the dataset's masks (PSG's panoptic segments) or from the boxes (Visual Genome, as
`data_prep.demo` does), the action word and caption of `actions`, and the dataset's own split;
a `ShardWriter` writes them as annotate's do.

What cannot be used is skipped and counted, never fatal. An image is skipped (`skipped`) for:
    outside_root         a path the dataset names (photograph, panoptic PNG) resolves outside
                         its root: absolute, `..`, a link out of it; neither file is opened
    missing_image        the photograph is missing or does not decode
    bad_panoptic_png     PSG: the panoptic PNG is missing, unreadable or of another size
    no_caption           no caption (COCO caption, VG region description) names the image
    no_relations         no relation is left (the dataset gave none, or all were dropped)
a relation is dropped (`relations_dropped`) for:
    index_out_of_range   its subject or object index lies past the object list (VG: an object
                         neither listed nor boxed), or PSG's predicate index past
                         predicate_classes
    object_dropped       its subject or object was dropped (below)
    empty_mask           a mask is empty: PSG's segment id is absent from the PNG (or a box
                         covers no pixel centre)
    no_predicate         the predicate is empty
and an object (`objects_dropped`) for an empty name (no_name) or a box with no area inside the
photograph (bad_box); boxes are clipped to the photograph.

Parallel and resumable: the images go in blocks (256 by default) to worker processes; each
finished block is written to the work folder (OUT.work: `blocks`), so a killed import keeps
what it finished and the rerun of the same command does only the rest. When every block is
done the records are published in the dataset's order through a `ShardWriter` (atomic: a kill
there leaves no dataset, and the rerun publishes again from the blocks) and the work folder is
removed. The import makes and marks its work folder (`sclaro_jax.files.own_folder`): it removes
only a folder it marked, and refuses a non-empty --work it did not make. The records are the same for any number of workers, block size or kills (the
manifest's creation time aside). The summary (counts above, action coverage, the rule and files
read) goes into the manifest's "import" entry.
"""

from __future__ import annotations

import collections
import errno
import io
import multiprocessing
import os
import signal
import sys
from concurrent import futures

import numpy as np
from tqdm import tqdm

from data_prep import focus
from data_prep.scene_graphs import actions as action_rule
from data_prep.scene_graphs import blocks, psg, vg
from data_prep.scene_graphs.graph import Graph, SceneGraphs
from data_prep.shards import ShardWriter, convert_sample, iter_records, refuse_a_dataset_in
from data_prep.source_items import SourceError, SourceItem, read_image
from sclaro_jax import bounds, cli
from sclaro_jax.data import schema
from sclaro_jax.data.images import box_mask, encode_jpeg
from sclaro_jax.data.panoptic import Panoptic
from sclaro_jax.files import own_folder, remove_own_folder

READERS = {"psg": psg.read, "vg": vg.read}
REGION_QUALITY = 95  # JPEG quality of the focused regions, as annotate's


def read_panoptic(path: str, size: tuple[int, int]) -> tuple[bytes, np.ndarray]:
    """(the file's bytes, the segment id of every pixel) of a COCO panoptic PNG: id = R + 256 G
    + 256^2 B. Its header's size is checked (against the photograph's, and the pixel limit)
    before it is decoded."""
    with open(path, "rb") as f:
        data = f.read()
    png = bounds.open_image(io.BytesIO(data), path)
    if png.size != size:
        raise ValueError(f"{path} is {png.size[0]}x{png.size[1]}, the photograph "
                         f"{size[0]}x{size[1]}")
    png.load()
    rgb = np.asarray(png.convert("RGB"), np.uint32)
    return data, rgb[..., 0] + 256 * rgb[..., 1] + 65536 * rgb[..., 2]


def mask_box(mask: np.ndarray):
    """The (x0, y0, x1, y1) box of a mask's pixels (x1, y1 exclusive); None if empty."""
    rows, cols = np.nonzero(mask)
    if rows.size == 0:
        return None
    return (float(cols.min()), float(rows.min()), float(cols.max() + 1), float(rows.max() + 1))


class Counts:
    """The import's tallies: images kept and skipped, relations, objects and action words
    dropped (labels past `bounds.label_problem`: long_label, control_characters), actions."""

    DROPS = ("skipped", "relations_dropped", "objects_dropped", "actions_dropped", "splits")

    def __init__(self):
        self.images = self.kept = self.with_action = 0
        for name in self.DROPS:
            setattr(self, name, collections.Counter())

    def as_dict(self) -> dict:
        return {"images": self.images, "kept": self.kept, "with_action": self.with_action,
                "skipped": dict(self.skipped), "relations_dropped": dict(self.relations_dropped),
                "objects_dropped": dict(self.objects_dropped),
                "actions_dropped": dict(self.actions_dropped), "splits": dict(self.splits)}

    def add(self, d: dict) -> None:
        """Add the tallies of another `as_dict` (a block's)."""
        self.images += d["images"]
        self.kept += d["kept"]
        self.with_action += d["with_action"]
        for name in self.DROPS:
            getattr(self, name).update(d.get(name, {}))

    def summary(self, data: SceneGraphs, with_actions: bool) -> dict:
        return {
            "source": data.source, "files": data.files, "images": self.images,
            "kept": self.kept, "splits": dict(sorted(self.splits.items())),
            "skipped": dict(sorted(self.skipped.items())),
            "relations_dropped": dict(sorted(self.relations_dropped.items())),
            "objects_dropped": dict(sorted(self.objects_dropped.items())),
            "actions_dropped": dict(sorted(self.actions_dropped.items())),
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
        if bounds.label_problem(name):  # over the label limit, or control characters
            counts.objects_dropped[bounds.label_problem(name)] += 1
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
    regions = focus.Regions(rgb)  # the blurred background once, for all the image's relations
    for s, predicate, o in graph.relations:
        if predicate is None or not (0 <= s < n and 0 <= o < n):
            reason = "index_out_of_range"
        elif s not in index or o not in index:
            reason = "object_dropped"
        elif not predicate:
            reason = "no_predicate"
        elif bounds.label_problem(predicate):
            reason = bounds.label_problem(predicate)
        elif not (masks[s].any() and masks[o].any()):
            reason = "empty_mask"
        else:
            region = regions(masks[s], masks[o])
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
    if graph.skip:  # the reader's reason, e.g. outside_root: nothing of it is opened
        counts.skipped[graph.skip] += 1
        return None
    try:
        image, img = read_image(SourceItem(id=graph.id, source=data.source, path=graph.image))
    except SourceError:
        counts.skipped["missing_image"] += 1
        return None
    if not graph.captions:
        counts.skipped["no_caption"] += 1
        return None
    ids = png = None
    if graph.panoptic is not None:
        try:
            png, ids = read_panoptic(graph.panoptic, img.size)
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
    if action and bounds.label_problem(action):  # the caption's verb: kept without an action
        counts.actions_dropped[bounds.label_problem(action)] += 1
        action = ""
    counts.kept += 1
    counts.with_action += bool(action)
    counts.splits[graph.split] += 1
    # the segment masks travel with the originals (the writer drops both without
    # --keep-originals): relation localisation's targets
    panoptic = None if png is None else Panoptic(
        png, tuple(int(graph.segments[k]) for k in sorted(index, key=index.get)))
    return schema.Sample(
        id=graph.id, source=data.source, split=graph.split, image=image, width=img.width,
        height=img.height, action=action, caption=caption, objects=tuple(objects),
        relations=tuple(relations), mask_kind=data.mask_kind, panoptic=panoptic)


def _files(data: SceneGraphs) -> list[str]:
    """The dataset files a reader read (the key of the blocks made from them)."""
    out = []
    for value in data.files.values():
        out.extend([value] if isinstance(value, str) else list(value))
    return out


_JOB: dict = {}  # what a block needs; forked workers inherit it (no pickling of the graphs)


def _run_block(k: int) -> dict:
    """Block k: its records (views made, as the writer would) in one block file; its marker."""
    job = _JOB
    graphs, counts, records = job["blocks"][k], Counts(), []
    for graph in graphs:
        counts.images += 1
        sample = make_sample(graph, job["data"], counts, job["rule"])
        if sample is not None:
            sample, _ = convert_sample(sample, None, view_size=job["view_size"],
                                       keep_originals=job["keep_originals"],
                                       view_quality=schema.VIEW_QUALITY)
            records.append(schema.encode(sample))
    return blocks.write(job["work"], k, [g.id for g in graphs], records, counts.as_dict(),
                        job["key"])


def _run_blocks(todo: list[int], workers: int):
    """The markers of the blocks `todo`, as they finish: in this process for one worker, else
    in `workers` forked processes (a Ctrl-C ends them at once, without their tracebacks; the
    blocks they were writing are left as temporary files, removed by the next run)."""
    if workers <= 1 or len(todo) <= 1:
        for k in todo:
            yield _run_block(k)
        return
    pool = futures.ProcessPoolExecutor(min(workers, len(todo)),
                                       mp_context=multiprocessing.get_context("fork"),
                                       initializer=signal.signal,
                                       initargs=(signal.SIGINT, signal.SIG_DFL))
    try:
        running = [pool.submit(_run_block, k) for k in todo]
        for done in futures.as_completed(running):
            yield done.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _earlier_blocks(work: str, chunks: list, key: str) -> dict:
    """{k: marker} of the blocks an earlier run finished in `work` with this key, said so.
    `work` is made (and marked) here; a non-empty folder an import did not make is refused."""
    own_folder(work, flag="--work")
    blocks.clear_partial(work)
    markers, other = blocks.finished(work, [[g.id for g in c] for c in chunks], key)
    if markers:
        print(f"import: {len(markers)} of {len(chunks)} blocks already done in {work} (an "
              f"earlier run); doing the other {len(chunks) - len(markers)}", file=sys.stderr)
    if other:
        print(f"import: {other} blocks in {work} were made from other files or settings; "
              f"redoing them", file=sys.stderr)
    return markers


def import_scene_graphs(kind: str, root: str, out: str, *, captions: tuple[str, ...] = (),
                        with_actions: bool = True, limit: int = 0,
                        records_per_shard: int = 1000, overwrite: bool = False,
                        image_size: int | None = schema.DEFAULT_VIEW_SIZE,
                        keep_originals: bool = False, progress: bool = True,
                        rule=None, workers: int = 1, block_size: int = 256,
                        work: str | None = None) -> dict:
    """Import dataset `kind` ("psg" or "vg") from its released layout under `root` into the
    dataset folder `out`; returns the manifest (its "import" entry is the summary).

    The images go in blocks of `block_size` to `workers` processes, each block written to the
    work folder `work` (default OUT.work) when finished (`blocks`); a rerun after a kill keeps
    the finished blocks. When every block is done the records are published in the dataset's
    order (`ShardWriter`, atomic) and the work folder removed: the records are the same for any
    number of workers or kills. `rule`: (tagger, lemmatize) in place of NLTK's (tests).
    Checked before anything is read or made: a dataset already in `out`, a missing root, then
    missing NLTK data."""
    if kind not in READERS:
        raise ValueError(f"unknown scene-graph source {kind!r}; choose {', '.join(READERS)}")
    if block_size < 1 or workers < 1:
        raise ValueError(f"block_size ({block_size}) and workers ({workers}) must be at least 1")
    out = os.path.abspath(out)
    refuse_a_dataset_in(out, overwrite)
    if not os.path.isdir(root):
        raise FileNotFoundError(errno.ENOENT, "no such dataset folder (--root)", root)
    actions = "none"
    if with_actions:
        actions = "given" if rule is not None else "nltk"
        rule = rule if rule is not None else action_rule.require_rule()
    else:
        rule = None
    data = READERS[kind](root, captions=tuple(captions))
    graphs = data.graphs[:limit] if limit else data.graphs
    chunks = [graphs[i:i + block_size] for i in range(0, len(graphs), block_size)]
    keep = bool(keep_originals) or image_size is None
    key = blocks.run_key({"version": 2, "source": kind, "root": os.path.abspath(root),
                          "actions": actions, "view_size": image_size, "keep_originals": keep,
                          "view_quality": schema.VIEW_QUALITY,
                          "region_quality": REGION_QUALITY}, _files(data))
    work = os.path.abspath(work or out.rstrip(os.sep) + ".work")
    markers = _earlier_blocks(work, chunks, key)
    todo = [k for k in range(len(chunks)) if k not in markers]
    _JOB.update(blocks=chunks, data=data, rule=rule, view_size=image_size, keep_originals=keep,
                work=work, key=key)
    bar = tqdm(total=len(graphs), initial=sum(len(chunks[k]) for k in markers),
               desc=f"importing {kind}", unit="image", disable=not progress)
    try:
        try:
            for marker in _run_blocks(todo, workers):
                markers[marker["block"]] = marker
                bar.update(len(marker["ids"]))
        finally:
            bar.close()
            _JOB.clear()
    except cli.INTERRUPTS as e:
        if not cli.ctrl_c(e):
            raise
        print(f"import: interrupted; {len(markers)} of {len(chunks)} blocks are kept in {work}: "
              f"rerun the same command to resume", file=sys.stderr)
        raise
    counts = Counts()
    for k in range(len(chunks)):
        counts.add(markers[k]["counts"])
    summary = counts.summary(data, with_actions)
    summary["root"] = os.path.abspath(root)  # a re-import's --root (dataset.check_view_size)
    if not counts.kept:
        remove_own_folder(work)
        raise ValueError(f"no image of {root} could be imported: "
                         + format_summary(summary).replace("\n", ";"))
    manifest = _publish(out, work, len(chunks), summary, data.split_rule,
                        records_per_shard=records_per_shard, overwrite=overwrite,
                        image_size=image_size, keep_originals=keep_originals,
                        progress=progress)
    remove_own_folder(work)  # only ever a folder this command made (`own_folder`)
    return manifest


def _publish(out: str, work: str, n_blocks: int, summary: dict, split_rule: dict, *,
             records_per_shard: int, overwrite: bool, image_size, keep_originals: bool,
             progress: bool) -> dict:
    """The finished blocks' records, in block order, published as the dataset `out` (records
    validated and given their views in the blocks pass through); its manifest."""
    existed = os.path.isdir(out)
    try:
        with ShardWriter(out, records_per_shard=records_per_shard, overwrite=overwrite,
                         split_rule=split_rule, validate_images=False, view_size=image_size,
                         keep_originals=keep_originals,
                         manifest_extra={"import": summary}) as writer:
            for k in tqdm(range(n_blocks), desc="writing shards", unit="block",
                          disable=not progress):
                for _, record in iter_records(blocks.paths(work, k)[0]):
                    writer.add(record)
    except BaseException as e:
        if not existed:
            try:
                os.rmdir(out)   # only if the writer left it empty
            except OSError:
                pass
        if isinstance(e, KeyboardInterrupt):
            print(f"import: interrupted while writing {out}; every block is kept in {work}: "
                  f"rerun the same command to write it", file=sys.stderr)
        raise
    return writer.manifest


def format_summary(summary: dict) -> str:
    """The summary in a few lines: images kept and skipped by reason, drops, action coverage."""
    lines = [f"{summary['images']} images: {summary['kept']} kept ("
             + ", ".join(f"{k} {v}" for k, v in summary["splits"].items()) + "), "
             f"{sum(summary['skipped'].values())} skipped"]
    for title, key in (("skipped", "skipped"), ("relations dropped", "relations_dropped"),
                       ("objects dropped", "objects_dropped"),
                       ("action words dropped", "actions_dropped")):
        if summary.get(key):
            lines.append(f"  {title}: " + ", ".join(f"{k} {v}" for k, v in summary[key].items()))
    acts = summary["actions"]
    lines.append(f"  action words: {acts['with_action']} of {summary['kept']} images "
                 f"({100 * acts['coverage']:.1f}%)" + ("" if acts["rule"] != "none"
                                                       else " (--no-actions)"))
    return "\n".join(lines)
