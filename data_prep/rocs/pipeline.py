"""Build a ROCS-style split from a detection-annotated image set (MINER section 3), end to end:
instances -> high-clutter subset -> rare objects -> mask-area rule (segment-anything masks) ->
class-aware captions -> a `save_to_disk` folder that `python -m sclaro_jax.eval.rocs` reads.

`build_rocs(images, image_dir, segment, ask, out)` runs the steps of `rocs_select` and
`rocs_caption` in order, with the models passed in: `segment(image uint8 [H, W, 3], boxes
[N, 4]) -> bool masks [N, H, W]` (`data_prep.segment.SamSegmenter`; the paper used SAM 3, this
uses segment-anything) and `ask(image, prompt) -> reply or None` (a VLM, or
`rocs_caption.CaptionReplies`, which is asked with (image id, instance id) instead of the
image). It writes OUT/rocs (the dataset), OUT/summary.json (images and objects kept and dropped
at each step, each drop with its reason), OUT/stats.json (Figure 3's numbers per stage) and
OUT/stats.png (them as a figure).

For image sets without instance annotations (Flickr30K in the paper), `detect_instances`
gives GroundingDINO boxes for a class list, e.g. `COCO80`: the paper prompts SAM 3 with the 80
COCO class names (appendix J.2); SAM 3 is not a package here, GroundingDINO stands in for it.

`python -m data_prep rocs` runs it with the stage caches in WORK (a rerun skips finished
work).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from data_prep.rocs import caption as rocs_caption, selection as rocs_select
from data_prep.rocs.selection import AnnotatedImage
from sclaro_jax.paths import OUTSIDE_ROOT, inside_root
from sclaro_jax import bounds
from sclaro_jax.files import own_folder, write_replacing

# The 80 MS COCO class names (the detection categories, in category-id order): the object
# prompts of MINER appendix J.2 (there SAM 3's noun phrases; here GroundingDINO's). The paper
# rephrases six of them for open-vocabulary detection without saying which in the text we
# have, so all 80 are the canonical names.
COCO80 = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich",
    "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote",
    "keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book",
    "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush")
CLASS_LISTS = {"coco80": COCO80}  # the named values of `python -m data_prep rocs --classes`


def class_list(value: str) -> list[str]:
    """`--classes` as class names: a named list (`CLASS_LISTS`, e.g. "coco80"), "@FILE" (one
    name a line, blank lines skipped) or "name,name,...". A lone word ending in digits (such
    as "coco91") is taken for a list name and must be one of `CLASS_LISTS`."""
    value = value.strip()
    if value.lower() in CLASS_LISTS:
        return list(CLASS_LISTS[value.lower()])
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                names = [line.strip() for line in f if line.strip()]
        except FileNotFoundError:
            raise FileNotFoundError(f"--classes {value}: no such file") from None
    elif re.fullmatch(r"[A-Za-z_]+\d+", value):
        raise ValueError(f"--classes {value}: unknown class list (named lists: "
                         f"{', '.join(CLASS_LISTS)}; or pass 'name,name,...' or @FILE)")
    else:
        names = [c.strip() for c in value.split(",") if c.strip()]
    if not names:
        raise ValueError(f"--classes {value!r}: no class names to prompt the detector with")
    return names


def _lazy_pixels(image: AnnotatedImage, path: Path) -> Callable[[], np.ndarray]:
    """The image's RGB pixels, read on the first call (and checked against the instances
    file's size)."""
    loaded = []

    def pixels() -> np.ndarray:
        if not loaded:
            with bounds.open_image(path, f"image {image.id}: {path}") as img:
                array = np.asarray(img.convert("RGB"))
            if array.shape[:2] != (image.height, image.width):
                raise ValueError(f"image {image.id}: {path} is {array.shape[1]}x{array.shape[0]},"
                                 f" the instances file says {image.width}x{image.height}")
            loaded.append(array)
        return loaded[0]
    return pixels


