"""The package's structure, derived from the source: no import cycles between packages nor
between the modules of one package, and the directions DESIGN.md names (the trainer never
reaches the tuner by any path, the cache never imports the trainer, the trace analyzer
imports neither, ...); every import counts: module level, function level, ``TYPE_CHECKING``
blocks and string imports through ``importlib``. And one owner per concern: only the tuner's
measurement core times candidates in a loop or defines a selection margin, and only the
runtime overrides aten operators, and only ``base/environment.py`` reads the process's environment."""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "primus_perf"

# The ground floor imports nothing above it; each package below may import only the units
# listed (besides itself and the ground floor).
GROUND = {"kinds", "problems", "base"}
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "cache": {"kernels"},
    # activate (entries -> routers), enable, the dispatches and their overrides; online tuning is
    # handed to enable from above, so never the tuner
    "runtime": {"kernels", "cache"},
    "trainer": {"kernels", "cache", "runtime"},  # the trainer enables a cache as any program does
    "tracelens": {"cache"},  # report --cache reads the store to mark tuned problems
    "profiler": {"trainer", "kernels", "cache", "tracelens"},
    "gate": {"tracelens", "profiler", "trainer", "kernels", "cache"},
    # online tuning wraps the runtime's routers; the FP8 plan (and step) tuner measures the trainer's steps
    "tuner": {"kernels", "cache", "runtime", "tracelens", "trainer"},
    # primus_perf.enable: the runtime's enable with the tuner's online tuning plugged in
    "enabling": {"runtime", "tuner"},
    "env_hook": {"enabling", "runtime"},
    # the whole loop: profile, analyze, report, tune, train with the cache
    "loop": {"profiler", "tracelens", "tuner", "trainer", "runtime", "kernels", "cache"},
    # the public face of FP8 plans: tuned by tuner.fp8, applied by runtime.fp8
    "fp8": {"runtime", "tuner"},
}
# never, whatever ALLOWED says: the rules DESIGN.md spells out
FORBIDDEN = [("trainer", "tuner"), ("runtime", "tuner"), ("kernels", "runtime"), ("cache", "runtime"),
             ("cache", "trainer"), ("cache", "tuner"), ("kernels", "tuner"), ("kernels", "trainer"),
             ("runtime", "trainer"), ("tracelens", "trainer"), ("tracelens", "tuner")]
