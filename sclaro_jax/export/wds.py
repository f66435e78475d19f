"""Write a split of a SCLARO dataset as a local CLIP_benchmark webdataset.

    python -m sclaro_jax.export.wds --data DATASET --split test --out WDS/sclaro_actions
    python -m sclaro_jax.export.wds --data DATASET --split test --out WDS/sclaro_captions \
        --task zeroshot_retrieval

The folder is the `wds/NAME` layout LAION's CLIP_benchmark reads
(`clip_benchmark.datasets.builder.build_wds_dataset`): `OUT/<split>/0.tar, 1.tar, ...` and
`OUT/<split>/nshards.txt`; for zero-shot classification `OUT/classnames.txt` (the dataset's
`actions.txt`, one class a line) and `OUT/zeroshot_classification_templates.txt` (the single
template `{c}`: our zero-shot evaluator encodes each class string alone); for retrieval
`OUT/dataset_type.txt` (`retrieval`). `OUT/sclaro_wds.json` records where it came from. Evaluate
an exported level on it with `python -m data_prep.clip_benchmark eval --model_type sclaro ...`.

Each image is one webdataset sample with key `%08d` (its index in the split; webdataset cuts keys
at the first dot, and sample ids may hold dots): `<key>.jpg` / `.png` / `.webp`, the image's own
encoded bytes (never re-encoded); `<key>.cls` (classification: the action's index in
classnames.txt); `<key>.txt` (the caption, one line; retrieval reads one query per line);
`<key>.json` (id, source, action, caption, the photograph's size). Images without an action
(classification) or without a caption (retrieval) are left out, as our evaluator leaves them out.

Which image: by default the one our evaluator makes the image's global view from, so the
benchmark sees our evaluator's pixels: a version-2 record's stored `train_image` (a JPEG
downscale of the photograph), a version-1 record's photograph. The view is
`augment.resize_centre_crop` of it; a `train_image`'s view is taken from the box the transform
takes from the photograph, scaled to the copy, so the JPEG gets one more comment segment
(`sclaro-photo-size=WxH`, the last before its scan; pixel data untouched;
`sclaro_jax.export.photo_size`) that `photo_size_of` reads back from a decoded PIL image
(`data_prep.clip_benchmark`'s transform does; without the tag the view may shift by up to a
pixel). The benchmark model's image size should be the dataset's view size (`view_size` in
OUT/sclaro_wds.json), as our evaluator requires. `--originals` stores the full-size
photographs instead (records written with originals).

No model and no trained run is needed; this module imports neither JAX nor torch.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
from typing import Sequence

from tqdm.auto import tqdm

from sclaro_jax import bounds, cli
from sclaro_jax.data import schema
from sclaro_jax.data.dataset import open_dataset
from sclaro_jax.export.photo_size import tag_photo_size
from sclaro_jax.files import MADE, open_new, own_folder, remove_own_folder, write_replacing

TASKS = ("zeroshot_classification", "zeroshot_retrieval")
MAX_SHARD = 1000  # images a shard at most, by default
TEMPLATE = "{c}"  # our zero-shot evaluator encodes the class string alone
INFO_FILE = "sclaro_wds.json"


class WdsError(ValueError):
    """A webdataset that cannot be written; the message names the file or record and the fix."""


def image_extension(data: bytes) -> str | None:
    """The webdataset extension CLIP_benchmark decodes for these bytes (jpg, png, webp), or
    None for another format."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def _image_bytes(sample: schema.Sample, where: str, originals: bool) -> tuple[bytes, str]:
    """(encoded bytes, extension) of the image stored for `sample`."""
    if originals or not sample.has_views:
        try:
            data = schema.original_image(sample)
        except schema.MissingOriginalsError as e:
            raise WdsError(f"{where}: {e}; or write the views our evaluator sees (leave out "
                           "--originals)") from None
        ext = image_extension(data)
        if ext is None:  # a format CLIP_benchmark does not decode: PNG, losslessly
            with bounds.open_image(io.BytesIO(data), where) as img:
                buf = io.BytesIO()
                img.convert("RGB").save(buf, format="PNG")
            data, ext = buf.getvalue(), "png"
        return data, ext
    data = sample.train_image
    if image_extension(data) != "jpg":
        raise WdsError(f"{where}: the stored train_image is not a JPEG; rewrite the dataset "
                       "with `python -m data_prep reshard`, or pass --originals")
    width, height = schema.train_image_size(sample.width, sample.height, sample.view_size)
    if (width, height) != (sample.width, sample.height):
        try:
            data = tag_photo_size(data, sample.width, sample.height)
        except ValueError as e:
            raise WdsError(f"{where}: the stored train_image: {e}; rewrite the dataset with "
                           "`python -m data_prep reshard`, or pass --originals") from None
    return data, "jpg"