class StageCache:
    """One JSON file per unit of work (`WORK/<stage>/<name>.json`, written atomically), valid
    while its `key` (a hash of what produced it: the model's identity and the inputs) matches;
    `computed` counts the units worked out in this run."""

    def __init__(self, work: Path | None, stage: str, model_key: str):
        if work is not None:  # made and marked, or an earlier run's; never a user's folder
            own_folder(work, flag="--work")
        self.folder = None if work is None else Path(work) / stage
        self.model_key = model_key
        self.computed = 0

    def get(self, name: str, inputs, make: Callable[[], dict]) -> dict:
        key = hashlib.sha256(json.dumps([self.model_key, inputs], default=str).encode()
                             ).hexdigest()
        path = None if self.folder is None else self.folder / f"{name}.json"
        if path is not None and path.exists():
            try:
                cached = bounds.read_json(path)
            except ValueError:
                cached = None  # torn by a crash (or not ours): redo it
            if isinstance(cached, dict) and cached.get("key") == key:
                return cached["value"]
        value = make()
        self.computed += 1
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_replacing(path, lambda f: f.write(json.dumps({"key": key, "value": value},
                                                               default=str)), text=True)
        return value


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def _image_size(path: Path) -> list[int]:
    with bounds.open_image(path, str(path)) as img:
        return list(img.size)


def prompt_groups(classes: list[str], detector) -> list[list[str]]:
    """`classes` in order, cut into runs whose GroundingDINO prompt (`detect.make_prompt`) fits
    the detector's `model.config.max_text_len` tokens (its `processor.tokenizer` counts them):
    the 80 COCO names do not fit one prompt of the tiny test model (64 tokens). A detector
    without those attributes gets all the classes in one prompt."""
    from data_prep.detect import make_prompt

    tokenizer = getattr(getattr(detector, "processor", None), "tokenizer", None)
    config = getattr(getattr(detector, "model", None), "config", None)
    max_len = getattr(config, "max_text_len", None)
    if tokenizer is None or max_len is None:
        return [list(classes)]
    groups: list[list[str]] = []
    for name in classes:
        if groups and len(tokenizer(make_prompt(groups[-1] + [name]))["input_ids"]) <= max_len:
            groups[-1].append(name)
        else:  # a name too long alone still gets its prompt: the detector says it is too long
            groups.append([name])
    return groups


def detect_instances(image_dir: str | Path, classes: list[str], detector: Callable, *,
                     work: str | Path | None = None, detector_key: str = "",
                     batch: int = 8, progress: bool = True) -> list[AnnotatedImage]:
    """Instances for an image set without annotations (Flickr30K in the paper): every image
    under `image_dir` (sorted paths; ids 1, 2, ... in that order) through `detector(images,
    objects) -> [[Detection]]` (`data_prep.detect.GroundingDetector`) prompted with `classes`
    (in as many prompts as its text length needs, `prompt_groups`; an image's detections are
    those of all its prompts, highest score first); each detection becomes an instance of the
    class it was matched to. Cached per image in WORK/boxes, keyed by `detector_key` and the
    class list."""
    from tqdm.auto import tqdm

    image_dir = Path(image_dir)
    files = sorted(p for p in image_dir.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"--images {image_dir}: no images ({', '.join(IMAGE_SUFFIXES)})")
    if not classes:
        raise ValueError("--classes: no class names to prompt the detector with")
    groups = prompt_groups(classes, detector)
    cache = StageCache(None if work is None else Path(work), "boxes", detector_key)
    out = []
    for start in tqdm(range(0, len(files), batch), desc="rocs boxes", unit="batch",
                      disable=not progress):
        chunk = files[start:start + batch]
        found: dict[Path, list] = {}

        def run_chunk():  # one detector call per prompt for the chunk's images not cached yet
            if not found:
                opened = []
                for p in chunk:
                    with bounds.open_image(p, str(p)) as img:
                        opened.append(img.convert("RGB"))
                dets: dict[Path, list] = {path: [] for path in chunk}
                for group in groups:
                    for path, got in zip(chunk, detector(opened, [group] * len(chunk))):
                        dets[path] += got
                for path in chunk:
                    ranked = sorted(dets[path], key=lambda d: -d.score)  # stable: ties in order
                    found[path] = [[list(map(float, d.box)), d.label] for d in ranked]
            return found

        for k, path in enumerate(chunk):
            rel = path.relative_to(image_dir).as_posix()
            value = cache.get(f"{start + k + 1}", [rel, classes], lambda path=path: {
                "size": _image_size(path), "boxes": run_chunk()[path]})
            image_id = start + k + 1
            instances = tuple(rocs_select.Instance(n, image_id, label, tuple(box))
                              for n, (box, label) in enumerate(value["boxes"]))
            out.append(AnnotatedImage(image_id, rel, value["size"][0], value["size"][1],
                                      instances))
    return out


