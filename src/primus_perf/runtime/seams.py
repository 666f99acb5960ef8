"""The routing points code calls directly: every linear GEMM of the reference trainer goes
through :func:`linear` (:func:`matmul` for each of its three GEMMs), every attention through
:func:`attention`, and every MoE expert GEMM (the trainer's, or any program's that calls it)
through :func:`grouped_mm` (:func:`grouped_pass` for each of its three passes). They are the
fast path into the one routing path of :mod:`.routes`: the routers installed there, called
directly instead of through the dispatcher overrides (``intercept``); with none installed
the cost is one dictionary lookup and the call goes to torch (or, for a grouped GEMM, to
the caller's backend).

Routers (``kernels/``, or online tuning's):

- GEMM: ``fn(a, b, bias) -> Tensor | None`` for 2-D operands (``a @ b``); None means
  "not mine, use torch". ``kernels.gemm.problem_of`` gives the
  :class:`~primus_perf.problems.GemmProblem`.
- Attention: ``fn(q, k, v, causal) -> Tensor | None`` with q/k/v in (batch, seq, heads,
  head_dim) layout (kv heads may be fewer: GQA); returns the output in the same layout.
- Grouped GEMM: ``fn(phase, a, b, counts) -> Tensor | None`` with the operands of the pass
  (``kernels.grouped.passes``) and the host token counts per group;
  ``kernels.grouped.problem_of`` gives the :class:`~primus_perf.problems.GroupedGemmProblem`.

:func:`linear` and :func:`grouped_mm` are custom autograd Functions whose forward, input
gradient and weight gradient GEMMs all go through the routing point, so a router sees and
can replace all three. Under autocast they cast their inputs to the autocast dtype once (as
``custom_fwd`` with ``cast_inputs`` does) and run their GEMMs with autocast off, so the
router receives operands of the dtype the GEMM really runs in.

While torch.profiler records, :func:`grouped_pass` wraps each call in an annotation named by
:func:`~primus_perf.problems.grouped_trace_name` (the problem's key and the call's exact
total tokens), so a trace shows one grouped GEMM call, with its problem and exact FLOPs,
around the per-expert GEMMs or the kernel that ran it. Outside the profiler it costs one
flag read (:func:`~primus_perf.kernels.tracing.profiler_on`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from primus_perf.kernels.attention.backends import SDPA_BACKENDS, sdpa_bshd
from primus_perf.kernels.autocast import cast_operands
from primus_perf.kernels.grouped.backends import BACKENDS
from primus_perf.kernels.grouped.passes import DEFAULT_BACKEND, inside, problem_of, run_backend
from primus_perf.kernels.tracing import profiler_on
from primus_perf.kinds import ATTENTION, GEMM
from primus_perf.problems import grouped_trace_name
from primus_perf.runtime import native, routes

_sdpa_backend: str | None = None  # a row of kernels.attention.backends.SDPA_BACKENDS; None: torch picks


def set_sdpa_backend(name: str) -> None:
    """Restrict torch SDPA to one backend (a row of ``SDPA_BACKENDS``: "cudnn", "flash",
    ...); "auto" lets torch pick."""
    global _sdpa_backend
    if name != "auto" and name not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {name!r} (auto, {', '.join(SDPA_BACKENDS)})")
    _sdpa_backend = None if name == "auto" else name


_GEMM = GEMM.name


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D operands: the router's answer when it gives one, else torch's (through
    ``torch.mm`` where the native GEMM dispatch is installed: it routes the call without Python)."""
    if routes.installed(_GEMM) is None or native.installed():
        return torch.mm(a, b)
    return routes.gemm(a, b)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        device_type = x.device.type
        x, weight = cast_operands(x, weight)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        with torch.autocast(device_type, enabled=False):
            y = matmul(x2, weight.t())
        ctx.save_for_backward(x2, weight)
        ctx.in_shape = shape
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        if dy2.dtype != x2.dtype:
            dy2 = dy2.to(x2.dtype)
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = matmul(dy2, weight).view(ctx.in_shape)
            if ctx.needs_input_grad[1]:
                dw = matmul(dy2.t(), x2)
        return dx, dw


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (weight is ``[out, in]``) with all three GEMMs through :func:`matmul`;
    a weight tagged for FP8 (``kernels.fp8.linear.tag_weights``) runs its FP8 recipe instead."""
    fp8 = getattr(weight, "fp8_linear", None)
    if fp8 is not None:
        return fp8(x, weight)
    return _Linear.apply(x, weight)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Scaled dot-product attention, (batch, seq, heads, head_dim) in and out."""
    if routes.installed(ATTENTION.name) is None:
        return sdpa_bshd(q, k, v, causal, _sdpa_backend)
    return routes.attention(q, k, v, causal, _sdpa_backend)


# ---- grouped GEMMs (MoE expert layers) ---------------------------------------------------


def grouped_pass(
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
            return _grouped_route(phase, a, b, counts, backend)
    return _grouped_route(phase, a, b, counts, backend)


def _grouped_route(
    phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int], backend: str
) -> torch.Tensor:
    with inside:
        def fallback() -> torch.Tensor:
            return run_backend(BACKENDS[backend], phase, a, b, counts)

        return routes.grouped(phase, a, b, counts, fallback, backend)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, backend):  # type: ignore[override]
        device_type = x.device.type
        x, w = cast_operands(x, w)
        if not x.is_contiguous():
            x = x.contiguous()
        with torch.autocast(device_type, enabled=False):
            y = grouped_pass("fwd", x, w, counts, backend)
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
                dx = grouped_pass("dgrad", dy, w.transpose(1, 2), ctx.counts, ctx.backend)
            if ctx.needs_input_grad[1]:
                dw = grouped_pass("wgrad", x, dy, ctx.counts, ctx.backend)
        return dx, dw, None, None


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: Sequence[int], backend: str = DEFAULT_BACKEND
) -> torch.Tensor:
    """``y[T, N]`` with the rows of group g equal to ``x_g @ w[g]``: ``x[T, K]`` sorted by
    group (``counts[g]`` rows each, host ints summing to T), ``w[G, K, N]``. Differentiable;
    all three GEMMs go through :func:`grouped_pass` with ``backend`` as the fallback."""
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
