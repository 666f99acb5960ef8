"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``), applied from
outside the model by ``parallelize.py`` after tensor and expert parallelism.

The data-parallel ranks (``dp = dp_replicate x dp_shard``) form a device mesh laid out like
the process groups of ``parallel.py``: rank = (replicate x dp_shard + shard) x tp + tp_rank.
With ``dp_shard > 1`` every transformer block (dense or MoE), the token embedding and the
root (final norm and output head) become one FSDP2 unit each: their parameters are sharded
over the ``dp_shard`` ranks, all-gathered before a unit's forward and backward, and their
gradients reduce-scattered (averaged). With ``dp_replicate > 1`` as well the mesh is 2-D
(hybrid sharding): shards are replicated over ``dp_replicate`` groups and their gradients
all-reduced between them.

Tensor parallelism composes without DTensor: each rank's parameters are already its
tensor-parallel slice (``tensor_parallel.py``), and FSDP2 shards those slices over the
``dp_shard`` ranks holding the same tensor-parallel rank. Routed experts of an
expert-parallel MoE model (``ep_sharded``) are left out of FSDP2 (``ignored_params``):
their gradients are reduced by ``parallel.reduce_expert_grads`` as under DDP.

Precision: on a GPU with bf16 autocast, parameters are all-gathered in bf16 and gradients
reduced in fp32 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); the
sharded master weights and the optimizer stay fp32. Otherwise (CPU, ``train.dtype=fp32``)
everything is fp32.

Prefetch: ``prefetch`` > 0 asks each block to all-gather the next ``prefetch`` blocks
ahead of use in forward and the previous ``prefetch`` in backward
(``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``); 0 keeps
FSDP2's own schedule. ``reshard_after_forward=False`` keeps the blocks' gathered
parameters from forward to backward (no second all-gather, more memory).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

SHARDING_FLAGS = ("tp_sharded", "ep_sharded")  # parameter attributes gradient clipping reads


def shard_model(
    model: nn.Module,
    mesh: Any,
    *,
    bf16: bool,
    prefetch: int = 0,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply FSDP2 to a (tensor/expert-parallelized) Transformer in place; returns it.
    ``mesh``: the (dp_replicate, dp_shard, tp) mesh of ``parallel.make_groups``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # the root returns the logits as a view of the head's output; the trainer never
    # changes them in place, so FSDP2's warning about in-place ops on views does not apply
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    replicate = mesh["dp_replicate"].size() > 1
    dp_mesh = mesh["dp_replicate", "dp_shard"] if replicate else mesh["dp_shard"]
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    flags = {
        name: {f: True for f in SHARDING_FLAGS if getattr(p, f, False)}
        for name, p in model.named_parameters()
    }
    ignored = {p for p in model.parameters() if getattr(p, "ep_sharded", False)}
    common: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": policy, "ignored_params": ignored or None}
    fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **common)
    blocks = list(model.layers)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **common)
    # the root holds the final norm and the head, used right after forward: keep them gathered
    fully_shard(model, reshard_after_forward=False, **common)
    if prefetch > 0:
        set_prefetch(blocks, prefetch)
    for name, p in model.named_parameters():  # FSDP2 made new (DTensor) parameters
        for flag, value in flags.get(name, {}).items():
            setattr(p, flag, value)
    return model


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP2-sharded DTensor) tensor; in-place changes to
    it change the DTensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def set_prefetch(blocks: list[nn.Module], prefetch: int) -> None:
    """Each sharded block all-gathers the next ``prefetch`` blocks in forward and the previous
    ``prefetch`` in backward; 0: FSDP2's own schedule (callable again between steps)."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch] if prefetch else [])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch) : i][::-1] if prefetch else [])