# no import path at all, direct or through other units, eager or lazy, leads from the first
# to the second (module by module)
UNREACHABLE = [("trainer", "tuner"), ("runtime", "tuner"), ("kernels", "runtime")]


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
            # `from pkg import submodule` imports the submodule too
            subs = {f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}")}
            out.update(subs)
            if mod != "primus_perf" or len(subs) < len(node.names):  # the root's lazy __init__ aside
                out.add(mod)
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
    assert "pathlib" in _imports(f)
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


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (importing a module runs its parent
    packages' ``__init__`` too). The public API's lazy names (``primus_perf.__init__``) are
    left out: no package imports them (``test_no_package_imports_the_public_api``)."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        name = _module_of_file(path)
        deps = graph.setdefault(name, set())
        for mod in _imports(path):
            if _unit(mod) is None:
                continue
            parts = mod.split(".")
            # the packages above an imported module run first, except those this module is in
            # (they are already running)
            deps.update(p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if not name.startswith(p + "."))
            if _is_module(mod) and not name.startswith(mod + "."):
                deps.add(mod)
        deps.discard(name)
        deps.discard("primus_perf")
    return graph


def _reachable(graph: dict[str, set[str]], start: set[str]) -> dict[str, str]:
    """Every module reachable from ``start``, with the module it was reached from."""
    seen = {m: "" for m in start}
    todo = list(start)
    while todo:
        m = todo.pop()
        for dep in graph.get(m, ()):
            if dep not in seen:
                seen[dep] = m
                todo.append(dep)
    return seen


def test_module_graph_sees_parent_packages():
    graph = module_graph()
    # `from primus_perf.kernels.grouped import problem_of` runs kernels/ and kernels/grouped/ __init__
    assert {"primus_perf.kernels", "primus_perf.kernels.grouped"} <= graph["primus_perf.trainer.grouped_problems"]
    assert "primus_perf.runtime" not in graph["primus_perf.runtime.handle"]  # its own package is running
    assert _cycle({"p.a": {"p.b"}, "p.b": {"p.a"}}) == ["p.a", "p.b", "p.a"]


@pytest.mark.parametrize("unit", sorted({_unit_of_file(p) for p in SRC.rglob("*.py")}))
def test_no_import_cycle_inside_a_package(unit):
    """Between the modules of one package (its ``__init__`` aside: it re-exports them)."""
    prefix = f"primus_perf.{unit}"
    graph = {m: {d for d in deps if d.startswith(prefix + ".")} for m, deps in module_graph().items()
             if m.startswith(prefix + ".")}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(("unit", "other"), UNREACHABLE)
def test_no_import_path_at_all(unit, other):
    graph = module_graph()
    start = {m for m in graph if m == f"primus_perf.{unit}" or m.startswith(f"primus_perf.{unit}.")}
    seen = _reachable(graph, start)
    hit = sorted(m for m in seen if m == f"primus_perf.{other}" or m.startswith(f"primus_perf.{other}."))
    if hit:
        path, m = [hit[0]], hit[0]
        while seen[m]:
            m = seen[m]
            path.append(m)
        raise AssertionError(f"{unit} reaches {other}: " + " -> ".join(reversed(path)))


# ---- one owner per concern -------------------------------------------------------------------

CORE = {"primus_perf.tuner.measure", "primus_perf.tuner.decide"}  # the one clock layer and decision rule
# units that time work in a loop for a purpose other than choosing: their figures decide nothing
TIMING_ELSEWHERE = {
    "profiler": "preflight's hardware probes and capture's phase times report the machine, choose nothing",
    "gate": "the regression gate repeats whole commands; its statistics test a change, choose nothing",
}
CLOCK_CALLS = {"perf_counter", "perf_counter_ns", "process_time", "elapsed_time"}  # (monotonic: deadlines)
MARGIN_NAME = re.compile(r"(^|_)(MARGIN|MIN_GAIN|MIN_SAVING(_S)?|RATIO)$", re.IGNORECASE)
# the units that keep or drop a candidate, and figures of theirs that do but not on speed
CHOOSING = {"tuner", "kinds", "runtime", "closed_loop", "fp8", "enabling"}
NOT_SPEED = {
    "GPU_HEADROOM": "memory: a trial whose config would fill the GPU is skipped before it runs",
    "LOSS_TOLERANCE": "numerics: the loss with the cache against the loss without it",
}
UNIT = re.compile(r"_(s|ms|us|ns|min|mb|gib|bytes)$", re.IGNORECASE)  # a time or a size, not a ratio


def _called(node: ast.AST) -> str:
    fn = getattr(node, "func", None)
    return fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")


def timing_loops(tree: ast.AST) -> list[int]:
    """Lines of loops whose body reads a clock (or makes a timing event): a timing loop."""
    out = []
    for loop in ast.walk(tree):
        if not isinstance(loop, (ast.For, ast.While, ast.AsyncFor)):
            continue
        for node in ast.walk(loop):
            if not isinstance(node, ast.Call):
                continue
            timing_event = _called(node) == "Event" and any(k.arg == "enable_timing" for k in node.keywords)
            if _called(node) in CLOCK_CALLS or timing_event:
                out.append(loop.lineno)
                break
    return out


def _bindings(tree: ast.AST) -> Iterator[tuple[str, ast.AST, int]]:
    """(name, value, line) of every assignment (to a name, an attribute, a dataclass field),
    parameter default and keyword argument."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                name = getattr(t, "id", None) or getattr(t, "attr", None)
                if name:
                    yield name, node.value, node.lineno
        elif isinstance(node, ast.arguments):
            pos = [*node.posonlyargs, *node.args]
            for arg, default in [*zip(pos[len(pos) - len(node.defaults):], node.defaults),
                                 *zip(node.kwonlyargs, node.kw_defaults)]:
                if default is not None:
                    yield arg.arg, default, default.lineno
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg, node.value, node.value.lineno


def _ratio_literal(node: ast.AST) -> bool:
    """A float that can be a ratio or a margin: not 0 or 1, nor a power of ten that converts a
    unit or keeps a division off zero (1e3, 1e-6)."""
    v = getattr(node, "value", None)
    if not isinstance(node, ast.Constant) or type(v) is not float or v <= 0 or v == 1.0:
        return False
    return not math.log10(v).is_integer() or 1e-2 <= v <= 1e2


def selection_margins(tree: ast.AST) -> list[int]:
    """Lines that define a selection margin by name: a constant named like one (``*_MARGIN``,
    ``*_RATIO``...), or a parameter or field named so with a number for its value."""
    return sorted({line for name, value, line in _bindings(tree) if MARGIN_NAME.search(name)
                   and (name.isupper() or isinstance(getattr(value, "value", None), float))})


def decision_literals(tree: ast.AST) -> list[int]:
    """Lines where a number decides a comparison, whatever its name: a float literal in a
    comparison, or bound to a name (constant, attribute, parameter, keyword) that a comparison
    of the module reads; 0, 1, unit conversions, names with a unit and :data:`NOT_SPEED` aside."""
    compared = {getattr(n, "id", None) or getattr(n, "attr", None) for c in ast.walk(tree)
                if isinstance(c, ast.Compare) for n in ast.walk(c)}
    lines = {c.lineno for c in ast.walk(tree) if isinstance(c, ast.Compare) and any(map(_ratio_literal, ast.walk(c)))}
    return sorted(lines | {line for name, value, line in _bindings(tree) if name in compared
                           and _ratio_literal(value) and not UNIT.search(name) and name not in NOT_SPEED})


ENVIRON = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_uses(tree: ast.AST) -> list[int]:
    """Lines that read or write the process's environment: ``os.environ``, ``os.getenv``,
    ``os.putenv`` (...), or one of them imported from ``os``."""
    return sorted(node.lineno for node in ast.walk(tree)
                  if (isinstance(node, ast.Attribute) and node.attr in ENVIRON and getattr(node.value, "id", "") == "os")
                  or (isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & ENVIRON))


def aten_overrides(tree: ast.AST) -> list[int]:
    """Lines that register a kernel for an aten operator: ``Library("aten", ...)``,
    ``torch.library.impl("aten::...")`` or ``register_kernel("aten::...")``."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
            continue
        first = node.args[0].value
        if not isinstance(first, str):
            continue
        if (_called(node) == "Library" and first == "aten") or (
                _called(node) in ("impl", "register_kernel", "register_fake") and first.startswith("aten::")):
            out.append(node.lineno)
    return out


def _found(check, where=lambda path: True) -> dict[str, list[int]]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        if where(path):
            lines = check(ast.parse(path.read_text(encoding="utf-8")))
            if lines:
                found[str(path.relative_to(SRC))] = lines
    return found


def test_the_detectors_find_what_they_look_for():
    loop = "import time\nfor c in cands:\n    t0 = time.perf_counter()\n    c()\n    ts.append(time.perf_counter() - t0)\n"
    events = "while n:\n    e = torch.cuda.Event(enable_timing=True)\n"
    assert timing_loops(ast.parse(loop)) == [2] and timing_loops(ast.parse(events)) == [1]
    assert timing_loops(ast.parse("t0 = time.perf_counter()\nrun()\nt = time.perf_counter() - t0\n")) == []
    assert selection_margins(ast.parse("KEEP_DEFAULT_MARGIN = 0.01\nMIN_GAIN = 0.002\n")) == [1, 2]
    assert selection_margins(ast.parse("def select(times, margin=0.01):\n    pass\n")) == [1]
    assert selection_margins(ast.parse("class P:\n    margin: float = 0.01\n")) == [2]
    assert selection_margins(ast.parse("TEMPERATURE_MARGIN_C = 5.0\ndef f(margin=MARGIN): pass\n")) == []
    assert selection_margins(ast.parse("DROP_RATIO = 1.25\ndef f(prune_ratio=1.3): pass\n")) == [1, 2]
    prune = "def __init__(self, slack: float = 1.3):\n    self.slack = slack\ndef f(self):\n    return a > self.slack * b\n"
    assert decision_literals(ast.parse(prune)) == [1]
    assert decision_literals(ast.parse("if med > 1.02:\n    keep()\nx = run(cut=0.97)\nif y < cut: pass\n")) == [1, 3]
    fine = "def f(budget_s=30.0, n=2):\n    return t > budget_s or t * 1e3 < 1.0 or n > 2\nGPU_HEADROOM = 0.05\n"
    assert decision_literals(ast.parse(fine + "if x > GPU_HEADROOM: pass\n")) == []
    assert aten_overrides(ast.parse('lib = torch.library.Library("aten", "IMPL")\n')) == [1]
    assert aten_overrides(ast.parse('torch.library.impl("aten::mm", "CUDA")(f)\n')) == [1]
    assert aten_overrides(ast.parse('torch.library.custom_op("primus_perf::gemm")\n')) == []
    uses = 'a = os.environ.get("X")\nos.putenv("Y", "1")\nfrom os import getenv\nline = "os.environ"\n'
    assert environment_uses(ast.parse(uses)) == [1, 2, 3]


def test_only_the_measurement_core_times_candidates_in_a_loop():
    def elsewhere(path: Path) -> bool:
        return _module_of_file(path) not in CORE and _unit_of_file(path) not in TIMING_ELSEWHERE

    assert _found(timing_loops, elsewhere) == {}, "a timing loop outside tuner/measure.py"


def test_only_the_decision_core_defines_a_selection_margin():
    """One margin everywhere: a ratio that keeps or drops a candidate is decide.py's, or made of it."""
    def elsewhere(path: Path) -> bool:
        return _module_of_file(path) != "primus_perf.tuner.decide"

    assert _found(selection_margins, elsewhere) == {}, "a selection margin outside tuner/decide.py"
    assert _found(decision_literals, lambda p: elsewhere(p) and _unit_of_file(p) in CHOOSING) == {}, \
        "a number that keeps or drops a candidate outside tuner/decide.py"


def test_only_the_runtime_overrides_aten_operators():
    assert _found(aten_overrides, lambda p: _unit_of_file(p) != "runtime") == {}
    cpp = [p.relative_to(SRC) for p in SRC.rglob("*.cpp") if _unit_of_file(p) != "runtime"
           and re.search(r'TORCH_LIBRARY_IMPL\(aten|Library\([^)]*"aten"', p.read_text())]
    assert cpp == []


def test_only_the_environment_module_reads_the_environment():
    assert _found(environment_uses, lambda p: _module_of_file(p) != "primus_perf.base.environment") == {}, \
        "os.environ outside base/environment.py: declare the variable in environment.VARIABLES and read it there"


def test_every_variable_read_is_declared():
    from primus_perf.base.environment import VARIABLES

    def undeclared(tree: ast.AST) -> list[int]:
        return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and _called(node) == "get"
                and getattr(node.func, "value", None) is not None and getattr(node.func.value, "id", "") == "environment"
                and isinstance(node.args[0], ast.Constant) and node.args[0].value not in VARIABLES]

    assert _found(undeclared) == {}
