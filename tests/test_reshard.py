"""`python -m data_prep reshard` and the version-2 training views it writes: the views hold the
pixels today's host path makes from the originals, the stored global image never makes
RandomResizedCrop upsample, conversions between versions and sizes, refusals, byte-identical
reruns, and a SIGKILL part-way followed by a rerun."""

import dataclasses
import io
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from data_prep import shards
from data_prep.reshard import reshard
from sclaro_jax.data import augment, schema
from sclaro_jax.data.dataset import ViewSizeError, open_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _samples(folder) -> dict[str, schema.Sample]:
    ds = open_dataset(folder)
    return {s.id: s for split in schema.SPLITS for path in ds.paths(split)
            for s in map(schema.decode, (r for _, r in shards.iter_records(path)))}


def _files(folder) -> dict[str, bytes]:
    names = sorted(os.listdir(folder))
    assert all(os.path.isfile(os.path.join(folder, n)) for n in names), names
    return {name: open(os.path.join(folder, name), "rb").read() for name in names}


def _pixels(data: bytes, **kw) -> np.ndarray:
    return np.asarray(schema.decode_image(data, **kw), np.float64)


@pytest.fixture(scope="module")
def data(demo_dir, tmp_path_factory):
    """The demo as a version-1 dataset (the demo's v2 records with originals, views dropped),
    and reshards of it."""
    root = tmp_path_factory.mktemp("reshard")
    v1 = str(root / "v1")
    with shards.ShardWriter(v1, records_per_shard=4, view_size=None,
                            split_rule=open_dataset(demo_dir).manifest["split_rule"]) as w:
        for s in _samples(demo_dir).values():
            w.add(s)
    out = {"root": root, "v1": v1}
    for name, size, keep in (("r224", 224, False), ("r336", 336, False), ("r224k", 224, True)):
        out[name] = str(root / name)
        reshard(v1, out[name], image_size=size, keep_originals=keep, progress=False)
    return out


def test_v1_dataset_is_legacy(data):
    ds = open_dataset(data["v1"], verify=True)
    assert ds.schema_version == 1 and ds.has_originals and ds.view_size == 224
    assert not {"view_size", "originals"} & set(ds.manifest)
    assert all(s.view_size is None and s.train_image is None for s in _samples(data["v1"]).values())


@pytest.mark.parametrize("name, size, keep", [("r224", 224, False), ("r336", 336, False),
                                              ("r224k", 224, True)])
def test_reshard_v1_to_v2(data, name, size, keep):
    ds = open_dataset(data[name], verify=True)
    src = open_dataset(data["v1"])
    m = ds.manifest
    assert (ds.schema_version, ds.view_size, ds.has_originals) == (2, size, keep)
    assert (m["view_size"], m["originals"], m["view_quality"], m["global_short_side"]) == (
        size, keep, schema.VIEW_QUALITY, {224: 290, 336: 434}[size])
    assert m["created"] == src.manifest["created"] and m["split_rule"] == src.manifest["split_rule"]
    assert m["converted_from"] == {
        "schema_version": 1, "view_size": None,
        "manifest_sha256": schema.file_sha256(os.path.join(data["v1"], "manifest.json"))}
    for split in schema.SPLITS:  # same records per shard, same order, same splits
        assert [s["records"] for s in m["splits"][split]["shards"]] == [
            s["records"] for s in src.manifest["splits"][split]["shards"]]
        assert [s.id for p in ds.paths(split) for s in
                map(schema.decode, (r for _, r in shards.iter_records(p)))] == [
            s.id for p in src.paths(split) for s in
            map(schema.decode, (r for _, r in shards.iter_records(p)))]
    for key in schema.VOCAB_FILES:
        assert m["vocab"][key] == src.manifest["vocab"][key]
    ds.check_view_size(size)
    with pytest.raises(ViewSizeError, match=f"{size} px training views.*--image-size 112"):
        ds.check_view_size(112)
    old = _samples(data["v1"])
    for sid, s in _samples(data[name]).items():
        schema.validate(s)
        assert s.view_size == size and s.split == old[sid].split
        assert (s.image == old[sid].image) if keep else s.image is None
        assert [r.region for r in s.relations] == (
            [r.region for r in old[sid].relations] if keep else [None] * len(s.relations))
        assert [(o.name, o.box) for o in s.objects] == [(o.name, o.box) for o in old[sid].objects]


