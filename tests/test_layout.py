"""Rules of the layout: the layering goes one way, with no import cycle; sclaro_jax stays
torch-free; no library module grows past 450 lines. (That every command line answers --help:
tests/test_docs.py, over the commands README.md and docs/ show.)"""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sclaro_jax", "data_prep")
MAX_LINES = 450

# (importer prefix, imported prefixes it must not reach). Prefixes match whole dotted parts.
FORBIDDEN = [
    ("sclaro_jax", ("torch", "torchvision", "transformers", "data_prep")),
    ("sclaro_jax.ops", ("sclaro_jax",)),
    ("sclaro_jax.losses", ("sclaro_jax.data", "sclaro_jax.models", "sclaro_jax.train",
                           "sclaro_jax.eval", "sclaro_jax.export", "sclaro_jax.miner")),
    ("sclaro_jax.models", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.export",
                           "sclaro_jax.data.pipeline")),
    ("sclaro_jax.data", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.export",
                         "sclaro_jax.models")),
    ("sclaro_jax.checkpoint", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.export")),
    ("sclaro_jax.eval", ("sclaro_jax.train",)),
    # eval's two families: the retrieval wing (MINER / ROCS) and the ScenarioCLIP protocols
    ("sclaro_jax.eval.retrieval", ("sclaro_jax.eval.protocols",)),
    ("sclaro_jax.eval.protocols", ("sclaro_jax.eval.retrieval",)),
    # exports and the dataset writer: above checkpoint, models and data, beside train and eval
    ("sclaro_jax.export", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.detection")),
    ("sclaro_jax.detection", ("sclaro_jax.eval", "sclaro_jax.train", "sclaro_jax.export")),
    # the run layer under every trainer: above only config, compile and ops
    ("sclaro_jax.run", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.export",
                        "sclaro_jax.detection", "sclaro_jax.models", "sclaro_jax.data",
                        "sclaro_jax.losses", "sclaro_jax.miner", "sclaro_jax.checkpoint")),
    ("sclaro_jax.detection.ops", ("sclaro_jax.models", "sclaro_jax.train", "sclaro_jax.data",
                                  "sclaro_jax.eval", "sclaro_jax.export",
                                  "sclaro_jax.detection.model", "sclaro_jax.detection.data")),
    ("sclaro_jax.miner", ("sclaro_jax.models", "sclaro_jax.eval", "sclaro_jax.export",
                          "sclaro_jax.train")),
]


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# Folders of .py files that are package data, not modules: the transformers remote code an
# export carries (it imports torch; sclaro_jax copies it as a file and never imports it).
DATA_FOLDERS = ("sclaro_jax/models/remote",)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if p.parent.relative_to(ROOT).as_posix() not in DATA_FOLDERS}


