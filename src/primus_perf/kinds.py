"""The kinds of problem the toolkit tunes and routes, one :class:`Kind` record each.

A kind (GEMM, grouped GEMM, attention, FP8 plan) is one unit: its problem type
(``problems/``), how a problem is labelled, the analyzer's problem table (its name on
``Analysis`` and its columns), and the parts the upper layers implement for it:

- ``router`` (``kernels``): cache entries -> a router, an empty router, and the running
  library versions an entry must match (:class:`RouterPart`);
- ``intercept`` (``runtime``): the dispatcher overrides (and Inductor passes) that send an
  unmodified program's calls of the kind to its router; a kind without one is routed only
  where code calls its routing point (``runtime.seams``);
- ``tuner`` and ``online`` (``tuner``): the plugin class that tunes the kind's problems and
  the factory of its in-step (online) timing adapter.

Everything that lists kinds iterates this registry (:func:`all_kinds`, :func:`get`): the
cache's schema checks, the runtime's routers and intercepts, online tuning, ``primus-tune``'s
listings, the analyzer's problem tables, the loop's counts. The ground floor imports
nothing above it, so the upper layers attach their parts (:func:`attach`) when their
modules load: ``kernels.routers``, ``runtime.intercept``, ``tuner.kinds`` and
``tuner.online_kinds``. A kind without a
part in a layer is not available there (e.g. no router: its cache entries are counted
and not routed). Adding a kind: its problem type, one :func:`register` here, and one part
per layer that supports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from primus_perf.problems import (
    AttentionProblem,
    Fp8PlanProblem,
    GemmProblem,
    GroupedGemmProblem,
    problem_types,
)

# the analyzer's problem-table columns (``tracelens.analyses.problems``): every kind's rows
# have these; a kind adds its own shape columns after ``label``
TABLE_COLUMNS = ("key", "label", "direction", "calls", "time_s", "flops", "bytes", "intensity", "tflops", "tb_s",
                 "pct_roofline", "roofline_note", "share_of_kind", "dtype", "problem")


@dataclass(frozen=True)
class RouterPart:
    """A kind's router in ``kernels``: ``factory(entries)`` -> a router or None (no entry
    it can use), ``versions()`` -> the running library versions an entry must match,
    ``empty()`` -> a router with no entries (it counts the calls it leaves to torch)."""

    factory: Callable[[list[Any]], Any]
    versions: Callable[[], dict[str, str]]
    empty: Callable[[], Any]


# the parts an upper layer may attach, and the layer that owns each
PARTS = {"router": "kernels", "intercept": "runtime", "tuner": "tuner", "online": "tuner"}


@dataclass(eq=False)
class Kind:
    """One kind: its identity and ground-floor data, and the parts upper layers attach."""

    problem_type: type
    title: str  # how listings name it: "GEMM", "grouped GEMM", "attention"
    shape_columns: tuple[str, ...] = ()  # the analyzer table's columns of the problem's shape
    label: Callable[[Any], str] = str  # a problem as a row of a listing shows it
    parts: dict[str, Any] = field(default_factory=dict)  # PARTS name -> the attached part

    @property
    def name(self) -> str:
        """The kind's name in cache entries, problems files, routers and ``--kinds``."""
        return self.problem_type.kind

    @property
    def table(self) -> str:
        """The analyzer's problem table of this kind: ``Analysis.<table>``, the JSON key."""
        return f"{self.name}_problems"

    @property
    def columns(self) -> list[str]:
        """The analyzer table's columns: key, label, the shape columns, then the rest."""
        return [*TABLE_COLUMNS[:2], *self.shape_columns, *TABLE_COLUMNS[2:]]

    def part(self, slot: str) -> Any:
        """The part attached in ``slot`` (one of :data:`PARTS`), None where no layer did."""
        if slot not in PARTS:
            raise KeyError(f"no part {slot!r} on a kind (one of {', '.join(PARTS)})")
        return self.parts.get(slot)

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


def attach(name: str, **parts: Any) -> None:
    """Attach upper-layer parts (``router=...``, ``intercept=...``, ``tuner=...``,
    ``online=...``) to the kind ``name``; attaching again replaces the part."""
    kind = get(name)
    for slot, part in parts.items():
        if slot not in PARTS:
            raise KeyError(f"no part {slot!r} on a kind (one of {', '.join(PARTS)})")
        kind.parts[slot] = part


def get(name: str) -> Kind:
    """The kind called ``name``; KeyError naming the registered kinds for any other name."""
    try:
        return _KINDS[name]
    except KeyError:
        raise KeyError(f"unknown kind {name!r} (one of {', '.join(_KINDS)})") from None


def names() -> tuple[str, ...]:
    """Every registered kind's name, in registration order."""
    return tuple(_KINDS)


def all_kinds() -> Iterator[Kind]:
    return iter(tuple(_KINDS.values()))


def with_part(slot: str, among: Iterable[str] | None = None) -> dict[str, Any]:
    """Kind name -> its part in ``slot``, in registration order, for the kinds (of ``among``,
    default all) that have one."""
    wanted = set(names() if among is None else among)
    return {n: k.part(slot) for n, k in _KINDS.items() if n in wanted and k.part(slot) is not None}


def kind_of(problem: Any) -> Kind:
    """The kind whose problem type ``problem`` is; TypeError for any other object."""
    kind = _KINDS.get(getattr(type(problem), "kind", ""))
    if kind is None or not kind.takes(problem):
        raise TypeError(f"no kind takes problems of type {type(problem).__name__}")
    return kind


GEMM = register(Kind(GemmProblem, "GEMM", ("m", "n", "k")))
GROUPED = register(Kind(GroupedGemmProblem, "grouped GEMM", ("groups", "k", "n", "tokens", "skew", "skew_known")))
ATTENTION = register(Kind(AttentionProblem, "attention"))
# a model's FP8 plan (``primus_perf.fp8``): tuned and applied as a whole, no router or intercept
FP8_PLAN = register(Kind(Fp8PlanProblem, "FP8 plan", ("layers", "tokens"), label=Fp8PlanProblem.label))

if set(problem_types()) != set(_KINDS):  # every problem type is a kind, and no kind lacks one
    raise ImportError(f"problem types {sorted(problem_types())} and kinds {sorted(_KINDS)} differ")
