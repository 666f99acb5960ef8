"""The trainer's two dispatch points: every linear GEMM goes through :func:`matmul`, every
attention through :func:`attention`. A tuning cache installs a router here; with none set
the cost is one ``is None`` check and the call goes to torch.

Routers:

- GEMM: ``fn(a, b) -> Tensor | None`` for 2-D operands (``a @ b``); None means "not mine,
  use torch". :func:`problem_of` gives the :class:`~primus_perf.problems.GemmProblem`.
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

from collections.abc import Callable

import torch
import torch.nn.functional as F

from primus_perf.problems import GemmProblem, dtype_name, operand_layout

GemmRouter = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
AttentionRouter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], "torch.Tensor | None"]

_gemm_router: GemmRouter | None = None
_attention_router: AttentionRouter | None = None
_sdpa_backends: list | None = None  # None: torch picks


def set_gemm_router(fn: GemmRouter | None) -> None:
    """Install (or with None remove) the GEMM router."""
    global _gemm_router
    _gemm_router = fn


def get_gemm_router() -> GemmRouter | None:
    return _gemm_router


def set_attention_router(fn: AttentionRouter | None) -> None:
    """Install (or with None remove) the attention router."""
    global _attention_router
    _attention_router = fn


def get_attention_router() -> AttentionRouter | None:
    return _attention_router


_BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def set_sdpa_backend(name: str) -> None:
    """Restrict torch SDPA to one backend ("cudnn", "flash", ...); "auto" lets torch pick."""
    global _sdpa_backends
    if name == "auto":
        _sdpa_backends = None
        return
    from torch.nn.attention import SDPBackend

    _sdpa_backends = [getattr(SDPBackend, _BACKENDS[name])]


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D operands: the router's answer when it gives one, else torch's."""
    router = _gemm_router
    if router is not None:
        out = router(a, b)
        if out is not None:
            return out
    return torch.mm(a, b)


def problem_of(a: torch.Tensor, b: torch.Tensor) -> GemmProblem:
    """The GemmProblem of ``a @ b`` for 2-D operands whose rows or columns are contiguous
    (``problems.operand_layout``); ValueError for any other operands."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"problem_of needs 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    la = operand_layout(*a.shape, *a.stride())
    lb = operand_layout(*b.shape, *b.stride())
    if la is None or lb is None:
        raise ValueError(
            f"operand strides {a.stride()} / {b.stride()} have no BLAS layout"
        )
    if a.dtype != b.dtype:
        raise ValueError(f"operand dtypes differ: {a.dtype} and {b.dtype}")
    return GemmProblem.from_operands(la, lb, dtype_name(a.dtype))


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        device_type = x.device.type
        cast = _autocast_dtype(device_type)
        if cast is not None:
            x = x.to(cast)
            weight = weight.to(cast)
        elif weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
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
    """``x @ weight.T`` (weight is ``[out, in]``) with all three GEMMs through :func:`matmul`."""
    return _Linear.apply(x, weight)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    hq, hkv = q.shape[2], k.shape[2]
    if hkv != hq:  # GQA: expand kv heads so every SDPA backend (flash, cuDNN) applies
        rep = hq // hkv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if _sdpa_backends is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_sdpa_backends):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Scaled dot-product attention, (batch, seq, heads, head_dim) in and out."""
    router = _attention_router
    if router is not None:
        out = router(q, k, v, causal)
        if out is not None:
            return out
    return _sdpa(q, k, v, causal)