def test_data_folders_hold_no_importable_module():
    """A data folder is no package, and no module names it in an import or mentions the file
    other than as a path (export.hf.REMOTE_CODE)."""
    for folder in DATA_FOLDERS:
        assert not (ROOT / folder / "__init__.py").exists(), folder
        names = {p.stem for p in (ROOT / folder).glob("*.py")}
        assert names, folder
        dotted = folder.replace("/", ".")
        for name, targets in import_graph().items():
            bad = [t for t in targets if _under(t, dotted) or t.split(".")[-1] in names]
            assert not bad, f"{name} imports {bad}"


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module `path` imports, at any depth of the file (function-level imports included),
    resolved to a module of `known` where it is one (`from pkg import sub` -> pkg.sub), else kept
    as written (third-party)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: imports_of(path, name, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or a module importing itself
    (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        out.append(sorted(component))
                continue
            if child not in graph:
                continue
            if child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_cycle_finder_finds_a_function_level_cycle(tmp_path):
    # the checker itself: a cycle hidden in a function body is still an edge
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    graph = {"a": imports_of(tmp_path / "a.py", "a", {"a", "b"}),
             "b": imports_of(tmp_path / "b.py", "b", {"a", "b"})}
    assert graph == {"a": {"b"}, "b": {"a"}}
    assert cycles(graph) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles (function-level imports count): {found}"


def test_layering():
    bad = []
    for name, targets in sorted(import_graph().items()):
        for importer, banned in FORBIDDEN:
            if not _under(name, importer):
                continue
            bad += [f"{name} imports {t}" for t in sorted(targets)
                    if any(_under(t, b) for b in banned) and not _under(t, name)]
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_no_library_module_over_450_lines():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


MAX_FUNCTION_LINES = 80


def test_no_library_function_over_80_lines_but_those_docs_give_a_reason_for():
    """docs/design.md names each longer function, with its reason."""
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                short = f"{name.split('.', 1)[1]}.{node.name}"
                if n > MAX_FUNCTION_LINES and f"`{short}`" not in design:
                    long.append(f"{short} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines, no reason in docs: {long}"


def test_sclaro_jax_never_imports_torch():
    code = ("import sys, sclaro_jax.models.clip, sclaro_jax.data.tokenizer\n"
            "import sclaro_jax.data.pipeline, sclaro_jax.train.trainer, sclaro_jax.losses\n"
            "import sclaro_jax.eval.rocs, sclaro_jax.eval.suite, sclaro_jax.miner\n"
            "import sclaro_jax.export.hf, sclaro_jax.export.wds, sclaro_jax.train.export\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'data_prep'))\n"
            "assert not bad, bad\n")
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr


def test_the_torch_file_reader_loads_without_jax():
    """`sclaro_jax.models.torch_files` (and the `CheckpointError` it raises) import neither JAX
    nor flax: the package imports `clip` when it is first named, so a process that only
    reads or refuses a torch file does not pay for them."""
    code = "; ".join([
        "import json, sys", "from sclaro_jax import cli",  # what a refusal prints through
        "from sclaro_jax.models import torch_files",
        "from sclaro_jax.models.errors import CheckpointError",
        "assert torch_files.CheckpointError is CheckpointError",
        "heavy = [m for m in ('flax', 'jax', 'optax', 'torch') if m in sys.modules]",
        "import sclaro_jax.models as models",  # clip when named, not before
        "print(json.dumps([heavy, models.clip.__name__]))"])
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [[], "sclaro_jax.models.clip"]


def test_the_launchers_help_and_its_refusals_of_a_command_line_import_no_jax(tmp_path):
    """`launch/train.py --help` (which loads every recipe), an unknown config key, a bad flag
    and a busy workdir are answered before JAX, flax, optax or orbax is imported: the recipes
    read their defaults and ranges from `sclaro_jax.recipes`, and the run layer's package
    imports its modules when used."""
    busy = tmp_path / "busy"
    busy.mkdir()
    code = ("import contextlib, io, json, sys\n"
            "sys.path.insert(0, '.')\n"
            "import fcntl\n"
            f"held = open({str(busy / '.run.lock')!r}, 'a')\n"
            "fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another run's lock: this process's\n"
            "import launch.train as launcher\n"
            "codes = []\n"
            "for args in (['--help'], ['--config', 'scenarioclip:demo', '--workdir', 'w',\n"
            "              '--config.train.lrr=1'], ['--config', 'scenarioclip:demo',\n"
            "              '--workdir', 'w', '--no-such-flag'], ['--config', 'detection:demo',\n"
            f"              '--workdir', {str(busy)!r}]):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), \\\n"
            "            contextlib.redirect_stderr(io.StringIO()) as err:\n"
            "        try:\n"
            "            codes.append(launcher.main(args))\n"
            "        except SystemExit as e:\n"
            "            codes.append(e.code)\n"
            "    codes.append(err.getvalue().strip().splitlines()[-1:])\n"
            "heavy = sorted(m for m in ('jax', 'flax', 'optax', 'orbax') if m in sys.modules)\n"
            "print(json.dumps([codes, heavy]))\n")
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    codes, heavy = json.loads(result.stdout.strip().splitlines()[-1])
    assert codes[0::2] == [0, 2, 2, 2], codes
    assert "unknown config key 'train.lrr'" in codes[3][0], codes
    assert "--no-such-flag" in codes[5][0], codes
    assert "is in use by another run" in codes[7][0], codes
    assert heavy == [], heavy


# Writes that bypass sclaro_jax.files (the one place that writes files without following links:
# `write_replacing` / `replacing` for whole files, `open_new` for streams). LIBRARY_DIRS are
# walked; files.py itself is the helper. Each allowed site: (module path, enclosing function,
# call) -> its reason.
LIBRARY_DIRS = ("sclaro_jax", "data_prep", "launch")
WRITE_HELPER = "sclaro_jax/files.py"
ALLOWED_WRITES = {
    ("data_prep/shards.py", "_open_shard", "ArrayRecordWriter"):
        "a shard in the writer's own `tempfile.mkdtemp` folder (0700, made by this process)",
    ("data_prep/rocs/caption.py", "write_rocs", "save_to_disk"):
        "the datasets library writes rocs.partial, removed first, in the command's own --out",
}
_MODE = re.compile(r"[rwaxbt+]{1,4}(:\w*)?")
_PATH_NAME = re.compile(r"path|file$|dir|out|dest|target|name", re.IGNORECASE)
_OPEN_FLAGS = {"O_CREAT", "O_WRONLY", "O_RDWR", "O_APPEND", "O_TRUNC"}
_MODULES = {"", "io", "os", "gzip", "bz2", "lzma", "tarfile", "codecs", "np", "numpy"}
# (owner, call) -> the argument that is the file written to (position, keyword): never a path
_TO_FILE = {("np", "save"): (0, "file"), ("numpy", "save"): (0, "file"),
            ("np", "savez"): (0, "file"), ("np", "savez_compressed"): (0, "file"),
            ("json", "dump"): (1, "fp"), ("pickle", "dump"): (1, "file"),
            ("torch", "save"): (1, "f"), ("*", "savefig"): (0, "fname"),
            ("*", "tofile"): (0, "fid")}
# writers that open the path they are given themselves: only the name `replacing` yields
_BY_PATH = {("*", "ArrayRecordWriter"), ("*", "save_file"), ("*", "save_to_disk"),
            ("shutil", "copyfile"), ("shutil", "copy"), ("shutil", "copy2"),
            ("shutil", "copytree"), ("shutil", "move")}


def _call_name(func) -> tuple[str, str]:
    """(owner, name) of a call's function: ('np', 'save') for np.save and np.lib.format.save,
    ('', 'open') for open, ('?', 'open') for Path(p).open."""
    if isinstance(func, ast.Attribute):
        owner = func.value
        while isinstance(owner, ast.Attribute):
            owner = owner.value
        return (owner.id if isinstance(owner, ast.Name) else "?"), func.attr
    return "", getattr(func, "id", "")


def _arg(call: ast.Call, position: int, keyword: str):
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _is_path(node) -> bool:
    """Whether `node` reads as a path (not a file object): a string, an f-string, a `/` or `+`
    expression, a call (os.path.join, Path(...)), or a name like path / out_dir / target."""
    if isinstance(node, (ast.JoinedStr, ast.BinOp, ast.Call)):
        return True
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return bool(_PATH_NAME.search(name))


def _writes(call: ast.Call, owner: str) -> bool:
    """Whether an open-like call opens for writing: a mode with w, a, x or + (for open(),
    os.fdopen(), tarfile.open(), open_memmap(): any mode that is not a constant counts);
    tarfile over a file opened elsewhere (`fileobj=`, from files.open_new) does not."""
    if any(kw.arg == "fileobj" for kw in call.keywords):
        return False
    module = owner in _MODULES  # open(file, mode, ...); else Path(p).open(mode, ...)
    mode = _arg(call, 1 if module else 0, "mode")
    if mode is None:
        return False
    texts = [n.value for n in ast.walk(mode) if isinstance(n, ast.Constant)
             and isinstance(n.value, str)]
    if not texts:
        return module
    return any(_MODE.fullmatch(t) and set(t.split(":")[0]) & set("wax+") for t in texts)


def _unsafe_call(call: ast.Call, replaced: set[str]) -> str:
    owner, name = _call_name(call.func)
    if (owner, name) == ("os", "open"):
        flags = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
                 for n in ast.walk(_arg(call, 1, "flags") or ast.Constant(0))}
        return "os.open() that creates or writes" if flags & _OPEN_FLAGS else ""
    if name in ("open", "fdopen", "open_memmap"):
        target = call.args[0] if call.args else None
        if isinstance(target, ast.Name) and target.id in replaced:
            return ""
        return f"{name}() for writing" if _writes(call, owner) else ""
    if name in ("write_text", "write_bytes") and owner:
        return f"Path.{name}()"
    where = _TO_FILE.get((owner, name)) or _TO_FILE.get(("*", name))
    if where and (target := _arg(call, *where)) is not None and _is_path(target):
        return f"{name}() to a path"
    if (owner, name) in _BY_PATH or ("*", name) in _BY_PATH:
        target = call.args[0] if call.args else None
        if not (isinstance(target, ast.Name) and target.id in replaced):
            return f"{name}() writes a path itself (give it the name `replacing` yields)"
    return ""


def unsafe_writes(source: str, path: str = "<planted>") -> list[str]:
    """'line N in FUNCTION: WHAT' for each write in `source` that bypasses sclaro_jax.files
    (ALLOWED_WRITES aside): see `_unsafe_call`."""
    found = []

    def visit(node, function: str, replaced: set[str]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.With):
            replaced = replaced | {
                item.optional_vars.id for item in node.items
                if isinstance(item.context_expr, ast.Call)
                and _call_name(item.context_expr.func)[1] == "replacing"
                and isinstance(item.optional_vars, ast.Name)}
        if isinstance(node, ast.Call):
            what = _unsafe_call(node, replaced)
            if what and (path, function, _call_name(node.func)[1]) not in ALLOWED_WRITES:
                found.append(f"line {node.lineno} in {function}: {what}")
        for child in ast.iter_child_nodes(node):
            visit(child, function, replaced)

    visit(ast.parse(source), "<module>", set())
    return found


def test_library_writes_go_through_the_files_helper():
    bad = {}
    for folder in LIBRARY_DIRS:
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel != WRITE_HELPER and p.parent.relative_to(ROOT).as_posix() not in DATA_FOLDERS:
                if found := unsafe_writes(p.read_text(encoding="utf-8"), rel):
                    bad[rel] = found
    assert not bad, f"writes that bypass sclaro_jax.files: {bad}"
    for path, function, call in ALLOWED_WRITES:  # no reason kept for a site that is gone
        source = (ROOT / path).read_text(encoding="utf-8")
        assert f"def {function}(" in source and f"{call}(" in source, (path, function, call)


def test_write_checker_finds_planted_writes():
    planted = ('import json, os, shutil, tarfile\n'
               'import numpy as np\n'
               'from sclaro_jax.files import replacing, write_replacing\n'
               'def bad(out, path, arr, text):\n'
               '    open(path, "w").write(text)\n'
               '    with open(os.path.join(out, "log"), mode="a") as f:\n'
               '        json.dump({}, f)\n'
               '    (out / "x.txt").write_text(text)\n'
               '    np.save(out / "a.npy", arr)\n'
               '    json.dump({}, open(path, "w" if text else "wb"))\n'
               '    fd = os.open(path, os.O_WRONLY | os.O_CREAT)\n'
               '    tarfile.open(path, "w")\n'
               '    shutil.copyfile(path, out)\n'
               '    np.lib.format.open_memmap(path, mode="w+", shape=(2,))\n'
               '    Path(path).open("a")\n'
               'def good(out, path, arr, fd):\n'
               '    with open(path, encoding="utf-8") as f, open(path, "rb") as g:\n'
               '        json.dump(json.load(f), fd)\n'
               '    write_replacing(path, lambda f: np.save(f, arr))\n'
               '    with replacing(path) as tmp:\n'
               '        np.lib.format.open_memmap(tmp, mode="w+", shape=(2,))\n'
               '    tarfile.open(fileobj=fd, mode="w")\n'
               '    os.open(path, os.O_RDONLY)\n')
    assert unsafe_writes(planted) == [
        "line 5 in bad: open() for writing", "line 6 in bad: open() for writing",
        "line 8 in bad: Path.write_text()", "line 9 in bad: save() to a path",
        "line 10 in bad: dump() to a path", "line 10 in bad: open() for writing",
        "line 11 in bad: os.open() that creates or writes",
        "line 12 in bad: open() for writing",
        "line 13 in bad: copyfile() writes a path itself (give it the name `replacing` yields)",
        "line 14 in bad: open_memmap() for writing",
        "line 15 in bad: open() for writing"]


def test_train_cli_missing_data_message(tmp_path):
    run = _run("launch/train.py", "--config", "configs/scenarioclip.py", "--workdir",
               str(tmp_path))
    assert run.returncode != 0 and "config.data.dir is empty" in run.stderr


# data_prep's wings: each imports only itself and the shared modules at the top of data_prep,
# and no shared module reaches into a wing, so no wing reaches another, not even through a
# shared module. data_prep.__main__ assembles the wings' command lines and is exempt.
WINGS = ("data_prep.annotate", "data_prep.curate", "data_prep.rocs", "data_prep.scene_graphs")
WING_EXEMPT = ("data_prep.__main__",)


def package_graph(root: Path, package: str) -> dict[str, set[str]]:
    """The import graph (`imports_of`) of the package folder `root/package`."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return {name: imports_of(path, name, set(modules)) for name, path in modules.items()}


def wing_crossings(graph: dict[str, set[str]], wings=WINGS, exempt=WING_EXEMPT) -> list[str]:
    """Every import chain, direct or through other modules of `graph`, from a module of the
    wings' package to a module of a wing it is not in (a shared module is in none)."""
    package = wings[0].split(".")[0]

    def wing(name):
        return next((w for w in wings if _under(name, w)), None)

    out = []
    for start in sorted(graph):
        if start in exempt or not _under(start, package):
            continue
        parent, todo = {start: None}, [start]  # breadth-first: the shortest chain to each module
        while todo:
            node = todo.pop(0)
            for child in sorted(graph[node]):
                if child in graph and child not in parent:
                    parent[child] = node
                    todo.append(child)
        for reached in sorted(parent):
            if wing(reached) not in (None, wing(start)) or (wing(start) is None and wing(reached)):
                chain = [reached]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                out.append(" -> ".join(reversed(chain)))
    return out


def test_wing_checker_finds_a_crossing_through_a_shared_module(tmp_path):
    files = {"data_prep/__init__.py": "", "data_prep/shards.py": "import json\n",
             "data_prep/__main__.py": "from data_prep.annotate import run\n"
                                      "from data_prep.curate import run\n",
             "data_prep/annotate/__init__.py": "", "data_prep/curate/__init__.py": "",
             "data_prep/rocs/__init__.py": "",
             "data_prep/annotate/run.py": "from data_prep import shards\nfrom . import keys\n",
             "data_prep/annotate/keys.py": "", "data_prep/curate/run.py": "import data_prep.shards\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert wing_crossings(package_graph(tmp_path, "data_prep")) == []
    # planted: a shared module that, inside a function, reaches into the curate wing
    (tmp_path / "data_prep/shards.py").write_text("def f():\n    from data_prep.curate import run\n")
    assert wing_crossings(package_graph(tmp_path, "data_prep")) == [
        "data_prep.annotate.run -> data_prep.shards -> data_prep.curate.run",
        "data_prep.shards -> data_prep.curate.run"]
    # planted: one wing importing another directly
    (tmp_path / "data_prep/shards.py").write_text("")
    (tmp_path / "data_prep/rocs/__init__.py").write_text("from data_prep.annotate.keys import x\n")
    assert wing_crossings(package_graph(tmp_path, "data_prep")) == [
        "data_prep.rocs -> data_prep.annotate.keys"]


def test_data_prep_wings_import_only_shared_modules():
    graph = package_graph(ROOT, "data_prep")
    assert all(w in graph for w in WINGS)
    found = wing_crossings(graph)
    assert not found, "data_prep wings reach each other:\n" + "\n".join(found)


# (importer prefix, prefixes it must not reach through any chain of imports)
FORBIDDEN_TRANSITIVE = [
    ("sclaro_jax.eval", ("sclaro_jax.train",)),
    ("sclaro_jax.eval.retrieval", ("sclaro_jax.eval.protocols",)),
    ("sclaro_jax.eval.protocols", ("sclaro_jax.eval.retrieval",)),
    ("sclaro_jax.export", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.detection")),
    ("sclaro_jax.detection", ("sclaro_jax.train", "sclaro_jax.eval")),
    ("sclaro_jax.run", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.detection",
                        "sclaro_jax.models")),
]


def reachable(graph: dict[str, set[str]], name: str) -> set[str]:
    """The modules of `graph` that `name` imports directly or through other modules."""
    seen, todo = set(), [name]
    while todo:
        for child in graph.get(todo.pop(), ()):
            if child in graph and child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def transitive_violations(graph: dict[str, set[str]], rules=FORBIDDEN_TRANSITIVE) -> list[str]:
    """'A reaches B' for every module A under a rule's importer that reaches, through any
    chain of imports, a module B under one of its banned prefixes."""
    bad = []
    for name in sorted(graph):
        for importer, banned in rules:
            if _under(name, importer):
                bad += [f"{name} reaches {t}" for t in sorted(reachable(graph, name))
                        if any(_under(t, b) for b in banned)]
    return bad


def test_layering_holds_through_chains_of_imports():
    bad = transitive_violations(import_graph())
    assert not bad, "layering broken through imports:\n" + "\n".join(bad)


def test_transitive_checker_finds_a_planted_chain():
    """eval -> detection -> train, each import allowed on its own, is caught as eval reaching
    train; so is run reaching models through a module outside the rules."""
    graph = {"sclaro_jax.eval.detect": {"sclaro_jax.detection.backbones"},
             "sclaro_jax.detection.backbones": {"sclaro_jax.ops"},
             "sclaro_jax.ops": set(), "sclaro_jax.train.core": set(),
             "sclaro_jax.models.clip": set(), "sclaro_jax.run.loop": {"sclaro_jax.config"},
             "sclaro_jax.config": set()}
    assert transitive_violations(graph) == []
    graph["sclaro_jax.detection.backbones"].add("sclaro_jax.train.core")
    graph["sclaro_jax.config"].add("sclaro_jax.models.clip")
    assert transitive_violations(graph) == [
        "sclaro_jax.detection.backbones reaches sclaro_jax.train.core",
        "sclaro_jax.eval.detect reaches sclaro_jax.train.core",
        "sclaro_jax.run.loop reaches sclaro_jax.models.clip"]


def test_transitive_checker_finds_eval_families_reaching_each_other():
    """retrieval -> encoders -> protocols: the shared module at eval's top does not carry one
    family into the other."""
    graph = {"sclaro_jax.eval.retrieval.gallery": {"sclaro_jax.eval.encoders"},
             "sclaro_jax.eval.encoders": {"sclaro_jax.ops"}, "sclaro_jax.ops": set(),
             "sclaro_jax.eval.protocols.probe": {"sclaro_jax.eval.encoders"}}
    assert transitive_violations(graph) == []
    graph["sclaro_jax.eval.encoders"].add("sclaro_jax.eval.protocols.probe")
    assert transitive_violations(graph) == [
        "sclaro_jax.eval.retrieval.gallery reaches sclaro_jax.eval.protocols.probe"]


def test_run_detection_and_eval_load_without_train():
    """Imported in a fresh interpreter, the run layer loads no trainer, model or evaluation code,
    and detection, eval and export load nothing of sclaro_jax.train."""
    code = ("import sys, pkgutil, importlib, sclaro_jax.run\n"
            "for m in pkgutil.iter_modules(sclaro_jax.run.__path__):\n"
            "    importlib.import_module('sclaro_jax.run.' + m.name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (['sclaro_jax', 'train'], "
            "['sclaro_jax', 'eval'], ['sclaro_jax', 'detection'], ['sclaro_jax', 'models']))\n"
            "assert not bad, bad\n"
            "import sclaro_jax.eval, sclaro_jax.detection, sclaro_jax.export\n"
            "for pkg in (sclaro_jax.eval, sclaro_jax.detection, sclaro_jax.export):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "bad = sorted(m for m in sys.modules if m.startswith('sclaro_jax.train'))\n"
            "assert not bad, bad\n"
            "print('OK')\n")
    result = _run("-c", code)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------- tasks and recipes


def task_problems(tasks: dict[str, object]) -> list[str]:
    """'NAME lacks METHOD' for every registered task (name -> its TASK object) without one of
    `run.task.METHODS` as a callable, and 'NAME is named X' where its own name differs."""
    from sclaro_jax.run.task import METHODS

    bad = []
    for name, task in tasks.items():
        bad += [f"{name} lacks {m}" for m in METHODS if not callable(getattr(task, m, None))]
        if getattr(task, "name", None) != name:
            bad.append(f"{name} is named {getattr(task, 'name', None)!r}")
    return bad


def test_every_registered_task_has_check_fit_and_evaluate():
    from sclaro_jax.run import task

    assert set(task.TASKS) == {"scenarioclip", "detection"}
    assert task_problems({name: task.get(name) for name in task.TASKS}) == []


def test_task_checker_finds_a_planted_task_without_evaluate():
    class Half:
        name = "half"

        def check(self, config): ...

        def demo_view_size(self, config): ...

        def fit(self, config, workdir): ...

    assert task_problems({"half": Half(), "other": Half()}) == [
        "half lacks evaluate", "other lacks evaluate", "other is named 'half'"]


# calls that take a path (a config read by path inside the library is a checkout's file)
PATH_CALLS = {"open", "Path", "join", "exists", "isfile", "load_config", "spec_from_file_location"}


def config_path_reads(source: str) -> list[str]:
    """Where `source` reaches the checkout's configs/ by path: the path component "configs" as
    a string anywhere in code, or a "configs/..." string handed to a call that takes a path.
    Docstrings and messages that name `configs/x.py` for a user are neither."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value == "configs":
            found.append(f"line {node.lineno}: the path component 'configs'")
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
                node.func, "id", "")
            found += [f"line {a.lineno}: {func}({a.value!r})" for a in node.args
                      if func in PATH_CALLS and isinstance(a, ast.Constant)
                      and isinstance(a.value, str) and a.value.startswith("configs/")]
    return sorted(found, key=lambda line: int(line.split(":")[0].split()[1]))


def test_no_library_module_reads_the_checkouts_configs_by_path():
    bad = {name: found for name, path in _modules().items()
           if (found := config_path_reads(path.read_text(encoding="utf-8")))}
    assert not bad, bad


def test_config_path_checker_finds_planted_reads():
    planted = ('from pathlib import Path\n'
               'CONFIG = Path(__file__).resolve().parents[2] / "configs" / "detection.py"\n'
               'def f(load_config):\n'
               '    """Loads configs/scenarioclip.py:demo."""\n'
               '    raise ValueError("pass --config configs/detection.py")\n'
               '    return load_config("configs/scenarioclip.py:demo")\n')
    assert config_path_reads(planted) == [
        "line 2: the path component 'configs'",
        "line 6: load_config('configs/scenarioclip.py:demo')"]


# what a recipe may import: ml_collections, the standard library, other recipes and the public
# config types (the ranges of its keys: sclaro_jax.config.Range)
RECIPE_IMPORTS = ("sclaro_jax.configs", "sclaro_jax.config", "sclaro_jax.recipes")


def test_recipes_import_only_public_config_types_and_no_library_module_imports_them():
    graph = import_graph()
    for name, targets in graph.items():
        ours = {t for t in targets if _under(t, "sclaro_jax")}
        if _under(name, "sclaro_jax.configs"):
            assert all(any(_under(t, ok) for ok in RECIPE_IMPORTS) for t in ours), (name, ours)
        else:  # recipes are loaded by name (sclaro_jax.config.load_config), never imported
            assert not {t for t in ours if _under(t, "sclaro_jax.configs")}, name


# ---------------------------------------------------------------- one name for each thing


def reexport_problems(source: str, is_package: bool) -> list[str]:
    """Why `source` is a second name for code that lives elsewhere: a module (not a package's
    `__init__`) whose body is only imports, `__all__` and names bound to imported names; an
    import hook (`sys.meta_path`); a module aliased in `sys.modules` (set to None, it is
    hidden for a moment, not aliased)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "meta_path":
            found.append(f"line {node.lineno}: installs an import hook (sys.meta_path)")
        if isinstance(node, ast.Assign) and not (  # None only hides a module
                isinstance(node.value, ast.Constant) and node.value.value is None) and any(
                isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute)
                and t.value.attr == "modules" for t in node.targets):
            found.append(f"line {node.lineno}: aliases a module in sys.modules")
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value,
                                                                              ast.Constant))]
    imported = {a.asname or a.name.split(".")[0] for n in body
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}

    def plain(n):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            return True
        if isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) for t in n.targets):
            names = [t.id for t in n.targets]
            return names == ["__all__"] or (isinstance(n.value, (ast.Name, ast.Attribute))
                                            and ast.unparse(n.value).split(".")[0] in imported)
        return False

    if not is_package and body and all(plain(n) for n in body):
        found.append("re-exports only: imports and names bound to imported names")
    return sorted(found, key=lambda f: int(f.split(":")[0].split()[1]) if f[:5] == "line " else 0)


