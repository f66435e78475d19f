"""One writer per run folder: `hold_workdir` takes an exclusive `flock` on WORKDIR/.run.lock for
as long as the process trains (the operating system drops it however the process ends, a kill
included), so a second run on the same workdir (a scheduler's requeued job while the first
still runs) is refused with one message naming the holder's host and pid, instead of two runs
writing one metrics.jsonl and one checkpoint folder. `probe_workdir` gives that answer early, in
a launcher, before anything heavy is imported.
"""

from __future__ import annotations

import json
import os

from sclaro_jax.files import UnsafePathError, open_new
from sclaro_jax.run.folder import RunError, check_workdir

LOCK_NAME = ".run.lock"
_held: dict[str, list] = {}  # real path of a workdir -> [its open lock file, holds]


class WorkdirInUseError(RunError):
    pass


def _holder(path: str) -> dict:
    """What a lock file says of its holder ({} when it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _in_use(workdir: str, info: dict) -> str:
    try:
        who = f"pid {info['pid']} on host {info['host']} (since {info['started']})"
    except KeyError:
        who = "another process"
    return (f"{workdir} is in use by another run: {who}. Wait for it to end (or stop it), or "
            "pass another --workdir.")


def hold_workdir(workdir: str, *, chief: bool | None = None) -> None:
    """Make this process the one writer of WORKDIR for the rest of its life: an exclusive
    `flock` on WORKDIR/.run.lock, which the operating system releases however the process ends
    (a kill included), with the holder's host, pid and start time written in it. A second run
    on the same workdir (a requeued job while the first still runs) gets `WorkdirInUseError`
    naming the holder. Holding it again in the same process counts one more hold
    (`release_workdir` gives one back). With many processes, process 0 holds it for the run and
    the others learn its answer (collective)."""
    import fcntl
    import socket
    import sys
    import time

    # Without jax imported no distributed runtime is up: one process (and the refusal of a
    # second run comes before jax's import time).
    jax = sys.modules.get("jax")
    processes = jax.process_count() if jax is not None else 1
    key = os.path.realpath(workdir)
    if chief is None:
        chief = jax is None or jax.process_index() == 0
    message = ""
    if key in _held:
        _held[key][1] += 1
    elif chief:
        check_workdir(workdir)  # a folder this process can write (RunError naming it)
        path = os.path.join(workdir, LOCK_NAME)
        try:  # never through a link, nor onto a file of another name (its target untouched)
            f = open_new(path, append=True)
        except UnsafePathError as e:
            raise RunError(f"{e} (the run lock)") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            message = _in_use(workdir, _holder(path))
        else:
            info = {"host": socket.gethostname(), "pid": os.getpid(), "processes": processes,
                    "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
            os.ftruncate(f.fileno(), 0)  # appends land at 0 after this
            f.write((json.dumps(info) + "\n").encode())
            f.flush()
            _held[key] = [f, 1]
    if processes > 1:
        import numpy as np
        from jax.experimental import multihost_utils
        refused = int(multihost_utils.broadcast_one_to_all(np.int32(bool(message))))
        if refused and not message:
            message = f"{workdir} is in use by another run (process 0 could not lock it)"
    if message:
        raise WorkdirInUseError(message)


def probe_workdir(workdir: str) -> None:
    """`WorkdirInUseError` when WORKDIR is held by a single-process run: the early answer a
    launcher gives before loading anything heavy (`hold_workdir` still decides; a run of many
    processes is left to it, since its other processes start while process 0 holds the lock)."""
    import fcntl

    path = os.path.join(workdir, LOCK_NAME)
    if os.path.islink(path):
        raise RunError(f"{path} is a symbolic link: the library never writes through one; "
                       "remove it, or use another folder (the run lock)")
    if os.path.realpath(workdir) in _held or not os.path.isfile(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        info = _holder(path)
        if info.get("processes", 1) == 1:
            raise WorkdirInUseError(_in_use(workdir, info)) from None
    finally:
        os.close(fd)  # a shared lock taken here goes with it


def release_workdir(workdir: str) -> None:
    """Give back one hold of `hold_workdir`; the last unlocks WORKDIR before the process ends
    (a trainer called from a notebook holds it only while it trains)."""
    key = os.path.realpath(workdir)
    if key in _held:
        _held[key][1] -= 1
        if not _held[key][1]:
            _held.pop(key)[0].close()
