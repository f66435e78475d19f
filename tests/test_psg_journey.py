"""The pieces of README's "Train on PSG" journey, on the released-layout fixture of
test_import_scene_graphs (psg.json, COCO photographs, panoptic PNGs, captions): panoptic records'
localisation targets; the view-size and tiny-preset checks before any model is built. The
journey itself, README's commands run as written, is tests/test_readme_journeys.py's."""

import shlex
from pathlib import Path

import numpy as np
import pytest

from conftest import launch_all
from data_prep.__main__ import main as data_prep_main
from sclaro_jax.data import schema
from sclaro_jax.data.dataset import ViewSizeError, open_dataset
from test_import_scene_graphs import PSG_IMAGES, decode_panoptic, psg_root  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
SIZE = 48  # not the tiny preset's own 32: its vision tower follows data.image_size


def _import(root, out, *extra):
    assert data_prep_main(["import", "--source", "psg", "--root", str(root), "--out", str(out),
                           "--no-actions", "--workers", "1", "--no-progress", *extra]) == 0


@pytest.fixture(scope="module")
def psg_data(psg_root, tmp_path_factory):  # noqa: F811
    """README's import, with --no-actions (no NLTK data here), at SIZE px."""
    out = tmp_path_factory.mktemp("psg_journey") / "data"
    _import(psg_root, out, "--keep-originals", "--image-size", str(SIZE))
    return out


def test_panoptic_records_keep_their_segments_and_localisation_targets_are_their_union(
        psg_root, psg_data):  # noqa: F811
    from PIL import Image

    from sclaro_jax.data import augment
    from sclaro_jax.eval.protocols import localise

    ds = open_dataset(str(psg_data))
    samples = {s.id: s for split in ("train", "test") for s in ds.samples(split)}
    checked = 0
    for sample_id, sample in samples.items():
        image_id = sample_id.split("/")[1]
        png = psg_root / "coco" / f"panoptic_train2017/{int(image_id):012d}.png"
        assert sample.panoptic.png == png.read_bytes()   # the dataset's PNG as released
        ids = decode_panoptic(png)
        segments = [sid for sid, _, _ in PSG_IMAGES[image_id][2]]
        for j, rel in enumerate(sample.relations):
            # objects are kept in order here, so object k is segment k of the fixture
            expected = (ids == segments[rel.subject]) | (ids == segments[rel.object])
            assert expected.any()
            np.testing.assert_array_equal(localise.relation_mask(sample, j), expected)
            # the protocol's target: that mask at the encoder's size (Resize + CenterCrop)
            _, targets = localise.relation_examples([sample], SIZE)
            small = augment.resize_centre_crop(
                Image.fromarray(expected.astype(np.uint8) * 255, "L"), SIZE)
            np.testing.assert_array_equal(targets[j], np.asarray(small) >= 128)
            checked += 1
    assert checked == 4   # 7 relations given, 3 dropped (test_import_scene_graphs)
    # a panoptic record without its masks (an import from before they were kept) is refused
    # naming the import flag
    bare = next(iter(samples.values()))
    import dataclasses
    with pytest.raises(localise.LocaliseError, match="--keep-originals"):
        localise.relation_mask(dataclasses.replace(bare, panoptic=None), 0)
    # records written without originals drop the masks with the photographs
    from data_prep.views import drop_originals
    assert drop_originals(bare).panoptic is None
    # a record round-trips, and one without the key (older imports) reads as panoptic=None
    assert schema.decode(schema.encode(bare)) == bare
    assert schema.decode(schema.encode(dataclasses.replace(bare, panoptic=None))).panoptic is None


def test_tiny_preset_follows_the_image_size():
    from sclaro_jax.models import clip

    assert clip.preset_at("tiny", 224).vision.image_size == 224
    assert clip.preset_at("tiny", 32) == clip.PRESETS["tiny"]
    assert clip.preset_at("ViT-B/32", 64) == "ViT-B/32"   # a real preset keeps its size
    with pytest.raises(ValueError, match=r"config.model.preset='tiny'.*config.data.image_size"
                                         r"=50"):
        clip.preset_at("tiny", 50)


def test_view_size_mismatch_is_one_line_before_any_model_with_a_command_that_works(
        psg_root, psg_data, tmp_path):  # noqa: F811
    common = ["--config", "configs/scenarioclip.py:psg", "--config.model.preset=tiny",
              f"--config.data.dir={psg_data}", "--config.train.steps=2"]
    mismatch, tiny_odd = launch_all([
        [*common, "--workdir", tmp_path / "a"],   # the recipe's 224 px on SIZE px views
        [*common, "--workdir", tmp_path / "b", "--config.data.image_size=50"]])
    for run in (mismatch, tiny_odd):
        lines = [x for x in run.stderr.splitlines() if x.startswith("error:")]
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert "building the model" not in run.stderr
        assert not (tmp_path / "a" / "checkpoints").exists()
    line = [x for x in mismatch.stderr.splitlines() if x.startswith("error:")][0]
    assert f"{SIZE} px training views" in line and "224 px images" in line, line
    assert "config.data.image_size=50" in tiny_odd.stderr
    # the import kept originals: reshard is the fix, and it works
    command = shlex.split(line.split(": ", 2)[-1].split("convert it: ")[1])
    assert command[:3] == ["python", "-m", "data_prep"] and "reshard" in command
    assert "--image-size" in command and command[command.index("--image-size") + 1] == "224"
    # an import without originals: the advice is to import again at that size, and it works
    bare = tmp_path / "bare"
    _import(psg_root, bare, "--image-size", str(SIZE))
    with pytest.raises(ViewSizeError) as err:
        open_dataset(str(bare)).check_view_size(32)
    fix = str(err.value).split("import it again at that size: ")[1]
    argv = shlex.split(fix)
    assert argv[:3] == ["python", "-m", "data_prep"] and "--no-actions" in argv, fix
    assert "reshard" not in fix
    assert data_prep_main([*argv[3:], "--workers", "1", "--no-progress"]) == 0
    open_dataset(argv[argv.index("--out") + 1]).check_view_size(32)   # the views fit now