def test_no_reexport_module_or_import_hook_is_left():
    bad = {name: found for name, path in _modules().items()
           if (found := reexport_problems(path.read_text(encoding="utf-8"),
                                          path.name == "__init__.py"))}
    assert not bad, bad


def test_reexport_checker_finds_planted_shims():
    shim = ('"""Old name."""\nfrom sclaro_jax.run.folder import *  # noqa\n'
            'from sclaro_jax.run import folder\n_event_records = folder._event_records\n'
            '__all__ = ["folder"]\n')
    assert reexport_problems(shim, is_package=False) == [
        "re-exports only: imports and names bound to imported names"]
    assert reexport_problems(shim, is_package=True) == []  # a package's API is its __init__
    hook = ("import sys\n\ndef install():\n    sys.meta_path.insert(0, object())\n"
            "    sys.modules['data_prep.curate'] = sys.modules['data_prep.curate_old']\n"
            "    sys.modules['torch'] = None\n")
    assert reexport_problems(hook, is_package=True) == [
        "line 4: installs an import hook (sys.meta_path)",
        "line 5: aliases a module in sys.modules"]
    real = "from sclaro_jax import ops\n\ndef f(x):\n    return ops.l2_normalize(x)\n"
    assert reexport_problems(real, is_package=False) == []


