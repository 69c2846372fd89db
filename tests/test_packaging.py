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
# The layers of lit_ess and the layers each stands on; a module imports its own layer and what its layer
# stands on (directly or through another layer), nothing else: no import runs up, or across to a
# neighbour. The order, lowest first:
#     ground < envs, engines < rollout < datamodules, callbacks < entry points
#     ground < trainer < datamodules, callbacks
# The ground floor is lit_ess itself and every module directly in lit_ess/ that no other layer names: the
# vocabulary every layer speaks (batch, sampling, data, objectives, knobs, rewards, logprobs, ...). The
# trainer stands on it alone: it names the batch, the sampling settings and the data side
# (lit_ess.data's Protocols), never the engines or the rollout layer. Every subpackage has a layer: one
# that has none fails test_every_module_has_a_layer until it is named here.
LAYERS = {   # layer: (its packages and modules, the layers it stands on)
    "ground": ([], []),
    "envs": (["lit_ess.envs"], ["ground"]),                      # environments and episodes; call a Sampler
    "engines": (["lit_ess.engines"], ["ground"]),                # vLLM in process, vLLM servers, hf
    "rollout": (["lit_ess.rollout"], ["envs", "engines"]),       # worker, buffer, executors, transports
    "trainer": (["lit_ess.module", "lit_ess.sft"], ["ground"]),  # the LightningModules
    "datamodules": (["lit_ess.datamodules"], ["rollout", "trainer"]),
    "callbacks": (["lit_ess.callbacks"], ["rollout", "trainer"]),
    "entry points": (["lit_ess.cli", "lit_ess.config_check", "lit_ess.output_dir", "lit_ess.reference"], ["datamodules", "callbacks"]),
}
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


def _import_lines(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(lit_ess module, line) of every import in the file (module level or inside functions)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in known else base, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names)
    return [(m, line) for m, line in found if m in known and m != name]


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """lit_ess modules imported anywhere in the file (module level or inside functions)."""
    return {m for m, _ in _import_lines(name, path, known)}


def _layer(module: str, path: Path) -> str | None:
    """The layer of a module; None for a module of a subpackage LAYERS does not name."""
    for layer, (names, _) in LAYERS.items():
        if any(module == n or module.startswith(n + ".") for n in names):
            return layer
    return "ground" if module == "lit_ess" or path.parent == ROOT / "lit_ess" else None


def _below(layer: str) -> set[str]:
    """The layers `layer` stands on, directly or through another."""
    out, todo = set(), list(LAYERS[layer][1])
    while todo:
        if (below := todo.pop()) not in out:
            out.add(below)
            todo.extend(LAYERS[below][1])
    return out


def test_every_module_has_a_layer():
    mods = _modules()
    homeless = sorted(n for n, p in mods.items() if _layer(n, p) is None)
    assert not homeless, f"modules in no layer: {homeless}: name their package in LAYERS (tests/test_packaging.py)"


def test_layers_import_downward_only():
    """A module imports its own layer and the layers it stands on (LAYERS), nothing above or beside."""
    mods = _modules()
    bad = []
    for name, path in mods.items():
        if (mine := _layer(name, path)) is None:
            continue                                         # test_every_module_has_a_layer names it
        for dep, line in _import_lines(name, path, set(mods)):
            theirs = _layer(dep, mods[dep])
            if theirs is not None and theirs != mine and theirs not in _below(mine):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name} ({mine}) imports {dep} ({theirs}); "
                           f"{mine} stands on {', '.join(sorted(_below(mine))) or 'nothing'}")
    assert not bad, "imports that run up or across the layers (tests/test_packaging.py LAYERS):\n" + "\n".join(bad)


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


def test_setup_says_each_stage_and_drops_the_known_noise(tmp_path):
    """scripts/setup.sh as a user runs it, on a copy of the repo whose .venv/bin/python is a stand-in that
    records its calls and prints pip's harmless pip.conf warning beside a real one: one numbered line per
    stage with the seconds so far, the warning dropped, anything else kept, and a second run silent."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/calls"\n[ "$1" = -c ] && exit 0\n'
                      'echo "WARNING: Location \'file:///gone\' is ignored: it is neither a file nor a directory." >&2\n'
                      'echo "ERROR: a real problem"\n')
    python.chmod(0o755)
    path = "/usr/bin:/bin"
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PATH": path, "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    stages = [ln for ln in lines if ln.startswith("setup: [")]
    gpu = shutil.which("nvidia-smi", path=path) is not None
    assert len(stages) == (4 if gpu else 7), lines
    for i, ln in enumerate(stages, 1):
        assert re.fullmatch(rf"setup: \[{i}/{len(stages)}\] \S.* \(\d+ s\)", ln), ln
    if not gpu:
        assert stages[1].startswith("setup: [2/7] torch 2.13.0+cpu (")
    assert re.fullmatch(r"setup: done in \d+ s", lines[-1]), lines
    assert "is ignored" not in out.stdout + out.stderr and "ERROR: a real problem" in out.stdout
    calls = (python.parent / "calls").read_text().splitlines()
    assert calls[0] == "-m pip -q install --upgrade pip" and calls[-1].startswith("-c import torch")
    again = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env={"PATH": path, "HOME": str(tmp_path)})
    assert again.returncode == 0 and again.stdout == again.stderr == ""
