"""The grouped-GEMM router: the cached backend per problem, the caller's backend otherwise.

A cached choice is ``GroupedChoice(backend, config)``: ``backend`` is a row of
``backends.BACKENDS`` (``loop``, ``grouped_mm``, ``padded_bmm``, ``triton``), ``config``
the Triton tiles when it is ``triton``. The router answers a pass of the routing point
(``runtime.seams.grouped_pass``: ``(phase, a, b, counts)``) whose problem (``passes.problem_of``: the
pass, shapes, dtype and token-distribution bucket) has a choice by running that backend,
also when it is the per-expert loop (the caller may have named another backend); for any
other problem it answers None and the caller's backend runs. ``summary()``:
``routing.Router``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from primus_perf.errors import CacheError
from primus_perf.kernels.grouped.backends import BACKENDS, Backend, triton_backend
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.passes import problem_of, run_backend
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

    def implementation(self) -> Backend:
        return triton_backend(self.config) if self.config is not None else BACKENDS[self.backend]


class GroupedGemmRouter(Router):
    """Callable ``(phase, a, b, counts) -> Tensor | None`` over a table of cached choices."""

    def __init__(self, choices: Mapping[str, GroupedChoice] | Iterable[tuple[str, GroupedChoice]]):
        super().__init__()
        self.choices: dict[str, GroupedChoice] = dict(choices)
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

    def __call__(self, phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]):
        try:
            key = problem_of(phase, a, b, counts).key()
        except ValueError:  # a dtype or pass no problem describes
            self._fall_back("unsupported")
            return None
        choice = self.choices.get(key)
        if choice is None:
            self._fall_back(key)
            return None
        impl = self._impls.get(choice)
        if impl is None:
            impl = self._impls[choice] = choice.implementation()
        return self._run(key, lambda: run_backend(impl, phase, a, b, counts))