def test_views_are_the_host_paths_pixels(data, capsys):
    """Each stored view against today's host path on the v1 record: objects
    resize_centre_crop(photo.crop(box), S); relations resize_centre_crop of the region decoded
    fully, and decoded with min_side=S as the pipeline does by default."""
    old = _samples(data["v1"])
    lines = []
    for name, size in (("r224", 224), ("r336", 336)):
        diffs = {"object": [], "relation (full decode)": [], "relation (min_side decode)": [],
                 "host min_side vs host full decode, no view": []}
        for sid, s in _samples(data[name]).items():
            photo = schema.decode_image(old[sid].image)
            for k, o in enumerate(s.objects):
                host = np.asarray(augment.resize_centre_crop(photo.crop(o.box), size), float)
                diffs["object"].append((np.abs(_pixels(o.view) - host), f"{sid} object {k}"))
            for k, r in enumerate(s.relations):
                region = old[sid].relations[k].region
                host = {key: np.asarray(augment.resize_centre_crop(
                    schema.decode_image(region, **kw), size), float)
                    for key, kw in (("full", {}), ("min_side", {"min_side": size}))}
                where = f"{sid} relation {k}"
                diffs["relation (full decode)"].append((np.abs(_pixels(r.view) - host["full"]),
                                                        where))
                diffs["relation (min_side decode)"].append(
                    (np.abs(_pixels(r.view) - host["min_side"]), where))
                diffs["host min_side vs host full decode, no view"].append(
                    (np.abs(host["min_side"] - host["full"]), where))
        for key, items in diffs.items():
            mean = float(np.mean([d.mean() for d, _ in items]))
            worst, where = max((d.mean(), w) for d, w in items)
            lines.append(f"{size} px {key}: {len(items)} views, mean |diff| {mean:.3f} grey "
                         f"levels, worst view {worst:.3f} ({where}), max pixel "
                         f"{max(d.max() for d, _ in items):.0f}")
            if "min_side" not in key:
                assert mean <= 1.0, lines[-1]
                assert worst <= 3.5, lines[-1]  # 4:2:0 chroma on a detailed view
            else:  # PIL's draft (DCT-scaled) decoding differs by itself: see the last line
                assert mean <= 1.5, lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.mark.parametrize("name, size", [("r224", 224), ("r336", 336)])
def test_train_image_never_makes_random_resized_crop_upsample(data, name, size):
    """The stored global image is the smallest downscale with area >= S^2 / 0.6 and shorter
    side >= S, from which RandomResizedCrop boxes are never smaller than S; photographs that
    are no larger are stored as they are."""
    old = _samples(data["v1"])
    rng = np.random.default_rng(0)
    downscaled = 0
    for sid, s in _samples(data[name]).items():
        img = Image.open(io.BytesIO(s.train_image))
        w, h = img.size
        assert (w, h) == schema.train_image_size(s.width, s.height, size)
        if (w, h) == (s.width, s.height):  # small photographs are stored as they are
            assert s.train_image == old[sid].image
            continue
        downscaled += 1
        assert min(w, h) >= size and 0.6 * w * h >= size * size
        smaller = (w - 1, round(h * (w - 1) / w)) if w <= h else (round(w * (h - 1) / h), h - 1)
        assert min(smaller) < size or 0.6 * smaller[0] * smaller[1] < size * size  # smallest
        assert abs(w / h - s.width / s.height) < 2 / min(w, h)  # aspect kept
        assert max(w, h) <= schema.global_short_side(size) * max(w, h) / min(w, h)
        ref = np.asarray(schema.decode_image(old[sid].image).resize((w, h), Image.BICUBIC),
                         float)
        # JPEG q97 with 4:2:0 chroma: the astronaut's fine colour detail costs the most
        assert np.abs(np.asarray(img.convert("RGB"), float) - ref).mean() <= 2.5
        boxes = np.array([augment.random_resized_crop_box(rng, w, h) for _ in range(2000)])
        assert (boxes[:, 2] - boxes[:, 0]).min() >= size
        assert (boxes[:, 3] - boxes[:, 1]).min() >= size
    assert downscaled >= {224: 13, 336: 6}[size]