def mask_step(segment: Callable, pixels: Callable[[], np.ndarray], image: AnnotatedImage,
              max_mask_area: float, cache: StageCache | None = None) -> tuple[list, list]:
    """(rare instances kept, [(instance, mask share)] dropped as visually dominant)."""
    rare = rocs_select.rare_instances(image)
    if not rare:
        return [], []
    boxes = [list(i.box) for i in rare]

    def shares():
        masks = segment(pixels(), np.array(boxes, np.float32))
        return [rocs_select.mask_fraction(m) for m in masks]

    cache = cache or StageCache(None, "masks", "")
    kept, dropped = [], []
    for inst, share in zip(rare, cache.get(str(image.id), [image.file_name, boxes], shares)):
        if rocs_select.small_enough(share, max_mask_area):
            kept.append(inst)
        else:
            dropped.append((inst, share))
    return kept, dropped


def _inside(images: list[AnnotatedImage], image_dir: Path) -> tuple[list, list[dict]]:
    """(the images whose file_name resolves inside `image_dir`, the others as drops): an image
    outside it (absolute, `..`, a link out) is dropped unread, as `outside_root`."""
    inside = [im for im in images if inside_root(image_dir, im.file_name) is not None]
    kept = {im.id for im in inside}
    return inside, [{"image_id": im.id, "file_name": im.file_name} for im in images
                    if im.id not in kept]


def build_rocs(images: list[AnnotatedImage], image_dir: str | Path, segment: Callable,
               ask: Callable, out: str | Path, *, top_fraction: float = rocs_select.TOP_FRACTION,
               max_mask_area: float = rocs_select.MAX_MASK_AREA, ask_with_ids: bool = False,
               work: str | Path | None = None, segment_key: str = "", ask_key: str = "",
               caption_words: tuple[int, int] = rocs_caption.CAPTION_WORDS,
               progress: bool = True) -> dict:
    """Run the construction (see the module docstring); returns the summary.

    With `work`, each image's mask shares and each object's caption are cached there, keyed by
    `segment_key` / `ask_key` (the models' identities, e.g. a hash of the weights or of the
    replies file) and the inputs: a rerun (after a crash, say) recomputes only what is missing
    or stale (a caption's key also holds the prompts and `caption_words`, the accepted word
    counts). The returned summary also says what this run worked out (`computed`: masks
    and captions); summary.json leaves that out, so a resumed run writes the same files."""
    from tqdm.auto import tqdm

    out, image_dir = Path(out), Path(image_dir)
    own_folder(out, flag="--out")  # rocs/ and rocs.partial are replaced only in a folder it made
    mask_cache = StageCache(None if work is None else Path(work), "masks", segment_key)
    caption_cache = StageCache(None if work is None else Path(work), "captions", ask_key)
    inside, outside = _inside(images, image_dir)
    clutter = rocs_select.high_clutter(inside, top_fraction)
    dropped: dict[str, list] = {OUTSIDE_ROOT: outside, "no_rare_object": [],
                                "mask_too_large": [], **{kind: [] for kind in rocs_caption.REASONS}}
    caption_words = tuple(caption_words)
    prompts = [rocs_caption.SYSTEM_PROMPT, rocs_caption.USER_PROMPT, list(caption_words)]
    rows, kept_pairs, rare_pairs, candidates = [], [], [], []
    # Stage 1: masks, image by image (an image is read only if its masks are not cached).
    for image in tqdm(clutter, desc="rocs masks", unit="image", disable=not progress):
        path = image_dir / image.file_name
        if not path.exists():
            raise FileNotFoundError(f"image {image.id}: {path} not found (file_name "
                                    f"{image.file_name!r} under --images {image_dir})")
        rare_pairs += [(image, i) for i in rocs_select.rare_instances(image)]
        pixels = _lazy_pixels(image, path)
        kept, too_large = mask_step(segment, pixels, image, max_mask_area, mask_cache)
        dropped["mask_too_large"] += [{"image_id": image.id, "instance_id": i.id,
                                       "object": i.category, "mask_share": round(s, 6)}
                                      for i, s in too_large]
        if not kept and not too_large:
            dropped["no_rare_object"].append({"image_id": image.id})
        candidates += [(image, path, inst) for inst in kept]
    # Stage 2: a caption per surviving rare object.
    for image, path, inst in tqdm(candidates, desc="rocs captions", unit="object",
                                  disable=not progress):
        def caption(image=image, inst=inst, pixels=_lazy_pixels(image, path)):
            query = (image.id, inst.id) if ask_with_ids else Image.fromarray(pixels())
            got = rocs_caption.recaption(ask, query, inst.category, words=caption_words)
            return {"caption": got.caption, "reason": got.reason, "replies": list(got.replies)}

        got = caption_cache.get(f"{image.id}_{inst.id}",
                                [image.file_name, inst.category, list(inst.box), prompts],
                                caption)
        if got["caption"] is None:
            dropped[rocs_caption.reason_kind(got["reason"])].append(
                {"image_id": image.id, "instance_id": inst.id, "object": inst.category,
                 "reason": got["reason"], "replies": got["replies"]})
            continue
        kept_pairs.append((image, inst))
        rows.append({"image": path, "image_id": image.id, "caption": got["caption"],
                     "object": inst.category, "box": inst.box})
    kept_images = sorted({im.id for im, _ in kept_pairs})
    summary = {"images": len(images), "high_clutter": len(clutter),
               "kept_images": len(kept_images), "kept_captions": len(rows),
               "top_fraction": top_fraction, "max_mask_area": max_mask_area,
               "caption_words": list(caption_words), "dropped": dropped}
    stats = {"all": rocs_select.figure_stats(images),
             "high_clutter": rocs_select.figure_stats(clutter, rare_pairs),
             "rocs": rocs_select.figure_stats([im for im in clutter if im.id in kept_images],
                                              kept_pairs)}
    if not rows:
        _write_json(out / "summary.json", summary)
        raise ValueError(f"no caption survived the selection: nothing to write (the reasons "
                         f"are in {out / 'summary.json'})")
    _write_outputs(out, rows, stats, summary)
    return {**summary, "computed": {"masks": mask_cache.computed,
                                    "captions": caption_cache.computed}}