def _captions(caption: str) -> list[str]:
    return [line.strip() for line in (caption or "").splitlines() if line.strip()]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


def _close(tar: tarfile.TarFile) -> None:
    """Close a tar and the file it was opened on (`files.open_new`)."""
    try:
        tar.close()
    finally:
        tar.fileobj.close()


def _check_out(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise WdsError(f"--out {out} is {'not empty' if os.path.isdir(out) else 'a file'}: "
                       "pass a new or empty folder (a webdataset is never written over files)")


def write_wds(data_dir: str, split: str, out: str, *,
              task: str = "zeroshot_classification", shard_size: int | None = None,
              originals: bool = False, progress: bool = True) -> dict:
    """Write `split` of the dataset folder `data_dir` as a CLIP_benchmark webdataset in `out`
    (a new or empty folder; the module docstring gives the layout), `shard_size` images a tar
    (default: a quarter of the split, at most MAX_SHARD). Returns a summary
    {"out", "task", "split", "images", "skipped", "shards", "classes"} (also in
    OUT/sclaro_wds.json)."""
    if task not in TASKS:
        raise WdsError(f"task {task!r} is not one of {TASKS}")
    if shard_size is not None and shard_size < 1:
        raise WdsError(f"shard size {shard_size} must be at least 1")
    _check_out(out)
    ds = open_dataset(data_dir)
    ds.paths(split)  # DatasetError naming the folder and its splits
    if shard_size is None:  # clip_benchmark's 4 loader workers get a shard each, if they can
        shard_size = min(MAX_SHARD, max(1, -(-ds.num_records(split) // 4)))
    classes = list(ds.vocab.actions)
    actions_file = os.path.join(ds.root, schema.VOCAB_FILES["actions"])
    if task == "zeroshot_classification" and not classes:
        raise WdsError(f"{actions_file} lists no action: zero-shot classification needs classes")
    own_folder(out, flag="--out")  # new or empty (checked): made or taken, and marked
    try:
        summary = _write(ds, split, out, task, shard_size, originals, progress, classes)
    except BaseException:  # leave no half-written dataset: only what this command made goes
        remove_own_folder(out)
        raise
    os.remove(os.path.join(out, MADE))  # a finished webdataset, no longer this command's
    return summary


def _write(ds, split: str, out: str, task: str, shard_size: int, originals: bool,
           progress: bool, classes: list[str]) -> dict:
    """`write_wds` after its checks (`classes`: the dataset's actions)."""
    actions_file = os.path.join(ds.root, schema.VOCAB_FILES["actions"])
    index = {c: i for i, c in enumerate(classes)}
    split_dir = os.path.join(out, split)
    os.makedirs(split_dir, exist_ok=True)
    written, skipped, shards = 0, 0, 0
    tar = None
    bar = tqdm(total=ds.num_records(split), desc=f"wds {split}", unit="img",
               disable=not progress)
    try:
        for n, (where, sample) in enumerate(ds.samples(split, located=True)):
            bar.update(1)
            captions = _captions(sample.caption)
            if task == "zeroshot_classification":
                if not sample.action:
                    skipped += 1
                    continue
                if sample.action not in index:
                    raise WdsError(f"{where}: sample {sample.id!r} has action {sample.action!r}, "
                                   f"which {actions_file} does not list: the dataset's "
                                   "vocabulary and shards disagree; rebuild the dataset")
            elif not captions:
                skipped += 1
                continue
            data, ext = _image_bytes(sample, f"{where} (sample {sample.id!r})", originals)
            if tar is None or written % shard_size == 0:
                if tar is not None:
                    _close(tar)
                tar = tarfile.open(fileobj=open_new(os.path.join(split_dir, f"{shards}.tar")),
                                   mode="w", format=tarfile.USTAR_FORMAT)
                shards += 1
            key = f"{n:08d}"
            _add(tar, f"{key}.{ext}", data)
            if task == "zeroshot_classification":
                _add(tar, f"{key}.cls", str(index[sample.action]).encode())
            _add(tar, f"{key}.txt", "\n".join(captions).encode("utf-8"))
            meta = {"id": sample.id, "source": sample.source, "action": sample.action,
                    "caption": sample.caption, "width": sample.width, "height": sample.height}
            _add(tar, f"{key}.json", json.dumps(meta, ensure_ascii=False).encode("utf-8"))
            written += 1
    finally:
        bar.close()
        if tar is not None:
            _close(tar)
    if not written:
        what = "an action" if task == "zeroshot_classification" else "a caption"
        raise WdsError(f"{ds.root}: no image of split {split!r} has {what}; nothing to write")

    def text(name: str, value: str) -> None:
        write_replacing(os.path.join(out, name), lambda f: f.write(value), text=True)

    text(os.path.join(split, "nshards.txt"), f"{shards}\n")
    if task == "zeroshot_classification":
        text("classnames.txt", "".join(f"{c}\n" for c in classes))
        text("zeroshot_classification_templates.txt", TEMPLATE + "\n")
    else:
        text("dataset_type.txt", "retrieval\n")
    summary = {"out": os.path.abspath(out), "task": task, "split": split, "images": written,
               "skipped": skipped, "shards": shards,
               "classes": len(classes) if task == "zeroshot_classification" else None,
               "dataset": os.path.abspath(ds.root), "manifest_sha256": ds.identity,
               "image": "original" if originals else "evaluator view source",
               "view_size": ds.view_size,
               "template": TEMPLATE if task == "zeroshot_classification" else None}
    text(INFO_FILE, json.dumps(summary, indent=1) + "\n")
    return summary


def _parser() -> argparse.ArgumentParser:
    p = cli.parser(
        "python -m sclaro_jax.export.wds",
        "Write a split of a SCLARO dataset as a local CLIP_benchmark webdataset "
        "(no trained run needed); evaluate an exported level on it with LAION's "
        "CLIP_benchmark: python -m data_prep.clip_benchmark eval --help.")
    p.add_argument("--data", required=True, help="SCLARO dataset folder (its manifest.json)")
    p.add_argument("--split", default="test", help="split to write")
    p.add_argument("--out", required=True, type=cli.writable, help="output folder, new or empty")
    p.add_argument("--task", default="zeroshot_classification", choices=TASKS,
                   help="classification: images + action labels, classnames.txt, the '{c}' "
                        "template; retrieval: images + captions")
    p.add_argument("--shard-size", type=int, default=None,
                   help=f"images per tar shard (default: a quarter of the split's, at most "
                        f"{MAX_SHARD}: clip_benchmark's 4 loader workers read one shard each)")
    p.add_argument("--originals", action="store_true",
                   help="store the full-size photographs, not the image our evaluator makes "
                        "its view from")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        summary = write_wds(args.data, args.split, args.out, task=args.task,
                            shard_size=args.shard_size, originals=args.originals,
                            progress=not args.no_progress)
    except cli.USER_ERRORS as e:  # WdsError and DatasetError are ValueErrors
        return cli.fail(e)
    skipped = f" ({summary['skipped']} left out)" if summary["skipped"] else ""
    name = os.path.basename(os.path.normpath(args.out))
    print(f"wrote {summary['images']} images of {args.split}{skipped} in {summary['shards']} "
          f"shard(s) to {args.out}: evaluate with python -m data_prep.clip_benchmark eval "
          f"--model_type sclaro --pretrained EXPORT --dataset wds/{name} --dataset_root "
          f"{args.out} --split {args.split} --task {args.task} --no_amp")
    return 0


if __name__ == "__main__":
    from sclaro_jax.heap import freeze_for_process
    freeze_for_process()  # a command's process: its imports are not scanned again
    sys.exit(main())
