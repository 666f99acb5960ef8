"""The grouped-GEMM seam: every expert GEMM of a training step goes through :func:`run`.

:func:`grouped_mm` is a custom autograd Function whose three grouped GEMMs (forward
``x_g @ W_g``, input gradient ``dy_g @ W_g^T``, weight gradient ``x_g^T @ dy_g``) each call
:func:`run` with the pass name ("fwd", "dgrad", "wgrad"; see
:class:`~primus_perf.problems.GroupedGemmProblem`), so one router sees and can replace all
three. With no router, or when it answers None, the caller's backend runs (``loop`` unless
the caller names another one).

Router: ``fn(phase, a, b, counts) -> Tensor | None`` with the operands of the pass
(fwd: ``x[T, K]``, ``w[G, K, N]``; dgrad: ``dy[T, N]``, ``w.transpose(1, 2)``; wgrad:
``x[T, K]``, ``dy[T, N]``) and the host token counts per group; :func:`problem_of` gives the
:class:`~primus_perf.problems.GroupedGemmProblem`. Under autocast the Function casts its
inputs to the autocast dtype once and runs its GEMMs with autocast off, so the router sees
the dtype the GEMM really runs in.

While torch.profiler records, :func:`run` wraps each call in an annotation named by
:func:`~primus_perf.problems.grouped_trace_name` (the problem's key and the call's exact
total tokens), so a trace shows one grouped GEMM call, with its problem and exact FLOPs,
around the per-expert GEMMs or the kernel that ran it. Outside the profiler it costs one
flag read (:func:`~primus_perf.kernels.tracing.profiler_on`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from primus_perf.kernels.autocast import cast_operands
from primus_perf.kernels.grouped_gemm.backends import BACKENDS, Backend
from primus_perf.kernels.tracing import profiler_on
from primus_perf.problems import (
    GROUPED_PASSES,
    GroupedGemmProblem,
    dtype_name,
    grouped_mm_call,
    grouped_trace_name,
)

DEFAULT_BACKEND = "loop"

Router = Callable[[str, torch.Tensor, torch.Tensor, Sequence[int]], "torch.Tensor | None"]

_router: Router | None = None
_local = threading.local()  # .depth: > 0 while a grouped GEMM runs on this thread


class _Inside:
    """While entered, this thread runs a grouped GEMM (:func:`in_grouped`)."""

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1


inside = _Inside()


def in_grouped() -> bool:
    """True while a grouped GEMM runs (:func:`run`, or an ``aten::_grouped_mm`` call routed
    by ``enable()``): the GEMMs its router or backend calls, ``torch.mm``, ``torch.bmm`` and
    ``torch._grouped_mm`` alike, are torch's and are not routed again. The grouped problem
    is what was tuned, timed with those GEMMs as torch runs them; its pieces (per-expert
    slices, a zero-padded batch) change shape with every step's token split and are no
    problem the GEMM router was tuned for."""
    return getattr(_local, "depth", 0) > 0


def set_router(fn: Router | None) -> None:
    """Install (or with None remove) the grouped-GEMM router."""
    global _router
    _router = fn


def get_router() -> Router | None:
    return _router


def run(
    phase: str,
    a: torch.Tensor,
    b: torch.Tensor,
    counts: Sequence[int],
    backend: str = DEFAULT_BACKEND,
) -> torch.Tensor:
    """One grouped GEMM of ``phase``: the router's answer when it gives one, else
    ``backend``'s (inside an annotation naming the problem while the profiler records)."""
    if profiler_on():
        name = grouped_trace_name(problem_of(phase, a, b, counts), sum(counts))
        with torch.autograd.profiler.record_function(name):
            return _route(phase, a, b, counts, backend)
    return _route(phase, a, b, counts, backend)


def _route(
    phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int], backend: str
) -> torch.Tensor:
    router = _router
    with inside:
        if router is not None:
            out = router(phase, a, b, counts)
            if out is not None:
                return out
        return run_backend(BACKENDS[backend], phase, a, b, counts)


def run_backend(
    backend: Backend, phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]
) -> torch.Tensor:
    """One pass of :func:`run` on ``backend`` (``wgrad`` or the product of the others)."""
    return backend.wgrad(a, b, counts) if phase == "wgrad" else backend.mm(a, b, counts)


def problem_of(
    phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]
) -> GroupedGemmProblem:
    """The problem of a :func:`run` call, read as the ``aten::_grouped_mm`` call of that pass
    would be (``problems.grouped_mm_call``: the seam, the dispatcher override and the trace
    analyzer share one reading). ``k``, ``n`` and ``trans_w`` describe the forward weight
    (``trans_w``: stored ``[G, N, K]`` and used transposed); a wgrad problem has
    ``trans_w=False``: it produces ``dW[G, K, N]`` whatever the weight's storage."""
    if phase not in GROUPED_PASSES:
        raise ValueError(f"unknown grouped GEMM pass {phase!r}")
    a_shape, a_strides = tuple(a.shape), a.stride()
    if phase == "wgrad":  # the aten call's a is x^T
        a_shape, a_strides = a_shape[::-1], a_strides[::-1]
    call = grouped_mm_call(a_shape, a_strides, b.shape, b.stride(), len(counts), phase == "dgrad")
    if call is None or call.phase != phase:
        raise ValueError(f"grouped GEMM {phase}: operands {tuple(a.shape)} and {tuple(b.shape)} do not fit")
    return call.problem(dtype_name(a.dtype), list(counts))


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, backend):  # type: ignore[override]
        device_type = x.device.type
        x, w = cast_operands(x, w)
        if not x.is_contiguous():
            x = x.contiguous()
        with torch.autocast(device_type, enabled=False):
            y = run("fwd", x, w, counts, backend)
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.backend = counts, backend
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, w = ctx.saved_tensors
        dy = dy.contiguous().to(x.dtype)
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = run("dgrad", dy, w.transpose(1, 2), ctx.counts, ctx.backend)
            if ctx.needs_input_grad[1]:
                dw = run("wgrad", x, dy, ctx.counts, ctx.backend)
        return dx, dw, None, None


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: Sequence[int], backend: str = DEFAULT_BACKEND
) -> torch.Tensor:
    """``y[T, N]`` with the rows of group g equal to ``x_g @ w[g]``: ``x[T, K]`` sorted by
    group (``counts[g]`` rows each, host ints summing to T), ``w[G, K, N]``. Differentiable;
    all three GEMMs go through :func:`run` with ``backend`` as the fallback."""
    counts = tuple(int(c) for c in counts)
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(
            f"grouped_mm needs x[T, K] and w[G, K, N], got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0] or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"grouped_mm: {len(counts)} counts summing to {sum(counts)} do not fit"
            f" x{tuple(x.shape)} and w{tuple(w.shape)}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped GEMM backend {backend!r} ({', '.join(BACKENDS)})")
    return _GroupedMM.apply(x, w, counts, backend)
