"""The trainer's two dispatch points: every linear GEMM goes through :func:`matmul`, every
attention through :func:`attention`. They are the fast path into the one routing path of
``primus_perf.runtime.routes``: the routers ``primus_perf.enable`` installed (the trainer
enables a tuning cache with it, as any program does), called directly instead of through
the dispatcher overrides; with none installed the cost is one dictionary lookup and the
call goes to torch.

Routers (``kernels/``, or online tuning's):

- GEMM: ``fn(a, b, bias) -> Tensor | None`` for 2-D operands (``a @ b``); None means
  "not mine, use torch". ``kernels.gemm.problem_of`` gives the
  :class:`~primus_perf.problems.GemmProblem`.
- Attention: ``fn(q, k, v, causal) -> Tensor | None`` with q/k/v in (batch, seq, heads,
  head_dim) layout (kv heads may be fewer: GQA); returns the output in the same layout.

:func:`linear` is a custom autograd Function whose forward (``x @ W.T``), input gradient
(``dy @ W``) and weight gradient (``dy.T @ x``) GEMMs all go through :func:`matmul` with
2-D operands (batch and sequence flattened), so a router sees and can replace all three.
Under autocast it casts its inputs to the autocast dtype once (as ``custom_fwd`` with
``cast_inputs`` does) and runs its GEMMs with autocast off, so the router receives
operands of the dtype the GEMM really runs in.
"""

from __future__ import annotations

import torch

from primus_perf.kernels.attention.backends import SDPA_BACKENDS, sdpa_bshd
from primus_perf.kernels.autocast import cast_operands
from primus_perf.runtime import routes

_sdpa_backend: str | None = None  # a row of kernels.attention.backends.SDPA_BACKENDS; None: torch picks


def set_sdpa_backend(name: str) -> None:
    """Restrict torch SDPA to one backend (a row of ``SDPA_BACKENDS``: "cudnn", "flash",
    ...); "auto" lets torch pick."""
    global _sdpa_backend
    if name != "auto" and name not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {name!r} (auto, {', '.join(SDPA_BACKENDS)})")
    _sdpa_backend = None if name == "auto" else name


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D operands: the router's answer when it gives one, else torch's."""
    if routes.installed("gemm") is None:
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
    if routes.installed("attention") is None:
        return sdpa_bshd(q, k, v, causal, _sdpa_backend)
    return routes.attention(q, k, v, causal, _sdpa_backend)
