"""The grouped-GEMM router: the cached backend per problem of a program's grouped GEMM calls.

A cached choice is ``GroupedChoice(backend, config)``: ``backend`` is a row of
``backends.BACKENDS`` (``loop``, ``grouped_mm``, ``padded_bmm``, ``triton``), ``config``
the Triton tiles when it is ``triton``.

A call is a pass whose groups are :class:`~.offsets.Offsets` (the device ``offs`` of an
``aten::_grouped_mm`` call). A problem's key holds its pass, shapes, dtype, token bucket and
skew bucket (``passes.problem_of``); its *shape* is all of that but the skew: the
balanced-split key (skew 1, ``passes.shape_problem_of``), which a call's operands give
without its counts. Where every entry of a shape (all its skew buckets) names the same
choice, that choice runs for every call of the shape, read without the counts; where they
disagree (:data:`MIXED`), the call's own key decides: its counts are taken from a
non-blocking copy (``Offsets.peek``) where it has landed (a layer's backward: its forward
started the copy), else the call runs the choice its call site (shape and weight) ran last,
and only a site's first call reads its counts on the host, waiting for the device. A shape
with no entry runs the caller's kernel without any host read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from primus_perf.base.errors import CacheError
from primus_perf.kernels.grouped.backends import BACKENDS, Backend, triton_backend
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.offsets import Offsets
from primus_perf.kernels.grouped.passes import problem_of, run_offsets, shape_problem_of
from primus_perf.kernels.routing import (
    OWN,
    UNSUPPORTED,
    CachedChoice,
    choice_solution,
    solution_backend,
)
from primus_perf.problems import GroupedGemmProblem

VERSIONED_LIBRARIES = ("torch", "cuda", "hip", "triton")
TRITON = "triton"


def library_versions() -> dict[str, str]:
    """The library versions a grouped-GEMM cache entry must match: torch (its CUDA or HIP)
    and Triton."""
    from primus_perf.base.devices import library_versions as all_versions

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
        as ``backends.default_backend`` runs it); None for a name no backend has."""
        if name not in BACKENDS:
            return None
        return cls(name, GroupedGemmConfig() if name == TRITON else None)

    def implementation(self) -> Backend:
        return triton_backend(self.config) if self.config is not None else BACKENDS[self.backend]


MIXED = "mixed"  # a shape whose entries name different choices by skew bucket
BY_SKEW = "its choices by skew bucket"  # how a MIXED shape's choice is named
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


class GroupedGemmRouter:
    """``route(phase, a, b, offsets, baseline)`` over a table of cached choices (module docstring)."""

    def __init__(self, choices: Mapping[str, GroupedChoice] | Iterable[tuple[str, GroupedChoice]]):
        self.choices: dict[str, GroupedChoice] = dict(choices)
        self.shapes = _shapes(self.choices)
        self._last: dict[tuple[str, int], str] = {}  # call site -> the key it ran last (mixed shapes)
        self._impls: dict[GroupedChoice, Backend] = {}

    @classmethod
    def from_entries(cls, entries: Iterable[CachedChoice]) -> GroupedGemmRouter:
        """The router over usable cache entries; CacheError for an unreadable solution."""
        choices: dict[str, GroupedChoice] = {}
        for entry in entries:
            try:
                choices[entry.problem_key] = GroupedChoice.from_solution(entry.solution["config"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CacheError(f"{GroupedGemmProblem.kind} cache entry {entry.problem_key}: {exc}") from None
        return cls(choices)

    def idle(self, baseline: str = TORCH_KERNEL) -> bool:
        """True when the cache has choices and every one is the ``baseline`` backend: the calls
        would run it either way. With no choice at all the router is not idle: its dispatch
        counts the calls left to the caller and names each call's problem in a trace."""
        own = GroupedChoice.of_backend(baseline)
        return bool(self.choices) and all(c == own for c in self.choices.values())

    def may_route(self, *call: Any) -> bool:
        return True

    def _choice(self, problem: GroupedGemmProblem) -> GroupedChoice | None:
        found = self.shapes.get(shape_key(problem))
        if found is None:
            return self.choices.get(problem.key())  # an entry no shape covers (not a problem key)
        return self.choices.get(problem.key()) if found == MIXED else found

    def implementation(self, choice: GroupedChoice) -> Backend:
        impl = self._impls.get(choice)
        if impl is None:
            impl = self._impls[choice] = choice.implementation()
        return impl

    def label(self, shape: str) -> str | None:
        """The name of a shape's choice (:data:`BY_SKEW` where its entries differ), None for none."""
        choice = self.shapes.get(shape)
        return BY_SKEW if choice == MIXED else (choice.label() if choice is not None else None)

    def route(self, phase: str, a: torch.Tensor, b: torch.Tensor, offsets: Offsets,
              baseline: str = TORCH_KERNEL) -> tuple[str, Any]:
        """``(key, run)`` of a pass whose groups are ``offsets`` (``a``, and a wgrad's ``b``, with
        ``offsets.rows`` rows): the key is the shape's, or the call's own where the shape's
        entries differ by skew (:meth:`_mixed_key`); ``run`` the choice (:data:`OWN` where it
        is the ``baseline`` backend, None where no entry applies)."""
        try:
            problem = shape_problem_of(phase, a, b, offsets.groups)
            key = problem.key()
            if self.shapes.get(key) == MIXED:
                key = self._mixed_key(key, phase, a, b, offsets)
                problem = GroupedGemmProblem.from_key(key)
        except ValueError:  # a dtype or pass no problem describes, offs that split no rows
            return UNSUPPORTED, None
        choice = self._choice(problem)
        if choice is None:
            return key, None
        if choice == GroupedChoice.of_backend(baseline):
            return key, OWN
        impl = self.implementation(choice)
        return key, lambda: run_offsets(impl, phase, a, b, offsets)

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

    def close(self) -> None:
        self._impls.clear()
