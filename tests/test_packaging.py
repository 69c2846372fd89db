"""The installed distribution and the import layers: one top-level package, imports that point down."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# layer of each installed package, lowest first: a module may import its own layer and those below
LAYERS = {"lit_ess.engines": 0, "lit_ess.rollout": 1, "lit_ess.datamodules": 2, "lit_ess.callbacks": 2}
SOURCES = {"lit_ess": ROOT / "lit_ess", "lit_ess.callbacks": ROOT / "callbacks", "lit_ess.datamodules": ROOT / "datamodules"}


def test_the_wheel_installs_one_top_level_package(tmp_path):
    """Built from a copy of the tracked files (a build in the checkout would reuse a stale build/ folder,
    and write into the tree other tests read)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / f).is_symlink():
            (src / f).symlink_to((ROOT / f).readlink())
        elif (ROOT / f).is_file():
            shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(src)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("lit_ess-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"lit_ess"}
    assert "lit_ess/callbacks/weight_sync.py" in names and "lit_ess/datamodules/rollout.py" in names
    assert not any(n.startswith(("experiments/", "benchmarks/", "tests/")) for n in names)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in SOURCES.items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if pkg == "lit_ess" and parts and parts[0] in ("callbacks", "datamodules"):
                continue                                     # the links: counted under their own package
            out[".".join([pkg, *parts])] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """lit_ess modules imported anywhere in the file (module level or inside functions)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known and m != name}


def _layer(module: str) -> int | None:
    return next((v for k, v in LAYERS.items() if module == k or module.startswith(k + ".")), None)


def test_layers_import_downward_only():
    """engines < rollout < datamodules, callbacks: nothing imports a layer above its own, except the two
    composition roots (lit_ess.cli, and lit_ess.reference, the plain loop) and the package's own exports."""
    mods = _modules()
    bad = []
    for name, path in mods.items():
        if name in ("lit_ess.cli", "lit_ess.reference"):
            continue
        mine = _layer(name)
        for dep in _imports(name, path, set(mods)):
            theirs = _layer(dep)
            if theirs is not None and (mine is None and theirs >= 2 or mine is not None and theirs > mine):
                bad.append(f"{name} -> {dep}")
    assert not bad, bad


def test_no_import_circle():
    mods = _modules()
    graph = {n: _imports(n, p, set(mods)) for n, p in mods.items()}
    # a package's __init__ re-exporting its own modules (and a module importing its own package) is no circle
    graph = {n: {d for d in deps if not n.startswith(d + ".") and not d.startswith(n + ".")} for n, deps in graph.items()}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for d in graph.get(node, ()):
                if d == start:
                    return path + [d]
                if d not in seen:
                    seen.add(d)
                    stack.append((d, path + [d]))
        return None

    circles = [c for n in sorted(graph) if (c := cycle_from(n))]
    assert not circles, " -> ".join(circles[0])


def test_version_is_one_string():
    """`lit_ess.__version__` is pyproject's version and the installed distribution's; the code names no
    other lit-ess version (a docstring or error message about a release that does not exist misleads)."""
    import importlib.metadata
    import tomllib

    import lit_ess

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert lit_ess.__version__ == version
    assert importlib.metadata.version("lit-ess") == version
    named = {(str(p.relative_to(ROOT)), v) for p in _modules().values()
             for v in re.findall(r"lit-ess (\d+\.\d+(?:\.\d+)?)", p.read_text()) if not version.startswith(v)}
    assert not named, f"versions named in the code that are not {version}: {sorted(named)}"