# ---------------------------------------------------------------- no code from data files

CODE_FROM_DATA_FOLDERS = ("sclaro_jax", "data_prep", "launch")
# The one pickle reader allowed, with its reason: the restricted unpickler of torch zip archives,
# whose find_class rebuilds containers, numbers and tensors and refuses every other class.
UNPICKLER_ALLOWED = {"sclaro_jax/models/torch_files.py": "restricted torch-file unpickler"}
PICKLE_MODULES = ("pickle", "_pickle", "cPickle")
# calls that run code from the bytes they read, whatever their arguments
CODE_LOADING_CALLS = {f"{m}.{f}" for m in PICKLE_MODULES for f in ("load", "loads")} | {
    "joblib.load", "cloudpickle.load", "cloudpickle.loads", "marshal.load", "marshal.loads",
    "pandas.read_pickle", "shelve.open", "yaml.unsafe_load", "yaml.unsafe_load_all",
    "eval", "exec", "builtins.eval", "builtins.exec"}
SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader"}


def _import_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it stands for (`import numpy as np`: np -> numpy;
    `from pickle import loads as l`: l -> pickle.loads)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                    a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _dotted(node, aliases: dict[str, str]) -> str:
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _keyword_is(call: ast.Call, name: str, value) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value
               for k in call.keywords)


