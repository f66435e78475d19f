"""Export of a trained level: the folder holds towers, heads and logit scale under the names
its transformers remote code reads (tests/test_export_clients.py runs that code); it carries our
tokenizer and image preprocessing for transformers; our own readers load it with its heads or
refuse it (clip.from_hf, an older export's zero CLIP projections); the command line's user
errors; file permissions; no random-init notice when loading a run."""

import os
import shutil
import stat
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file

from sclaro_jax.checkpoint import DamagedRunError
from sclaro_jax.export import hf
from sclaro_jax.models import scenarioclip
from sclaro_jax.train import export


@pytest.fixture(scope="module")
def tiny_model():
    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=24, seed=1)
    for level in scenarioclip.LEVELS:
        model.pair(level).vision_head.linear.bias[...] += 0.3  # not the init values
    return model


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    """The object level of `tiny_model`, exported."""
    return Path(hf.export_level(tiny_model, "object",
                                str(tmp_path_factory.mktemp("export") / "object")))


def test_export_holds_towers_heads_and_scale_under_the_remote_codes_names(tiny_model,
                                                                          exported):
    """model.safetensors: the object level's towers as Hugging Face CLIP keys, its heads as
    `nn.Sequential(Linear, LayerNorm)` under visual_projection / text_projection (torch layout:
    Linear weight [out, in]), and its logit scale; no CLIP projection matrices."""
    from sclaro_jax.models import clip

    pair = tiny_model.pair("object")
    tensors = load_file(str(exported / "model.safetensors"))
    towers = clip.create("tiny")
    towers.vision_model, towers.text_model = pair.vision_model, pair.text_model
    want = {k: v for k, v in clip.hf_state_dict(towers).items()
            if k.split(".")[0] in ("vision_model", "text_model")}
    for ours, theirs in (("vision_head", "visual_projection"), ("text_head", "text_projection")):
        head = getattr(pair, ours)
        want[f"{theirs}.0.weight"] = np.asarray(head.linear.kernel[...]).T
        want[f"{theirs}.0.bias"] = np.asarray(head.linear.bias[...])
        want[f"{theirs}.1.weight"] = np.asarray(head.norm.scale[...])
        want[f"{theirs}.1.bias"] = np.asarray(head.norm.bias[...])
    want["logit_scale"] = np.asarray(tiny_model.logit_scale("object"))
    assert sorted(tensors) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(tensors[key], value, err_msg=key)
    assert tensors["visual_projection.0.weight"].shape == (24, 64)
    remote = (exported / "modeling_scenarioclip.py").read_text()
    assert remote == hf.REMOTE_CODE.read_text() and "class ScenarioCLIPModel" in remote


def _older_export(tiny_model, folder):
    """The object level as older versions exported it: a CLIPModel folder with zero CLIP
    projections, the heads beside it in scenarioclip_heads.safetensors."""
    from sclaro_jax.models import clip, hf_weights

    pair = tiny_model.pair("object")
    towers = clip.create(pair.config.replace(projection_dim=24))
    towers.vision_model, towers.text_model = pair.vision_model, pair.text_model
    for proj in (towers.visual_projection, towers.text_projection):
        proj.kernel[...] = jnp.zeros_like(proj.kernel[...])
    clip.to_hf(towers, folder)
    legacy = {f"{ours}{key[len(theirs):]}": value  # vision_head.0.weight, ...
              for key, value in scenarioclip.export_heads(pair).items()
              for ours, theirs in scenarioclip.EXPORT_HEAD_NAMES.items() if key.startswith(theirs)}
    hf_weights.save_safetensors(legacy | {"logit_scale": np.zeros((), np.float32)},
                                folder / clip.HEADS_FILE)
    return folder