def test_reshard_conversions_between_v2_datasets(data, tmp_path):
    # v2 with originals -> another size: the same bytes as from the v1 dataset
    out = str(tmp_path / "k336")
    reshard(data["r224k"], out, image_size=336, keep_originals=False, progress=False)
    assert _files(out) != _files(data["r336"])  # the manifests differ (converted_from) ...
    for split in schema.SPLITS:
        for a, b in zip(open_dataset(out).paths(split), open_dataset(data["r336"]).paths(split)):
            assert open(a, "rb").read() == open(b, "rb").read()  # ... the records do not
    assert open_dataset(out).manifest["converted_from"]["view_size"] == 224
    # v2 without originals -> its own size: the records pass through unchanged
    same = str(tmp_path / "same")
    reshard(data["r224"], same, progress=False)
    for split in schema.SPLITS:
        for a, b in zip(open_dataset(same).paths(split), open_dataset(data["r224"]).paths(split)):
            assert open(a, "rb").read() == open(b, "rb").read()
    # ... and to anything that needs the originals it is refused, saying what to do
    for kw in (dict(image_size=336), dict(keep_originals=True)):
        with pytest.raises(schema.MissingOriginalsError,
                           match="224 px training views without the original photographs.*"
                                 "Reshard the dataset it was made from"):
            reshard(data["r224"], str(tmp_path / "no"), progress=False, **kw)
        assert not os.path.exists(tmp_path / "no" / "manifest.json")
    with pytest.raises(ValueError, match="--in and --out are both"):
        reshard(data["v1"], data["v1"] + "/.", progress=False)
    with pytest.raises(FileExistsError, match="already holds a dataset"):
        reshard(data["v1"], data["r224"], progress=False)


def test_cli(data, tmp_path):
    run = [sys.executable, "-m", "data_prep", "reshard"]
    helped = subprocess.run(run + ["--help"], cwd=REPO, capture_output=True, text=True)
    assert helped.returncode == 0
    for flag in ("--in", "--out", "--image-size", "--keep-originals", "--overwrite",
                 "--workers", "--verbose", "--no-progress"):
        assert flag in helped.stdout
    refused = subprocess.run(run + ["--in", data["r224"], "--out", str(tmp_path / "x"),
                                    "--image-size", "336", "--no-progress"],
                             cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2
    assert "error: " in refused.stderr and "without the original" in refused.stderr
    assert not os.path.exists(tmp_path / "x" / "manifest.json")


def test_cli_keeps_the_originals_as_demo_does(data, tmp_path):
    """reshard keeps the originals --in holds unless --no-keep-originals (localisation and
    MINER crops need them), and a views-only --in stays views-only."""
    from data_prep.__main__ import main
    run = ["reshard", "--image-size", "32", "--workers", "1", "--no-progress", "--in"]
    kept, dropped, same = (str(tmp_path / n) for n in ("kept", "dropped", "same"))
    assert main(run + [data["v1"], "--out", kept]) == 0
    assert main(run + [data["v1"], "--out", dropped, "--no-keep-originals"]) == 0
    assert open_dataset(kept).has_originals and not open_dataset(dropped).has_originals
    assert main(run + [dropped, "--out", same]) == 0
    assert not open_dataset(same).has_originals


@pytest.mark.slow
def test_sigkill_part_way_then_rerun_gives_the_same_bytes(data, tmp_path):
    # a dataset big enough to kill part-way: the demo five times over, two records per shard
    big = str(tmp_path / "big")
    samples = list(_samples(data["v1"]).values())
    with shards.ShardWriter(big, records_per_shard=2, view_size=None) as w:
        for k in range(5):
            for s in samples:
                w.add(dataclasses.replace(s, id=f"{s.id}#{k}"))
    reference = str(tmp_path / "reference")
    reshard(big, reference, progress=False)  # one process; the command below uses two
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "data_prep", "reshard", "--in", big, "--out", str(out),
           "--no-progress", "--workers", "2"]
    # --verbose logs each finished shard; the run is killed the moment a second one is done
    proc = subprocess.Popen(cmd + ["--verbose"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    finished = 0
    for line in proc.stderr:  # blocks on the pipe until the writer reports a shard
        finished += "finished shard" in line
        if finished == 2:
            break
    assert finished == 2 and proc.poll() is None, "the reshard finished before it was killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = os.listdir(out)
    assert len(left) == 1 and left[0].startswith(f".writing-{proc.pid}-"), left
    assert "manifest.json" not in left
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _files(str(out)) == _files(reference)  # every file, byte for byte; nothing else
