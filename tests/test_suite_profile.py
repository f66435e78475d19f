"""bench/suite_profile.py's report and the durations file that orders the suite's files."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import suite_profile  # noqa: E402


def _write(folder, worker, rows):
    with open(folder / f"{worker}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _row(nodeid, phase, wall, compile=0.0, children=None, started=()):
    children = children or {}
    return dict(nodeid=nodeid, phase=phase, wall=wall, compile=compile, children=children,
                children_any=sum(children.values()), started=list(started), child_cpu=0.0)


def test_report_sums_kinds_and_files_and_writes_the_heaviest_first_order(tmp_path):
    _write(tmp_path, "gw0", [
        {"phase": "collect", "wall": 2.0, "compile": 0.0, "children": {}, "child_cpu": 0.0,
         "nodeid": "(collection)"},
        _row("tests/test_b.py::t1", "setup", 1.0),
        _row("tests/test_b.py::t1", "call", 10.0, compile=4.0,
             children={"launcher (training runs)": 5.0}, started=["launcher (training runs)"]),
    ])
    _write(tmp_path, "gw1", [_row("tests/test_a.py::t2", "call", 3.0),
                             _row("tests/test_c.py::t3", "call", 3.0)])
    text = suite_profile.report(str(tmp_path))
    assert text.startswith("3 tests, 2 worker(s), 19 worker-seconds")
    assert "| XLA compiles in the test process | 4 | 21.1% |" in text
    assert "| child processes: launcher (training runs) | 5 | 26.3% |" in text
    # 1 s of setup + 10 - 4 - 5 of the call, 3 + 3 of the other files
    assert "| the rest: steps, I/O, imports, fixtures in the test process | 8 | 42.1% |" in text
    assert "child processes started: launcher (training runs) 1" in text
    assert "idle" not in text  # rows without the test process's CPU: no idle table
    out = tmp_path / "durations.json"
    got = suite_profile.write_durations(str(tmp_path), str(out))
    assert list(got.items()) == [("tests/test_b.py", 11), ("tests/test_a.py", 3),
                                 ("tests/test_c.py", 3)]  # ties by name
    assert json.loads(out.read_text()) == got


def test_idle_is_the_wall_that_neither_the_test_process_nor_its_children_spent_on_a_cpu(
        tmp_path):
    rows = [dict(_row("tests/test_a.py::t", "call", 10.0), cpu=3.0, child_cpu=4.0),
            dict(_row("tests/test_a.py::t", "setup", 2.0), cpu=2.5, child_cpu=0.0),  # none
            dict(_row("tests/test_b.py::u", "call", 5.0), cpu=1.0, child_cpu=0.0)]
    _write(tmp_path, "gw0", rows)
    assert suite_profile.idle_seconds(suite_profile._rows(str(tmp_path))) == {
        "tests/test_a.py": 3.0, "tests/test_b.py": 4.0}
    text = suite_profile.report(str(tmp_path))
    assert "idle: 7 worker-seconds of 17" in text
    assert text.index("| tests/test_b.py | 4 | 80% |") < text.index("| tests/test_a.py | 3 | 25% |")


def _profiled_call(test: Path) -> dict:
    """The plugin's row of the call phase of the one test in file `test`, run by pytest."""
    import subprocess
    out = test.parent / "prof"
    env = dict(__import__("os").environ, SUITE_PROFILE_DIR=str(out),
               PYTHONPATH=str(ROOT) + ":" + str(ROOT / "bench"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "bench.suite_profile",
                           "-p", "no:cacheprovider", "-p", "no:xdist", str(test)],
                          cwd=test.parent, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [r for r in suite_profile._rows(str(out)) if r["phase"] == "call"][0]


def test_the_plugin_records_the_test_processs_own_cpu(tmp_path):
    """The plugin's own rows, from a pytest run of a test that spins 0.3 s and sleeps 0.3 s."""
    test = tmp_path / "test_spin.py"
    test.write_text("import time\n\ndef test_spin():\n    t = time.process_time()\n"
                    "    while time.process_time() - t < 0.3:\n        pass\n"
                    "    time.sleep(0.3)\n")
    call = _profiled_call(test)
    assert 0.28 <= call["cpu"] <= call["wall"] - 0.25, call
    assert suite_profile.idle_seconds([call])["test_spin.py"] >= 0.25


SPIN = ("import sys, time\n"
        "for line in sys.stdin:\n"
        "    t = time.process_time()\n"
        "    while time.process_time() - t < 0.3:\n"
        "        pass\n"
        "    print('done', flush=True)\n")


def test_a_long_lived_childs_commands_are_children_and_its_idle_life_is_not(tmp_path):
    """A child that lives across phases (tests/conftest.py's shared launcher) is left out
    (`forget`); a command it runs for a phase (`command`) is a child of that phase started there,
    with the CPU it took, and the wall it waited idle is not a child's."""
    test = tmp_path / "test_server.py"
    test.write_text(
        "import subprocess, sys, time\n\n"
        "def test_server():\n"
        "    profile = sys.modules['bench.suite_profile']\n"
        f"    p = subprocess.Popen([sys.executable, '-c', {SPIN!r}], stdin=subprocess.PIPE,\n"
        "                         stdout=subprocess.PIPE, text=True)\n"
        "    profile.forget(p)\n"
        "    time.sleep(0.5)  # alive, idle\n"
        "    with profile.command('launcher (training runs)', p.pid):\n"
        "        p.stdin.write('go\\n')\n"
        "        p.stdin.flush()\n"
        "        assert p.stdout.readline() == 'done\\n'\n"
        "    p.stdin.close()  # it ends; reaped after the phase\n")
    call = _profiled_call(test)
    assert call["started"] == ["launcher (training runs)"], call
    assert 0.28 <= call["children"]["launcher (training runs)"] <= call["wall"] - 0.45, call
    assert call["children_any"] == call["children"]["launcher (training runs)"], call
    assert 0.28 <= call["child_cpu"] <= 0.6, call


def test_the_suite_collects_its_files_heaviest_first():
    import conftest
    stored = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert conftest._file_seconds() == {k: float(v) for k, v in stored.items()}

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    heavy, light = sorted(stored, key=stored.get)[-1], sorted(stored, key=stored.get)[0]
    items = [Item("tests/test_new.py::y"), Item(f"{light}::x"), Item(f"{heavy}::z"),
             Item(f"{heavy}::w")]
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == [f"{heavy}::z", f"{heavy}::w", f"{light}::x",
                                         "tests/test_new.py::y"]


def test_a_same_worker_group_is_one_unit_of_loadfile_its_first_file_first(tmp_path, monkeypatch):
    """test_trainer.py and test_runs.py (conftest.SAME_WORKER): collected together at their
    summed seconds, trainer first, and dealt by xdist's `--dist loadfile` to one worker."""
    import types

    import conftest
    seconds = {"tests/test_a.py": 100, "tests/test_b.py": 55, "tests/test_runs.py": 50,
               "tests/test_trainer.py": 60}
    (tmp_path / "durations.json").write_text(json.dumps(seconds))
    monkeypatch.setattr(conftest, "DURATIONS", tmp_path / "durations.json")
    items = [types.SimpleNamespace(nodeid=n) for n in (
        "tests/test_a.py::a", "tests/test_b.py::b", "tests/test_new.py::n",
        "tests/test_runs.py::r1", "tests/test_runs.py::r2", "tests/test_trainer.py::t")]
    conftest.pytest_collection_modifyitems(None, None, items)
    order = [i.nodeid for i in items]
    assert order == ["tests/test_trainer.py::t", "tests/test_runs.py::r1",
                     "tests/test_runs.py::r2", "tests/test_a.py::a", "tests/test_b.py::b",
                     "tests/test_new.py::n"]

    class Config:  # what xdist's scheduler reads of a `-n 2 --dist loadfile` run's config
        option = types.SimpleNamespace(loadscopereorder=False)

        def getvalue(self, name):
            return {"dist": "loadfile", "tx": ["2*popen"]}[name]

    class Worker:  # a worker as the scheduler drives it: the tests it was sent
        shutting_down = False

        def __init__(self, name):
            self.sent, self.gateway = [], types.SimpleNamespace(id=name)

        def send_runtest_some(self, indices):
            self.sent += [order[i] for i in indices]

        def shutdown(self):
            self.shutting_down = True

    sched = conftest.pytest_xdist_make_scheduler(Config(), None)
    workers = [Worker("gw0"), Worker("gw1")]
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, order)
    sched.schedule()
    while any(sched.assigned_work[w] for w in workers) and sched.workqueue:
        for w in workers:  # each finishes what it holds, then asks for more
            for scope in sched.assigned_work[w].values():
                for nodeid in scope:
                    scope[nodeid] = True
            sched._reschedule(w)
    first = next(w for w in workers if "tests/test_trainer.py::t" in w.sent)
    assert first.sent[:3] == order[:3], first.sent  # the group, in turn, on one worker
    assert sorted(workers[0].sent + workers[1].sent) == sorted(order)  # each test once
    assert not any(n.startswith(("tests/test_runs", "tests/test_trainer"))
                   for w in workers if w is not first for n in w.sent)
    assert conftest.pytest_xdist_make_scheduler(
        types.SimpleNamespace(getvalue={"dist": "load"}.get), None) is None  # xdist's own


