"""A torchtitan-style MoE layer written against torch's API only (no primus_perf): a top-k
router, tokens sorted by expert, and ``GroupedExperts`` whose SwiGLU experts are three
``torch._grouped_mm`` calls with ``offs`` (the cumulative tokens per expert), weights held
``[experts, in, out]``. Autograd's formulas for ``_grouped_mm`` give each call's input and
weight gradients, so one training step calls ``aten::_grouped_mm`` in every layout a MoE
program does: forward ``x[T, K] @ w[E, K, N]``, input gradient ``dy[T, N] @ w^T``, weight
gradient ``x^T[K, T] @ dy[T, N] -> [E, K, N]``. ``BatchedExperts`` is the equal-capacity
variant (3-D ``x[E, C, K] @ w[E, K, N]``, no ``offs``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU MLPs of ``dim -> hidden -> dim`` over tokens sorted by expert."""

    def __init__(self, dim: int, hidden: int, experts: int, transposed_down: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        # the nn.Linear storage [E, out, in], used transposed (as HF transformers holds it)
        self.transposed_down = transposed_down
        shape = (experts, dim, hidden) if transposed_down else (experts, hidden, dim)
        self.w2 = nn.Parameter(torch.randn(*shape) * hidden ** -0.5)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1, offs=offs)) * torch._grouped_mm(x, self.w3, offs=offs)
        w2 = self.w2.transpose(-2, -1) if self.transposed_down else self.w2
        return torch._grouped_mm(h, w2, offs=offs)


class MoE(nn.Module):
    """Router (softmax top-k), the experts, and the weighted sum back per token."""

    def __init__(self, dim: int = 32, hidden: int = 64, experts: int = 4, top_k: int = 2,
                 transposed_down: bool = False) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.grouped = GroupedExperts(dim, hidden, experts, transposed_down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # counted on the device (torch.bincount would read the largest index on the host)
        tokens_per_expert = torch.zeros(self.experts, dtype=torch.int64, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))
        routed = x[order // self.top_k]
        out = self.grouped(routed, tokens_per_expert)
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, order // self.top_k, out)
        return y.reshape(shape)


class BatchedExperts(nn.Module):
    """Equal-capacity experts: ``x[E, C, dim]`` through 3-D ``torch._grouped_mm`` calls."""

    def __init__(self, dim: int = 32, hidden: int = 64, experts: int = 4) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(F.gelu(torch._grouped_mm(x, self.w1)), self.w2)


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward with a fixed output gradient: the output and the gradients
    of the input and every parameter."""
    x = x.detach().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(x)
    g = torch.Generator().manual_seed(7)
    y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
    return y.detach(), [x.grad, *(p.grad for p in model.parameters())]
