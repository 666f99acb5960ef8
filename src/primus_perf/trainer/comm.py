"""The trainer's collectives, the only place its parallel modules talk to other ranks.

Autograd-aware (each backward is the collective that makes the gradient right):

- :func:`copy_to_tp`: identity forward, all-reduce of the gradient backward (the input of
  a column-parallel layer);
- :func:`reduce_from_tp`: all-reduce forward, identity backward (the output of a
  row-parallel layer);
- :func:`gather_from_tp`: all-gather along the last dimension forward, this rank's slice
  backward;
- :func:`all_to_all`: rows to other ranks with split sizes (all-to-all(v)) forward, the
  gradients back the same way backward.

Plain (no gradient): :func:`all_reduce_` sums a tensor over a group in place, and
:func:`all_to_all_equal` sends equal parts of a tensor to every rank (split sizes before
an all-to-all(v)).

Every function takes a process group and calls ``torch.distributed``; the model never
calls them: ``parallelize.py`` swaps in the modules that do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        size = dist.get_world_size(group)
        ctx.rank = dist.get_rank(group)
        ctx.size = size
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        x = x.contiguous()
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        grad = grad.contiguous()
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad, in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward, all-reduce backward (the input of a column-parallel layer)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce forward, identity backward (the output of a row-parallel layer)."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along the last dimension forward, take own slice backward."""
    return _GatherFromTP.apply(x, group)


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
) -> torch.Tensor:
    """Rows ``in_splits[r]`` of ``x`` (in rank order) go to rank r; ``out_splits[r]`` rows
    come from rank r. Backward sends the gradients back the same way."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def all_reduce_(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (no gradient); returns it."""
    dist.all_reduce(x, group=group)
    return x


def all_to_all_equal(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Part r of ``x`` (split into equal parts along dim 0) goes to rank r; returns the
    parts received, in rank order (no gradient)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out