@pytest.mark.slow
def test_our_readers_load_the_export_with_its_heads_and_refuse_it_as_plain_clip(
        exported, tiny_model, tiny_hf, tmp_path, capsys):
    import jax
    from flax import nnx

    from sclaro_jax.eval import encoders, rocs
    from sclaro_jax.eval.retrieval import synthetic
    from sclaro_jax.models import clip

    # clip.from_hf: the export's projections are heads, not CLIP's matrices
    with pytest.raises(clip.CheckpointError) as err:
        clip.from_hf(exported)
    message = str(err.value)
    assert message.startswith(f"{exported} is a ScenarioCLIP export")
    assert "scenarioclip.from_export" in message and "trust_remote_code=True" in message
    # an older export (zero CLIP projections + heads file) is asked to be exported again, by
    # clip.from_hf, from_export and eval.rocs (one error line, nothing written)
    old = _older_export(tiny_model, tmp_path / "old")
    with pytest.raises(clip.CheckpointError, match="all zeros.*export it again"):
        clip.from_hf(old)
    with pytest.raises(clip.CheckpointError, match="older sclaro_jax.*export it again"):
        scenarioclip.from_export(old)
    split = synthetic.make_planted_split(tmp_path / "split", num_images=2, width=64, height=48)
    argv = ["--split", str(split), "--out", str(tmp_path / "out"), "--no_progress"]
    capsys.readouterr()
    assert rocs.main(["--model", str(old), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {old}: ") and err.count("\n") == 1
    assert "export it again with python -m sclaro_jax.train.export" in err
    assert not (tmp_path / "out").exists()
    # zero projections without a heads file: no export advice
    (old / clip.HEADS_FILE).unlink()
    with pytest.raises(clip.CheckpointError, match="all zeros") as err:
        clip.from_hf(old)
    assert "export it again" not in str(err.value) and "towers_only=True" in str(err.value)
    with pytest.raises(clip.CheckpointError, match="not a ScenarioCLIP export"):
        scenarioclip.from_export(old)
    # the export: the level's towers and heads (from_export), and eval.rocs's encoder embeds
    # with them
    pair = tiny_model.pair("object")
    loaded = jax.tree.leaves(nnx.state(scenarioclip.from_export(exported), nnx.Param))
    want = jax.tree.leaves(nnx.state(pair, nnx.Param))
    assert len(loaded) == len(want)
    for a, b in zip(loaded, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    enc = encoders.load_encoder(str(exported))
    assert type(enc) is encoders.ExportEncoder and enc.name == "scenarioclip-export:object"
    captions = ["a dog on a mat", "two cats"]
    np.testing.assert_allclose(enc.encode_texts(captions),
                               encoders.towers(pair)[1](enc.tokenize(captions))[0], atol=1e-6)
    # towers alone (model.init, load_hf_into_level, detection): zero CLIP projections
    towers = clip.from_hf(exported, towers_only=True)
    assert not towers.visual_projection.kernel[...].any()
    assert towers.visual_projection.kernel.shape == (64, 24)
    for a, b in zip(jax.tree.leaves(nnx.state(towers.text_model, nnx.Param)),
                    jax.tree.leaves(nnx.state(pair.text_model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a plain CLIP folder still loads
    assert type(encoders.load_encoder(str(tiny_hf[0]))) is encoders.ClipEncoder
    assert clip.from_hf(tiny_hf[0]).visual_projection.kernel[...].any()


def test_export_carries_our_tokenizer(exported):
    """`CLIPTokenizer.from_pretrained(export)` gives our ids: padded with <|endoftext|> to the
    text tower's 77 positions and truncated keeping the end token, as our readers tokenize;
    and at the training length (data.text_length) when asked for it."""
    from sclaro_jax.data.tokenizer import ClipTokenizer

    captions = ["a photo of a cat", "A man RIDING a horse, on the beach!", "", "café naïve 日本語",
                "don't stop; we'll see", " ".join(["word"] * 100)]
    hf = transformers.CLIPTokenizer.from_pretrained(exported)
    assert hf.model_max_length == 77 and hf.pad_token_id == 49407
    ids = np.array(hf(captions, padding="max_length", truncation=True)["input_ids"])
    np.testing.assert_array_equal(ids, ClipTokenizer()(captions, length=77))
    ids = np.array(hf(captions, padding="max_length", max_length=32,
                      truncation=True)["input_ids"])
    np.testing.assert_array_equal(ids, ClipTokenizer()(captions, length=32))
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert (exported / name).is_file(), name


def test_export_carries_our_image_preprocessing(exported):
    """`CLIPImageProcessor.from_pretrained(export)` gives our pixels (bicubic short-side
    resize, centre crop, CLIP mean/std) on a photograph, within one grey level (its default
    backend resamples with torchvision, not PIL; the PIL backend gives equal pixels here)."""
    import json

    import skimage.data
    from PIL import Image

    from sclaro_jax import ops
    from sclaro_jax.data import augment

    config = json.loads((exported / "preprocessor_config.json").read_text())
    assert config["size"] == {"shortest_edge": 32} and config["resample"] == 3
    assert config["crop_size"] == {"height": 32, "width": 32} and config["do_center_crop"]
    np.testing.assert_array_equal(np.float32(config["image_mean"]), ops.CLIP_MEAN)
    np.testing.assert_array_equal(np.float32(config["image_std"]), ops.CLIP_STD)
    image = skimage.data.coffee()  # 400 x 600: resized to 32 x 48, then cropped
    ours = ops.normalize(np.asarray(augment.resize_centre_crop(Image.fromarray(image), 32)))
    grey_level = 1 / 255 / ops.CLIP_STD.min()
    classes = [transformers.CLIPImageProcessor, getattr(transformers, "CLIPImageProcessorPil",
                                                        None)]
    for cls, atol in zip(classes, (1.01 * grey_level, 1e-5)):
        if cls is not None:
            theirs = cls.from_pretrained(exported)(images=image, return_tensors="np")
            theirs = np.asarray(theirs["pixel_values"])[0].transpose(1, 2, 0)
            assert theirs.shape == ours.shape
            np.testing.assert_allclose(theirs, ours, atol=atol, rtol=0, err_msg=cls.__name__)


@pytest.mark.slow
def test_load_hf_into_one_level_replaces_only_its_towers(tiny_hf):
    from flax import nnx

    from sclaro_jax.models import clip

    model = scenarioclip.build("scenarioclip", preset="tiny", embed_dim=24, seed=3)
    pixels = jnp.asarray(np.random.default_rng(1).normal(size=(2, 32, 32, 3)), jnp.float32)
    before = {lv: np.asarray(model.pair(lv).encode_image(pixels)) for lv in scenarioclip.LEVELS}
    head_before = np.asarray(model.pair("object").vision_head.linear.kernel[...])
    scenarioclip.load_hf_into_level(model, "object", str(tiny_hf[0]))
    hf = clip.from_hf(tiny_hf[0])
    np.testing.assert_allclose(model.pair("object").vision_model.pooled(pixels),
                               hf.vision_model.pooled(pixels), atol=1e-6)
    ids = jnp.asarray([[49406, 320, 1125, 49407, 0, 0]], jnp.int32)
    np.testing.assert_allclose(model.pair("object").text_model.pooled(ids),
                               hf.text_model.pooled(ids), atol=1e-6)
    np.testing.assert_array_equal(model.pair("object").vision_head.linear.kernel[...],
                                  head_before)
    for lv in ("global", "relation"):
        np.testing.assert_array_equal(model.pair(lv).encode_image(pixels), before[lv])
    assert np.abs(np.asarray(model.pair("object").encode_image(pixels))
                  - before["object"]).max() > 1e-3
    # a refusal by shapes: the ViT-B/32 model built abstractly (no weights drawn)
    other = nnx.eval_shape(lambda: scenarioclip.build("scenarioclip", preset="ViT-B/32",
                                                      embed_dim=24, seed=0))
    with pytest.raises(clip.CheckpointError, match="does not fit the global level"):
        scenarioclip.load_hf_into_level(other, "global", str(tiny_hf[0]))


@pytest.mark.slow
def test_load_checkpoint_reads_params_and_teacher_whatever_the_optimiser_state(
        scenario_workdir, tmp_path):
    # only state.params / state.teacher are restored: a checkpoint whose opt_state has another
    # layout (here keyed by names, unlike the conftest's positional list) loads the same way
    import shutil

    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from sclaro_jax.checkpoint import build_model, load_checkpoint, run_config

    shutil.copy(scenario_workdir / "config.json", tmp_path / "config.json")
    params = nnx.to_pure_dict(nnx.state(build_model(run_config(str(tmp_path))), nnx.Param))
    teacher = jax.tree.map(lambda x: x * 0.5 + 1.0, params)
    state = {"step": jnp.int32(3), "params": params, "teacher": teacher,
             "opt_state": {"adam": {"mu": {"vision.kernel": jnp.ones((5, 2))}},
                           "count": jnp.zeros((), jnp.int32)}}
    manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"))
    manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
    manager.close()
    for is_teacher, want in ((False, params), (True, teacher)):
        model, step = load_checkpoint(str(tmp_path), teacher=is_teacher)
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        assert step == 3
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the trainer's own checkpoint (conftest) loads too, by step; a missing step is named
    assert load_checkpoint(str(scenario_workdir), 7)[1] == 7
    with pytest.raises(DamagedRunError, match="no checkpoint of step 4"):
        load_checkpoint(str(tmp_path), 4)


RANDOM_INIT = "model.init is empty"


def _export_cli(capsys, *argv):
    """(exit code, stdout, stderr) of the export command line, run in this process."""
    try:
        code = export.main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _umask(mask):
    old = os.umask(mask)
    return old


@pytest.mark.slow
def test_export_cli_writes_files_with_the_umasks_permissions_and_no_random_init_notice(
        scenario_workdir, tmp_path, capsys, caplog):
    """The checkpoint's model is built only to restore into: no 'random weights' notice (a
    fresh random build still logs it once). safetensors creates its files 0600; ours follow
    the umask like any new file."""
    old = _umask(0o022)
    try:
        code, out, err = _export_cli(capsys, "--workdir", scenario_workdir, "--level", "object",
                                     "--out", tmp_path / "object")
    finally:
        os.umask(old)
    assert code == 0, err
    assert out.strip() == f"wrote the object level of step 7 to {tmp_path / 'object'}"
    files = ["config.json", "model.safetensors", "modeling_scenarioclip.py", "vocab.json",
             "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
             "preprocessor_config.json"]
    for name in files:
        assert stat.S_IMODE(os.stat(tmp_path / "object" / name).st_mode) == 0o644, name
    assert sorted(os.listdir(tmp_path / "object")) == sorted(files)  # no .tmp left
    assert RANDOM_INIT not in caplog.text and RANDOM_INIT not in err
    caplog.clear()
    scenarioclip.build("scenarioclip", preset="tiny", embed_dim=8, seed=0)
    assert sum(RANDOM_INIT in r.getMessage() for r in caplog.records) == 1


def test_to_hf_follows_another_umask(tmp_path):
    from sclaro_jax.models import clip

    old = _umask(0o027)
    try:
        clip.to_hf(clip.create("tiny"), tmp_path / "hf")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "hf" / "model.safetensors").st_mode) == 0o640


def test_export_cli_user_errors_are_one_line_naming_the_fix(scenario_workdir, tmp_path, capsys):
    work = str(scenario_workdir)
    ckpts = os.path.join(work, "checkpoints")
    empty_run = tmp_path / "fresh_run"  # a run that has not saved a checkpoint yet
    empty_run.mkdir()
    shutil.copy(scenario_workdir / "config.json", empty_run / "config.json")
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    out = tmp_path / "out"
    cases = [
        (["--workdir", tmp_path / "nope", "--level", "object", "--out", out], 2,
         f"error: workdir {tmp_path / 'nope'} does not exist: pass the folder a run's "
         "launch/train.py --workdir wrote"),
        (["--workdir", empty_run, "--level", "object", "--out", out], 2,
         f"error: no checkpoint in {empty_run / 'checkpoints'}: the run has not saved one yet "
         "(it saves every config.checkpoint_every steps and at its end); train it further or "
         "pass another workdir"),
        (["--workdir", work, "--level", "object", "--out", out, "--step", "4"], 2,
         f"error: no checkpoint of step 4 in {ckpts}; it has steps [7]: pass one of them, or "
         "no step for the newest"),
        (["--workdir", work, "--level", "object", "--out", full], 2,
         f"error: --out {full} is not empty: pass a new or empty folder (an export never "
         "overwrites files)"),
        (["--workdir", work, "--level", "object", "--out", a_file / "sub"], 2,
         f"error: argument --out: cannot write {a_file / 'sub'}: {a_file} is a file, not a "
         "folder (see python -m sclaro_jax.train.export --help)"),
        (["--workdir", work, "--level", "objects", "--out", out], 2,
         "error: argument --level: invalid choice: 'objects' (choose from 'global', 'object', "
         "'relation') (did you mean object?) (see python -m sclaro_jax.train.export --help)"),
    ]
    for argv, want_code, want in cases:
        code, stdout, err = _export_cli(capsys, *argv)
        assert (code, err) == (want_code, want + "\n"), argv
        assert stdout == ""
    assert not out.exists() and os.listdir(full) == ["notes.txt"]
    # --verbose: the traceback too, then the same line
    code, _, err = _export_cli(capsys, "--workdir", work, "--level", "object", "--out", out,
                               "--step", "4", "--verbose")
    assert code == 2 and err.startswith("Traceback") and "DamagedRunError" in err
    assert err.endswith(f"error: no checkpoint of step 4 in {ckpts}; it has steps [7]: pass one "
                        "of them, or no step for the newest\n")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only folders")
def test_export_cli_refuses_an_unwritable_out(scenario_workdir, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, _, err = _export_cli(capsys, "--workdir", scenario_workdir, "--level", "object",
                               "--out", locked / "out")
    assert code == 2
    assert err == (f"error: argument --out: cannot write {locked / 'out'}: {locked} refuses new "
                   "files (Permission denied) (see python -m sclaro_jax.train.export --help)\n")
