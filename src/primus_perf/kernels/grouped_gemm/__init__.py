"""Grouped GEMM (MoE expert layers): backends, the Triton kernel's configs, and the one
dispatch point (:func:`grouped_mm`, routed through :func:`run`)."""

from __future__ import annotations

from primus_perf.kernels.grouped_gemm.backends import (
    AUTO,
    BACKENDS,
    DEFAULT_RULE,
    Backend,
    available,
    default_backend,
    triton_backend,
)
from primus_perf.kernels.grouped_gemm.configs import GroupedGemmConfig
from primus_perf.kernels.grouped_gemm.dispatch import (
    DEFAULT_BACKEND,
    get_router,
    grouped_mm,
    in_grouped,
    inside,
    problem_of,
    run,
    set_router,
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
    "get_router",
    "grouped_mm",
    "in_grouped",
    "inside",
    "problem_of",
    "run",
    "set_router",
    "triton_backend",
]
