"""Megatron-style tensor parallelism, applied from outside the model, and process groups.

:func:`parallelize` shards a full (identically initialised) model in place:

- column-parallel: the fused Q/K/V projection (each of Q, K, V split by heads) and the fused
  gate/up projection (each half split by rows), with the input passed through
  :func:`copy_to_tp` (identity forward, all-reduce of the gradient backward);
- row-parallel: the attention output and MLP down projections (split by columns), their
  partial outputs summed by :func:`reduce_from_tp` (all-reduce forward, identity backward);
- vocab-parallel embedding (rows split; out-of-range tokens give zeros, then all-reduce);
- the output head is column-parallel over the vocabulary; its logits are all-gathered
  (:func:`gather_from_tp`) and the loss is the ordinary cross entropy on full logits.
  This is a documented simplification of Megatron's vocab-parallel cross entropy: it
  costs one all-gather of the logits and memory for the full logits on every rank.

RMSNorm weights are replicated; their gradients are identical on every tensor-parallel
rank. Sharded parameters carry ``tp_sharded = True`` so :func:`clip_grad_norm_` counts
them once across the group. Ranks are laid out tensor-parallel-major: rank =
dp_rank * tp + tp_rank.

MoE layers (``trainer/moe.py``): their shared experts are sharded like the dense MLP; the
router and the routed experts are replicated over the tensor-parallel group (each
tensor-parallel rank runs the same expert GEMMs: expert tensor parallelism is not
implemented). Expert parallelism ``ep`` splits the routed experts over ``ep``
data-parallel ranks (an expert-parallel group: consecutive data-parallel ranks with the
same tensor-parallel rank): each keeps ``n_experts / ep`` of them (``ep_sharded = True``)
and the MoE layer exchanges token rows with :func:`all_to_all`. Expert weights are left
out of DDP; :func:`reduce_expert_grads` sums their gradients over the ranks that hold the
same experts and divides by the data-parallel size, as DDP's average would.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

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


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
) -> torch.Tensor:
    """Rows ``in_splits[r]`` of ``x`` (in rank order) go to rank r; ``out_splits[r]`` rows
    come from rank r. Backward sends the gradients back the same way."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward, all-reduce backward (the input of a column-parallel layer)."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce forward, identity backward (the output of a row-parallel layer)."""
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along the last dimension forward, take own slice backward."""
    return x if group is None else _GatherFromTP.apply(x, group)


@dataclass
class ProcessGroups:
    world_size: int = 1
    rank: int = 0
    tp: int = 1
    dp: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    tp_group: Any = None  # None when tp == 1
    dp_group: Any = None  # None when dp == 1
    ep: int = 1
    ep_rank: int = 0
    ep_group: Any = None  # None when ep == 1
    expert_dp_group: Any = None  # ranks holding the same experts; None when dp == ep
    dp_shard: int = 1  # FSDP2 degree (dp = dp_replicate * dp_shard)
    dp_replicate: int = 1  # replicas: DDP without FSDP2, hybrid sharding with it
    mesh: Any = None  # the (dp_replicate, dp_shard, tp) device mesh when dp_shard > 1
    shard_group: Any = None  # the dp_shard ranks of mesh; None when dp_shard == 1


