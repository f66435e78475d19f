"""Shared fixtures. Parity tests run with float32 matmuls at the highest precision.

One JAX persistent compilation cache serves the whole run of the suite: a folder made for the
run (`pytest_configure` in the controller), handed to the xdist workers and every child process
through the environment (`JAX_COMPILATION_CACHE_DIR`, every compile stored), removed at the
end. A step that one test compiled is read from the folder by every other test and child that
compiles the same computation (a cache hit is the same executable: results do not change). A
test of the cache itself starts its children with `own_cache_env()`.

XLA:CPU compiles without LLVM's optimisation passes and with its older elemental emitters in
the test processes and every child (`CHEAP_COMPILE`, appended to `XLA_FLAGS` here, before JAX
starts its backend). Most of the suite's CPU time was XLA compiling steps that then run only a
few times; with these flags a step compiles in about half the CPU time and runs somewhat slower
(on a 2-core machine, CPU seconds: test_train_core 120 -> 60, test_packing 193 -> 103,
test_trainer 227 -> 154 with its 24-step runs). Every test and child of a run compiles with the
same flags, and the tests that compare numbers keep their tolerances.
`SCLARO_TEST_XLA_DEFAULTS=1` runs the suite with XLA's default flags. Where a test's own work
runs long (the detection overfit: 53 s of steps that took 177 s without LLVM's passes), it runs
in a child with LLVM's passes at level 1 (`long_run_xla_env()`).

Three settings of the test processes only (children are untouched):
- Python's full garbage collection runs a tenth as often (`gc.set_threshold`'s third value 10
  -> 100): a worker's heap (every test module, the traced and compiled programs JAX keeps)
  is large, and each full collection scans all of it. test_packing + test_train_core on one
  core: 22 full collections, 5.4 s, 126.5 s in all -> 5, 2.0 s, 123.8 s, the same peak memory.
  (The run's own code freezes its heap instead, `sclaro_jax.heap`, in the launcher and
  commands the tests start.)
- torch runs on one thread (`pytest_runtest_setup`): two xdist workers on a 2-core CPU, each
  with torch's default of a thread per core, mostly spin (about 10x the CPU for the same numbers).
- A traced value's missing `.sharding` raises its AttributeError without the origin message.
  JAX 0.10 builds that message by walking every equation traced so far, and flax NNX probes
  `getattr(value, "sharding", None)` on every variable it sets, so building a model under
  `nnx.eval_shape` or `jit` took time quadratic in its size (upstream: jax-ml/jax pull 40041).
  Only the message changes: the probe still gets its AttributeError."""

import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

gc.set_threshold(gc.get_threshold()[0], gc.get_threshold()[1], 100)  # the module's docstring

# the last: one LLVM module per executable (XLA:CPU splits it for a parallel codegen that a
# process on one core of a 2-core run cannot use): test_train_core + test_packing 138.7 ->
# 130.7 s on one core
CHEAP_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                 "--xla_cpu_parallel_codegen_split_count=1")


def _cheap_compile() -> None:
    if os.environ.get("SCLARO_TEST_XLA_DEFAULTS") == "1":
        return
    flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join([*flags, *(f for f in CHEAP_COMPILE if f not in flags)])


_cheap_compile()  # before JAX's backend starts (it reads XLA_FLAGS once, then)

jax.config.update("jax_default_matmul_precision", "highest")


def _quick_tracer_sharding():
    from jax._src import core as jax_core

    def sharding(self):
        raise AttributeError(f"The 'sharding' attribute is not available on {self._error_repr()}.")

    if isinstance(getattr(jax_core.Tracer, "sharding", None), property):
        jax_core.Tracer.sharding = property(sharding)


_quick_tracer_sharding()

ROOT = Path(__file__).resolve().parents[1]

# JAX's settings of the run's cache, as environment variables (read by every child's JAX).
CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": None,  # the folder, set in pytest_configure
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
_MADE_CACHE = []  # the folder this process made (the controller's), removed at the end


