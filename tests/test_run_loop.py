"""The run layer on a toy step: `run_steps`'s metrics lines, checkpoints (every / at end / on a
stop) and non-finite guard, and the name-and-regex parameter labeller both optimisers use."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sclaro_jax.run import Checkpoints, Hooks, LoopSpec, NonFiniteLossError, run_steps
from sclaro_jax.run.params import label_params


def _step(state, batch):
    loss = jnp.sum(state["w"] * batch["x"])
    return {"step": state["step"] + 1, "w": state["w"] - 0.1}, {"loss": loss}


def _run(workdir, steps=6, stop_at=None, x=1.0, hooks=None):
    checkpoints = Checkpoints.open(str(workdir), ocp.args.StandardSave, keep=5,
                                   background=False)
    state = {"step": jnp.zeros((), jnp.int32), "w": jnp.ones(3)}
    if checkpoints.start:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = checkpoints.manager.restore(checkpoints.start,
                                            args=ocp.args.StandardRestore(abstract))
    spec = LoopSpec(workdir=str(workdir), start=checkpoints.start, steps=steps, log_every=2,
                    checkpoint_every=4, examples_per_step=8, progress=False, stop_at=stop_at)
    return run_steps(jax.jit(_step), state, lambda i: {"x": jnp.full(3, x)}, checkpoints, spec,
                     hooks)


def _lines(workdir):
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_logs_saves_every_at_the_end_and_on_a_stop(tmp_path):
    seen = []
    hooks = Hooks(started=lambda: seen.append("started"),
                  log_fields=lambda wall, step: {"extra": step * 10},
                  after_step=lambda step, state: seen.append(step))
    result = _run(tmp_path, stop_at=3, hooks=hooks)
    assert result.done == 3 and result.stopped == "stop_at" and int(result.state["step"]) == 3
    assert seen == ["started", 1, 2, 3]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [3]
    result = _run(tmp_path)  # resumes at 3
    assert result.done == 6 and result.stopped is None
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [3, 4, 6]
    rows = _lines(tmp_path)
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert list(rows[0]) == ["loss", "step", "examples_per_sec", "extra"]
    assert rows[0]["extra"] == 20
    np.testing.assert_allclose([r["loss"] for r in rows], [3 * 0.9, 3 * 0.7, 3 * 0.5], rtol=1e-6)


def test_a_sigterm_while_the_last_checkpoint_is_written_is_a_request(tmp_path, monkeypatch):
    """The last write ends while the loop's handlers are still set: a SIGTERM then is a stop
    request, not the default handler ending the process mid-write (which left an unfinished
    checkpoint for the next start)."""
    import os
    import signal

    def default(signum, frame):
        raise RuntimeError("SIGTERM reached the handler outside the loop")

    original = Checkpoints.close

    def close(self):
        os.kill(os.getpid(), signal.SIGTERM)  # as the last checkpoint is being finished
        return original(self)

    monkeypatch.setattr(Checkpoints, "close", close)
    previous = signal.signal(signal.SIGTERM, default)
    try:
        result = _run(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.done == 6 and result.stopped == "SIGTERM"
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [4, 6]


def test_a_non_finite_loss_stops_before_anything_of_its_step_is_saved(tmp_path):
    with pytest.raises(NonFiniteLossError, match="loss became nan at step 2"):
        _run(tmp_path, x=float("nan"))
    assert not (tmp_path / "checkpoints").exists() or \
        not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]


def test_label_params_first_matching_rule_else_the_default():
    params = {"backbone": {"vision": {"w": jnp.ones((2, 2))}}, "head": {"b": jnp.ones(2),
                                                                       "kd_log_scale": 1.0}}
    labels = label_params(params, [(r"(^|/)backbone/vision(/|$)", "backbone"),
                                   (r"(^|/)kd_log_scale$", "kd")],
                          lambda name, v: "decay" if jnp.ndim(v) >= 2 else "no_decay")
    assert labels == {"backbone": {"vision": {"w": "backbone"}},
                      "head": {"b": "no_decay", "kd_log_scale": "kd"}}
    assert label_params(params, [("", "never")], "head")["head"]["b"] == "head"


def test_tensorboardx_is_imported_without_torch_or_boto3_unless_already_imported():
    # tensorboardX imports torch and boto3 where they are installed (seconds at every start, for
    # torch tensors and s3:// folders, neither of which a run uses); they are hidden while it
    # imports, and importable again after it
    import subprocess
    import sys
    probe = (
        "import sys\n"
        "from sclaro_jax.run.folder import import_tensorboardx\n"
        "{pre}"
        "tbx = import_tensorboardx()\n"
        "rw = import_tensorboardx('tensorboardX.record_writer')\n"
        "print(sorted(n for n in ('torch', 'boto3') if n in sys.modules), rw.S3_ENABLED)\n"
        "import boto3\n"
        "print(sys.modules['boto3'] is not None, callable(tbx.SummaryWriter))\n")
    outputs = [subprocess.run([sys.executable, "-c", probe.format(pre=pre)], capture_output=True,
                              text=True, timeout=300, check=True).stdout.split("\n")
               for pre in ("", "import boto3\n")]
    assert outputs[0][:2] == ["[] False", "True True"]
    assert outputs[1][:2] == ["['boto3'] True", "True True"]  # imported before: left as it was
