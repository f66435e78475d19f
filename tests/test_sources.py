"""Source adapters on miniature copies of each source's on-disk layout, with real photographs."""

import io
import json
import os

import numpy as np
import pytest
import skimage.data
from PIL import Image

from data_prep import sources
from data_prep.sources import SourceError, SourceItem, iter_source, read_image
from sclaro_jax.data import schema

PHOTOS = [skimage.data.astronaut(), skimage.data.coffee(), skimage.data.chelsea(),
          skimage.data.rocket()]


def photo(i: int, size=(40, 30)) -> np.ndarray:
    """A small, distinct real photograph: a crop of one skimage sample, resized."""
    src = PHOTOS[i % len(PHOTOS)]
    h, w = src.shape[:2]
    x0, y0 = (i * 37) % (w // 2), (i * 23) % (h // 2)
    crop = Image.fromarray(src[y0:y0 + h // 2, x0:x0 + w // 2])
    return np.asarray(crop.resize(size, Image.BILINEAR))


def save(path, pixels: np.ndarray, fmt=None, **kw) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(pixels).save(path, format=fmt, **kw)
    return str(path)


def write(path, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def ids(kind, root, **options):
    return [item.id for item in iter_source(kind, root, **options)]


# --------------------------------------------------------------------------- layouts

def make_mmit(root, annotations=""):
    """Two training videos (multi-label, index labels) and one validation video (name label);
    frames named 1.jpg ... N.jpg so that natural and lexicographic orders differ."""
    ann = os.path.join(root, annotations)
    write(os.path.join(ann, "moments_categories.txt"), "clapping,0\ncooking,1\nrunning,2\n")
    write(os.path.join(ann, "trainingSet.csv"),
          "cooking/yt-abc_12.mp4,1,2\nrunning/getty-run 7.mp4,2\n")
    write(os.path.join(ann, "validationSet.csv"), "clapping/flickr-9.mp4,clapping\n")
    for video, n in (("cooking/yt-abc_12", 10), ("running/getty-run 7", 3),
                     ("clapping/flickr-9", 4)):
        for k in range(1, n + 1):
            save(os.path.join(root, "frames", video, f"{k}.jpg"), photo(k))
    return str(root)


def make_cc3m(root):
    """img2dataset 'files' output: two shards; one sample has its caption only in .json."""
    captions = {("00000", "000000000"): "a man in a space suit",
                ("00000", "000000001"): "a cup of coffee on a table",
                ("00001", "000010000"): "a cat lying on a rug"}
    for i, ((shard, key), caption) in enumerate(captions.items()):
        save(os.path.join(root, shard, key + ".jpg"), photo(i), quality=90)
        meta = {"key": key, "caption": caption, "status": "success"}
        write(os.path.join(root, shard, key + ".json"), json.dumps(meta))
        if key != "000000001":
            write(os.path.join(root, shard, key + ".txt"), caption + "\n")
    write(os.path.join(root, "00000_stats.json"), "{}")
    write(os.path.join(root, "00000", "000000002.json"),  # a failed download: no image
          json.dumps({"key": "000000002", "status": "failed_to_download"}))
    return str(root), captions


def make_openpsg(root, nested=False):
    data = [{"file_name": "val2017/000000000139.jpg", "image_id": "139", "height": 30,
             "width": 40, "relations": []},
            {"file_name": "train2017/000000000009.jpg", "image_id": "9", "height": 30,
             "width": 40, "relations": []}]
    psg = os.path.join(root, "psg", "psg.json") if nested else os.path.join(root, "psg.json")
    write(psg, json.dumps({"data": data, "thing_classes": [], "stuff_classes": [],
                           "predicate_classes": []}))
    for i, entry in enumerate(data):
        save(os.path.join(root, "coco", entry["file_name"]), photo(i))
    return str(root)


def make_pvsg(root):
    """One VidOR video (60 frames) and one Ego4D video (26 frames), frames as OpenPVSG writes
    them (0000.png ...)."""
    videos = {("vidor", "0001_4164158586"): 60, ("ego4d", "ec2e7d2b-0b4f"): 26}
    data = [{"video_id": v, "meta": {"num_frames": n, "width": 40, "height": 30},
             "objects": [], "relations": []} for (_, v), n in videos.items()]
    write(os.path.join(root, "pvsg.json"),
          json.dumps({"data": data, "split": {}, "objects": {"thing": [], "stuff": []}}))
    for (subset, video), n in videos.items():
        for frame in range(n):
            save(os.path.join(root, subset, "frames", video, f"{frame:04d}.png"),
                 photo(frame, size=(8, 6)))
    return str(root)


def make_kitti(root, subsets=("training", "testing")):
    for subset in subsets:
        for scene in (0, 1):
            for frame in (10, 11):
                for camera in ("image_2", "image_3"):
                    save(os.path.join(root, subset, camera, f"{scene:06d}_{frame}.png"),
                         photo(scene + frame, size=(16, 8)))
    write(os.path.join(root, "training", "disp_occ_0", "000000_10.txt"), "not an image")
    return str(root)


def make_folder(root):
    save(os.path.join(root, "b.png"), photo(0))
    save(os.path.join(root, "a.JPG"), photo(1), fmt="JPEG")
    save(os.path.join(root, "sub dir", "c.bmp"), photo(2))
    save(os.path.join(root, "sub dir", "deeper", "d.webp"), photo(3), lossless=True)
    save(os.path.join(root, "a.png"), photo(2))
    write(os.path.join(root, "notes.txt"), "not an image")
    save(os.path.join(root, ".hidden.jpg"), photo(0))
    save(os.path.join(root, ".cache", "e.jpg"), photo(0))
    return str(root)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("sources")
    return {"mmit": make_mmit(base / "mmit"), "cc3m": make_cc3m(base / "cc3m")[0],
            "openpsg": make_openpsg(base / "openpsg"), "pvsg": make_pvsg(base / "pvsg"),
            "kitti2015": make_kitti(base / "kitti"), "folder": make_folder(base / "folder")}


# --------------------------------------------------------------------------- adapters

def test_registry_names_every_source():
    assert set(sources.SOURCES) == {"mmit", "cc3m", "openpsg", "pvsg", "kitti2015", "folder",
                                    "webdataset", "hf"}


def test_mmit_first_label_and_middle_frame_in_natural_order(roots):
    items = list(iter_source("mmit", roots["mmit"]))
    assert [(i.id, i.action) for i in items] == [
        ("mmit/clapping/flickr-9/3", "clapping"),     # 4 frames -> index 2 -> "3.jpg"
        ("mmit/cooking/yt-abc_12/6", "cooking"),      # 10 frames -> index 5 -> "6.jpg"
        ("mmit/running/getty-run%207/2", "running"),  # 3 frames -> index 1; space encoded
    ]
    assert items[1].path == os.path.join(roots["mmit"], "frames", "cooking", "yt-abc_12",
                                         "6.jpg")
    assert all(i.source == "mmit" and i.caption is None and os.path.isabs(i.path)
               for i in items)


def test_mmit_frames_per_video_and_splits(roots):
    three = ids("mmit", roots["mmit"], frames_per_video=3, splits=("training",))
    # centres of 3 equal segments of 10 frames: indices 1, 5, 8 -> files 2, 6, 9
    assert three == ["mmit/cooking/yt-abc_12/2", "mmit/cooking/yt-abc_12/6",
                     "mmit/cooking/yt-abc_12/9", "mmit/running/getty-run%207/1",
                     "mmit/running/getty-run%207/2", "mmit/running/getty-run%207/3"]
    everything = ids("mmit", roots["mmit"], frames_per_video=50)
    assert len(everything) == 10 + 3 + 4


def test_mmit_annotations_subfolder_and_errors(tmp_path):
    root = make_mmit(tmp_path / "m", annotations="annotations")
    assert len(ids("mmit", root)) == 3
    os.rename(os.path.join(root, "frames", "running", "getty-run 7"),
              os.path.join(root, "frames", "running", "moved"))
    with pytest.raises(SourceError, match=r"no frames for video 'running/getty-run 7.mp4'.*"
                                          r"trainingSet\.csv line 2"):
        iter_source("mmit", root)
    assert len(ids("mmit", root, skip_missing=True)) == 2
    write(os.path.join(root, "annotations", "validationSet.csv"), "clapping/flickr-9.mp4,7\n")
    with pytest.raises(SourceError, match=r"validationSet\.csv line 1: label '7'"):
        iter_source("mmit", root, skip_missing=True)
    os.remove(os.path.join(root, "annotations", "moments_categories.txt"))
    with pytest.raises(SourceError, match="moments_categories.txt not found; expected"):
        iter_source("mmit", root)


def test_cc3m_img2dataset_layout(tmp_path):
    root, captions = make_cc3m(tmp_path / "cc3m")
    items = list(iter_source("cc3m", root))
    assert [i.id for i in items] == [f"cc3m/{s}/{k}" for s, k in sorted(captions)]
    assert [i.caption for i in items] == [captions[k] for k in sorted(captions)]
    assert items[2].path == os.path.join(root, "00001", "000010000.jpg")
    assert all(i.action is None for i in items)


def test_cc3m_tsv_layout(tmp_path):
    root = tmp_path / "gcc"
    save(os.path.join(root, "images", "train", "0001.jpg"), photo(0))
    save(os.path.join(root, "images", "train", "0000.png"), photo(1))
    write(os.path.join(root, "train.tsv"),
          'caption\tfilename\nactor "quoted" in a suit\ttrain/0001.jpg\n'
          "a cup of coffee\ttrain/0000.png\n")
    items = list(iter_source("cc3m", str(root), tsv="train.tsv"))
    assert [(i.id, i.caption) for i in items] == [
        ("cc3m/train/0000", "a cup of coffee"), ("cc3m/train/0001", 'actor "quoted" in a suit')]
    write(os.path.join(root, "bad.tsv"), "only a caption\n")
    with pytest.raises(SourceError, match=r"bad\.tsv line 1: expected caption<TAB>filename"):
        iter_source("cc3m", str(root), tsv="bad.tsv")
    with pytest.raises(SourceError, match=r"no shard folders .* expected img2dataset"):
        iter_source("cc3m", str(root))


def test_openpsg(roots, tmp_path):
    items = list(iter_source("openpsg", roots["openpsg"]))
    assert [i.id for i in items] == ["openpsg/139", "openpsg/9"]  # sorted as strings
    assert items[1].path == os.path.join(roots["openpsg"], "coco", "train2017",
                                         "000000000009.jpg")
    nested = make_openpsg(tmp_path / "nested", nested=True)
    assert ids("openpsg", nested) == ["openpsg/139", "openpsg/9"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SourceError, match=r"OpenPSG: .*empty/psg\.json not found; expected "
                                          r"<root>/psg\.json .*<root>/coco/"):
        iter_source("openpsg", str(empty))


def test_pvsg_stride_and_subset_folders(roots, tmp_path):
    items = list(iter_source("pvsg", roots["pvsg"]))
    assert [i.id for i in items] == [
        "pvsg/0001_4164158586/0000", "pvsg/0001_4164158586/0025", "pvsg/0001_4164158586/0050",
        "pvsg/ec2e7d2b-0b4f/0000", "pvsg/ec2e7d2b-0b4f/0025"]
    assert items[4].path == os.path.join(roots["pvsg"], "ego4d", "frames", "ec2e7d2b-0b4f",
                                         "0025.png")
    assert all(os.path.isfile(i.path) for i in items)
    assert len(ids("pvsg", roots["pvsg"], stride=10)) == 6 + 3

    root = make_pvsg(tmp_path / "p")
    os.rename(os.path.join(root, "ego4d"), os.path.join(root, "elsewhere"))
    with pytest.raises(SourceError, match=r"no frames folder for video 'ec2e7d2b-0b4f'"):
        iter_source("pvsg", root)
    assert len(ids("pvsg", root, skip_missing=True)) == 3


def test_kitti2015_takes_left_frame_10_by_default(roots, tmp_path):
    assert ids("kitti2015", roots["kitti2015"]) == [
        "kitti2015/testing/image_2/000000_10", "kitti2015/testing/image_2/000001_10",
        "kitti2015/training/image_2/000000_10", "kitti2015/training/image_2/000001_10"]
    both = ids("kitti2015", roots["kitti2015"], subsets=("training",), frames=(10, 11))
    assert both == ["kitti2015/training/image_2/000000_10", "kitti2015/training/image_2/000000_11",
                    "kitti2015/training/image_2/000001_10", "kitti2015/training/image_2/000001_11"]
    root = make_kitti(tmp_path / "k", subsets=("training",))
    with pytest.raises(SourceError, match=r"testing/image_2 not found; expected .*subsets="):
        iter_source("kitti2015", root)
    assert len(ids("kitti2015", root, subsets=("training",))) == 2


def test_folder_recursive_sorted_skips_hidden_and_non_images(roots):
    items = list(iter_source("folder", roots["folder"]))
    assert [i.id for i in items] == ["folder/a.JPG", "folder/a.png", "folder/b.png",
                                     "folder/sub%20dir/c.bmp", "folder/sub%20dir/deeper/d.webp"]
    assert items[3].path == os.path.join(roots["folder"], "sub dir", "c.bmp")


def test_ids_unique_across_sources_without_whitespace(roots):
    # (webdataset and hf: tests/test_streaming_sources.py)
    everything = [item for kind in roots for item in iter_source(kind, roots[kind])]
    all_ids = [item.id for item in everything]
    assert len(set(all_ids)) == len(all_ids) == 3 + 3 + 2 + 5 + 4 + 5
    assert not any(any(c.isspace() for c in i) for i in all_ids)
    assert {item.source for item in everything} == set(roots)
    assert all(item.id.startswith(item.source + "/") for item in everything)


def test_iter_source_rejects_unknown_kind_missing_root_and_empty_source(tmp_path):
    with pytest.raises(SourceError, match="unknown source 'coco'; known sources: cc3m, folder"):
        iter_source("coco", str(tmp_path))
    with pytest.raises(SourceError, match=r"KITTI2015: root folder .*nowhere not found"):
        iter_source("kitti2015", str(tmp_path / "nowhere"))
    write(os.path.join(tmp_path, "readme.txt"), "no images here")
    with pytest.raises(SourceError, match="folder: no images found under"):
        iter_source("folder", str(tmp_path))


# --------------------------------------------------------------------------- read_image

def test_read_image_keeps_jpeg_and_png_bytes(roots):
    by_id = {i.id: i for i in iter_source("folder", roots["folder"])}
    for item_id in ("folder/a.JPG", "folder/b.png"):
        item = by_id[item_id]
        data, image = read_image(item)
        with open(item.path, "rb") as f:
            assert data == f.read()
        assert image.mode == "RGB"
        # the reader decodes the record's bytes to the same pixels
        np.testing.assert_array_equal(np.asarray(schema.decode_image(data)), np.asarray(image))
    np.testing.assert_array_equal(np.asarray(read_image(by_id["folder/b.png"])[1]), photo(0))


@pytest.mark.parametrize("item_id, expected", [("folder/sub%20dir/c.bmp", 2),
                                               ("folder/sub%20dir/deeper/d.webp", 3)])
def test_read_image_reencodes_other_formats_as_lossless_png(roots, item_id, expected):
    item = {i.id: i for i in iter_source("folder", roots["folder"])}[item_id]
    data, image = read_image(item)
    assert Image.open(io.BytesIO(data)).format == "PNG"
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(data))), photo(expected))
    np.testing.assert_array_equal(np.asarray(image), photo(expected))


def test_read_image_does_not_apply_exif_orientation(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = save(tmp_path / "rotated.jpg", photo(0, size=(40, 30)), exif=exif.tobytes())
    data, image = read_image(SourceItem("folder/rotated.jpg", "folder", path))
    assert image.size == (40, 30)  # as stored, not transposed to 30x40
    assert schema.decode_image(data).size == (40, 30)


def test_read_image_names_item_on_corrupt_or_missing_file(tmp_path):
    good = save(tmp_path / "good.jpg", photo(0, size=(64, 48)))
    with open(good, "rb") as f:
        head = f.read()[:300]
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(head)
    text = tmp_path / "text.png"
    text.write_text("not an image")
    for path in (truncated, text, tmp_path / "absent.jpg"):
        item = SourceItem(f"folder/{path.name}", "folder", str(path))
        with pytest.raises(SourceError, match=rf"folder/{path.name}: cannot read image "
                                              rf".*{path.name}"):
            read_image(item)
    assert issubclass(SourceError, ValueError)


# --------------------------------------------------------------------------- outside the root

@pytest.mark.parametrize("relative", ["a/b.jpg", "a/../b.jpg", "x:y.jpg"])
def test_inside_root_resolves_relative_paths_below_the_root(tmp_path, relative):
    from sclaro_jax.paths import inside_root
    (tmp_path / "root").mkdir()
    assert inside_root(tmp_path / "root", relative) == (tmp_path / "root" / relative).resolve()
    # the root itself may be a link (coco -> /datasets/coco)
    (tmp_path / "link").symlink_to(tmp_path / "root")
    assert inside_root(tmp_path / "link", relative) == (tmp_path / "root" / relative).resolve()


@pytest.mark.parametrize("relative", ["/etc/passwd", "../x.jpg", "a/../../x.jpg", "out/x.jpg",
                                      "a\0.jpg", "~/x.jpg", "C:\\x.jpg", "C:/x.jpg",
                                      "\\\\server\\x.jpg", "", None, 7])
def test_inside_root_refuses_every_path_that_leaves_it(tmp_path, relative):
    from sclaro_jax.paths import inside_root
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "out").symlink_to(tmp_path)  # a link inside the root, pointing out
    assert inside_root(tmp_path / "root", relative) is None


def test_paths_that_leave_their_root_are_listed_but_never_read(tmp_path):
    """Every adapter that takes a path from a data file, or lists a folder, marks an image
    outside its root (absolute, ../, a link out) `outside_root`; read_image refuses it with
    OutsideRoot (a SourceError) without opening it."""
    from data_prep.source_items import OutsideRoot
    private = save(tmp_path / "users_files" / "private.jpg", photo(3))
    psg = make_openpsg(tmp_path / "psg")
    doc = json.loads(open(os.path.join(psg, "psg.json")).read())
    doc["data"][0]["file_name"] = private  # absolute
    doc["data"][1]["file_name"] = "../../users_files/private.jpg"
    write(os.path.join(psg, "psg.json"), json.dumps(doc))
    gcc = tmp_path / "gcc"
    save(os.path.join(gcc, "images", "0000.jpg"), photo(0))
    write(os.path.join(gcc, "train.tsv"), "a photo\t0000.jpg\nescaping\t../../users_files/"
                                          "private.jpg\nabsolute\t" + private + "\n")
    folder = make_folder(tmp_path / "folder")
    os.symlink(private, os.path.join(folder, "linked.jpg"))  # a file linking out: refused
    os.symlink(os.path.dirname(private), os.path.join(folder, "linked_dir"))  # not followed
    mmit = make_mmit(tmp_path / "mmit")
    write(os.path.join(mmit, "trainingSet.csv"), "../../users_files/v.mp4,1\n")
    os.makedirs(tmp_path / "users_files" / "v")
    os.symlink(private, tmp_path / "users_files" / "v" / "1.jpg")
    pvsg = make_pvsg(tmp_path / "pvsg")
    doc = json.loads(open(os.path.join(pvsg, "pvsg.json")).read())
    doc["data"][0]["video_id"] = "../../../users_files/v"
    write(os.path.join(pvsg, "pvsg.json"), json.dumps(doc))
    outside = {}
    for kind, root, options in (("openpsg", psg, {}), ("cc3m", str(gcc), {"tsv": "train.tsv"}),
                                ("folder", folder, {}),
                                ("mmit", mmit, {"splits": ("training",)}),
                                ("pvsg", pvsg, {})):
        for item in iter_source(kind, root, **options):
            if item.outside_root is not None:
                with pytest.raises(OutsideRoot, match=r"lies outside .*; not opened"):
                    read_image(item)
                outside.setdefault(kind, []).append(item.id)
            else:
                read_image(item)
    assert outside == {"openpsg": ["openpsg/139", "openpsg/9"],
                       "cc3m": ["cc3m/../../users_files/private", "cc3m/" + private[:-4]],
                       "folder": ["folder/linked.jpg"], "mmit": ["mmit/../../users_files/v"],
                       "pvsg": [f"pvsg/../../../users_files/v/{k:04d}" for k in (0, 25, 50)]}