# Each test file's seconds in a profiled run of the suite (`bench/suite_profile.py DIR
# --durations-out tests/durations.json`). xdist's `--dist loadfile` hands whole files to the
# workers in collection order, by default re-sorted by their number of tests: a heavy file with
# three tests then started last and ran alone at the end (70 s of one idle core). Files are
# collected heaviest first instead (longest-processing-time-first; files not listed keep their
# order, after the listed ones), which leaves the workers' last files short.
DURATIONS = ROOT / "tests" / "durations.json"


def _file_seconds() -> dict:
    try:
        with open(DURATIONS, encoding="utf-8") as f:
            return {str(k): float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}  # no stored durations (or not a file of seconds): pytest's own order


# Files that run on one worker, in turn, as one unit of `--dist loadfile` (first file first; the
# unit's seconds are its files'). test_runs.py's reruns go to the worker's shared launcher
# (below), where test_trainer.py's runs of the same program leave their traced and compiled
# step (`run.ahead.kept_step`). xdist deals each file to whichever worker asks first, so the two
# met only by chance: test_runs.py took 64.5 s after test_trainer.py on its worker and
# 84.5-116.6 s on the other (tests/README.md, sixteenth round).
SAME_WORKER = (("tests/test_trainer.py", "tests/test_runs.py"),)
_UNIT = {file: (group[0], i) for group in SAME_WORKER for i, file in enumerate(group)}


def _unit(file: str) -> tuple:
    """(work unit, place in it) of a test file: the first file of its SAME_WORKER group and the
    file's place in the group, or the file itself and 0."""
    return _UNIT.get(file, (file, 0))


def pytest_collection_modifyitems(session, config, items):
    seconds = _file_seconds()
    if not seconds:
        return  # pytest's own order
    units: dict = {}
    for file, s in seconds.items():
        unit = _unit(file)[0]
        units[unit] = units.get(unit, 0.0) + s

    def key(item):
        unit, position = _unit(item.nodeid.split("::")[0])
        return (unit not in units, -units.get(unit, 0.0), unit if unit in units else "",
                position)  # a group's files together, its first file first

    items.sort(key=key)  # stable: a file's tests keep their order


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with each SAME_WORKER group as one unit (other modes: xdist's own)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Units(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(super()._split_scope(nodeid))[0]

    return _Units(config, log)


def _pin_worker(config) -> None:
    """An xdist worker of a run with one worker per core runs on a core of its own, and so do
    the processes it starts (children inherit the affinity). Two workers on 2 cores otherwise
    share both: each process sizes its XLA and torch thread pools to the machine, and the
    threads of one worker's process spin on the core the other worker is computing on.
    `SCLARO_TEST_NO_PIN=1`: no pinning."""
    if os.environ.get("SCLARO_TEST_NO_PIN") or not hasattr(config, "workerinput"):
        return
    cores = sorted(os.sched_getaffinity(0))
    count = int(config.workerinput.get("workercount", 0))
    index = config.workerinput.get("workerid", "")
    if count != len(cores) or count < 2 or not index.startswith("gw"):
        return
    core = {cores[int(index[2:]) % count]}
    for tid in os.listdir("/proc/self/task"):  # every thread the worker has started so far
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:  # a thread that ended meanwhile
            pass


def pytest_configure(config):
    _pin_worker(config)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # the heaviest-first order above, not test counts
    if not hasattr(config, "workerinput") and "SCLARO_TEST_JAX_CACHE" not in os.environ:
        folder = tempfile.mkdtemp(prefix="sclaro-test-jax-cache-")
        _MADE_CACHE.append(folder)
        os.environ["SCLARO_TEST_JAX_CACHE"] = folder  # workers and children inherit it
    folder = os.environ["SCLARO_TEST_JAX_CACHE"]
    os.environ.update({**CACHE_ENV, "JAX_COMPILATION_CACHE_DIR": folder})
    # this process imported JAX before the variables were set: the same settings, directly
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_TORCH_DEFAULT_THREADS = []  # torch's own count, before this process first set it to one


def _one_torch_thread(torch):
    if not _TORCH_DEFAULT_THREADS:
        _TORCH_DEFAULT_THREADS.append(torch.get_num_threads())
    torch.set_num_threads(1)


def pytest_runtest_setup(item):
    torch = sys.modules.get("torch")  # set once torch is imported, by whichever test module
    if torch is not None:
        _one_torch_thread(torch)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread in this process from the requesting module fixture on; it yields
    torch's own default count (for a fixture that runs at the default on purpose).
    `pytest_runtest_setup` sets one thread before each test, but only once some module has
    imported torch: a module whose first fixture imports torch and runs a pipeline asks for this
    fixture."""
    import torch
    _one_torch_thread(torch)
    yield _TORCH_DEFAULT_THREADS[0]


def pytest_unconfigure(config):
    _SHARED_LAUNCHER.stop()
    for folder in _MADE_CACHE:
        shutil.rmtree(folder, ignore_errors=True)


def init_ray() -> None:
    """`ray.init` of a local Ray with 2 CPUs that other drivers can join, keeping its idle task
    workers as the Ray that `--engine ray` starts does (`ray_start.IDLE_WORKERS`): Ray's default
    reaps them within a second, and each annotate run of test_annotate_ray's config then started
    about six new ones (3-4 of its 20-22 CPU seconds on one core)."""
    import ray

    from data_prep.annotate.ray_start import IDLE_WORKERS
    with pytest.MonkeyPatch.context() as env:  # the raylet reads it when it starts
        env.setenv(*IDLE_WORKERS)
        ray.init(num_cpus=2, include_dashboard=False)


# A child that computes for long: LLVM's passes at level 1 (XLA's default is 2). The detection
# overfit (fit + evaluation, one core): 70.3 CPU-s at XLA's defaults, 63.7 with this, its AP50
# 0.925 and 0.927.
LONG_RUN_COMPILE = ("--xla_backend_optimization_level=1",)


def long_run_xla_env(**extra) -> dict:
    """The environment for a child that computes for long (many steps at a real size): the
    suite's `CHEAP_COMPILE` flags replaced by `LONG_RUN_COMPILE` in XLA_FLAGS (its steps run
    at about XLA's default speed, its compiles take less than XLA's default time), the tests'
    matmul precision set."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in CHEAP_COMPILE]
    return {**os.environ, "XLA_FLAGS": " ".join([*flags, *LONG_RUN_COMPILE]),
            "JAX_DEFAULT_MATMUL_PRECISION": "highest", **extra}


