"""Where the test suite's time goes, by kind: a pytest plugin and its report.

    python -m pytest -q -n 2 --dist loadfile -p bench.suite_profile --durations=0
    python bench/suite_profile.py /tmp/sclaro-suite-profile     # the table
    python bench/suite_profile.py DIR --durations-out tests/durations.json   # the suite's order

The plugin (loaded with `-p bench.suite_profile`, in every xdist worker) writes one JSON line per
test phase into $SUITE_PROFILE_DIR (default /tmp/sclaro-suite-profile, emptied by the
controller at the start): the phase's wall seconds, the seconds XLA spent compiling in the test
process (JAX's own compile events: tracing, lowering, backend compile; a persistent-cache hit
counts its retrieval), the wall seconds during which at least one child process ran, with each
child's kind (the launcher, a `data_prep` / `sclaro_jax` CLI, a bench script, the notebook
kernel, other Python, other programs), the CPU seconds of the children that ended, and the test
process's own CPU seconds (all its threads). Each worker's collection (the test modules'
imports) is a line of its own. A long-lived child that runs commands for many tests (the
shared launcher of tests/conftest.py) is left out (`forget`); each command it runs counts as a
child of its kind started in the phase, with the CPU seconds it took (`command`).

The report sums them over the suite: compile (in the test process), child processes by kind
(their imports, compiles and work, which the parent cannot tell apart), Ray tests and the
notebook by file, and the rest (steps, I/O, imports done by the tests themselves), each as
worker-seconds and as a share of the summed test time; and, by file, the idle time: the wall
seconds of each phase that neither the test process nor its ended children spent on a CPU (a
worker pinned to one core leaves its core idle then: waits on a child's I/O, sleeps, timeouts;
Ray's worker processes, which are not the test process's children, count as idle).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

DEFAULT_DIR = "/tmp/sclaro-suite-profile"
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration",
                  "/jax/compilation_cache/cache_retrieval_time_sec")


def _folder() -> str:
    return os.environ.get("SUITE_PROFILE_DIR", DEFAULT_DIR)


class _State:
    def __init__(self):
        self.compile = 0.0
        self.children: list[list] = []  # [kind, start, end or None]
        self.command_cpu = 0.0  # CPU seconds of the commands long-lived children ran (`command`)
        self.lock = threading.Lock()


STATE = _State()


def _kind(args) -> str:
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    text = " ".join(argv)
    if "ipykernel" in text:
        return "notebook kernel"
    if "launch/train.py" in text or "launch.train" in text or "sclaro-train" in text:
        return "launcher (training runs)"
    if "bench/" in text or "bench." in text:
        return "bench scripts"
    if "data_prep" in text:
        return "data_prep CLIs"
    if "sclaro_jax" in text:
        return "sclaro_jax CLIs"
    if argv and ("python" in os.path.basename(argv[0]) or argv[0] == sys.executable):
        return "other python"
    return "other programs"


def _install():
    original_init = subprocess.Popen.__init__
    original_wait = subprocess.Popen.wait
    original_poll = subprocess.Popen.poll

    def init(self, args, *a, **k):
        entry = [_kind(args), time.perf_counter(), None]
        with STATE.lock:
            STATE.children.append(entry)
        self._profile_entry = entry
        original_init(self, args, *a, **k)

    def ended(self):
        entry = getattr(self, "_profile_entry", None)
        if entry is not None and entry[2] is None and self.returncode is not None:
            entry[2] = time.perf_counter()

    def wait(self, *a, **k):
        try:
            return original_wait(self, *a, **k)
        finally:
            ended(self)

    def poll(self):
        try:
            return original_poll(self)
        finally:
            ended(self)

    subprocess.Popen.__init__ = init
    subprocess.Popen.wait = wait
    subprocess.Popen.poll = poll
    try:
        import jax.monitoring

        def listener(event, seconds, **_):
            if event in COMPILE_EVENTS:
                STATE.compile += seconds

        jax.monitoring.register_event_duration_secs_listener(listener)
    except ImportError:
        pass


def forget(proc) -> None:
    """Leave the child `proc` out of every phase: a long-lived process that runs commands for
    many tests (tests/conftest.py's shared launcher), alive across the phases between them;
    each command it runs is recorded with `command`."""
    entry = getattr(proc, "_profile_entry", None)
    with STATE.lock:
        STATE.children = [c for c in STATE.children if c is not entry]
    proc._profile_entry = None


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads (/proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@contextlib.contextmanager
def command(kind: str, pid: int):
    """A command that the long-lived child `pid` (see `forget`) runs for the current phase: its
    wall seconds count as a child of `kind` that started in the phase, its CPU seconds as the
    phase's children's."""
    entry = [kind, time.perf_counter(), None]
    with STATE.lock:
        STATE.children.append(entry)
    cpu = _cpu_seconds(pid)
    try:
        yield
    finally:
        entry[2] = time.perf_counter()
        spent = _cpu_seconds(pid) - cpu
        with STATE.lock:
            STATE.command_cpu += spent


def _union(intervals, start, end) -> float:
    spans = sorted((max(s, start), min(e if e is not None else end, end))
                   for _, s, e in intervals)
    total, reach = 0.0, start
    for s, e in spans:
        if e <= reach:
            continue
        total += e - max(s, reach)
        reach = e
    return total


def _write(row: dict):
    name = os.path.join(_folder(), f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl")
    with open(name, "a") as out:
        out.write(json.dumps(row) + "\n")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        folder = _folder()
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            if name.endswith(".jsonl"):
                os.remove(os.path.join(folder, name))
    _install()


def pytest_collection(session):
    session._profile_start = time.perf_counter()


def pytest_collection_finish(session):
    start = getattr(session, "_profile_start", None)
    if start is not None:
        _write({"phase": "collect", "wall": time.perf_counter() - start, "compile": 0.0,
                "children": {}, "child_cpu": 0.0, "nodeid": "(collection)"})



def _phase():
    import resource

    start = time.perf_counter()
    compile0 = STATE.compile
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with STATE.lock:
        STATE.children = [c for c in STATE.children if c[2] is None]
        command_cpu = STATE.command_cpu
    return start, compile0, cpu0, time.process_time(), command_cpu


def _finish(item, when, mark):
    import resource

    start, compile0, cpu0, own0, command_cpu = mark
    end = time.perf_counter()
    own = time.process_time() - own0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with STATE.lock:
        children = list(STATE.children)
        command_cpu = STATE.command_cpu - command_cpu
    by_kind: dict[str, float] = {}
    for kind in {c[0] for c in children}:
        by_kind[kind] = _union([c for c in children if c[0] == kind], start, end)
    _write({"nodeid": item.nodeid, "phase": when, "wall": end - start,
            "compile": STATE.compile - compile0, "children": by_kind,
            "children_any": _union(children, start, end),
            "started": [c[0] for c in children if c[1] >= start],
            "child_cpu": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
            + command_cpu,
            "cpu": own})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    mark = _phase()
    yield
    _finish(item, "setup", mark)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    mark = _phase()
    yield
    _finish(item, "call", mark)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    mark = _phase()
    yield
    _finish(item, "teardown", mark)


# ------------------------------------------------------------------------------------- report

def _rows(folder: str) -> list[dict]:
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                rows += [dict(json.loads(line), worker=name[:-6]) for line in f if line.strip()]
    return rows


def _file_seconds(rows: list[dict]) -> dict[str, float]:
    per_file: dict[str, float] = {}
    for r in rows:
        if r["phase"] != "collect":
            file = r["nodeid"].split("::")[0]
            per_file[file] = per_file.get(file, 0.0) + r["wall"]
    return per_file


def write_durations(folder: str, path: str) -> dict[str, int]:
    """Each test file's seconds (whole seconds, heaviest first) as JSON at `path`: the order in
    which tests/conftest.py collects the files."""
    per_file = _file_seconds(_rows(folder))
    durations = {f: round(s) for f, s in sorted(per_file.items(), key=lambda kv: (-kv[1], kv[0]))}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(durations, f, indent=1)
        f.write("\n")
    return durations


def report(folder: str) -> str:
    rows = _rows(folder)
    total = sum(r["wall"] for r in rows)
    kinds: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(kind, seconds):
        kinds[kind] = kinds.get(kind, 0.0) + seconds

    for r in rows:
        file = r["nodeid"].split("::")[0]
        if r["phase"] == "collect":
            add("collection (test modules' imports)", r["wall"])
            continue
        if file.endswith("test_notebook.py"):
            add("the notebook (kernel start, cells)", r["wall"])
            continue
        children = r.get("children_any", 0.0)
        rest = max(r["wall"] - children - r["compile"], 0.0)
        add("XLA compiles in the test process", min(r["compile"], r["wall"]))
        for kind, seconds in r["children"].items():
            share = seconds / max(sum(r["children"].values()), 1e-9) * children
            add(f"child processes: {kind}", share)
        ray = "ray" in file
        for kind in r.get("started", []):
            counts[kind] = counts.get(kind, 0) + 1
        add("Ray tests: the rest (Ray start, actors, steps)" if ray else
            "the rest: steps, I/O, imports, fixtures in the test process", rest)
    tests = len({r["nodeid"] for r in rows if r["phase"] == "call"})
    workers = sorted({r["worker"] for r in rows})
    lines = [f"{tests} tests, {len(workers)} worker(s), {total:.0f} worker-seconds "
             f"({total / 60:.1f} worker-minutes)", "",
             "| kind | worker-seconds | share |", "|---|---:|---:|"]
    for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {seconds:.0f} | {100 * seconds / total:.1f}% |")
    lines += ["", "child processes started: " + ", ".join(
        f"{kind} {n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))]
    per_file = _file_seconds(rows)
    lines += ["", "| file | seconds |", "|---|---:|"]
    lines += [f"| {f} | {s:.0f} |" for f, s in sorted(per_file.items(), key=lambda kv: -kv[1])]
    idle = idle_seconds(rows)
    if idle:
        lines += ["", f"idle: {sum(idle.values()):.0f} worker-seconds of {total:.0f} (wall "
                      f"seconds that neither the test process nor its ended children spent on "
                      f"a CPU)", "", "| file | idle seconds | of its seconds |", "|---|---:|---:|"]
        lines += [f"| {f} | {s:.0f} | {100 * s / max(per_file[f], 1e-9):.0f}% |"
                  for f, s in sorted(idle.items(), key=lambda kv: -kv[1])[:15]]
    return "\n".join(lines)


def idle_seconds(rows: list[dict]) -> dict[str, float]:
    """Per file, the wall seconds its phases did not spend on a CPU (wall less the test
    process's CPU less its ended children's; each phase at least 0). Rows from a run before the
    plugin recorded the test process's CPU give none."""
    idle: dict[str, float] = {}
    for r in rows:
        if r["phase"] != "collect" and "cpu" in r:
            file = r["nodeid"].split("::")[0]
            idle[file] = idle.get(file, 0.0) + max(r["wall"] - r["cpu"] - r["child_cpu"], 0.0)
    return idle


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", default=DEFAULT_DIR,
                        help=f"the plugin's folder ($SUITE_PROFILE_DIR; default {DEFAULT_DIR})")
    parser.add_argument("--durations-out", metavar="PATH",
                        help="also write each file's seconds as JSON (tests/durations.json: the "
                             "heaviest-first order in which the suite collects its files)")
    args = parser.parse_args()
    print(report(args.folder))
    if args.durations_out:
        write_durations(args.folder, args.durations_out)
