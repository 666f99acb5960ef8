"""The grouped-GEMM router: the cached backend per problem, the caller's backend otherwise.

A cached choice is ``GroupedChoice(backend, config)``: ``backend`` is a row of
``backends.BACKENDS`` (``loop``, ``grouped_mm``, ``padded_bmm``, ``triton``), ``config``
the Triton tiles when it is ``triton``.

Which problems have a choice: a problem's key holds its pass, shapes, dtype, token bucket
and skew bucket (``passes.problem_of``). Its *shape* is all of that but the skew: the
balanced-split key (skew 1, ``passes.shape_problem_of``), which a call's operands give
without its token counts. Where every cache entry of a shape (all its skew buckets) names
the same choice, that choice runs for every call of the shape, whatever its skew; where
entries of one shape disagree, the call's own key decides. A call whose counts are on the
device only (:meth:`GroupedGemmRouter.route_offsets`) then takes them from a non-blocking
copy (``offsets.Offsets.peek``) where it has landed (a layer's backward: its forward
started the copy); where it has not (a forward), the call runs the choice its call site
(the shape and the weight) ran last, and only the first call of a site reads its counts
on the host, waiting for the device: counted in ``summary()["offs_reads"]``. A shape with
no entry runs the caller's kernel without any host read.

Two entries: ``router(phase, a, b, counts)`` for a pass with host counts (the routing point
``runtime.seams.grouped_pass``; None: the caller's backend runs), and
:meth:`~GroupedGemmRouter.route_offsets` for a pass whose groups are the device ``offs`` of
an ``aten::_grouped_mm`` call (``runtime.grouped_intercept``; None: torch's kernel runs,
as it does where the choice is torch's own kernel, ``grouped_mm``: counted as routed, the
cache's choice, with nothing in between).
``summary()``: ``routing.Router``'s, with ``offs_reads`` (calls that waited for the device
to read their counts, by problem key). ``route_offsets`` counts a call under its shape's key
(the counts do not decide it, whether or not they were read for its backend), unless its
shape's entries differ by skew: then under its own key; the host-counts entry counts every
call under its own key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from primus_perf.errors import CacheError
from primus_perf.kernels.grouped.backends import BACKENDS, Backend, triton_backend
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.offsets import Offsets
from primus_perf.kernels.grouped.passes import (
    problem_of,
    run_backend,
    run_offsets,
    shape_problem_of,
)
from primus_perf.kernels.routing import CachedChoice, Router, choice_solution, solution_backend
from primus_perf.problems import GroupedGemmProblem

VERSIONED_LIBRARIES = ("torch", "cuda", "hip", "triton")
TRITON = "triton"


def library_versions() -> dict[str, str]:
    """The library versions a grouped-GEMM cache entry must match: torch (its CUDA or HIP)
    and Triton."""
    from primus_perf.devices import library_versions as all_versions

    return {k: v for k, v in all_versions().items() if k in VERSIONED_LIBRARIES}


@dataclass(frozen=True)
class GroupedChoice:
    backend: str
    config: GroupedGemmConfig | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown grouped GEMM backend {self.backend!r} ({', '.join(BACKENDS)})")
        if (self.backend == TRITON) != (self.config is not None):
            raise ValueError("a triton choice needs a config, and only a triton choice has one")

    def to_solution(self) -> dict[str, Any]:
        """The readable ``config`` part of a cache entry's solution."""
        return choice_solution(self.backend, self.config)

    @classmethod
    def from_solution(cls, data: Mapping[str, Any]) -> GroupedChoice:
        backend = solution_backend(data, "a grouped GEMM")
        fields = {k: v for k, v in data.items() if k not in ("backend", "name")}
        config = GroupedGemmConfig.from_dict(fields) if backend == TRITON else None
        return cls(backend, config)

    def label(self) -> str:
        return f"triton {self.config.label()}" if self.config else self.backend

    @classmethod
    def of_backend(cls, name: str | None) -> GroupedChoice | None:
        """The choice a caller's fixed backend ``name`` runs (``triton``: its default config,
        as ``backends.default_backend`` and the seam run it); None for a name no backend has."""
        if name not in BACKENDS:
            return None
        return cls(name, GroupedGemmConfig() if name == TRITON else None)

    def implementation(self) -> Backend:
        return triton_backend(self.config) if self.config is not None else BACKENDS[self.backend]


MIXED = "mixed"  # a shape whose entries name different choices by skew bucket
TORCH_KERNEL = "grouped_mm"  # the backend that is torch's own kernel: what an aten::_grouped_mm call runs


def shape_key(problem: GroupedGemmProblem) -> str:
    """The key of ``problem``'s shape: its balanced-split (skew 1) key."""
    return replace(problem, skew=1.0).key()