def _write_outputs(out: Path, rows: list[dict], stats: dict, summary: dict) -> None:
    """The dataset first (into a fresh folder, then moved in place), the reports last."""
    staging = out / "rocs.partial"  # `out` is this command's (`own_folder`)
    _remove(staging)
    rocs_caption.write_rocs(staging, rows)
    _remove(out / "rocs")
    os.replace(staging, out / "rocs")
    stats_figure(stats, out / "stats.png")
    for name, value in (("stats.json", stats), ("summary.json", summary)):
        _write_json(out / name, value)


def _remove(path: Path) -> None:
    """Remove an earlier run's folder or file at `path` (a link goes, never its target)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def _write_json(path: Path, value) -> None:
    write_replacing(path, lambda f: f.write(json.dumps(value, indent=2, default=str) + "\n"),
                    text=True)


def stats_figure(stats: dict, path: str | Path) -> Path:
    """Figure 3's layout for the stages of `stats`: objects per image and classes per image
    (means) per stage, and for the rare objects the median box area and the share under 1% of
    the image. A PNG (matplotlib, Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(stats)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key, title in ((axes[0], "objects_per_image_mean", "objects per image (mean)"),
                           (axes[1], "classes_per_image_mean", "classes per image (mean)")):
        ax.bar(stages, [stats[s][key] for s in stages], color="#4c72b0")
        ax.set_title(title)
    rare = [s for s in stages if "rare_objects" in stats[s]]
    x = np.arange(len(rare))
    axes[2].bar(x - 0.2, [100 * stats[s]["rare_box_area_median"] for s in rare], 0.4,
                label="median box area (% of image)")
    axes[2].bar(x + 0.2, [100 * stats[s]["rare_under_1pct"] for s in rare], 0.4,
                label="share under 1% of image (%)")
    axes[2].set_xticks(x, rare)
    axes[2].set_title("rare objects")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    write_replacing(path, lambda f: fig.savefig(f, format="png", dpi=100,
                                                metadata={"Software": None}))  # same bytes
    plt.close(fig)
    return Path(path)

