"""Install sclaro-jax into a running notebook kernel (Colab) without replacing its jax.

    import colab_install
    colab_install.install(".", extras="demo")

Writes a constraints file from the repository's constraints.txt in which jax, jaxlib and the
jax-cuda* plugins are pinned to the versions this runtime already has (constraints.txt's own
jax pins would replace them), and every other package the runtime already has is pinned to its
installed version too; packages it lacks get constraints.txt's tested versions. pip runs in a
subprocess. If pip cannot satisfy that, it retries with constraints.txt's pins for the others
(only jax kept), then with pyproject's ranges alone (only jax kept). Afterwards it compares
the installed versions with those before and says whether the runtime must be restarted: only
when pip replaced or removed a distribution that this kernel has already imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import re
import subprocess
import sys

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def is_jax_family(name: str) -> bool:
    """jax, jaxlib and the accelerator plugins (jax-cuda12-plugin, jax-cuda12-pjrt, ...)."""
    name = canonical(name)
    return name in ("jax", "jaxlib") or name.startswith(("jax-cuda", "jax-rocm", "libtpu"))


def installed_versions() -> dict[str, str]:
    """{canonical distribution name: version} of what this interpreter has now."""
    importlib.invalidate_caches()
    out = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonical(name), dist.version)
    return out


def runtime_constraints(constraints_txt: str, installed: dict[str, str], *,
                        keep_all: bool = True) -> str:
    """The constraints file's text: constraints.txt without its lines for the packages kept at
    their installed versions, then `name==version` for those. Kept: the jax family always
    (when installed), and with `keep_all` every other installed package constraints.txt
    names."""
    kept, lines = {}, []
    for line in constraints_txt.splitlines():
        match = _NAME.match(line.split("#", 1)[0])
        if match is None:  # comment or blank
            lines.append(line)
            continue
        name = canonical(match.group(1))
        if name in installed and (keep_all or is_jax_family(name)):
            kept[name] = installed[name]
        else:
            lines.append(line)
    for name, version in installed.items():
        if is_jax_family(name):
            kept[name] = version
    lines.append("# Kept at this runtime's installed versions:")
    lines += [f"{name}=={version}" for name, version in sorted(kept.items())]
    return "\n".join(lines) + "\n"


def modules_by_distribution() -> dict[str, set[str]]:
    """{canonical distribution name: its top-level modules}."""
    out: dict[str, set[str]] = {}
    for top, dists in metadata.packages_distributions().items():
        for dist in dists:
            out.setdefault(canonical(dist), set()).add(top)
    return out


def restart_needed(before: dict[str, str], after: dict[str, str],
                   imported: set[str], modules: dict[str, set[str]]) -> list[str]:
    """'name old -> new' for each distribution whose version changed (or that was removed)
    and whose top-level modules include one already in `imported`."""
    out = []
    for name, old in sorted(before.items()):
        new = after.get(name)
        if new != old and modules.get(name, set()) & imported:
            out.append(f"{name} {old} -> {new or 'removed'}")
    return out


def install(repo: str = ".", extras: str = "demo", *, workdir: str = "/tmp",
            quiet: bool = True) -> list[str]:
    """pip install -e REPO[EXTRAS] as the module docstring says; returns restart_needed's
    list (empty: carry on) and prints the verdict."""
    with open(f"{repo}/constraints.txt", encoding="utf-8") as f:
        tested = f.read()
    before = installed_versions()
    modules = modules_by_distribution()  # before pip: what the imported modules belong to
    imported = {name.partition(".")[0] for name in list(sys.modules)}
    path = f"{workdir}/sclaro_jax_runtime_constraints.txt"
    tries = [("installed versions kept, tested versions for new packages", True, True),
             ("jax kept, tested versions for the others", False, True),
             ("jax kept, pyproject ranges for the others", False, False)]
    for label, keep_all, pinned in tries:
        text = runtime_constraints(tested if pinned else "", before, keep_all=keep_all)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        command = [sys.executable, "-m", "pip", "install", *(["-q"] if quiet else []),
                   "-c", path, "-e", f"{repo}[{extras}]"]
        print(f"pip install ({label}):", " ".join(command[1:]))
        if subprocess.run(command).returncode == 0:
            break
    else:
        raise RuntimeError(
            f"pip could not install {repo}[{extras}] next to this runtime's jax "
            f"{before.get('jax')} / jaxlib {before.get('jaxlib')} (pyproject.toml's ranges: "
            "jax>=0.7): read pip's message above; a newer runtime, or "
            "`pip install -U jax jaxlib` and a restart, fixes an old jax")
    after = installed_versions()
    replaced = restart_needed(before, after, imported, modules)
    moved = [n for n in sorted(before) if is_jax_family(n) and after.get(n) != before[n]]
    if moved:  # the constraints pin them: pip must not have touched them
        raise RuntimeError(f"pip changed {moved} although {path} pins them")
    if replaced:
        print("RESTART THE RUNTIME (Runtime > Restart session), then run the notebook from the "
              "top again (the install is then a no-op): pip replaced packages this kernel had "
              "already imported: " + ", ".join(replaced))
    else:
        print("No restart needed: pip replaced nothing this kernel had imported "
              f"(jax {after.get('jax')}, jaxlib {after.get('jaxlib')} kept).")
    return replaced
