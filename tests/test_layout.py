"""The package's layout (docs/architecture.md): stage folders whose imports run one way, no circle
between modules (imports inside functions counted), modules of a few hundred lines, and the flat
layout's module paths still importable (tests/test_saved_layout.py loads what that layout saved)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeline"

# Floors, lowest first: a room imports only rooms on lower floors (or itself). `pipeline` is the
# package's __init__ (the public names, imported lazily by name); `_moved` the old paths' finder.
FLOORS = [
    {"errors", "storage", "_moved"},
    {"config"},
    {"fit", "feed", "demo"},
    {"read"},
    {"cluster"},
    {"ingest"},
    {"pipeline"},
    {"job"},
    {"bench"},
    {"cli"},
    {"__main__"},
]
MOST_LINES = 420


def modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every module's imports of the package's modules, at any depth (inside functions too)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                for a in node.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                    if target in mods:
                        found.add(target)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in mods}
        graph[name] = found - {name}
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    return "pipeline" if len(parts) == 1 else parts[1]


def test_no_circle_between_modules_counting_imports_inside_functions():
    graph = imports(modules())
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                pytest.fail(f"import circle: {' -> '.join(cycle)}")
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_import_runs_down_the_floors():
    floor = {r: i for i, rooms in enumerate(FLOORS) for r in rooms}
    graph = imports(modules())
    rooms = {room(m) for m in graph}
    assert rooms <= set(floor), f"rooms without a floor: {sorted(rooms - set(floor))} (add them to FLOORS and docs/architecture.md)"
    up = [(a, b) for a, bs in graph.items() for b in bs if room(a) != room(b) and floor[room(b)] >= floor[room(a)]]
    assert not up, f"imports that run up or sideways between rooms: {up}"


def test_the_stage_folders_are_there_and_no_module_is_large():
    for stage in ("read", "fit", "cluster", "feed", "bench", "job", "ingest"):
        assert (PACKAGE / stage / "__init__.py").exists(), stage
        doc = ast.get_docstring(ast.parse((PACKAGE / stage / "__init__.py").read_text()))
        assert doc, f"pipeline/{stage}/__init__.py says what the stage is"
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_moved.py", "cli.py", "config.py", "demo.py", "errors.py", "storage.py"], top
    large = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not large, f"modules over {MOST_LINES} lines: {large}"


def test_the_flat_layouts_module_paths_still_import_and_name_the_same_objects():
    from pipeline import _moved

    for old, homes in _moved.MOVED.items():
        module = importlib.import_module(old)
        new = importlib.import_module(homes[0])
        public = [n for n in dir(new) if not n.startswith("_") and getattr(getattr(new, n), "__module__", None) == new.__name__]
        assert public, old
        for n in public:
            assert getattr(module, n) is getattr(new, n), (old, n)
    import pipeline.preprocess
    import pipeline.source
    import pipeline.vocab

    assert pipeline.preprocess.FittedPreprocessor is pipeline.FittedPreprocessor
    assert pipeline.source.Fragment.__module__ == "pipeline.read.files"
    assert pipeline.vocab.Parts.__module__ == "pipeline.fit.vocab_parts"  # its home before vocab_parts.py
    with pytest.raises(AttributeError, match="moved to"):
        pipeline.vocab.no_such_name  # noqa: B018
    for old, homes in _moved.MOVED.items():  # `from <old path> import *` (a user's script; bench/scale.py's
        # children did so, and found nothing once the module had moved): every public name of the new homes
        got: dict = {}
        exec(f"from {old} import *", got)
        module = importlib.import_module(old)
        for home in homes:
            new = importlib.import_module(home)
            names = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
            assert all(got[n] is getattr(module, n) for n in names), (old, home)  # (a name in two homes: the first's)


def test_the_old_paths_resolve_in_a_fresh_interpreter_as_pickle_and_ray_hooks_import_them():
    code = ("import importlib, pickle; m = importlib.import_module('pipeline.runtime'); print(m.setup_worker.__module__); "
            "print(pickle.loads(pickle.dumps(importlib.import_module('pipeline.transforms').NumericOp)).__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pipeline.cluster.runtime", "pipeline.fit.transforms"]


def test_no_benchmark_output_is_tracked_at_the_repository_root():
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    at_root = [f for f in tracked if "/" not in f and f.endswith((".json", ".png"))]
    assert not at_root, at_root
