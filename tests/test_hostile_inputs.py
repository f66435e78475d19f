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


def _train(workdir: Path, data: str, cache: Path, *extra: str):
    return cli("launch/train.py", "--config", "configs/scenarioclip.py:demo", "--workdir",
               str(workdir), f"--config.data.dir={data}", f"--config.compilation_cache={cache}",
               "--config.train.steps=2", "--config.checkpoint_every=2", "--config.log_every=1",
               "--config.progress_bar=False", "--no-eval", *extra, timeout=900)


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, demo_dir):
    """Why 2: a fresh two-step run in a folder made beforehand holding `config.json.tmp` and
    `run.json.tmp` links to a user's files (the names write_replacing used); shared by the
    cases below as a finished run (each works on a copy)."""
    base = tmp_path_factory.mktemp("planted_run")
    users = Sentinel(base / "users_files")
    workdir = base / "run"
    workdir.mkdir()
    (workdir / "config.json.tmp").symlink_to(users.folder / "thesis.tex")
    (workdir / "run.json.tmp").symlink_to(users.folder / "weights.bin")
    proc = _train(workdir, demo_dir, base / "jax_cache")
    return workdir, users, proc, demo_dir, base / "jax_cache"


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


def test_resuming_a_run_whose_lock_is_a_link_leaves_its_target_alone(planted_run, tmp_path,
                                                                     sentinel):
    """Why 2: WORKDIR/.run.lock a link to a user's file; resuming the finished run truncated
    and overwrote that file (the lock was opened without O_NOFOLLOW)."""
    workdir = _finished_copy(planted_run, tmp_path)
    (workdir / ".run.lock").unlink()
    (workdir / ".run.lock").symlink_to(sentinel.folder / "thesis.tex")
    proc = _train(workdir, *planted_run[3:])
    assert_refused(proc, str(workdir / ".run.lock"), "symbolic link")


def test_a_workdir_every_user_may_write_is_refused(planted_run, tmp_path, sentinel):
    """Why 2: a workdir writable by every user without the sticky bit (anyone could plant the
    links above in it) is refused, as ssh's StrictModes refuses such key folders."""
    workdir = _finished_copy(planted_run, tmp_path)
    os.chmod(workdir, 0o777)
    assert_refused(_train(workdir, *planted_run[3:]), str(workdir), "writable by every user",
                   "chmod o-w")


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


def test_index_build_never_removes_a_parts_folder_it_did_not_make(tmp_path, sentinel):
    """`index build --out DIR`, DIR the user's with a parts/ folder: refused (the finished build
    removed DIR/parts whole)."""
    import numpy as np
    rng = np.random.default_rng(0)
    for name, shape in (("images", (64, 8)), ("bank", (16, 8))):
        x = rng.standard_normal(shape).astype(np.float32)
        np.save(tmp_path / f"{name}.npy", x / np.linalg.norm(x, axis=1, keepdims=True))
    users = tmp_path / "project"
    before = _user_folder(users, "parts/", "notes.txt")
    proc = cli("-m", "sclaro_jax.miner.index", "build", "--images", str(tmp_path / "images.npy"),
               "--bank", str(tmp_path / "bank.npy"), "--encoder", "e", "--factory", "Flat",
               "--out", str(users), "--no-progress")
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


def test_rocs_never_replaces_a_rocs_folder_it_did_not_make(tmp_path, sentinel):
    """`data_prep rocs --out DIR`, DIR the user's with a rocs/ folder: refused (the command
    removed DIR/rocs and DIR/rocs.partial whatever made them)."""
    from data_prep.segment import save_tiny_sam

    inputs = _coco_instances(tmp_path / "inputs")
    save_tiny_sam(str(inputs / "sam.pth"))
    users = tmp_path / "project"
    before = _user_folder(users, "rocs/", "notes.txt")
    proc = cli("-m", "data_prep", "rocs", "--images", str(inputs / "img"), "--instances",
               str(inputs / "instances.json"), "--out", str(users), "--sam",
               str(inputs / "sam.pth"), "--sam-type", "tiny", "--max-mask-area", "1.0",
               "--top-fraction", "1.0", "--vlm-replies", str(inputs / "replies.json"),
               "--device", "cpu", "--no-progress")
    assert_refused(proc, f"--out {users} holds files this command did not make")
    assert tree_hashes(users) == before


def test_annotate_refuses_a_work_folder_holding_a_users_files(tmp_path, sentinel):
    """`annotate --work DIR`, DIR the user's: refused before any model loads (it wrote its
    caches, run.json and blocks among the user's files and replaced their summary.json)."""
    import numpy as np
    from PIL import Image

    (tmp_path / "photos").mkdir()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(tmp_path / "photos" / "a.png")
    (tmp_path / "replies.json").write_text('{"folder/a.png": "a cat on a mat"}')
    (tmp_path / "detector").mkdir()
    (tmp_path / "sam.pth").write_bytes(b"")
    users = tmp_path / "project"
    before = _user_folder(users, "summary.json", "notes.txt", "blocks/")
    proc = cli("-m", "data_prep", "annotate", "--root", str(tmp_path / "photos"), "--out",
               str(tmp_path / "out"), "--work", str(users), "--vlm-replies",
               str(tmp_path / "replies.json"), "--detector", str(tmp_path / "detector"),
               "--sam", str(tmp_path / "sam.pth"), "--device", "cpu", "--no-progress")
    assert_refused(proc, f"--work {users} holds files this command did not make")
    assert tree_hashes(users) == before



# (end of writes and deletions)


# ------------------------------------------------------------------------------------------------
# Why 4: no code from data files (pickles, repository code, configs' folders)
# ------------------------------------------------------------------------------------------------

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