def own_cache_env(**extra) -> dict:
    """The environment for a child whose compilation cache is what the test is about: the run's
    shared cache settings removed (the child's config decides, as for a user)."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    env.pop("SCLARO_TEST_JAX_CACHE", None)
    return {**env, **extra}

TINY_HF = dict(
    text_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4),
    vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, image_size=32, patch_size=8),
    projection_dim=32,
)
# The real openai/clip-vit-base-patch32 sizes (transformers' CLIPConfig defaults), random weights.
VIT_B32_HF: dict = {}


def save_random_hf_clip(folder, config_kwargs, seed=0, **overrides):
    """A random-initialised transformers CLIPModel written with save_pretrained."""
    import torch
    import transformers

    config = transformers.CLIPConfig(**config_kwargs)
    for key, value in overrides.items():
        sub, name = key.split(".")
        setattr(getattr(config, sub), name, value)
    torch.manual_seed(seed)
    model = transformers.CLIPModel(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_clip")
    return folder, save_random_hf_clip(folder, TINY_HF)


@pytest.fixture(scope="session")
def b32_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vit_b32_clip")
    return folder, save_random_hf_clip(folder, VIT_B32_HF, seed=1)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def drawn_in_numpy(make, seed: int):
    """The model `make()` builds (built abstractly), its parameters drawn in numpy instead of by
    its initialisers: N(0, 0.02), LayerNorm scales near 1, logit scales log(1 / 0.07) (CLIP's
    start). At ViT-B/32 sizes the initialisers' truncated normals take about 20 s of a core
    under the suite's cheap-compile flags (XLA's unoptimised code, `CHEAP_COMPILE`); this, 6 s."""
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(seed)
    drawn = []
    for path, var in nnx.to_flat_state(state):
        value = rng.standard_normal(var.shape, np.float32) * np.float32(0.02)
        if path[-1] == "scale" and "norm" in str(path[-2]):
            value += np.float32(1)
        if str(path[-1]).endswith("logit_scale"):
            value = np.full(var.shape, np.log(1 / 0.07), np.float32)
        drawn.append((path, var.replace(jnp.asarray(value))))
    return nnx.merge(graphdef, nnx.from_flat_state(drawn))


DEMO_IMAGE_SIZE = 32  # configs/scenarioclip.py:demo's data.image_size


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The bundled demo dataset written by `data_prep.demo.build_demo` (14 records, 10/1/3):
    schema version 2 with originals, training views at the demo config's 32 px."""
    from data_prep.demo import build_demo

    folder = tmp_path_factory.mktemp("demo") / "shards"
    build_demo(str(folder), image_size=DEMO_IMAGE_SIZE, progress=False)
    return str(folder)


