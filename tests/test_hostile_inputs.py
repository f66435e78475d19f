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

import importlib.util  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

INDEX = ("-m", "sclaro_jax.miner.index")
IVF = "IVF{nlist},Flat"  # IVF lists in both indexes, so --nprobe reaches faiss
COUNTS = "from 1 to 2147483647"  # the declared range of every count flag
HUGE = "99999999999999999999"  # past every C integer
GALLERY, CHUNK = 600, 20  # 30 chunks: a build of a few seconds, interrupted after its first


def _unit(rng, *shape) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _gallery(folder: Path, images: int) -> dict[str, Path]:
    """A gallery as `index build --images` reads it: .npy files (NumPy's format, np.save) of
    global [G, 16] and crop [G, 3, 16] float16 embeddings, a [50, 16] query bank, 5 queries."""
    rng = np.random.default_rng(images)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"images": _unit(rng, images, 16).astype(np.float16),
              "crops": _unit(rng, images, 3, 16).astype(np.float16),
              "bank": _unit(rng, 50, 16), "queries": _unit(rng, 5, 16)}
    files = {}
    for name, array in arrays.items():
        files[name] = folder / f"{name}.npy"
        np.save(files[name], array)
    return files


def _build_argv(files: dict, out: Path, *extra: str) -> list[str]:
    return [*INDEX, "build", "--images", str(files["images"]), "--crops", str(files["crops"]),
            "--bank", str(files["bank"]), "--out", str(out), "--no-progress", *extra]


needs_faiss = pytest.mark.skipif(importlib.util.find_spec("faiss") is None,
                                 reason="the index needs faiss (the `ann` extra)")


@pytest.fixture(scope="module")
def gallery_files(tmp_path_factory) -> dict[str, Path]:
    return _gallery(tmp_path_factory.mktemp("index_gallery"), GALLERY)


