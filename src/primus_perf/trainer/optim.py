"""The optimizer (``train.optimizer``): AdamW, fused (one kernel over many tensors), foreach (a
few kernels per group of tensors), torch's own choice (``auto`` off the GPU) or with its
moments in bf16 (:class:`Bf16StateAdamW`).

Numerics of ``bf16``: the parameters (fp32 master weights) and gradients are as in AdamW; the
two moments are stored in bf16 and the update is computed in fp32 from them: each step rounds
each moment to bf16 (round to nearest, a relative error of at most 2^-9), so a moment carries
about 3 significant digits. The second moment's square root and the update are fp32. It saves
4 of AdamW's 16 bytes a parameter (weight, gradient, two moments) and moves fewer bytes a step;
it is not bit-identical to AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

CHUNK_ELEMENTS = 1 << 26  # fp32 moments made at once while stepping (256 MiB each)


class Bf16StateAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose ``exp_avg`` and ``exp_avg_sq`` are bf16 tensors."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            todo = [p for p in group["params"] if p.grad is not None]
            for p in todo:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
            chunk: list[torch.Tensor] = []
            size = 0
            for p in todo:
                chunk.append(p)
                size += p.numel()
                if size >= CHUNK_ELEMENTS:
                    self._update(chunk, group)
                    chunk, size = [], 0
            if chunk:
                self._update(chunk, group)

    def _update(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        step = self.state[params[0]]["step"]
        # FSDP2's parameters are DTensors sharded by rows: every op here is elementwise, so each
        # rank updates its own shard (the foreach ops have no DTensor sharding rule of their own)
        exp_avg = [_local(self.state[p]["exp_avg"]) for p in params]
        exp_avg_sq = [_local(self.state[p]["exp_avg_sq"]) for p in params]
        grads = [_local(p.grad).float() for p in params]
        params = [_local(p) for p in params]
        m = [t.float() for t in exp_avg]
        v = [t.float() for t in exp_avg_sq]
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias2**0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m, denom, value=-lr / bias1)
        torch._foreach_copy_(exp_avg, m)
        torch._foreach_copy_(exp_avg_sq, v)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (the tensor itself under no_grad), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def make_optimizer(param_groups: list[dict[str, Any]], kind: str, device: torch.device, *, lr: float,
                   betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """``train.optimizer``'s AdamW over ``param_groups`` (each with its weight decay; each of one
    kind of tensor); ``auto``: fused on a GPU, torch's own choice elsewhere."""
    if kind == "bf16":
        return Bf16StateAdamW(param_groups, lr=lr, betas=betas, eps=eps)
    if kind == "auto":
        fused, foreach = (True, False) if device.type == "cuda" else (None, None)
    else:
        fused, foreach = kind == "fused", kind == "foreach"
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, fused=fused, foreach=foreach)


def state_bytes_per_param(kind: str) -> int:
    """Bytes an optimizer keeps a parameter (its two moments)."""
    return 4 if kind == "bf16" else 8