def demo_config(demo_dir, steps=None):
    """configs/scenarioclip.py:demo on the demo shards (`steps` overrides train.steps)."""
    from sclaro_jax.config import load_config

    config = load_config(str(ROOT / "configs" / "scenarioclip.py") + ":demo")
    config.data.dir = demo_dir
    if steps is not None:
        config.train.steps = steps
    return config


def _checkpointed_workdir(workdir, demo_dir, kind="scenarioclip"):
    """A ScenarioCLIP (or `kind`) workdir as the trainer leaves it (config.json + an orbax
    checkpoint of the train state at step 7), written without training; the teacher differs from
    the student."""
    import dataclasses

    import jax
    import orbax.checkpoint as ocp

    from sclaro_jax.checkpoint import build_model
    from sclaro_jax.train import core, trainer

    config = demo_config(demo_dir)
    config.model.kind = kind
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    _, state, _ = core.init_state(build_model(config), trainer.train_config(config, 10))
    teacher = jax.tree.map(lambda x: x * 0.9 + 0.01, state.teacher)
    state = dataclasses.replace(state, teacher=teacher)
    manager = ocp.CheckpointManager(str(workdir / "checkpoints"))
    manager.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
    manager.close()


@pytest.fixture(scope="session")
def scenario_workdir(tmp_path_factory, demo_dir):
    """A tiny ScenarioCLIP training workdir on the demo data, checkpoint at step 7."""
    workdir = tmp_path_factory.mktemp("scenario") / "run"
    _checkpointed_workdir(workdir, demo_dir)
    return workdir


def run_script(script: str, timeout: int = 900) -> str:
    """Run `python -c script` from the repository root (e.g. with 8 host devices set up in the
    script's first lines); assert it exits 0 and prints OK; return its stdout."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "OK" in result.stdout
    return result.stdout


def launch_all(argvs: list, timeout: int = 600) -> list:
    """For each ARGS of `argvs`, what `python launch/train.py ARGS` gave, run in turn from the
    repository root in the worker's shared launcher (`shared_launcher` below): `returncode`,
    `stdout`, `stderr`, as `subprocess.run` names them. For command lines that are refused
    before a run starts, where a process each would spend its seconds importing."""
    return [_SHARED_LAUNCHER.run([sys.executable, "launch/train.py", *argv], timeout=timeout)
            for argv in argvs]


# One long-lived child per test worker that runs command lines of the launcher
# (`launch/train.py ARGS`, as `python launch/train.py` runs it) one after another, for the runs
# whose own process is not what their test is about (`shared_launcher`). A run there costs
# no imports (2-3 s of a launcher start on one core) and, for a recipe it ran before, no
# tracing or compiling of its train step (`run.ahead.kept_step`): a demo run of 8 steps took
# about 10 s in a process of its own and 3.4 s there. Its environment is the suite's (the
# worker's at the first call: a test that runs with an environment of its own, a signal, a kill
# or a timing of the process start, starts its own process instead; one whose environment
# only sets JAX options, e.g. JAX_DEFAULT_MATMUL_PRECISION, passes them as `jax_config`: set
# with `jax.config.update` for its command and set back after it). Each command runs with
# the child's stdin, /dev/null, and its stdout and stderr (file descriptors 1 and 2, so C++ and
# absl's log lines too) in files of its own; afterwards the run locks it took are given back,
# as its process ending would.
_LAUNCHER_LOOP = r"""
import json, os, runpy, sys, tempfile, traceback
sys.path.insert(0, ".")
requests, replies = (os.fdopen(int(fd), mode) for fd, mode in zip(sys.argv[1:3], "rw"))
for line in requests:
    request = json.loads(line)
    argv, settings, before = request["argv"], request["jax_config"], {}
    if settings:
        import jax
        before = {name: getattr(jax.config, name) for name in settings}
        for name, value in settings.items():
            jax.config.update(name, value)
    sys.argv = list(argv)
    files = [tempfile.TemporaryFile() for _ in (1, 2)]
    saved = [os.dup(1), os.dup(2)]
    for fd, f in zip((1, 2), files):
        os.dup2(f.fileno(), fd)
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        lock = sys.modules.get("sclaro_jax.run.lock")
        for key in list(getattr(lock, "_held", {})):
            while key in lock._held:
                lock.release_workdir(key)
        for name, value in before.items():
            jax.config.update(name, value)
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read().decode("utf-8", "replace"))
        f.close()
    replies.write(json.dumps({"code": code, "stdout": texts[0], "stderr": texts[1]}) + "\n")
    replies.flush()
