"""Rules of the layout: the layering goes one way, with no import cycle; sclaro_jax stays
torch-free; no library module grows past 450 lines; the command lines answer --help."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sclaro_jax", "data_prep")
MAX_LINES = 450

# (importer prefix, imported prefixes it must not reach). Prefixes match whole dotted parts.
FORBIDDEN = [
    ("sclaro_jax", ("torch", "torchvision", "transformers", "data_prep")),
    ("sclaro_jax.ops", ("sclaro_jax",)),
    ("sclaro_jax.losses", ("sclaro_jax.data", "sclaro_jax.models", "sclaro_jax.train",
                           "sclaro_jax.eval", "sclaro_jax.miner")),
    ("sclaro_jax.models", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.data.pipeline")),
    ("sclaro_jax.data", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.models")),
    ("sclaro_jax.checkpoint", ("sclaro_jax.train", "sclaro_jax.eval")),
    ("sclaro_jax.eval", ("sclaro_jax.train",)),
    ("sclaro_jax.detection", ("sclaro_jax.eval", "sclaro_jax.train")),
    # the run layer under every trainer: above only config, compile and ops
    ("sclaro_jax.run", ("sclaro_jax.train", "sclaro_jax.eval", "sclaro_jax.detection",
                        "sclaro_jax.models", "sclaro_jax.data", "sclaro_jax.losses",
                        "sclaro_jax.miner", "sclaro_jax.checkpoint")),
    ("sclaro_jax.detection.ops", ("sclaro_jax.models", "sclaro_jax.train", "sclaro_jax.data",
                                  "sclaro_jax.eval", "sclaro_jax.detection.model",
                                  "sclaro_jax.detection.data")),
    ("sclaro_jax.miner", ("sclaro_jax.models", "sclaro_jax.eval", "sclaro_jax.train")),
]


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


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


def test_sclaro_jax_never_imports_torch():
    code = ("import sys, sclaro_jax.models.clip, sclaro_jax.data.tokenizer\n"
            "import sclaro_jax.data.pipeline, sclaro_jax.train.trainer, sclaro_jax.losses\n"
            "import sclaro_jax.eval.rocs, sclaro_jax.eval.suite, sclaro_jax.miner\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'data_prep'))\n"
            "assert not bad, bad\n")
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr


def test_train_cli_help_and_missing_data_message(tmp_path):
    help_ = _run("launch/train.py", "--help")
    assert help_.returncode == 0 and "--workdir" in help_.stdout
    run = _run("launch/train.py", "--config", "configs/scenarioclip.py", "--workdir",
               str(tmp_path))
    assert run.returncode != 0 and "config.data.dir is empty" in run.stderr


def test_data_prep_help():
    result = _run("-m", "data_prep", "--help")
    assert result.returncode == 0 and "annotation pipeline" in result.stdout


@pytest.mark.parametrize("module", ["sclaro_jax.eval.rocs", "sclaro_jax.eval.suite"])
def test_eval_cli_help(module):
    result = _run("-m", module, "--help")
    assert result.returncode == 0 and "usage" in result.stdout.lower(), result.stderr[-2000:]


# (importer prefix, prefixes it must not reach through any chain of imports)
FORBIDDEN_TRANSITIVE = [
    ("sclaro_jax.eval", ("sclaro_jax.train",)),
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


def test_layering_holds_through_chains_of_imports():
    graph = import_graph()
    bad = []
    for name in sorted(graph):
        for importer, banned in FORBIDDEN_TRANSITIVE:
            if _under(name, importer):
                bad += [f"{name} reaches {t}" for t in sorted(reachable(graph, name))
                        if any(_under(t, b) for b in banned)]
    assert not bad, "layering broken through imports:\n" + "\n".join(bad)


def test_run_detection_and_eval_load_without_train():
    """Imported in a fresh interpreter, the run layer loads no trainer, model or evaluation code,
    and detection and eval load nothing of sclaro_jax.train."""
    code = ("import sys, pkgutil, importlib, sclaro_jax.run\n"
            "for m in pkgutil.iter_modules(sclaro_jax.run.__path__):\n"
            "    importlib.import_module('sclaro_jax.run.' + m.name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (['sclaro_jax', 'train'], "
            "['sclaro_jax', 'eval'], ['sclaro_jax', 'detection'], ['sclaro_jax', 'models']))\n"
            "assert not bad, bad\n"
            "import sclaro_jax.eval, sclaro_jax.detection\n"
            "for pkg in (sclaro_jax.eval, sclaro_jax.detection):\n"
            "    for m in pkgutil.iter_modules(pkg.__path__):\n"
            "        importlib.import_module(pkg.__name__ + '.' + m.name)\n"
            "bad = sorted(m for m in sys.modules if m.startswith('sclaro_jax.train'))\n"
            "assert not bad, bad\n"
            "print('OK')\n")
    result = _run("-c", code)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
