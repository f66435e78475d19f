"""Files the library writes: whole or not at all, never through a link, and only deleted where
the command made them. Every file written into a run folder, dataset, index, curation, export or
work folder goes through here (tests/test_layout.py forbids writes that bypass it):

- `write_replacing`: a file written whole (a temporary name of its own beside it, made with
  O_CREAT | O_EXCL | O_NOFOLLOW, then renamed over the target); `replacing`, the same for a
  writer that takes a path (ArrayRecord, safetensors, a memory-mapped array); a Ctrl-C that
  lands as the temporary file opens removes it too (`_open_made`);
- `open_new`: a stream that stays open (a tar being written, an appended log), opened without
  following a link, and only onto a plain file of one name;
- `probe_writable`: whether a folder takes new files (an empty probe, made and removed);
- `refuse_shared_folder`: an output folder that others may write (writable by every user
  without the sticky bit, or owned by another user) is refused, as ssh's StrictModes refuses
  such key folders;
- `own_folder` / `remove_own_folder`: a scratch folder a command makes is marked; it only ever
  removes a folder it marked, and refuses a non-empty folder it did not make.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO, Callable, Iterator

NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MODE = 0o666  # less the umask: 0644 under umask 022, what any new file of the user gets
MADE = ".made-by-sclaro"  # the mark of a folder a command made (or took empty)


class UnsafePathError(ValueError):
    """A path the library will not write through or delete: a link, a file of several names,
    a folder others may write, a non-empty folder a command did not make."""


def temporary_name(path) -> str:
    """A fresh name beside `path`: NAME.tmp-XXXXXXXXXXXX."""
    return f"{path}.tmp-{secrets.token_hex(6)}"


def _open_made(name: str) -> int:
    """The descriptor of `name`, a new empty file made by this call (O_EXCL, O_NOFOLLOW).

    A Ctrl-C can land as the open returns: CPython runs signal handlers once a C function is
    back, so the KeyboardInterrupt is raised with the file made and its descriptor not yet in
    any variable. The open itself raises only OSError; anything else arrived from outside after
    it, and the file this call made is closed and removed before that exception goes on (an
    interrupted command once left `manifest.json.tmp-...` in an index folder this way)."""
    try:
        return os.open(name, NEW_FILE, MODE)
    except OSError:
        raise
    except BaseException:
        _unmake(name)
        raise


def _unmake(name: str) -> None:
    """Close whatever descriptor of this process is open on the file `name` (the one an
    interrupted `_open_made` could not return), then remove it. Only ever called on a fresh
    random name this process opened with O_EXCL, so the file is the one it made."""
    with contextlib.suppress(OSError):
        st = os.stat(name, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size or st.st_uid != os.geteuid():
            return  # not the empty file this process just made: left as it is
        with contextlib.suppress(OSError):  # /proc/self/fd: Linux; elsewhere it stays open
            for entry in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError, ValueError):
                    fd = int(entry)
                    held = os.fstat(fd)
                    if (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino):
                        os.close(fd)
        os.remove(name)


def _new_file(fresh_name: Callable[[], str]) -> tuple[int, str]:
    """(descriptor, name) of a new empty file made by this call under a name `fresh_name()`
    gives (another one while a name is taken: never a name that was there, O_EXCL; never
    through a link, O_NOFOLLOW)."""
    while True:
        name = fresh_name()
        try:
            return _open_made(name), name
        except FileExistsError:
            continue


def _temporary(path: Path) -> tuple[int, str]:
    """(descriptor, name) of a new empty file beside `path`: NAME.tmp-XXXXXXXXXXXX."""
    return _new_file(lambda: temporary_name(path))


def probe_writable(folder, prefix: str = ".write-check-") -> None:
    """Make and remove an empty file in `folder`: OSError (naming the probe) when the folder
    refuses new files. An interrupt at any point leaves no probe behind."""
    fd, name = _new_file(lambda: os.path.join(folder, prefix + secrets.token_hex(6)))
    try:
        os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)


@contextlib.contextmanager
def replacing(path, *, fsync: bool = False) -> Iterator[str]:
    """Yield the name of a new empty temporary file beside `path` (made as `write_replacing`
    makes its own) for a writer that takes a path; when the block ends it is renamed over
    `path` (flushed to disk first with `fsync`); when the block fails it is removed."""
    path = Path(path)
    fd, tmp = _temporary(path)
    try:
        yield tmp
        if os.stat(tmp, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            raise UnsafePathError(f"{tmp} was replaced while it was written: {path} is not "
                                  "written (is another process writing this folder?)")
        if fsync:
            os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    finally:
        os.close(fd)


def write_replacing(path, write: Callable[[IO], object], *, text: bool = False,
                    fsync: bool = False) -> Path:
    """Write `path` through `write(file)` under a temporary name of its own beside it, then
    rename it over `path` (`os.replace`): an interrupted write never leaves a torn file, a
    reader sees the old file or the new one, and whatever was at `path` (a link included) is
    replaced, never written through. Two writers of one path never share a temporary file.

    text: the file is UTF-8 text (else binary). fsync: flushed to disk before the rename, so the
    new file also survives a power cut. The new file's mode is 0666 less the umask."""
    path = Path(path)
    fd, tmp = _temporary(path)
    try:
        with os.fdopen(fd, "w" if text else "wb", encoding="utf-8" if text else None) as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return path


