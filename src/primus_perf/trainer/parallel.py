"""Process groups, and what every kind of parallelism shares: swapping a module for its
parallel version, and gradient reductions over the groups.

Ranks are laid out tensor-parallel-major: rank = dp_rank * tp + tp_rank. An
expert-parallel group is ``ep`` consecutive data-parallel ranks with the same
tensor-parallel rank; with FSDP2 the data-parallel ranks form a (dp_replicate, dp_shard)
mesh (``fsdp.py``).

Sharded parameters carry a flag: ``tp_sharded`` (a tensor-parallel slice) or
``ep_sharded`` (this rank's routed experts). :func:`clip_grad_norm_` reads them to count
every parameter once; :func:`reduce_expert_grads` averages the expert gradients that DDP
and FSDP2 leave out.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from primus_perf.base import environment
from primus_perf.trainer.comm import all_reduce_

_SWAPPED: dict[tuple[type, type], type] = {}


def swap_class(module: nn.Module, mixin: type) -> None:
    """Make ``module`` an instance of ``mixin`` layered over its own class (in place, as
    FSDP2's ``fully_shard`` does): the mixin's methods call the model's own through
    ``super()``. One class per (mixin, class) pair."""
    cls = type(module)
    key = (mixin, cls)
    if key not in _SWAPPED:
        _SWAPPED[key] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    module.__class__ = _SWAPPED[key]


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


# the groups made over a default group, per layout: the trainers one process makes over one
# default group (the step tuner's, one after another) share them instead of leaving a set of
# communicators alive per trainer
_MADE: dict[tuple, ProcessGroups] = {}
_MADE_OVER: list[Any] = [None]  # the default group they were made over (held: its id stays its own)


def join_torchrun(cuda: bool) -> bool:
    """Under torchrun (``WORLD_SIZE`` above 1) join the job: NCCL/RCCL with ``cuda``, each rank
    on its GPU (``LOCAL_RANK``), else gloo; True if this call made the group (it owns it)."""
    if environment.get("WORLD_SIZE") <= 1 or dist.is_initialized():
        return False
    if cuda:
        torch.cuda.set_device(environment.get("LOCAL_RANK"))
    dist.init_process_group("nccl" if cuda else "gloo")
    return True


def leave_torchrun(finished: bool) -> None:
    """Leave the job :func:`join_torchrun` joined: its group destroyed, the groups made over it
    forgotten. ``finished`` (every rank got here without an error): all ranks meet at a barrier
    first. A gloo worker still releasing the last collective's tensors when the interpreter
    shuts down takes the GIL too late and aborts ("terminate called without an active
    exception"); the barrier waits for that work. Not after an error: another rank may never
    come."""
    if not dist.is_initialized():
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()
    forget_groups()


@contextmanager
def torchrun_job(cuda: bool) -> Iterator[bool]:
    """:func:`join_torchrun` for the block (left at its end if this call joined); yields whether
    this process is the job's rank 0 (or alone)."""
    owns, finished = join_torchrun(cuda), False
    try:
        yield not dist.is_initialized() or dist.get_rank() == 0
        finished = True
    finally:
        if owns:
            leave_torchrun(finished)


def forget_groups() -> None:
    """Drop the groups made over the default group, once it is destroyed (and at exit): held
    in this module past it, gloo's threads were torn down at the interpreter's exit (an abort:
    "terminate called without an active exception")."""
    _MADE.clear()
    _MADE_OVER[0] = None


def make_groups(
    tp: int, ep: int = 1, dp_shard: int = 1, dp_replicate: int = 1, device_type: str = "cpu"
) -> ProcessGroups:
    """Tensor-, data- and expert-parallel groups over the initialised default group (or
    none), and with ``dp_shard > 1`` the (dp_replicate, dp_shard, tp) device mesh of
    ``device_type`` for FSDP2. Data-parallel rank d is in expert-parallel group ``d // ep``
    at position ``d % ep``. Made once per layout and default group (:data:`_MADE`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ProcessGroups()
    if _MADE_OVER[0] is not dist.group.WORLD:  # a new default group: the old one's groups went with it
        if _MADE_OVER[0] is None and not _MADE:
            atexit.register(forget_groups)  # before the interpreter tears down (see forget_groups)
        _MADE.clear()
        _MADE_OVER[0] = dist.group.WORLD
    key = (tp, ep, dp_shard, dp_replicate, device_type)
    if key not in _MADE:
        _MADE[key] = _make_groups(tp, ep, dp_shard, dp_replicate, device_type)
    return _MADE[key]


def _make_groups(tp: int, ep: int, dp_shard: int, dp_replicate: int, device_type: str) -> ProcessGroups:
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // tp
    groups = ProcessGroups(world, rank, tp, dp, rank % tp, rank // tp)
    groups.ep, groups.ep_rank = ep, groups.dp_rank % ep

    def new_group(attr: str, ranks: list[int], needed: bool) -> None:
        group = dist.new_group(ranks) if needed else None
        if rank in ranks:
            setattr(groups, attr, group)

    for t in range(tp):  # every rank creates every group, in the same order
        for first in range(0, dp, ep):
            new_group("ep_group", [(first + e) * tp + t for e in range(ep)], ep > 1)
        for e in range(ep):
            new_group("expert_dp_group", [(first + e) * tp + t for first in range(0, dp, ep)], dp > ep)
    for d in range(dp):  # every rank creates every group, in the same order
        new_group("tp_group", [d * tp + t for t in range(tp)], tp > 1)
    for t in range(tp):
        new_group("dp_group", [d * tp + t for d in range(dp)], dp > 1)
    groups.dp_shard, groups.dp_replicate = dp_shard, dp_replicate
    if dp_shard > 1:
        groups.mesh = data_parallel_mesh(device_type, dp_replicate, dp_shard, tp)
        groups.shard_group = groups.mesh["dp_shard"].get_group()
    return groups


def data_parallel_mesh(device_type: str, dp_replicate: int, dp_shard: int, tp: int) -> Any:
    """The (dp_replicate, dp_shard, tp) device mesh over the initialised default group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type, (dp_replicate, dp_shard, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )


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
                all_reduce_(param.grad, groups.expert_dp_group)
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
        all_reduce_(fsdp_sq, shard_group)
        sharded_sq, replicated_sq = (t.clone() for t in fsdp_sq.unbind())
    if tp_group is not None:
        all_reduce_(sharded_sq, tp_group)
    if ep_group is not None:
        all_reduce_(experts_sq, ep_group)
    total = (sharded_sq + experts_sq + replicated_sq).sqrt()
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        grads = sharded + experts + replicated
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
