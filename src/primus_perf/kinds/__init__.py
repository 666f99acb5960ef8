"""The registry of kinds: what the toolkit tunes and routes (GEMM, grouped GEMM, attention, an
FP8 plan), one :class:`Kind` record each.

A kind is a package under ``primus_perf/kinds/`` that exports one record, ``KIND``, built in
code: its problem type (``problems/``), its title and the analyzer table's shape columns, how a
problem is labelled, and its parts, each owned by one layer:

- ``router`` (``kernels``): a :class:`RouterPart`, cache entries -> a pure router, and the
  running library versions an entry must match;
- ``intercept`` (``runtime``): the kind's ``runtime.dispatch.Dispatch`` subclass, owner of its
  aten overrides (and Inductor pass), its counts and failures;
- ``tuner`` (``tuner``): the plugin class that tunes its problems offline;
- ``online`` (``tuner``): ``router -> adapter`` for tuning inside the steps;
- ``trace`` (``tracelens``): a ``perf_models.TracePart``: its ops and perf models, attainable fraction, FLOPs;
- ``cli`` (``cli``): a ``tune_kind.CliPart``: its ``primus-tune <kind>`` problem spec and options.

A built-in record names its parts as ``"module:attribute"``, resolved on first use, so this
ground floor imports nothing above it and a layer resolves only the parts it owns (the runtime
never reaches the tuner). A record made elsewhere (a test's toy kind) may hold the objects
themselves; :func:`register` adds it. A kind without a part in a layer is not available there.
:data:`PACKAGES` lists the built-in kinds: adding one is one package and one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from primus_perf.problems import forget_problem_type, problem_types

PACKAGES = ("gemm", "grouped_gemm", "attention", "fp8_plan")  # the kinds' packages, in listing order
# the analyzer's problem-table columns (``tracelens.analyses.problems``): every kind's rows
# have these; a kind adds its own shape columns after ``label``
TABLE_COLUMNS = ("key", "label", "direction", "calls", "time_s", "flops", "bytes", "intensity", "tflops", "tb_s",
                 "pct_roofline", "roofline_note", "share_of_kind", "dtype", "problem")
PARTS = {"router": "kernels", "intercept": "runtime", "tuner": "tuner", "online": "tuner", "trace": "tracelens",
         "cli": "cli"}  # part -> its layer


def resolve(ref: Any) -> Any:
    """A part: ``"module:attribute[.attribute]"`` imported, anything else as it is."""
    if not isinstance(ref, str):
        return ref
    module, _, path = ref.partition(":")
    out: Any = importlib.import_module(module)
    for name in path.split("."):
        out = getattr(out, name)
    return out


@dataclass(frozen=True)
class RouterPart:
    """``factory(entries)`` -> a router (entries may be empty: a router with no choice), and
    ``versions()`` -> the running library versions an entry must match (each a callable or
    its ``"module:attribute"``)."""

    factory: Any
    versions: Any

    def build(self, entries: list[Any]) -> Any:
        return resolve(self.factory)(entries)

    def library_versions(self) -> dict[str, str]:
        return resolve(self.versions)()


@dataclass(eq=False)
class Kind:
    """One kind: its identity, its ground-floor data, and its parts (module docstring)."""

    problem_type: type
    title: str  # how listings name it: "GEMM", "grouped GEMM", "attention"
    shape_columns: tuple[str, ...] = ()  # the analyzer table's columns of the problem's shape
    label: Callable[[Any], str] = str  # a problem as a row of a listing shows it
    parts: dict[str, Any] = field(default_factory=dict)  # PARTS name -> the part, or its "module:attribute"
    _resolved: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ValueError(f"kind {self.name!r}: no part(s) {sorted(unknown)} (one of {', '.join(PARTS)})")

    @property
    def name(self) -> str:
        """The kind's name in cache entries, problems files, dispatches and ``--kinds``."""
        return self.problem_type.kind

    @property
    def table(self) -> str:
        """The analyzer's problem table of this kind: ``Analysis.<table>``, the JSON key."""
        return f"{self.name}_problems"

    @property
    def columns(self) -> list[str]:
        return [*TABLE_COLUMNS[:2], *self.shape_columns, *TABLE_COLUMNS[2:]]

    def part(self, slot: str) -> Any:
        """The part in ``slot`` (one of :data:`PARTS`), resolved; None where the kind has none."""
        if slot not in PARTS:
            raise KeyError(f"no part {slot!r} on a kind (one of {', '.join(PARTS)})")
        if slot not in self._resolved:
            self._resolved[slot] = resolve(self.parts.get(slot))
        return self._resolved[slot]

    def takes(self, problem: Any) -> bool:
        return isinstance(problem, self.problem_type)

    def __repr__(self) -> str:
        return f"Kind({self.name!r}, parts={sorted(self.parts)})"


_KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add ``kind`` to the registry (once per name) and return it."""
    if kind.name in _KINDS:
        raise ValueError(f"kind {kind.name!r} is registered twice")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind :func:`register` added, and its problem type (a test's toy kind)."""
    if _KINDS.pop(name, None) is not None:
        forget_problem_type(name)


def get(name: str) -> Kind:
    """The kind called ``name``; KeyError naming the registered kinds for any other name."""
    try:
        return _KINDS[name]
    except KeyError:
        raise KeyError(f"unknown kind {name!r} (one of {', '.join(_KINDS)})") from None


def names() -> tuple[str, ...]:
    return tuple(_KINDS)


def all_kinds() -> Iterator[Kind]:
    return iter(tuple(_KINDS.values()))


def with_part(slot: str, among: Iterable[str] | None = None) -> dict[str, Any]:
    """Kind name -> its resolved part in ``slot``, in registration order, for the kinds (of
    ``among``, default all) that have one."""
    wanted = set(names() if among is None else among)
    return {n: k.part(slot) for n, k in _KINDS.items() if n in wanted and slot in k.parts}


def kind_of(problem: Any) -> Kind:
    """The kind whose problem type ``problem`` is; TypeError for any other object."""
    kind = _KINDS.get(getattr(type(problem), "kind", ""))
    if kind is None or not kind.takes(problem):
        raise TypeError(f"no kind takes problems of type {type(problem).__name__}")
    return kind


for _package in PACKAGES:
    register(importlib.import_module(f"{__name__}.{_package}").KIND)

GEMM, GROUPED, ATTENTION, FP8_PLAN = (get(n) for n in ("gemm", "grouped_gemm", "attention", "fp8_plan"))

if set(problem_types()) != set(_KINDS):  # every problem type is a kind, and no kind lacks one
    raise ImportError(f"problem types {sorted(problem_types())} and kinds {sorted(_KINDS)} differ")
