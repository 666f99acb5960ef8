"""The three passes of a grouped GEMM (MoE expert layers) on the kernel side: the problem of
a pass's operands (:func:`problem_of`) and one pass on a backend (:func:`run_backend`).

A pass is ``(phase, a, b, counts)``: fwd ``x[T, K]``, ``w[G, K, N]``; dgrad ``dy[T, N]``,
``w.transpose(1, 2)``; wgrad ``x[T, K]``, ``dy[T, N]``; ``counts``: the host token counts
per group (see :class:`~primus_perf.problems.GroupedGemmProblem`). Where a program's grouped
GEMMs are routed is the runtime's business (``runtime.seams.grouped_mm``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from primus_perf.kernels.grouped.backends import Backend
from primus_perf.problems import GroupedGemmProblem, dtype_name

DEFAULT_BACKEND = "loop"


def run_backend(
    backend: Backend, phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]
) -> torch.Tensor:
    """One pass of :func:`run` on ``backend`` (``wgrad`` or the product of the others)."""
    return backend.wgrad(a, b, counts) if phase == "wgrad" else backend.mm(a, b, counts)


def problem_of(
    phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]
) -> GroupedGemmProblem:
    """The problem of a :func:`run` call. ``k``, ``n`` and ``trans_w`` describe the forward
    weight (``trans_w``: stored ``[G, N, K]`` and used transposed); a wgrad problem has
    ``trans_w=False``: it produces ``dW[G, K, N]`` whatever the weight's storage."""
    dtype = dtype_name(a.dtype)
    if phase == "fwd":
        k, n, trans_w = b.shape[1], b.shape[2], b.stride(2) != 1
    elif phase == "dgrad":
        k, n, trans_w = b.shape[2], b.shape[1], b.stride(1) != 1
    elif phase == "wgrad":
        k, n, trans_w = a.shape[1], b.shape[1], False
    else:
        raise ValueError(f"unknown grouped GEMM pass {phase!r}")
    return GroupedGemmProblem.from_counts(
        list(counts), k, n, dtype=dtype, trans_w=trans_w, phase=phase
    )
