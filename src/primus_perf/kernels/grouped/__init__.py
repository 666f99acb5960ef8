"""Grouped GEMM (MoE expert layers): backends, the Triton kernel's configs, the router
built from a tuning cache, and the passes' problems (:func:`problem_of`) with the
re-entrancy guard every routed grouped GEMM runs inside (:func:`in_grouped`). Where a
program's grouped GEMMs are routed is the runtime's (``runtime.grouped``)."""

from __future__ import annotations

from primus_perf.kernels.grouped.backends import (
    AUTO,
    BACKENDS,
    DEFAULT_RULE,
    Backend,
    available,
    default_backend,
    triton_backend,
)
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.passes import (
    DEFAULT_BACKEND,
    in_grouped,
    inside,
    problem_of,
    run_backend,
)

__all__ = [
    "AUTO",
    "BACKENDS",
    "DEFAULT_BACKEND",
    "DEFAULT_RULE",
    "Backend",
    "GroupedGemmConfig",
    "available",
    "default_backend",
    "in_grouped",
    "inside",
    "problem_of",
    "run_backend",
    "triton_backend",
]
