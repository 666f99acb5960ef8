"""The one step that makes a full model parallel, from outside it (as torchtitan's
``parallelize`` does): the model's modules are plain; this step shards their weights and
swaps in versions that call the collectives, in a fixed order:

1. tensor parallelism (``tensor_parallel.py``), when ``groups.tp > 1``;
2. global token counts and expert parallelism for MoE layers (``expert_parallel.py``),
   when there is more than one data-parallel rank;
3. data parallelism: FSDP2 (``fsdp.py``) when ``dp_shard > 1``, else DDP over the
   data-parallel group when ``dp > 1``.

Every rank builds the full model from the same seed first, so the initial weights do not
depend on the parallel sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from primus_perf.trainer.config import ParallelConfig
from primus_perf.trainer.expert_parallel import apply_expert_parallel
from primus_perf.trainer.fsdp import shard_model
from primus_perf.trainer.model import Transformer
from primus_perf.trainer.parallel import ProcessGroups
from primus_perf.trainer.tensor_parallel import apply_tensor_parallel


def parallelize(
    model: Transformer,
    groups: ProcessGroups,
    config: ParallelConfig,
    *,
    device: torch.device,
    bf16: bool,
    before_data_parallel: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Apply TP, EP and FSDP2 or DDP to ``model`` (in place) over ``groups`` (from
    ``parallel.make_groups``); ``bf16``: FSDP2 gathers parameters in bf16. Returns the
    module to call for the forward pass: ``model`` itself, or its DDP wrapper.
    ``before_data_parallel(model)`` runs between expert and data parallelism (the weights
    are this rank's TP shards and not yet FSDP2's: FP8 is applied there)."""
    if groups.tp > 1:
        apply_tensor_parallel(model, groups)
    apply_expert_parallel(model, groups)
    if before_data_parallel is not None:
        before_data_parallel(model)
    if groups.dp_shard > 1:
        shard_model(
            model,
            groups.mesh,
            bf16=bf16,
            prefetch=config.fsdp_prefetch,
            reshard_after_forward=config.fsdp_reshard_after_forward,
        )
        return model
    if groups.dp > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        experts = [n for n, p in model.named_parameters() if getattr(p, "ep_sharded", False)]
        if experts:  # reduced by parallel.reduce_expert_grads over the ranks that hold them
            DDP._set_params_and_buffers_to_ignore_for_model(model, experts)
        return DDP(
            model,
            process_group=groups.dp_group,
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,
        )
    return model