def _shapes(choices: Mapping[str, GroupedChoice]) -> dict[str, GroupedChoice | str]:
    """Shape key -> the one choice of all its entries, or :data:`MIXED`."""
    out: dict[str, GroupedChoice | str] = {}
    for key, choice in choices.items():
        try:
            shape = shape_key(GroupedGemmProblem.from_key(key))
        except ValueError:  # no problem key: found by its exact key only
            continue
        out[shape] = choice if out.get(shape, choice) == choice else MIXED
    return out


class GroupedGemmRouter(Router):
    """Callable ``(phase, a, b, counts) -> Tensor | None`` over a table of cached choices;
    :meth:`route_offsets` for a pass whose counts are on the device."""

    def __init__(self, choices: Mapping[str, GroupedChoice] | Iterable[tuple[str, GroupedChoice]]):
        super().__init__()
        self.choices: dict[str, GroupedChoice] = dict(choices)
        self.shapes = _shapes(self.choices)
        self.offs_reads: Counter[str] = Counter()
        self._last: dict[tuple[str, int], str] = {}  # call site -> the key it ran last (mixed shapes)
        self._impls: dict[GroupedChoice, Backend] = {}

    @classmethod
    def from_entries(cls, entries: Iterable[CachedChoice]) -> GroupedGemmRouter | None:
        """The router over usable cache entries; CacheError for an unreadable solution."""
        choices: dict[str, GroupedChoice] = {}
        for entry in entries:
            try:
                choices[entry.problem_key] = GroupedChoice.from_solution(entry.solution["config"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CacheError(f"{GroupedGemmProblem.kind} cache entry {entry.problem_key}: {exc}") from None
        return cls(choices) if choices else None

    @property
    def intercepts_nothing(self) -> bool:
        """True when the cache has choices and every one is torch's own kernel
        (:data:`TORCH_KERNEL`): a program's ``aten::_grouped_mm`` calls would run it either
        way, so they need no override (primus-train's seam still routes: its own backend may
        be another). With no choice at all the override stays: it counts the calls left to
        torch and names each call's problem in a profiler trace."""
        return bool(self.choices) and all(c.backend == TORCH_KERNEL for c in self.choices.values())

    def _choice(self, problem: GroupedGemmProblem) -> GroupedChoice | None:
        found = self.shapes.get(shape_key(problem))
        if found is None:
            return self.choices.get(problem.key())  # an entry no shape covers (not a problem key)
        return self.choices.get(problem.key()) if found == MIXED else found

    def _impl(self, choice: GroupedChoice) -> Backend:
        impl = self._impls.get(choice)
        if impl is None:
            impl = self._impls[choice] = choice.implementation()
        return impl

    def __call__(self, phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]):
        try:
            problem = problem_of(phase, a, b, counts)
        except ValueError:  # a dtype or pass no problem describes
            self._fall_back("unsupported")
            return None
        key = problem.key()
        choice = self._choice(problem)
        if choice is None:
            self._fall_back(key)
            return None
        impl = self._impl(choice)
        return self._run(key, lambda: run_backend(impl, phase, a, b, counts))

    def route_offsets(self, phase: str, a: torch.Tensor, b: torch.Tensor, offsets: Offsets):
        """A pass whose groups are :class:`~.offsets.Offsets` (``a``, and a wgrad's ``b``, with
        ``offsets.rows`` rows): the choice of its shape, read without the counts unless the
        shape's entries disagree by skew (:meth:`_mixed_key`: a device sync for a call site's
        first call only). None where no entry applies (torch's kernel runs, nothing read on
        the host)."""
        try:
            problem = shape_problem_of(phase, a, b, offsets.groups)
            key = problem.key()
            if self.shapes.get(key) == MIXED:
                key = self._mixed_key(key, phase, a, b, offsets)
                problem = GroupedGemmProblem.from_key(key)
        except ValueError:  # a dtype or pass no problem describes, offs that split no rows
            self._fall_back("unsupported")
            return None
        if offsets.read:
            self.offs_reads[key] += 1
        choice = self._choice(problem)
        if choice is None:
            self._fall_back(key)
            return None
        if choice.backend == TORCH_KERNEL:  # the cached choice is the caller's own kernel: it runs it
            self.routed[key] += 1
            return None
        impl = self._impl(choice)
        read = offsets.read

        def launch() -> torch.Tensor:
            out = run_offsets(impl, phase, a, b, offsets)
            if offsets.read and not read:  # the backend needed the counts
                self.offs_reads[key] += 1
            return out

        return self._run(key, launch)

    def _mixed_key(self, shape: str, phase: str, a: torch.Tensor, b: torch.Tensor, offsets: Offsets) -> str:
        """The key of a call whose shape's entries differ by skew: from its counts where they
        are at hand without waiting, else the key its call site ran last, else (the site's
        first call) from its counts read on the host."""
        site = (shape, b.data_ptr() if phase != "wgrad" else 0)  # the weight: one layer's GEMM
        counts = offsets.peek()
        if counts is None and site in self._last:
            return self._last[site]
        key = problem_of(phase, a, b, offsets.counts() if counts is None else counts).key()
        self._last[site] = key
        return key

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "offs_reads": dict(self.offs_reads)}