@pytest.mark.parametrize("text", ["[1, 2]", '{"tests/test_a.py": {"s": 1}}', "not json",
                                  '{"tests/test_a.py": "fast"}', None],
                         ids=["a-list", "nested", "not-json", "a-string", "a-link-to-nowhere"])
def test_a_durations_file_that_is_not_seconds_leaves_pytests_order(tmp_path, monkeypatch, text):
    import conftest
    path = tmp_path / "durations.json"
    if text is None:
        path.symlink_to(tmp_path / "missing.json")
    else:
        path.write_text(text)
    monkeypatch.setattr(conftest, "DURATIONS", path)
    assert conftest._file_seconds() == {}


def test_the_cheap_compile_flags_are_appended_once_unless_turned_off(monkeypatch):
    import conftest
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.setenv("SCLARO_TEST_XLA_DEFAULTS", "1")
    conftest._cheap_compile()
    assert conftest.os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    monkeypatch.delenv("SCLARO_TEST_XLA_DEFAULTS")
    conftest._cheap_compile()
    conftest._cheap_compile()  # a worker or child importing conftest again: not twice
    assert conftest.os.environ["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=4", *conftest.CHEAP_COMPILE]
    # a child that computes for long gets LLVM's passes back (level 1), and the tests' precision
    env = conftest.long_run_xla_env()
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4",
                                        *conftest.LONG_RUN_COMPILE]
    assert env["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"