def _call_problem(call: ast.Call, name: str, aliases: dict[str, str]) -> str | None:
    if name in CODE_LOADING_CALLS:
        return f"{name}() runs code from what it reads"
    if name == "torch.load" and not _keyword_is(call, "weights_only", True):
        return "torch.load() without weights_only=True unpickles any class"
    if name in ("yaml.load", "yaml.load_all"):
        loader = next((k.value for k in call.keywords if k.arg == "Loader"),
                      call.args[1] if len(call.args) > 1 else None)
        if _dotted(loader, aliases) not in SAFE_YAML_LOADERS:
            return f"{name}() without a safe Loader builds any Python object"
    if any(k.arg == "allow_pickle" and not _keyword_is(call, "allow_pickle", False)
           for k in call.keywords):
        return f"{name or 'a call'}(allow_pickle=...) other than False unpickles"
    if _keyword_is(call, "trust_remote_code", True):
        return f"{name or 'a call'}(trust_remote_code=True) runs a model folder's Python"
    return None


def code_from_data(source: str, path: str = "") -> list[str]:
    """Where `source` (the file `path`, relative to the repository) would run code that a data
    file brings: pickle loads (and joblib's, cloudpickle's, marshal's, pandas' read_pickle,
    shelve), a pickle.Unpickler outside UNPICKLER_ALLOWED, torch.load without
    weights_only=True, allow_pickle other than False, yaml.load without a safe Loader,
    eval / exec, dill, and trust_remote_code=True written as a literal (a flag's value is the
    user's choice)."""
    tree = ast.parse(source)
    aliases = _import_aliases(tree)
    found = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', 0)}: "
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""]
            if any(m.split(".")[0] == "dill" for m in modules):
                found.append(where + "imports dill (pickles code)")
        elif isinstance(node, ast.Call):
            problem = _call_problem(node, _dotted(node.func, aliases), aliases)
            if problem:
                found.append(where + problem)
        elif isinstance(node, ast.Dict):
            if any(isinstance(k, ast.Constant) and k.value == "trust_remote_code"
                   and isinstance(v, ast.Constant) and v.value is True
                   for k, v in zip(node.keys, node.values)):
                found.append(where + "{'trust_remote_code': True} runs a model folder's Python")
        if (isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load)
                and _dotted(node, aliases) in {f"{m}.Unpickler" for m in PICKLE_MODULES}
                and path not in UNPICKLER_ALLOWED):
            found.append(where + "uses pickle.Unpickler outside the restricted torch reader")
    return sorted(set(found), key=lambda f: (int(f.split(":")[0].split()[1]), f))