"""


def _profile():
    """bench/suite_profile.py when the run loaded it (`-p bench.suite_profile`), else None."""
    return sys.modules.get("bench.suite_profile")


class _SharedLauncher:
    """The worker's child of `_LAUNCHER_LOOP`, started at its first command line."""

    def __init__(self):
        self.proc = None

    def _start(self):
        import subprocess
        requests_in, requests_out = os.pipe()  # (read end, write end)
        replies_in, replies_out = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER_LOOP, str(requests_in), str(replies_out)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(requests_in, replies_out))
        os.close(requests_in)
        os.close(replies_out)
        profile = _profile()
        if profile is not None:  # bench/suite_profile.py: each command is a child, not this
            profile.forget(self.proc)
        self.requests = os.fdopen(requests_out, "w")
        self.replies = os.fdopen(replies_in, "r")

    def stop(self):
        """End the child (its loop ends when the requests pipe closes) and close both pipes."""
        import contextlib
        import subprocess
        if self.proc is not None:
            with contextlib.suppress(BrokenPipeError):  # a child that died with a request unread
                self.requests.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.replies.close()
            self.proc = None

    def run(self, argv: list, timeout: float = 900, jax_config: dict | None = None):
        """What `subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)` gives for
        ARGV `[python, "launch/train.py", *args]` (a `CompletedProcess`), the command run in
        this worker's child; `jax_config`: JAX options for this command (name -> value), as
        their `JAX_*` environment variables would set them in a process of its own."""
        import contextlib
        import select
        import subprocess
        argv = [str(a) for a in argv]
        assert argv[:2] == [sys.executable, "launch/train.py"], argv[:2]
        if self.proc is not None and self.proc.poll() is not None:
            self.stop()  # ended between commands: its pipes closed, a new one started
        if self.proc is None:
            self._start()
        profile = _profile()
        with (profile.command("launcher (training runs)", self.proc.pid) if profile is not None
              else contextlib.nullcontext()):
            self.requests.write(json.dumps({"argv": argv[1:],
                                            "jax_config": jax_config or {}}) + "\n")
            self.requests.flush()
            ready, _, _ = select.select([self.replies], [], [], timeout)
            line = self.replies.readline() if ready else ""
        if not line:
            self.proc.kill()
            code = self.proc.wait()
            self.stop()
            raise AssertionError(f"{argv[1:3]}: no answer in {timeout} s" if not ready else
                                 f"{argv[1:3]}: the shared launcher's process ended ({code})")
        reply = json.loads(line)
        return subprocess.CompletedProcess(argv, reply["code"], reply["stdout"], reply["stderr"])


_SHARED_LAUNCHER = _SharedLauncher()


@pytest.fixture(scope="session")
def shared_launcher():
    """The worker's `_SharedLauncher` (`shared_launcher.run(argv)`); its child ends with the
    worker (`pytest_unconfigure`: after the last test's phases, so that no phase counts it)."""
    return _SHARED_LAUNCHER
