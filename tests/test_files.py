"""sclaro_jax.files: files written whole and never through a link, folders others may write
refused, and only folders a command made (and marked) ever removed; and the deletion sites
that rely on it (orbax's unfinished checkpoints, a dataset writer's stale folders, ROCS's
earlier output)."""

import os
import random
import signal
import stat
import subprocess
import sys
import time

import pytest

from sclaro_jax import files


def _user_file(path, text="the user's own\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_write_replacing_never_writes_through_a_planted_link(tmp_path):
    mine = _user_file(tmp_path / "users" / "thesis.tex")
    other = _user_file(tmp_path / "users" / "notes.txt")
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json.tmp").symlink_to(mine)  # the fixed temporary name it once used
    (out / "config.json").symlink_to(other)     # the target itself a link: replaced, not followed
    files.write_replacing(out / "config.json", lambda f: f.write("{}"), text=True)
    assert mine.read_text() == other.read_text() == "the user's own\n"
    assert not (out / "config.json").is_symlink() and (out / "config.json").read_text() == "{}"
    assert sorted(os.listdir(out)) == ["config.json", "config.json.tmp"]


def test_write_replacing_leaves_nothing_when_the_write_fails(tmp_path):
    (tmp_path / "a.json").write_text("old")

    def fails(f):
        f.write("half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        files.write_replacing(tmp_path / "a.json", fails, text=True)
    assert os.listdir(tmp_path) == ["a.json"] and (tmp_path / "a.json").read_text() == "old"


def test_written_files_get_the_umasks_mode(tmp_path):
    old = os.umask(0o022)
    try:
        files.write_replacing(tmp_path / "a", lambda f: f.write(b"x"))
        with files.replacing(tmp_path / "b"):
            pass
        files.open_new(tmp_path / "c").close()
    finally:
        os.umask(old)
    for name in "abc":
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name


def test_replacing_moves_in_the_file_it_made_or_removes_it(tmp_path):
    with files.replacing(tmp_path / "x.bin", fsync=True) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and os.path.getsize(tmp) == 0
        with open(tmp, "wb") as f:  # a writer that takes a path (ArrayRecord, a memmap)
            f.write(b"data")
    assert os.listdir(tmp_path) == ["x.bin"] and (tmp_path / "x.bin").read_bytes() == b"data"
    with pytest.raises(ValueError):
        with files.replacing(tmp_path / "y.bin"):
            raise ValueError("refused")
    assert os.listdir(tmp_path) == ["x.bin"]
    # a writer that swaps the temporary file for a link of its own: nothing is moved in
    mine = _user_file(tmp_path / "users" / "thesis.tex")
    with pytest.raises(files.UnsafePathError, match="replaced while it was written"):
        with files.replacing(tmp_path / "z.bin") as tmp:
            os.remove(tmp)
            os.symlink(mine, tmp)
    assert not (tmp_path / "z.bin").exists() and mine.read_text() == "the user's own\n"


def test_open_new_refuses_what_was_there_links_and_hard_links(tmp_path):
    mine = _user_file(tmp_path / "users" / "thesis.tex")
    (tmp_path / "log.jsonl").symlink_to(mine)
    os.link(mine, tmp_path / "hard.jsonl")
    with pytest.raises(FileExistsError):
        files.open_new(tmp_path / "log.jsonl")
    with pytest.raises(files.UnsafePathError, match="symbolic link"):
        files.open_new(tmp_path / "log.jsonl", append=True)
    with pytest.raises(files.UnsafePathError, match="2 names"):
        files.open_new(tmp_path / "hard.jsonl", append=True)
    assert mine.read_text() == "the user's own\n"
    with files.open_new(tmp_path / "m.jsonl", append=True, text=True) as f:
        f.write("1\n")
    with files.open_new(tmp_path / "m.jsonl", append=True, text=True) as f:
        f.write("2\n")
    assert (tmp_path / "m.jsonl").read_text() == "1\n2\n"


def test_a_folder_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "shared"
    files.refuse_shared_folder(folder)  # not there yet: nothing to refuse
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(files.UnsafePathError, match=r"writable by every user \(mode 0777"):
        files.refuse_shared_folder(folder)
    os.chmod(folder, 0o1777)  # /tmp's mode: others cannot rename or remove what it holds
    files.refuse_shared_folder(folder)
    os.chmod(folder, 0o755)
    files.refuse_shared_folder(folder)
    if os.geteuid() == 0:
        os.chown(folder, 12345, 12345)
        with pytest.raises(files.UnsafePathError, match="belongs to another user"):
            files.refuse_shared_folder(folder)


def test_a_command_removes_only_a_folder_it_made_and_marked(tmp_path):
    work = tmp_path / "work"
    assert files.own_folder(work, flag="--work") is False  # made and marked
    assert files.own_folder(work, flag="--work") is True   # a rerun resumes in it
    (work / "blocks").mkdir()
    (work / "blocks" / "0.json").write_text("{}")
    mine = _user_file(tmp_path / "users" / "thesis.tex")
    (work / "blocks" / "link").symlink_to(mine.parent)  # a link inside: removed, not followed
    assert files.remove_own_folder(work) and not work.exists()
    assert mine.read_text() == "the user's own\n"
    # an empty folder of the user's is taken, then emptied and left where it was
    taken = tmp_path / "taken"
    taken.mkdir()
    assert files.own_folder(taken, flag="--work") is False
    (taken / "x").write_text("scratch")
    assert files.remove_own_folder(taken) and taken.is_dir() and not os.listdir(taken)
    # a folder without the mark is never removed; one reached through a link (a path the user
    # gave) is emptied, the link and the folder left
    assert not files.remove_own_folder(mine.parent) and mine.exists()
    files.own_folder(tmp_path / "marked", flag="--work")
    (tmp_path / "marked" / "x").write_text("scratch")
    (tmp_path / "alias").symlink_to(tmp_path / "marked")
    assert files.remove_own_folder(tmp_path / "alias")
    assert (tmp_path / "alias").is_symlink() and not os.listdir(tmp_path / "marked")


def test_own_folder_refuses_a_users_folder_and_a_file(tmp_path):
    users = _user_file(tmp_path / "users" / "thesis.tex").parent
    with pytest.raises(files.UnsafePathError,
                       match=f"--work {users} holds files this command did not make"):
        files.own_folder(users, flag="--work")
    (tmp_path / "link").symlink_to(users)  # a link the user gave: the folder it names decides
    with pytest.raises(files.UnsafePathError, match="did not make"):
        files.own_folder(tmp_path / "link", flag="--work")
    with pytest.raises(files.UnsafePathError, match="is a file"):
        files.own_folder(users / "thesis.tex", flag="--out")
    (users / files.MADE).symlink_to(tmp_path / "nowhere")  # a planted mark that is a link
    with pytest.raises(files.UnsafePathError, match="did not make"):
        files.own_folder(users, flag="--work")
    assert sorted(os.listdir(users)) == [files.MADE, "thesis.tex"]


def test_unfinished_checkpoint_names_that_are_links_are_removed_not_followed(tmp_path):
    from sclaro_jax.run.folder import unfinished_checkpoints

    mine = _user_file(tmp_path / "users" / "thesis.tex")
    (tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir(parents=True)
    (tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp-2").symlink_to(mine.parent)
    assert unfinished_checkpoints(str(tmp_path / "checkpoints")) == [
        "4.orbax-checkpoint-tmp-1", "8.orbax-checkpoint-tmp-2"]
    assert not os.listdir(tmp_path / "checkpoints") and mine.read_text() == "the user's own\n"


def test_a_stale_writer_folder_that_is_a_link_is_never_followed(tmp_path):
    from data_prep.shards import remove_stale_writers

    mine = _user_file(tmp_path / "users" / "thesis.tex")
    out = tmp_path / "dataset"
    (out / ".writing-999999999-abc").mkdir(parents=True)  # a dead writer's: removed
    (out / ".writing-999999998-def").symlink_to(mine.parent)  # a link of that name: kept
    assert remove_stale_writers(str(out)) == [str(out / ".writing-999999999-abc")]
    assert os.listdir(out) == [".writing-999999998-def"]
    assert mine.read_text() == "the user's own\n"


def test_rocs_replaces_its_earlier_output_never_what_a_link_there_names(tmp_path):
    from data_prep.rocs.pipeline import _remove

    mine = _user_file(tmp_path / "users" / "thesis.tex")
    out = tmp_path / "out"
    files.own_folder(out, flag="--out")
    (out / "rocs").symlink_to(mine.parent)
    (out / "rocs.partial").mkdir()
    (out / "rocs.partial" / "data.arrow").write_text("x")
    _remove(out / "rocs")
    _remove(out / "rocs.partial")
    _remove(out / "missing")
    assert os.listdir(out) == [files.MADE] and mine.read_text() == "the user's own\n"


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_ctrl_c_as_a_new_file_opens_leaves_no_file_and_no_descriptor(tmp_path, monkeypatch):
    """CPython runs a Ctrl-C's handler as soon as a C function returns, so a KeyboardInterrupt
    can arrive with the temporary file made and its descriptor in no variable yet. CI met it:
    an `index build` interrupted there left `manifest.json.tmp-...` beside its manifest. Each
    writer (and the folder probe of `--out`/`--workdir`) now closes and removes that file."""
    real_open = os.open
    opened = []

    def open_then_interrupted(path, flags, mode=0o777, **kw):
        real_open(path, flags, mode, **kw)  # the file made, its descriptor lost
        opened.append(str(path))
        raise KeyboardInterrupt  # as a signal handler raises it when os.open returns

    (tmp_path / "a.json").write_text("old")
    before = _open_fds()
    monkeypatch.setattr(files.os, "open", open_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.write_replacing(tmp_path / "a.json", lambda f: f.write("new"), text=True)
    with pytest.raises(KeyboardInterrupt):
        with files.replacing(tmp_path / "b.bin"):
            pass
    with pytest.raises(KeyboardInterrupt):
        files.probe_writable(tmp_path)
    monkeypatch.undo()
    assert len(opened) == 3 and all(os.path.dirname(p) == str(tmp_path) for p in opened)
    assert os.listdir(tmp_path) == ["a.json"] and (tmp_path / "a.json").read_text() == "old"
    assert _open_fds() == before


def test_an_interrupt_before_the_open_made_anything_removes_nothing(tmp_path, monkeypatch):
    """The cleanup removes only the empty file this process made: when the interrupt comes
    before the open made a file, a file that is there under that name (not empty: not one the
    library just made) stays."""
    names = []

    def interrupted_then_someone_writes_there(path, flags, mode=0o777, **kw):
        names.append(str(path))
        with open(path, "w") as f:  # someone else's file under the same name
            f.write("theirs")
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "open", interrupted_then_someone_writes_there)
    with pytest.raises(KeyboardInterrupt):
        files.write_replacing(tmp_path / "a.json", lambda f: f.write("new"), text=True)
    monkeypatch.undo()
    assert [open(n).read() for n in names] == ["theirs"]


def test_probe_writable_leaves_nothing_and_names_a_folder_that_refuses(tmp_path):
    files.probe_writable(tmp_path)
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "gone")):
        files.probe_writable(tmp_path / "gone")


# A process that rewrites one file through `write_replacing` until a stop file appears, taking
# every SIGINT as a Ctrl-C (a KeyboardInterrupt wherever it lands in the write) and going on.
_REWRITER = r"""
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("files", sys.argv[2])
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)
folder, stop = sys.argv[1], os.path.join(sys.argv[1], "..", "stop")
armed, caught = False, 0


def ctrl_c(*_):
    if armed:
        raise KeyboardInterrupt


def rewrite():
    global armed
    armed = True
    i = 0
    while not os.path.exists(stop):
        files.write_replacing(os.path.join(folder, "manifest.json"), lambda f: f.write(str(i)),
                              text=True)
        i += 1
    armed = False


signal.signal(signal.SIGINT, ctrl_c)
print("ready", flush=True)
while True:
    try:
        rewrite()
        break
    except KeyboardInterrupt:
        armed = False
        caught += 1
print(caught, flush=True)
"""


def test_real_ctrl_cs_at_random_moments_of_a_rewrite_leave_only_the_file(tmp_path):
    """300 SIGINTs, 1-4 ms apart, into a process rewriting a file: each lands wherever the
    write is, as a terminal's Ctrl-C does. Before `_open_made`, a dozen of them (checked once)
    each left a `.tmp-` file; now the folder holds the one file, whole."""
    folder = tmp_path / "index"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _REWRITER, str(folder), files.__file__],
                            stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline() == "ready\n"
        rng = random.Random(0)
        for _ in range(300):
            time.sleep(rng.uniform(0.001, 0.004))
            proc.send_signal(signal.SIGINT)
        (tmp_path / "stop").touch()
        caught = int(proc.communicate(timeout=60)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and caught >= 30, (proc.returncode, caught)
    assert os.listdir(folder) == ["manifest.json"], caught
    assert (folder / "manifest.json").read_text().isdigit()
