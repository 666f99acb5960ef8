"""The package's import graph, derived from the source: no cycles between packages, and the
directions DESIGN.md names (the trainer never imports the tuner, the cache never imports the
trainer, the trace analyzer imports neither, ...). Every import counts: module level,
function level, ``TYPE_CHECKING`` blocks and string imports through ``importlib``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "primus_perf"

# The ground floor imports nothing above it; each package below may import only the units
# listed (besides itself and the ground floor).
GROUND = {"problems", "devices", "files", "errors"}
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "cache": {"kernels"},
    "trainer": {"kernels", "cache", "runtime"},  # the trainer enables a cache as any program does
    # enable(): routers from the cache, installed at the dispatcher; the tuner only for
    # online tuning (imported inside enable when online=True)
    "runtime": {"kernels", "cache", "tuner"},
    "tracelens": {"cache"},  # report --cache reads the store to mark tuned problems
    "profiler": {"trainer", "kernels", "cache", "tracelens"},
    "gate": {"tracelens", "profiler", "trainer", "kernels", "cache"},
    "tuner": {"kernels", "cache", "tracelens"},
    # the whole loop: profile, analyze, report, tune, train with the cache
    "closed_loop": {"profiler", "tracelens", "tuner", "trainer", "runtime", "kernels", "cache"},
}
# never, whatever ALLOWED says: the rules DESIGN.md spells out
FORBIDDEN = [("trainer", "tuner"), ("tuner", "runtime"), ("kernels", "runtime"), ("cache", "runtime"), ("cache", "trainer"), ("cache", "tuner"), ("kernels", "tuner"),
             ("kernels", "trainer"), ("tracelens", "trainer"), ("tracelens", "tuner")]


def _unit(module: str) -> str | None:
    """The top-level unit of ``primus_perf.X.Y`` (``X``), None outside the package."""
    parts = module.split(".")
    if parts[0] != "primus_perf":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _unit_of_file(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def _module_of_file(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    base = SRC.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth, including ``importlib.import_module("...")``
    and ``__import__("...")`` with a literal name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ""
    if path.is_relative_to(SRC):
        package = _module_of_file(path)
        if path.name != "__init__.py":
            package = package.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            # `from pkg import submodule` imports the submodule too
            out.update(f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}"))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return out


def unit_graph() -> dict[str, set[str]]:
    import primus_perf

    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        unit = _unit_of_file(path)
        deps = graph.setdefault(unit, set())
        mods = _imports(path)
        if unit == "__init__":  # the public API imports its names lazily, from this table
            mods |= set(primus_perf._EXPORTS.values())
        for mod in mods:
            dep = _unit(mod)
            if dep is not None and dep != unit:
                deps.add(dep)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep):], dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_import_collector_sees_function_level_and_string_imports(tmp_path):
    f = SRC / "problems" / "files.py"  # any real file: the collector must at least see its imports
    assert "json" in _imports(f)
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import importlib\n    importlib.import_module('primus_perf.tuner.core')\n"
                     "    from primus_perf.cache import store\n")
    seen = _imports(probe)
    assert {"primus_perf.tuner.core", "primus_perf.cache", "primus_perf.cache.store"} <= seen


def test_no_import_cycle_between_packages():
    cycle = _cycle(unit_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_package_imports_point_one_way(unit):
    graph = unit_graph()
    if unit not in graph:
        pytest.skip(f"no package {unit}")
    extra = graph[unit] - GROUND - ALLOWED[unit] - {"cli"}
    assert not extra, f"{unit} imports {sorted(extra)}"
    assert "cli" not in graph[unit], f"{unit} imports the CLI"


@pytest.mark.parametrize(("unit", "other"), FORBIDDEN)
def test_forbidden_directions(unit, other):
    assert other not in unit_graph().get(unit, set()), f"{unit} must never import {other}"


def test_no_package_imports_the_public_api():
    users = sorted(unit for unit, deps in unit_graph().items() if "__init__" in deps and unit != "cli")
    assert not users, f"{users} import primus_perf's public API (its names import everything)"


def test_ground_floor_imports_nothing_above_it():
    graph = unit_graph()
    for unit in GROUND - {"__init__"}:
        assert graph.get(unit, set()) <= GROUND, f"{unit} imports {sorted(graph[unit] - GROUND)}"
