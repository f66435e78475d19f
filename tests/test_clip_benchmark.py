"""LAION's CLIP_benchmark on our exports: a SCLARO split written as a CLIP_benchmark webdataset
(`sclaro_jax.export.wds`) reads back with the `webdataset` library; the `sclaro` model type
(`data_prep.clip_benchmark`) gives our evaluator's views, ids and embeddings; clip_benchmark's
command line on an exported level reproduces the zero-shot action accuracy our own evaluator
computes with the JAX model on the same images, classes and template, and our retrieval
recall. That command line runs as in a PyTorch client's venv: every installed distribution
outside docs/exports.md's client pip line (and its requirements) hidden, JAX included."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from demo_extra import HOOK, closure
from sclaro_jax.data.dataset import open_dataset
from sclaro_jax.export import photo_size, wds

ROOT = Path(__file__).resolve().parents[1]
# what the client venv must not hold: JAX and the project's other dependencies
PROJECT_ONLY = {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "array-record",
                "msgpack", "ml-collections", "dm-pix", "simplejpeg", "numba", "tensorboardx"}
SPLIT = "train"  # the demo's largest split (10 images, 12 actions)
# A seed whose random tiny model gets some, not all, actions right on the demo's train split:
# the accuracy comparison is informative (test_..._reproduces_... asserts 0 < top-1 < 100).
SEED = 2


@pytest.fixture(scope="module")
def model():
    from sclaro_jax.models import scenarioclip

    return scenarioclip.build("scenarioclip", preset="tiny", embed_dim=24, seed=SEED)


@pytest.fixture(scope="module")
def folders(model, demo_dir, tmp_path_factory):
    """The global level exported, and the demo split as classification and retrieval wds."""
    from sclaro_jax.export import hf

    base = tmp_path_factory.mktemp("clip_benchmark")
    out = hf.export_level(model, "global", str(base / "export"))
    actions = base / "sclaro_actions"
    captions = base / "sclaro_captions"
    summary = wds.write_wds(demo_dir, SPLIT, str(actions), progress=False)
    wds.write_wds(demo_dir, SPLIT, str(captions), task="zeroshot_retrieval", shard_size=4,
                  progress=False)
    return {"export": out, "actions": actions, "captions": captions, "summary": summary,
            "base": base}


@pytest.fixture(scope="module")
def ours(model, demo_dir):
    """Our evaluator on the split: its embeddings, class text embeddings, action top-k."""
    from sclaro_jax.eval.protocols import embedding, zero_shot

    ds = open_dataset(demo_dir)
    emb = embedding.embed_dataset(model, demo_dir, SPLIT, image_size=32, progress=False)
    text = embedding.encode_texts(model, "global", ds.vocab.actions)
    result = zero_shot.zero_shot(model, emb, ds.vocab, root=ds.root)
    return {"emb": emb, "text": text, "action": result["action"]["strict"]["all"],
            "vocab": ds.vocab, "samples": list(ds.samples(SPLIT))}


def _read_back(folder, split=SPLIT):
    import webdataset

    shards = int((folder / split / "nshards.txt").read_text())
    urls = [str(folder / split / f"{i}.tar") for i in range(shards)]
    return list(webdataset.WebDataset(urls, shardshuffle=False).decode("pil"))


@pytest.mark.slow
def test_wds_reads_back_with_webdataset(folders, ours):
    samples, vocab = ours["samples"], ours["vocab"]
    actions = folders["actions"]
    assert (actions / "classnames.txt").read_text().splitlines() == list(vocab.actions)
    assert (actions / "zeroshot_classification_templates.txt").read_text() == "{c}\n"
    assert not (actions / "dataset_type.txt").exists()
    assert (folders["captions"] / "dataset_type.txt").read_text().strip() == "retrieval"
    assert folders["summary"]["images"] == len(samples) == 10
    got = _read_back(actions)
    assert [s["__key__"] for s in got] == [f"{i:08d}" for i in range(len(samples))]
    assert [int(s["cls"]) for s in got] == [vocab.index("actions", s.action) for s in samples]
    assert [s["json"]["id"] for s in got] == [s.id for s in samples]
    assert [s["txt"] for s in got] == [s.caption for s in samples]
    # retrieval: 4 images a shard, captions one a line
    caps = _read_back(folders["captions"])
    assert (folders["captions"] / SPLIT / "nshards.txt").read_text() == "3\n"
    assert [s["txt"].splitlines() for s in caps] == [[s.caption] for s in samples]
    assert all("cls" not in s for s in caps)


def test_transform_tokenizer_and_model_give_our_views_ids_and_embeddings(folders, ours):
    from data_prep import clip_benchmark as cb
    from sclaro_jax import ops
    from sclaro_jax.data import pipeline
    from sclaro_jax.data.tokenizer import ClipTokenizer

    model, transform, tokenizer = cb.load_sclaro("sclaro", folders["export"])
    config = pipeline.PipelineConfig(image_size=32, train=False)
    got = _read_back(folders["actions"])
    pixels = []
    for record, sample in zip(got, ours["samples"]):
        img = record["jpg"]
        # the stored train_image is a downscale: the tag carries the photograph's size
        assert photo_size.photo_size_of(img) == (sample.width, sample.height)
        view = pipeline.sample_views(sample, config)[2]["image"]
        mine = transform.pixels(img)
        # our evaluator decodes with simplejpeg, webdataset with PIL: one grey level at most
        assert np.abs(mine.astype(int) - view.astype(int)).max() <= 1
        x = transform(img)
        np.testing.assert_allclose(x.numpy().transpose(1, 2, 0), ops.normalize(mine), atol=1e-6)
        pixels.append(x)
    with torch.no_grad():
        image = torch.nn.functional.normalize(model.encode_image(torch.stack(pixels)), dim=-1)
    np.testing.assert_allclose(image.numpy(), ours["emb"].global_emb, atol=2e-2)
    assert tokenizer.context_length == 77
    names = list(ours["vocab"].actions)
    ids = tokenizer(names)
    assert ids.dtype == torch.int64
    np.testing.assert_array_equal(ids.numpy(), ClipTokenizer()(names, length=77))
    with torch.no_grad():
        text = torch.nn.functional.normalize(model.encode_text(ids), dim=-1)
    np.testing.assert_allclose(text.numpy(), ours["text"], atol=1e-5)


def client_packages() -> list[str]:
    """The packages of docs/exports.md's client venv line (`.../pip install -c constraints.txt
    NAME ...`)."""
    for line in (ROOT / "docs" / "exports.md").read_text(encoding="utf-8").splitlines():
        words = line.split()
        if words and words[0].endswith("pip") and "clip-benchmark" in words:
            assert words[1:4] == ["install", "-c", "constraints.txt"], line
            return words[4:]
    raise AssertionError("docs/exports.md shows no client venv pip line")


def _run_cli(*argv, cwd):
    """`python -m data_prep.clip_benchmark ARGV` with every installed distribution outside the
    client venv's hidden (demo_extra.HOOK); (the process, its import report)."""
    allowed, missing = closure(set(), {"dependencies": []}, client_packages())
    assert not missing, f"not installed here, install .[test] first: {sorted(missing)}"
    assert not allowed & PROJECT_ONLY, sorted(allowed & PROJECT_ONLY)
    report = Path(cwd) / "client_imports.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", HOOK, json.dumps(sorted(allowed)), str(report),
                           "-m", "data_prep.clip_benchmark", *map(str, argv)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    seen = json.loads(report.read_text()) if report.exists() else {}
    if seen:
        assert set(seen["imported"]) <= allowed
        assert not {m.partition(".")[0] for m in seen["modules"]} & {"jax", "flax", "msgpack"}
    return proc, seen


@pytest.mark.slow
def test_clip_benchmark_cli_in_a_client_venv_reproduces_our_action_accuracy(folders, ours):
    base = folders["base"]
    result, seen = _run_cli("eval", "--model_type", "sclaro", "--model", "sclaro",
                            "--pretrained", folders["export"], "--dataset", "wds/sclaro_actions",
                            "--dataset_root", folders["actions"], "--split", SPLIT,
                            "--task", "zeroshot_classification", "--no_amp", "--num_workers",
                            "8", "--batch_size", "4", "--dump_classnames", "--dump_templates",
                            "--save_clf", base / "clf.pt", "--quiet", cwd=base)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {"torch", "transformers", "clip-benchmark"} <= set(seen["imported"])
    # 10 images in 4 shards (a quarter each, rounded up): one loader worker per shard, not 8
    assert (folders["actions"] / SPLIT / "nshards.txt").read_text() == "4\n"
    # no --output: the file is named after the export folder, not its path
    out = base / "sclaro_actions_export_sclaro_en_zeroshot_classification.json"
    dump = json.loads(out.read_text())
    assert dump["classnames"] == list(ours["vocab"].actions) and dump["templates"] == ["{c}"]
    metrics = dump["metrics"]
    action = ours["action"]
    assert action["n"] == 10 and 0 < action["top1"] < 100  # an informative comparison
    assert 100 * metrics["acc1"] == pytest.approx(action["top1"], abs=1e-9)
    assert 100 * metrics["acc5"] == pytest.approx(action["top5"], abs=1e-9)
    # its classifier is our class text embeddings; its per-class recall our predictions'
    clf = torch.load(base / "clf.pt").numpy()
    np.testing.assert_allclose(clf.T, ours["text"], atol=1e-5)
    labels = np.array([ours["vocab"].index("actions", s.action) for s in ours["samples"]])
    pred = np.argmax(ours["emb"].global_emb @ ours["text"].T, axis=1)
    recall = np.mean([np.mean(pred[labels == c] == c) for c in np.unique(labels)])
    assert metrics["mean_per_class_recall"] == pytest.approx(recall, abs=1e-9)


@pytest.mark.filterwarnings("ignore:WebDataset\\(shardshuffle:UserWarning")
def test_clip_benchmark_retrieval_gives_our_recall(model, folders, ours, tmp_path, capsys):
    from data_prep import clip_benchmark as cb
    from sclaro_jax.eval.protocols import embedding

    out = tmp_path / "retrieval.json"
    code = cb.main(["eval", "--model_type", "sclaro", "--pretrained", str(folders["export"]),
                    "--dataset", "wds/sclaro_captions", "--dataset_root",
                    str(folders["captions"]), "--split", SPLIT, "--task", "zeroshot_retrieval",
                    "--recall_k", "1", "3", "--no_amp", "--num_workers", "0", "--batch_size",
                    "3", "--output", str(out), "--quiet"])
    assert code == 0
    metrics = json.loads(out.read_text())["metrics"]
    captions = [s.caption for s in ours["samples"]]  # one per image, in order
    text = embedding.encode_texts(model, "global", captions, text_length=77)
    scores = text @ ours["emb"].global_emb.T  # [texts, images]; text i describes image i
    for k in (1, 3):
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        image_hits = np.mean([i in row for i, row in enumerate(top)])
        top_t = np.argsort(-scores.T, axis=1, kind="stable")[:, :k]
        text_hits = np.mean([i in row for i, row in enumerate(top_t)])
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(image_hits, abs=1e-6)
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(text_hits, abs=1e-6)


def test_the_exports_python_runs_only_with_trust_remote_code(folders, tmp_path, capsys):
    """By default the towers are this checkout's ScenarioCLIPModel with the export's
    safetensors, and the export's modeling_scenarioclip.py never runs; --trust-remote-code
    runs it, says so in one line, and gives the same embeddings, bit for bit."""
    import shutil

    from data_prep import clip_benchmark as cb

    export = tmp_path / "export_with_code"
    shutil.copytree(folders["export"], export)
    marker = tmp_path / "ran"
    code = export / cb.REMOTE_CODE
    code.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + code.read_text())
    own, _, tokenizer = cb.load_sclaro("sclaro", str(export))
    assert not marker.exists()
    assert type(own.model) is cb.own_model_class()
    assert type(own.model).__module__ == "_sclaro_own_modeling_scenarioclip"
    assert "trust" not in capsys.readouterr().err  # (transformers' progress bars aside)
    remote, _, _ = cb.load_sclaro("sclaro", str(export), trust_remote_code=True)
    assert marker.exists()
    said = [line for line in capsys.readouterr().err.splitlines() if "trust" in line]
    assert len(said) == 1 and said[0].startswith(f"--trust-remote-code: running {code} ")
    assert type(remote.model) is not cb.own_model_class()
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ids = tokenizer(["a dog riding a horse", "two people eating"])
    with torch.no_grad():
        assert torch.equal(own.encode_image(pixels), remote.encode_image(pixels))
        assert torch.equal(own.encode_text(ids), remote.encode_text(ids))
    (export / cb.WEIGHTS_FILE).unlink()
    with pytest.raises(cb.ExportError, match=r"model\.safetensors not found"):
        cb.load_sclaro("sclaro", str(export))


def test_user_errors_name_the_file_and_the_fix(folders, demo_dir, tmp_path, capsys):
    from data_prep import clip_benchmark as cb

    towers = tmp_path / "towers"
    towers.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (towers / name).write_bytes((Path(folders["export"]) / name).read_bytes())
    capsys.readouterr()
    plain = tmp_path / "plain"
    plain.mkdir()
    config = json.loads((towers / "config.json").read_text())
    config.pop("auto_map")
    config["model_type"] = "clip"
    (plain / "config.json").write_text(json.dumps(config))
    (plain / "preprocessor_config.json").write_bytes((towers / "preprocessor_config.json")
                                                     .read_bytes())
    for folder, want in ((tmp_path / "nope", "is not a folder"),
                         (towers, f"{towers / cb.REMOTE_CODE} not found"),
                         (plain, "model_type 'clip' without an auto_map, not a ScenarioCLIP")):
        code = cb.main(["eval", "--model_type", "sclaro", "--pretrained", str(folder),
                        "--dataset", "wds/sclaro_actions", "--dataset_root",
                        str(folders["actions"]), "--split", SPLIT, "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and want in err, err
        assert "sclaro_jax.train.export" in err
    # the wds writer: one line naming the folder / split; nothing written
    cases = [(["--split", "tst"], "no split 'tst'"),
             (["--out", str(folders["actions"])], "is not empty: pass a new or empty folder")]
    for extra, want in cases:
        argv = ["--data", demo_dir, "--out", str(tmp_path / "w"), "--no-progress", *extra]
        assert wds.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and want in err and err.count("\n") == 1
    assert not (tmp_path / "w").exists()
    # a record that fails half-way leaves no partial dataset behind
    calls = []

    def failing(sample, where, originals):
        calls.append(where)
        if len(calls) == 3:
            raise wds.WdsError(f"{where}: planted")
        return real(sample, where, originals)

    real = wds._image_bytes
    for out in (tmp_path / "new", tmp_path / "empty"):
        calls.clear()
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(wds, "_image_bytes", failing)
            with pytest.raises(wds.WdsError, match="record 2 .*planted"):
                wds.write_wds(demo_dir, SPLIT, str(out), shard_size=1, progress=False)
        assert len(calls) == 3
        assert not (tmp_path / "new").exists() and os.listdir(tmp_path / "empty") == []
    for module in (wds, cb):
        with pytest.raises(SystemExit) as exit_:
            module.main(["--help"])
        assert exit_.value.code == 0
        assert "--model_type" in capsys.readouterr().out if module is cb else True

