"""MoE layers under data and expert parallelism, applied from outside the model.

With more than one data-parallel rank every MoE layer (``moe.py``) is swapped for a
version whose token counts are the global batch's: ``count_tokens`` sums them over the
data-parallel group (the balancing loss and the bias updates see the global batch, so
the data-parallel average of the per-rank losses equals one process's loss).

Expert parallelism ``ep`` splits the routed experts over ``ep`` data-parallel ranks (an
expert-parallel group: consecutive data-parallel ranks with the same tensor-parallel
rank): each keeps ``n_experts / ep`` of them (``ep_sharded = True``), and ``experts``
sends every row to the rank that holds its expert with an all-to-all(v), regroups the
received rows by local expert for the grouped GEMMs, and sends the outputs back the same
way. Expert weights are left out of DDP and FSDP2; ``parallel.reduce_expert_grads`` sums
their gradients over the ranks that hold the same experts and divides by the
data-parallel size, as DDP's average would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from primus_perf.trainer.comm import all_reduce_, all_to_all, all_to_all_equal
from primus_perf.trainer.moe import moe_layers
from primus_perf.trainer.parallel import ProcessGroups, swap_class


class GlobalCounts:
    """Tokens per expert summed over the data-parallel group."""

    dp_group: Any

    def count_tokens(self, counts: torch.Tensor) -> tuple[list[int], list[int]]:
        total = all_reduce_(counts.clone(), self.dp_group)
        local, total = torch.stack((counts, total)).tolist()
        return local, total


class ExpertParallel:
    """This rank's ``n_experts / ep`` routed experts; rows travel to their expert's rank."""

    ep_group: Any
    ep: int
    n_experts: int

    def experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by (global) expert, ``counts`` per global expert -> their expert
        outputs, in the same order."""
        ep, local_n = self.ep, self.n_experts // self.ep
        send = [sum(counts[r * local_n : (r + 1) * local_n]) for r in range(ep)]
        theirs = all_to_all_equal(torch.tensor(counts, device=rows.device), self.ep_group)
        grid = theirs.view(ep, local_n)  # grid[r, e]: rows rank r sends to my expert e
        recv = grid.sum(dim=1).tolist()
        received = all_to_all(rows, recv, send, self.ep_group)  # by (source rank, expert)
        # regroup by (expert, source rank) for the grouped GEMM, and back afterwards
        source = torch.repeat_interleave(
            torch.arange(ep * local_n, device=rows.device), grid.reshape(-1)
        )
        expert_major = (source % local_n) * ep + source // local_n
        by_expert = torch.argsort(expert_major, stable=True)
        out = super().experts(received[by_expert], grid.sum(dim=0).tolist())  # type: ignore[misc]
        back = torch.empty_like(out).index_copy(0, by_expert, out)
        return all_to_all(back, send, recv, self.ep_group)


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, groups: ProcessGroups) -> None:
    """Every MoE layer of ``model`` counts the global batch's tokens (dp > 1) and, with
    ``groups.ep > 1``, keeps this rank's slice of the routed experts (in place)."""
    if groups.dp_group is None:
        return
    for moe in moe_layers(model):
        swap_class(moe, GlobalCounts)
        moe.dp_group = groups.dp_group
        if groups.ep == 1:
            continue
        for name in ("w13", "w2"):
            weight = getattr(moe, name)
            local = weight.shape[0] // groups.ep
            start = groups.ep_rank * local
            param = nn.Parameter(weight[start : start + local].contiguous())
            param.ep_sharded = True  # type: ignore[attr-defined]
            setattr(moe, name, param)
        swap_class(moe, ExpertParallel)
        moe.ep_group, moe.ep = groups.ep_group, groups.ep