def write_text_file(path, text: str, *, fsync: bool = False) -> Path:
    """`text` as the UTF-8 file `path`, written whole (`write_replacing`)."""
    return write_replacing(path, lambda f: f.write(text), text=True, fsync=fsync)


def open_new(path, *, append: bool = False, text: bool = False) -> IO:
    """A file opened for writing that stays open (a tar being written, a log). Without `append`,
    a new file made by this call (FileExistsError when `path` exists, a link included); with
    it, appended to (made if missing), refused when `path` is a link, not a plain file or a
    file with another name too (a hard link: the append would reach a file elsewhere)."""
    if not append:
        fd = os.open(path, NEW_FILE, MODE)
    else:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path, flags | os.O_CLOEXEC, MODE)
        except OSError as e:
            if os.path.islink(path):
                raise UnsafePathError(f"{path} is a symbolic link: the library never writes "
                                      "through one; remove it, or use another folder") from None
            raise e
        check_plain_file(path, fd)
    mode = ("a" if append else "w") + ("" if text else "b")
    return os.fdopen(fd, mode, encoding="utf-8" if text else None)


def check_plain_file(path, fd: int) -> None:
    """UnsafePathError (closing `fd`) unless `fd` is a plain file with no other name."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        what = "not a plain file" if not stat.S_ISREG(st.st_mode) else \
            f"a file with {st.st_nlink} names (a hard link)"
        raise UnsafePathError(f"{path} is {what}: the library writes only plain files of "
                              "one name; remove it, or use another folder")


def refuse_shared_folder(folder) -> None:
    """UnsafePathError naming `folder` when others may write in it: writable by every user
    without the sticky bit (anyone could plant a link there or swap what a command wrote), or
    owned by another user (neither this user nor root). A missing folder passes."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafePathError(
            f"{folder} is writable by every user (mode {stat.S_IMODE(st.st_mode):04o}, no "
            f"sticky bit): anyone could plant files in it; run `chmod o-w {folder}`, or use a "
            "folder of your own")
    if st.st_uid not in (os.geteuid(), 0):
        raise UnsafePathError(f"{folder} belongs to another user (uid {st.st_uid}): use a "
                              "folder of your own")


def own_folder(folder, *, flag: str) -> bool:
    """Make `folder` this command's: made (and marked, MADE) when missing, taken (and marked)
    when empty; True when it already carries the mark (an earlier run's: resume in it).
    A non-empty folder without the mark is refused (UnsafePathError naming `flag`): the
    command never writes among, nor deletes, files it did not make. (`folder` itself may be a
    link the user gave: its target is the folder meant.)"""
    folder = os.path.abspath(folder)
    refuse_shared_folder(folder)
    made = not os.path.exists(folder)
    if made:
        os.makedirs(folder)
    elif not os.path.isdir(folder):
        raise UnsafePathError(f"{flag} {folder} is a file, not a folder")
    elif os.path.isfile(os.path.join(folder, MADE)) and \
            not os.path.islink(os.path.join(folder, MADE)):
        return True
    elif os.listdir(folder):
        fix = f"pass a new or empty folder to {flag}" if flag.startswith("--") else \
            f"move {folder} away and rerun"
        raise UnsafePathError(f"{flag} {folder} holds files this command did not make (it "
                              f"never writes among or deletes them): {fix}")
    write_replacing(os.path.join(folder, MADE), lambda f: json.dump({"made": made}, f),
                    text=True)
    return False


def remove_own_folder(folder) -> bool:
    """Remove `folder` when it carries this library's mark (`own_folder`): the whole folder
    when a command made it, its contents when it was taken empty (or is reached through a
    link). Never what a link inside points to; False (nothing removed) without the mark."""
    folder = os.path.abspath(folder)
    mark = os.path.join(folder, MADE)
    if os.path.islink(mark) or not os.path.isfile(mark):
        return False
    try:
        with open(mark, encoding="utf-8") as f:
            made = json.load(f).get("made", True) is not False
    except (OSError, ValueError, AttributeError):
        made = True
    if made and not os.path.islink(folder):
        shutil.rmtree(folder, ignore_errors=True)
        return True
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return True