def make_groups(tp: int, ep: int = 1) -> ProcessGroups:
    """Tensor-, data- and expert-parallel groups over the initialised default group (or
    none). Data-parallel rank d is in expert-parallel group ``d // ep`` at position
    ``d % ep``."""
    if not (dist.is_available() and dist.is_initialized()):
        return ProcessGroups()
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // tp
    groups = ProcessGroups(world, rank, tp, dp, rank % tp, rank // tp)
    groups.ep, groups.ep_rank = ep, groups.dp_rank % ep
    for t in range(tp):  # every rank creates every group, in the same order
        for first in range(0, dp, ep):
            ranks = [(first + e) * tp + t for e in range(ep)]
            group = dist.new_group(ranks) if ep > 1 else None
            if rank in ranks:
                groups.ep_group = group
        for e in range(ep):
            ranks = [(first + e) * tp + t for first in range(0, dp, ep)]
            group = dist.new_group(ranks) if dp > ep else None
            if rank in ranks:
                groups.expert_dp_group = group
    for d in range(dp):  # every rank creates every group, in the same order
        ranks = [d * tp + t for t in range(tp)]
        group = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            groups.tp_group = group
    for t in range(tp):
        ranks = [d * tp + t for d in range(dp)]
        group = dist.new_group(ranks) if dp > 1 else None
        if rank in ranks:
            groups.dp_group = group
    return groups


def _rows(w: torch.Tensor, sizes: list[int], rank: int, tp: int) -> torch.Tensor:
    """Split rows into consecutive parts of ``sizes``, keep this rank's slice of each."""
    parts = [p.chunk(tp, dim=0)[rank] for p in w.split(sizes, dim=0)]
    return torch.cat(parts, dim=0).contiguous()


def _cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return w.chunk(tp, dim=1)[rank].contiguous()


def _replace(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    param = torch.nn.Parameter(value, requires_grad=True)
    param.tp_sharded = True  # type: ignore[attr-defined]
    setattr(module, name, param)


def _shard_mlp(mlp: torch.nn.Module, rank: int, tp: int, group: Any) -> None:
    ffn = mlp.w2.shape[1]
    _replace(mlp, "w13", _rows(mlp.w13, [ffn, ffn], rank, tp))
    _replace(mlp, "w2", _cols(mlp.w2, rank, tp))
    mlp.tp_group = group


@torch.no_grad()
def parallelize(model: torch.nn.Module, groups: ProcessGroups) -> torch.nn.Module:
    """Shard a full model for tensor parallel ``groups.tp`` and, for an MoE model, expert
    parallel ``groups.ep`` (in place; returns it)."""
    from primus_perf.trainer.model import MLP, Transformer
    from primus_perf.trainer.moe import moe_layers

    assert isinstance(model, Transformer)
    for moe in moe_layers(model):
        moe.dp_group = groups.dp_group
    if groups.ep > 1:
        _shard_experts(model, groups)
    tp, rank, group = groups.tp, groups.tp_rank, groups.tp_group
    if tp == 1:
        return model
    cfg = model.cfg
    hd = cfg.head_dim
    qkv_sizes = [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd]
    for block in model.layers:
        attn, mlp = block.attention, block.mlp
        _replace(attn, "wqkv", _rows(attn.wqkv, qkv_sizes, rank, tp))
        if attn.bqkv is not None:
            _replace(attn, "bqkv", _rows(attn.bqkv, qkv_sizes, rank, tp))
        _replace(attn, "wo", _cols(attn.wo, rank, tp))
        attn.n_heads = cfg.n_heads // tp
        attn.n_kv_heads = cfg.n_kv_heads // tp
        attn.tp_group = group
        if isinstance(mlp, MLP):
            _shard_mlp(mlp, rank, tp, group)
        elif mlp.shared is not None:
            _shard_mlp(mlp.shared, rank, tp, group)
    emb = model.tok_embeddings
    per = cfg.vocab_size // tp
    _replace(emb, "weight", emb.weight[rank * per : (rank + 1) * per].contiguous())
    emb.vocab_start = rank * per
    emb.tp_group = group
    _replace(model, "output", _rows(model.output, [cfg.vocab_size], rank, tp))
    model.tp_group = group
    return model


def _shard_experts(model: torch.nn.Module, groups: ProcessGroups) -> None:
    """Keep this rank's ``n_experts / ep`` routed experts; leave them out of DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from primus_perf.trainer.moe import moe_layers

    ep, rank = groups.ep, groups.ep_rank
    ignored = []
    for moe in moe_layers(model):
        for name in ("w13", "w2"):
            weight = getattr(moe, name)
            local = weight.shape[0] // ep
            param = torch.nn.Parameter(weight[rank * local : (rank + 1) * local].contiguous())
            param.ep_sharded = True  # type: ignore[attr-defined]
            setattr(moe, name, param)
        moe.ep_group, moe.ep = groups.ep_group, ep
    for name, param in model.named_parameters():
        if getattr(param, "ep_sharded", False):
            ignored.append(name)
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)


@torch.no_grad()
def reduce_expert_grads(model: torch.nn.Module, groups: ProcessGroups) -> None:
    """After backward: each expert-parallel shard's gradient holds the sum over its
    expert-parallel group's tokens; sum it over the ranks that hold the same experts and
    divide by the data-parallel size (the average DDP gives every other parameter)."""
    if groups.ep == 1:
        return
    for param in model.parameters():
        if getattr(param, "ep_sharded", False) and param.grad is not None:
            if groups.expert_dp_group is not None:
                dist.all_reduce(param.grad, group=groups.expert_dp_group)
            param.grad /= groups.dp


@torch.no_grad()
def clip_grad_norm_(
    params: list[torch.nn.Parameter],
    max_norm: float,
    tp_group: Any = None,
    ep_group: Any = None,
    shard_group: Any = None,
) -> torch.Tensor:
    """Clip to a global L2 norm (tensor-parallel shards summed over the tensor-parallel
    group, expert-parallel shards over the expert-parallel group, replicated parameters
    counted once, FSDP2 shards (DTensor gradients) summed over ``shard_group``). Returns
    the norm before clipping; no host sync."""
    from primus_perf.trainer.fsdp import local_tensor

    with_grad = [p for p in params if p.grad is not None]
    sharded = [local_tensor(p.grad) for p in with_grad if getattr(p, "tp_sharded", False)]
    experts = [local_tensor(p.grad) for p in with_grad if getattr(p, "ep_sharded", False)]
    replicated = [
        local_tensor(p.grad)
        for p in with_grad
        if not getattr(p, "tp_sharded", False) and not getattr(p, "ep_sharded", False)
    ]
    device = with_grad[0].grad.device

    def sq(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=device, dtype=torch.float32)
        norms = torch._foreach_norm(grads, 2.0)
        return torch.stack([n.float() for n in norms]).square().sum()

    sharded_sq, experts_sq, replicated_sq = sq(sharded), sq(experts), sq(replicated)
    if shard_group is not None:  # experts are not FSDP-sharded (ignored_params)
        fsdp_sq = torch.stack([sharded_sq, replicated_sq])
        dist.all_reduce(fsdp_sq, group=shard_group)
        sharded_sq, replicated_sq = (t.clone() for t in fsdp_sq.unbind())
    if tp_group is not None:
        dist.all_reduce(sharded_sq, group=tp_group)
    if ep_group is not None:
        dist.all_reduce(experts_sq, group=ep_group)
    total = (sharded_sq + experts_sq + replicated_sq).sqrt()
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        grads = sharded + experts + replicated
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
