"""Python's garbage collector during a run (`sclaro_jax.heap`): the training loop freezes what
the run built before its loop and after its first step and unfreezes when it returns; a
command's process freezes once for good; a heap someone else froze is left to them. Cyclic
garbage made while frozen is still collected, and what died while frozen is collected after."""

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from sclaro_jax import heap
from sclaro_jax.run import Checkpoints, Hooks, LoopSpec, run_steps

ROOT = Path(__file__).resolve().parents[1]


class Node:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def unfrozen():
    """Each test starts from an unfrozen heap and no holder, and leaves the process so."""
    assert gc.get_freeze_count() == 0 and not heap._OWNERS
    yield
    heap._OWNERS.clear()
    gc.unfreeze()


def _cycle():
    node = Node()
    return weakref.ref(node), node


def _frozen(obj) -> bool:
    """Whether `obj` is in the permanent generation: `gc.get_objects()` lists the tracked objects
    of the three collected generations only. (The freeze count is no witness: a frozen object
    freed by its reference count, e.g. by another thread, leaves the permanent generation.)"""
    return not any(o is obj for o in gc.get_objects())


def test_frozen_heap_freezes_collects_new_garbage_and_unfreezes():
    dead_before, node = _cycle()
    with heap.FrozenHeap() as frozen:
        assert gc.get_freeze_count() > 0 and frozen.active
        del node  # a cycle frozen while alive: its garbage waits for the unfreeze
        gc.collect()
        assert dead_before() is not None
        young, node = _cycle()
        del node  # a cycle made while frozen: collected as before
        gc.collect()
        assert young() is None
        kept = Node()
        assert not _frozen(kept)
        frozen.settled()  # what was made since entry is frozen too
        assert _frozen(kept)
        del kept
    assert gc.get_freeze_count() == 0 and not heap._OWNERS
    gc.collect()
    assert dead_before() is None  # back with the collector after the exit


def test_a_heap_someone_else_froze_is_theirs():
    before = Node()
    gc.freeze()
    assert _frozen(before) and gc.get_freeze_count() > 0
    with heap.FrozenHeap() as frozen:
        assert not frozen.active
        extra = Node()
        frozen.settled()
        assert not _frozen(extra)  # nothing frozen ...
    assert _frozen(before)  # ... and nothing unfrozen
    heap.freeze_for_process()  # nor does a command take it over
    assert not heap._OWNERS and _frozen(before) and not _frozen(extra)
    del extra


def test_a_commands_process_stays_frozen_and_the_loops_freeze_more():
    heap.freeze_for_process()
    assert gc.get_freeze_count() > 0 and heap._OWNERS == [heap._PROCESS]
    heap.freeze_for_process()  # once
    assert heap._OWNERS == [heap._PROCESS]
    with heap.FrozenHeap() as frozen:
        assert frozen.active
        kept = Node()
        frozen.settled()
        assert _frozen(kept)
    assert _frozen(kept)  # the process's holder never unfreezes
    assert heap._OWNERS == [heap._PROCESS]
    del kept


def test_nested_heaps_leave_the_unfreezing_to_the_outermost():
    with heap.FrozenHeap() as outer:
        with heap.FrozenHeap() as inner:
            assert inner.active and heap._OWNERS == [outer, inner]
        assert gc.get_freeze_count() > 0 and heap._OWNERS == [outer]
    assert gc.get_freeze_count() == 0


def _step(state, batch):
    return {"w": state["w"] - 0.1 * batch["x"]}, {"loss": jnp.sum(state["w"])}


def test_run_steps_trains_frozen_and_returns_unfrozen(tmp_path):
    """While the loop runs the heap is frozen (more after its first step: the step's trace and
    executable); when it returns nothing is, and after an error in a step neither."""
    counts = []
    checkpoints = Checkpoints.open(str(tmp_path), ocp.args.StandardSave, keep=2,
                                   background=False)
    spec = LoopSpec(workdir=str(tmp_path), start=0, steps=3, log_every=1, checkpoint_every=2,
                    examples_per_step=1, progress=False)
    result = run_steps(jax.jit(_step), {"w": jnp.ones(3)}, lambda i: {"x": jnp.ones(3)},
                       checkpoints, spec,
                       Hooks(after_step=lambda step, state: counts.append(gc.get_freeze_count())))
    assert result.done == 3
    assert len(counts) == 3 and all(c > 0 for c in counts)
    assert counts[1] > counts[0]  # frozen again after the first step
    assert gc.get_freeze_count() == 0 and not heap._OWNERS

    def failing(state, batch):
        raise RuntimeError("a step that fails")
    checkpoints = Checkpoints.open(str(tmp_path / "b"), ocp.args.StandardSave, keep=2,
                                   background=False)
    spec.workdir = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="a step that fails"):
        run_steps(failing, {"w": jnp.ones(3)}, lambda i: {"x": jnp.ones(3)}, checkpoints, spec)
    assert gc.get_freeze_count() == 0 and not heap._OWNERS


@pytest.mark.parametrize("module", ["data_prep", "sclaro_jax.eval.suite",
                                    "sclaro_jax.miner.index", "launch/train.py"])
def test_each_command_freezes_its_process_after_its_imports(module):
    """A command's process (`python -m ...`, `python launch/train.py`) holds its heap frozen;
    importing its module does not (a notebook or a test imports it, and calls its `main`)."""
    run = ("runpy.run_path(sys.argv[0], run_name='__main__')" if module.endswith(".py") else
           "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
    probe = ("import gc, runpy, sys\n"
             "sys.path.insert(0, '.')\n"
             "import sclaro_jax.heap as heap\n"
             "sys.argv = [sys.argv[1], '--help']\n"
             "try:\n"
             f"    {run}\n"
             "except SystemExit:\n"
             "    pass\n"
             "print('FROZEN', gc.get_freeze_count() > 0, heap._OWNERS == [heap._PROCESS])\n")
    result = subprocess.run([sys.executable, "-c", probe, module], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert "FROZEN True True" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    name = "launch.train" if module.endswith(".py") else module
    imported = subprocess.run([sys.executable, "-c", f"import gc, {name}; "
                               "print('FROZEN', gc.get_freeze_count() > 0)"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert "FROZEN False" in imported.stdout, imported.stderr[-2000:]


def test_the_detectors_command_called_by_a_program_leaves_its_heap_alone(tmp_path):
    """`sclaro_jax.eval.detect.main` (the launcher's alias) called in a process, as a notebook
    or a test calls it: the launcher's run returns (here with a refusal, after its checks) and
    the caller's heap is not frozen."""
    from sclaro_jax.eval import detect

    # the demo recipe: its data written into the workdir, then no checkpoint to evaluate
    assert detect.main(["--workdir", str(tmp_path), "--config", "detection:demo"]) == 2
    assert gc.get_freeze_count() == 0 and not heap._OWNERS