@pytest.fixture(scope="module")
def built_index(gallery_files, tmp_path_factory) -> Path:
    """The gallery's IVF index, built once by the command, uninterrupted."""
    out = tmp_path_factory.mktemp("index_built") / "idx"
    proc = cli(*_build_argv(gallery_files, out, "--factory", IVF, "--chunk", str(CHUNK)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


HOSTILE_COUNTS = ("0", "-5", HUGE, "nan", "ten")


@needs_faiss
@pytest.mark.parametrize("value", HOSTILE_COUNTS)
@pytest.mark.parametrize("flag", ["--top", "--shortlist", "--nprobe", "--nprobe-global",
                                  "--batch"])
def test_index_search_numbers_outside_their_range_are_usage_errors(
        flag, value, built_index, gallery_files, sentinel, tmp_path):
    """`--nprobe 0` aborted in faiss, `--shortlist -5` was faiss's assertion traceback, `--top 0`
    exited 0 with empty hits, `--batch 0` said `range() arg 3 must not be zero`: each is now
    refused at parse time naming the flag and its range, and nothing is written."""
    out = tmp_path / "hits"
    proc = cli(*INDEX, "search", "--index", str(built_index), "--queries",
               str(gallery_files["queries"]), "--out", str(out), "--no-progress", flag, value)
    assert_refused(proc, f"argument {flag}:", repr(value), COUNTS)
    assert not out.exists()


@pytest.mark.parametrize("flag, value", [
    *[("--chunk", v) for v in HOSTILE_COUNTS], *[("--k", v) for v in HOSTILE_COUNTS],
    *[("--alpha", v) for v in ("-5", "7", "1e999", "nan", "ten")]])
def test_index_build_numbers_outside_their_range_are_refused_before_any_write(
        flag, value, sentinel, tmp_path):
    """`--chunk 0` said `range() arg 3 must not be zero` and left a meta.json, `--k -5` was a
    jax traceback, `--alpha nan` built an index no rerun could resume: refused at parse time,
    naming the flag and its range, with no index folder made."""
    files = _gallery(tmp_path / "gallery", 64)
    out = tmp_path / "idx"
    proc = cli(*_build_argv(files, out, flag, value))
    line = assert_refused(proc, f"argument {flag}:", repr(value))
    assert (COUNTS if flag != "--alpha" else "a number from 0 to 1") in line
    assert not out.exists()


@needs_faiss
@pytest.mark.parametrize("refused, corrected, words", [
    (("--chunk", "0"), ("--chunk", "16"), ("argument --chunk:", COUNTS)),
    (("--factory", "IVF{nlist},PQ3"), ("--factory", IVF),
     ("factory 'IVF{nlist},PQ3'", "FAISS cannot train", "at least as large"))])
def test_a_refused_index_build_leaves_nothing_that_blocks_the_corrected_command(
        refused, corrected, words, sentinel, tmp_path):
    """A refused `--chunk 0` used to leave a meta.json that refused the corrected command
    ("built with chunk 0, not 16"); a factory FAISS cannot train on 64 vectors (PQ's 256
    centres) was a C++ traceback, and its meta.json refused every other factory. Now the
    first is refused before anything is written, the second in one line, and the corrected
    command builds an index that searches."""
    files = _gallery(tmp_path / "gallery", 64)
    out = tmp_path / "idx"
    assert_refused(cli(*_build_argv(files, out, *refused)), *words)
    proc = cli(*_build_argv(files, out, *corrected))
    assert proc.returncode == 0 and "64 images x 4 views" in proc.stdout, proc.stderr[-3000:]
    assert_no_traceback(proc)
    from sclaro_jax.miner import index
    assert index.open_index(out).meta["factory"] == dict([corrected]).get("--factory", "auto")


@pytest.mark.parametrize("flag, value", [
    ("--nprobe", "0"), ("--nprobe", "-5"), ("--nprobe", HUGE), ("--nprobe-global", "0"),
    ("--nprobe-global", "nan"), ("--index-shortlist", "0"), ("--index-shortlist", HUGE),
    ("--index-shortlist", "ten")])
def test_rocs_index_numbers_outside_their_range_are_usage_errors(flag, value, sentinel,
                                                                  tmp_path):
    """`eval.rocs --index` takes the index search's numbers: out of range they reached faiss
    only after the whole split was embedded (`--nprobe 0`: faiss's error). Now a usage error
    at parse time, naming the flag, before any model or split is read."""
    proc = cli("-m", "sclaro_jax.eval.rocs", "--model", "planted-colours", "--split",
               str(tmp_path / "captions.json"), "--index", str(tmp_path / "idx"), "--out",
               str(tmp_path / "out"), flag, value)
    assert_refused(proc, f"argument {flag}:", repr(value), COUNTS)
    assert not (tmp_path / "out").exists()


def _stored(manifest: Path) -> bool:
    try:
        return bool(json.loads(manifest.read_text())["stored"])
    except (OSError, ValueError, KeyError):
        return False  # not written yet (each write is whole: temporary name, then renamed)


@needs_faiss
def test_ctrl_c_in_an_index_build_is_one_line_and_the_rerun_resumes_to_the_same_index(
        gallery_files, built_index, sentinel, tmp_path):
    """Ctrl-C in `index build` was an 18-line traceback. Now: SIGINT (as the terminal sends it)
    once the build has stored a chunk is one line saying what is kept and that the same
    command resumes, exit 130 (as `data_prep import`); the rerun says what it reuses and ends
    with the files of an uninterrupted build."""
    out = tmp_path / "idx"
    argv = _build_argv(gallery_files, out, "--factory", IVF, "--chunk", str(CHUNK))
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
    # a background child of a non-interactive shell inherits SIGINT ignored: the default back
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=environ, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not _stored(out / "manifest.json"):  # polls the build's own record
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no chunk stored in 240 s"
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    man = json.loads((out / "manifest.json").read_text())
    assert not man["complete"], "the build ended before the interrupt: make it longer"
    assert proc.returncode == 130, (proc.returncode, stderr[-3000:])
    assert "Traceback" not in stderr and not stdout.strip(), stderr[-3000:]
    chunks = GALLERY // CHUNK
    kept = (f"{len(man['stored'])} of {chunks} chunks stored, {len(man['added'])} added"
            f"{', trained' if man['trained'] else ''}")
    assert stderr.strip().splitlines() == [
        f"index build: interrupted; {kept} are kept in {out}: rerun the same command to "
        f"resume"], stderr
    assert 1 <= len(man["stored"])

    rerun = cli(*argv)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.stderr.strip().splitlines() == [
        f"index {out}: resuming the build, reusing what it kept ({kept})"], rerun.stderr
    for name in ("views.npy", "r_i.npy", "global.faiss", "crops.faiss", "meta.json"):
        assert (out / name).read_bytes() == (built_index / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in built_index.iterdir())


def _hiding(allowed: set[str], *argv: str) -> list[str]:
    """`python -c HOOK ...` argv: ARGV (a script or `-m MODULE`) run under tests/demo_extra.py's
    import hook, with every installed package outside the distributions `allowed` hidden (an
    import of one raises ModuleNotFoundError, as where it was never installed)."""
    from demo_extra import HOOK
    return ["-c", HOOK, json.dumps(sorted(allowed)), os.devnull, *argv]


def _installed_but(*names: str) -> set[str]:
    from importlib import metadata

    from packaging.utils import canonicalize_name
    return {canonicalize_name(d.metadata["Name"] or "") for d in metadata.distributions()} \
        - set(names)


@pytest.mark.parametrize("extras, argv, words", [
    # the detection demo, with what `pip install -e ".[demo]"` installs (no `eval` extra)
    ({"demo"}, ("launch/train.py", "--config", "configs/detection.py:demo", "--workdir",
                "{work}"), ("pycocotools", "`eval` extra", 'pip install -e ".[eval]"')),
    ({"demo"}, ("-m", "sclaro_jax.eval.detect", "--workdir", "{tmp}", "--config",
                "detection:demo"), ("pycocotools", "`eval` extra", 'pip install -e ".[eval]"')),
    # the evaluation suite's figures with the core dependencies only
    (set(), ("-m", "sclaro_jax.eval.suite", "--workdir", "{tmp}", "--out", "{work}"),
     ("matplotlib", "`demo` extra", 'pip install -e ".[demo]"', "--no-figures")),
    ({"demo"}, (*INDEX, "build", "--images", "{tmp}/g.npy", "--bank", "{tmp}/g.npy", "--out",
                "{work}"), ("faiss", "`ann` extra", 'pip install -e ".[ann]"')),
    # the `rocs` command where `datasets` (its writer) is all that is missing
    (None, ("-m", "data_prep", "rocs", "--images", "{tmp}", "--instances", "{tmp}/i.json",
            "--sam", "{tmp}/sam.pth", "--vlm-replies", "{tmp}/r.json", "--out", "{work}"),
     ("datasets", "`eval` extra", 'pip install -e ".[eval]"')),
], ids=["train-detection-demo", "eval-detect", "eval-suite", "index-build", "rocs"])
def test_a_missing_extra_is_one_line_naming_it_before_any_work(extras, argv, words, sentinel,
                                                               tmp_path):
    """The detection demo without the `eval` extra was a 20-line ImportError (now one line,
    before the workdir is made); the suite without matplotlib a traceback, even with
    --no-figures; `rocs` without `datasets` would run SAM and the VLM, then end in a traceback.
    Each names the package, the extra and the pip command, as the `ann` extra's line did."""
    from demo_extra import closure, pyproject

    allowed = _installed_but("datasets") if extras is None else closure(extras, pyproject())[0]
    tmp, work = tmp_path / "given", tmp_path / "work"
    tmp.mkdir()
    np.save(tmp / "g.npy", np.ones((4, 8), np.float32))
    for name in ("i.json", "r.json"):
        (tmp / name).write_text("{}")
    (tmp / "sam.pth").write_bytes(b"")
    before = tree_hashes(tmp)
    proc = cli(*_hiding(allowed, *(a.format(tmp=tmp, work=work) for a in argv)))
    assert_refused(proc, *words)
    assert not work.exists() and tree_hashes(tmp) == before

# (end of index commands)
