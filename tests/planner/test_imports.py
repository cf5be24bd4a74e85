"""planner/ has no import cycles, and every module imports on its own.

The graph counts every import of a planner module anywhere in a file: at the top, inside a
function, or under ``TYPE_CHECKING`` (a cycle hidden in a function or a type hint is still a
cycle a reader has to untangle).  Each module is then imported with no other planner module
loaded, so none relies on another having been imported first.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "planner"


def module_files(package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` (subpackages included) by dotted name."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, wherever the import sits."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from planner.bounds import memory`` imports the module planner.bounds.memory
                full = f"{source}.{alias.name}"
                if full in known:
                    found.add(full)
                elif source in known:
                    found.add(source)
    found.discard(name)
    return found


def import_graph(package: str = PACKAGE) -> dict[str, set[str]]:
    known = module_files(package)
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path ``[a, b, ..., a]``, or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_sees_cycles() -> None:
    """The check can fail: a cycle through a function-level import, and a longer one."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"x": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_are_found_wherever_they_sit(tmp_path: Path) -> None:
    """Function-level, TYPE_CHECKING, relative and ``from package import module`` imports
    all count as edges."""
    src = tmp_path / "mod.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from planner.search import state\n"
        "from .model import Split\n"
        "if TYPE_CHECKING:\n"
        "    from planner.bounds.memory import memory_bounds\n"
        "def f() -> None:\n"
        "    import planner.bounds.work\n"
    )
    known = module_files()
    found = imported_modules("planner.search.mod", src, known)
    assert found == {"planner.search.state", "planner.search.model", "planner.bounds.memory", "planner.bounds.work"}


def test_planner_import_graph_is_acyclic() -> None:
    graph = import_graph()
    assert "planner.search.driver" in graph and "planner.bounds.chunk_memory" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_planner_module_imports_on_its_own() -> None:
    """Each module imports with no other planner module loaded before it (one fresh
    interpreter; planner's modules are dropped from ``sys.modules`` before each import)."""
    code = (
        "import importlib, sys, traceback\n"
        f"names = {sorted(module_files())!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'planner' or m.startswith('planner.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ':\\n' + traceback.format_exc())\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_public_entry_point() -> None:
    """``planner.solver.solve`` stays the one public entry point (the CLI, the service's
    default ``planner.solver:solve``, the benchmarks and the notebook use it): the search
    (:func:`planner.search.axes.solve`), then partial recompute, which without it is the search."""
    from planner.schema import Cluster, PlanOptions, TrainingSetup
    from planner.search.axes import solve as search
    from planner.solver import solve as public
    from tests.planner.helpers import random_profile

    profile = random_profile(3, 6)
    cluster = Cluster.model_validate({"devices": 2, "memory": "1GiB"})
    options = PlanOptions(partial_recompute=False, time_limit_s=1)
    ours, theirs = public(profile, cluster, TrainingSetup(), options), search(profile, cluster, TrainingSetup(), options)
    assert ours.stages == theirs.stages and ours.predicted == theirs.predicted
