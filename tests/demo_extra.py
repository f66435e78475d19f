"""What a fresh `pip install -e ".[demo]"` venv would hold, and a child process that sees only
that: shared by tests/test_install.py (the demo run) and tests/test_notebook.py (the notebook);
tests/test_clip_benchmark.py runs the CLIP_benchmark loader the same way in a PyTorch client's
venv (the packages docs/exports.md installs, no project dependency).

`closure(extras, project, also)` walks the requirements of the core dependencies, the extras
and `also` (e.g. the notebook runner's ipykernel) through the installed distributions'
metadata. `HOOK` is the source of a child's `python -c` that hides every installed top-level
module whose distributions all lie outside a given set, then runs a script (`PATH args...`)
or a module (`-m NAME args...`) as `__main__`: an import of a hidden package raises
ModuleNotFoundError (and `importlib.util.find_spec` finds nothing), so optional imports
(tensorboardX's `import torch`, scikit-learn's pandas, torch's probes) take their fallback and
required ones fail the run.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Iterable

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "sclaro-jax"
# Never in the first hour's install: PyTorch and what only the annotation side needs.
HEAVY = {"torch", "torchvision", "transformers", "segment-anything", "triton", "nltk",
         "datasets", "sentencepiece"}


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def closure(extras: set[str], project: dict, also: Iterable[str] = ()
            ) -> tuple[set[str], set[str]]:
    """(canonical names of the distributions that `pip install .[extras] *also` brings, walked
    through the installed distributions' own metadata; requirements whose distribution is not
    installed here). sclaro-jax's self-references (`sclaro-jax[data,eval]`) expand from
    pyproject."""
    env = default_environment()
    todo = [Requirement(r) for r in [*project["dependencies"], *also]]
    seen_extras: set[str] = set()

    def add_own(names):
        for extra in sorted(set(names) - seen_extras):
            if extra not in project.get("optional-dependencies", {}):
                raise AssertionError(f"pyproject.toml: no extra {extra!r} in "
                                     "[project.optional-dependencies]")
            seen_extras.add(extra)
            todo.extend(Requirement(r) for r in project["optional-dependencies"][extra])

    add_own(extras)
    found, missing, done = set(), set(), set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == PROJECT:
            add_own(req.extras)
            continue
        key = (name, tuple(sorted(req.extras)))
        if key in done:
            continue
        done.add(key)
        found.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        for text in requires:
            sub = Requirement(text)
            wanted = [""] + sorted(req.extras)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e})
                                         for e in wanted):
                todo.append(sub)
    return found, missing


# The child: `python -c HOOK ALLOWED_JSON REPORT (SCRIPT | -m MODULE) ARGS...`. Hides every
# installed top-level module whose distributions all lie outside ALLOWED, runs the script or
# module as __main__, and at exit writes to REPORT what it hid and what was imported.
HOOK = r"""
import atexit, json, runpy, sys
from importlib import metadata
from packaging.utils import canonicalize_name
allowed, report, argv = set(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3:]
local = {"sclaro_jax", "data_prep", "configs", "launch"}
tops = {top: {canonicalize_name(d) for d in dists}
        for top, dists in metadata.packages_distributions().items()}
hidden_tops = {t for t, d in tops.items() if not d & allowed} - local - set(sys.stdlib_module_names)
visible = allowed | {d for t in local for d in tops.get(t, ())}  # distributions' metadata
hidden, before = [], set(sys.modules)  # before: the interpreter's start-up (site, .pth files)
class Hide:  # start-up's finders, blind to hidden modules and metadata, as if not installed
    def __init__(self, finders):
        self.finders = finders
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in hidden_tops:
            hidden.append(name)
            return None  # importlib.util.find_spec -> None; import -> ModuleNotFoundError
        for finder in self.finders:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                return spec
        return None
    def find_distributions(self, *args, **kwargs):  # importlib.metadata: hidden ones absent
        for finder in self.finders:
            find = getattr(finder, "find_distributions", None)
            for dist in find(*args, **kwargs) if find else ():
                if canonicalize_name(dist.metadata["Name"] or "") in visible:
                    yield dist
    def invalidate_caches(self):
        for finder in self.finders:
            getattr(finder, "invalidate_caches", lambda: None)()
sys.meta_path[:] = [Hide(list(sys.meta_path))]
for name in ("torch", "transformers", "jax"):
    if name in tops and not tops[name] & allowed:  # installed here: must look absent
        try:
            __import__(name)
            raise SystemExit(f"hook failed to hide {name}")
        except ModuleNotFoundError:
            pass
def write():
    used = sorted({canonicalize_name(d) for m in set(sys.modules) - before
                   if m.partition(".")[0] not in local for d in tops.get(m.partition(".")[0], ())})
    with open(report, "w") as f:
        json.dump({"hidden": sorted(set(hidden)), "imported": used,
                   "modules": sorted(sys.modules)}, f)
atexit.register(write)
if argv[0] == "-m":
    sys.argv = argv[1:]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
"""
