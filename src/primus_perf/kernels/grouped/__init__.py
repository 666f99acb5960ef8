"""Grouped GEMM (MoE expert layers): backends, the Triton kernel's configs, the router
built from a tuning cache, and the passes' problems (:func:`problem_of`). The routing point
every expert GEMM goes through is the runtime's (``runtime.seams.grouped_mm``)."""

from __future__ import annotations

from primus_perf.kernels.grouped.backends import BACKENDS, Backend, available, triton_backend
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.passes import DEFAULT_BACKEND, problem_of, run_backend

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "Backend",
    "GroupedGemmConfig",
    "available",
    "problem_of",
    "run_backend",
    "triton_backend",
]
