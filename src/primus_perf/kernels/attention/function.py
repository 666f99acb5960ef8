"""``triton_attention``: the Triton kernels as an autograd function (trainer layout)."""

from __future__ import annotations

import torch

from primus_perf.kernels.attention.configs import AttnConfig
from primus_perf.kernels.attention.kernels import flash_bwd, flash_fwd


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, config: AttnConfig, sm_scale: float | None):
        o, lse = flash_fwd(q, k, v, causal, config.fwd, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.config = config
        ctx.sm_scale = sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_bwd(do, q, k, v, o, lse, ctx.causal, ctx.config.bwd, ctx.sm_scale)
        return dq, dk, dv, None, None, None


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    config: AttnConfig | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Attention over (batch, seq, heads, head_dim) tensors with the given tile config."""
    return _TritonAttention.apply(q, k, v, causal, config or AttnConfig(), sm_scale)
