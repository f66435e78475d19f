"""A run opened for training, the same way by every task: `open_run`.

It does what both trainers did each in its own words: the workdir checked and held (one writer,
`lock`), JAX's compilation cache (`cache`), the checkpoints (an unfinished one removed with a
warning; the newest complete one is the step to resume from), a resumed run's config against the
one it was started with (refused beyond `folder.SAFE_KEYS` unless allowed), and the logs cut
back to that step. On leaving, the checkpoints close and the workdir is given back; an opening
that fails leaves no empty folder behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, Iterator

from sclaro_jax.run import folder, lock
from sclaro_jax.run.cache import use_compilation_cache
from sclaro_jax.run.checkpoints import Checkpoints


@dataclasses.dataclass
class OpenRun:
    """An opened run: its workdir, checkpoints (`start`: the step it resumes from, 0 fresh),
    the allowed changes of a resumed run's config (`unsafe`: key -> (saved, now)) and whether
    this process writes the run's files (`chief`)."""
    workdir: str
    checkpoints: Checkpoints
    unsafe: dict
    chief: bool

    @property
    def start(self) -> int:
        return self.checkpoints.start


@contextlib.contextmanager
def open_run(config, workdir: str, save_args: Callable | None = None, *,
             allow_config_change: bool = False, chief: bool = True) -> Iterator[OpenRun]:
    """Open WORKDIR for training with `config` (its `keep_checkpoints`, `checkpoint_async` and
    `compilation_cache`); `save_args(state)` gives the orbax args of a checkpoint (set later on
    `checkpoints.save_args` when it needs the data iterator). Raises `folder.RunError`s
    (unwritable workdir, `lock.WorkdirInUseError`, `folder.ConfigDriftError`)."""
    lock.hold_workdir(workdir)  # checks that WORKDIR is a folder this process can write
    made = [os.path.join(workdir, name) for name in ("checkpoints", "jax_cache")
            if not os.path.exists(os.path.join(workdir, name))]
    checkpoints = None
    try:
        checkpoints = Checkpoints.open(workdir, save_args, keep=config.keep_checkpoints,
                                       background=config.get("checkpoint_async", True),
                                       chief=chief)
        unsafe = checkpoints.config_drift(config, workdir, allow_config_change)
        use_compilation_cache(config, workdir)  # a refused rerun says nothing before its error
        if chief:
            folder.truncate_logs(workdir, checkpoints.start)
        yield OpenRun(workdir, checkpoints, unsafe, chief)
    except BaseException:
        for path in made:  # a failed start leaves no empty folders behind
            if os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
        raise
    finally:
        try:
            if checkpoints is not None:
                checkpoints.close()
        finally:
            lock.release_workdir(workdir)
