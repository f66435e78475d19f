"""The flat module names `data_prep` had before its wings: `import data_prep.curate_rules` still
works and gives `data_prep.curate.rules` itself (the same module object, so old imports,
monkeypatches and pickles naming the old paths keep working). New code imports the new names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "data_prep.annotate_keys": "data_prep.annotate.keys",
    "data_prep.annotate_ray": "data_prep.annotate.ray_engine",
    "data_prep.annotate_stages": "data_prep.annotate.stages",
    "data_prep.curate_actions": "data_prep.curate.actions",
    "data_prep.curate_cluster": "data_prep.curate.cluster",
    "data_prep.curate_extend": "data_prep.curate.extend",
    "data_prep.curate_objects": "data_prep.curate.objects",
    "data_prep.curate_predicates": "data_prep.curate.predicates",
    "data_prep.curate_relations": "data_prep.curate.relations",
    "data_prep.curate_report": "data_prep.curate.report",
    "data_prep.curate_rules": "data_prep.curate.rules",
    "data_prep.curate_text": "data_prep.curate.text",
    "data_prep.rocs_caption": "data_prep.rocs.caption",
    "data_prep.rocs_select": "data_prep.rocs.selection",
}


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of MOVED and loads it as the module at the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system overwrites __spec__; restored below
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put the finder first on `sys.meta_path`, once (first: it answers only for the old names,
    and no stale copy of an old file elsewhere on the path may answer before it)."""
    if not any(isinstance(f, _OldNames) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldNames())