def test_no_library_code_runs_code_from_data_files():
    files = [p for folder in CODE_FROM_DATA_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 100
    bad = {rel: found for p in files
           if (found := code_from_data(p.read_text(encoding="utf-8"),
                                       rel := p.relative_to(ROOT).as_posix()))}
    assert not bad, bad
    for rel in UNPICKLER_ALLOWED:  # the allow-list names a file that still needs it
        assert code_from_data((ROOT / rel).read_text(encoding="utf-8"), "elsewhere.py"), rel


def test_code_from_data_checker_finds_each_planted_kind():
    planted = (
        "import pickle, joblib, marshal, yaml, torch\n"                            # 1
        "import numpy as np\n"                                                     # 2
        "import cloudpickle as cp\n"                                               # 3
        "from pickle import loads as undo\n"                                       # 4
        "import dill\n"                                                            # 5
        "from transformers import AutoModel\n"                                     # 6
        "def f(path, text, flag):\n"                                               # 7
        "    a = pickle.load(open(path, 'rb'))\n"                                  # 8
        "    b = undo(text)\n"                                                     # 9
        "    class Mine(pickle.Unpickler):\n"                                      # 10
        "        pass\n"                                                           # 11
        "    c = torch.load(path)\n"                                               # 12
        "    d = torch.load(path, weights_only=False)\n"                           # 13
        "    e = np.load(path, allow_pickle=True)\n"                               # 14
        "    g = yaml.load(text)\n"                                                # 15
        "    h = yaml.load(text, Loader=yaml.FullLoader)\n"                        # 16
        "    i = eval(text) + exec(text)\n"                                        # 17
        "    j = AutoModel.from_pretrained(path, trust_remote_code=True)\n"        # 18
        "    k = AutoModel.from_pretrained(path, **{'trust_remote_code': True})\n" # 19
        "    m = joblib.load(path), cp.loads(text), marshal.loads(text)\n"         # 20
        "    return dill.loads(text)\n"                                            # 21
        "def fine(path, text, flag, model):\n"                                     # 22
        "    model.eval()\n"                                                       # 23
        "    pickle.dumps(text)\n"                                                 # 24
        "    torch.load(path, map_location='cpu', weights_only=True)\n"            # 25
        "    np.load(path, allow_pickle=False)\n"                                  # 26
        "    np.load(path)\n"                                                      # 27
        "    yaml.safe_load(text)\n"                                               # 28
        "    yaml.load(text, Loader=yaml.SafeLoader)\n"                            # 29
        "    AutoModel.from_pretrained(path, trust_remote_code=flag)\n"            # 30
        "    AutoModel.from_pretrained(path, trust_remote_code=False)\n")          # 31
    found = code_from_data(planted, "sclaro_jax/planted.py")
    lines = [int(f.split(":")[0].split()[1]) for f in found]
    assert lines == [5, 8, 9, 10, 12, 13, 14, 15, 16, 17, 17, 18, 19, 20, 20, 20], found
    assert sum("eval()" in f or "exec()" in f for f in found) == 2
    # the restricted torch reader may subclass pickle.Unpickler, and only it
    unpickler = "import pickle\nclass R(pickle.Unpickler):\n    pass\n"
    assert code_from_data(unpickler, "sclaro_jax/models/torch_files.py") == []
    assert code_from_data(unpickler, "sclaro_jax/models/other.py") == [
        "line 2: uses pickle.Unpickler outside the restricted torch reader"]
