"""Will a config run here? The checks that need the device, made before the model is built:
the SDPA backend exists on this device, and the memory the config needs (an estimate:
parameters, gradients and optimizer state, one micro-batch's activations as the recompute
mode keeps them, the logits) fits in the device's memory (host RAM on a CPU). A config that does not fit is one ConfigError naming the key that costs the
most, instead of an allocation that takes minutes to fail or kills the machine.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from primus_perf.base.errors import ConfigError
from primus_perf.trainer.config import TrainerConfig
from primus_perf.trainer.flops import is_moe_layer, matmul_params
from primus_perf.trainer.optim import state_bytes_per_param

# Rows of kernels.attention.backends.SDPA_BACKENDS that torch runs on a CPU.
CPU_SDPA_BACKENDS = ("auto", "flash", "math")
MASTER_AND_GRAD = 4 + 4  # fp32 master weight and gradient, per parameter
# Values kept per token and layer for backward, in units of model.dim and of the MLP's width
# (model.ffn_dim, or top_k x expert_dim for a routed MoE layer): with no recompute, the norms'
# inputs, the projections, attention's output, SwiGLU's three wide tensors; with selective
# recompute only the GEMMs' and attention's outputs; with full recompute the block's input.
ACTIVATIONS = {"none": (16, 6), "selective": (8, 3), "full": (1, 0)}


# The largest part of the estimate -> (the config key that drives it, what reduces it).
REDUCE = {
    "params": ("model.dim", "shard it: parallel.dp_shard or parallel.tp"),
    "activations": ("train.micro_batch", "a smaller train.micro_batch or train.recompute=selective|full"),
    "logits": ("train.micro_batch", "a smaller train.micro_batch (the logits are micro_batch x seq_len x vocab)"),
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a config needs on one rank, by part; ``largest_key`` is the config key that
    drives the largest part (what to reduce)."""

    params: int  # weights, gradients and optimizer state (this rank's shard), and cast copies
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.params + self.activations + self.logits

    @property
    def largest_key(self) -> str:
        return REDUCE[self._largest][0]

    @property
    def remedy(self) -> str:
        """What reduces the largest part, in words."""
        return REDUCE[self._largest][1]

    @property
    def model_key(self) -> str:
        """The model's key behind the largest part (when no micro-batch fits)."""
        return {"params": "model.dim", "activations": "train.seq_len", "logits": "model.vocab_size"}[self._largest]

    @property
    def _largest(self) -> str:
        return max(("params", self.params), ("activations", self.activations), ("logits", self.logits),
                   key=lambda kv: kv[1])[0]

    def line(self) -> str:
        gib = 2**30
        return (f"about {self.total / gib:,.1f} GiB (parameters and optimizer {self.params / gib:,.1f},"
                f" activations {self.activations / gib:,.1f}, logits {self.logits / gib:,.1f})")


def _params(cfg: TrainerConfig) -> tuple[int, int]:
    """(dense parameters of one tensor-parallel rank, routed experts' of one expert-parallel rank)."""
    m, tp = cfg.model, cfg.parallel.tp
    dense = matmul_params(m, tp)
    dense += m.vocab_size * m.dim // tp + (2 * m.n_layers + 1) * m.dim  # embedding, norms
    moe = m.moe
    layers = sum(is_moe_layer(m, i) for i in range(m.n_layers))
    experts = layers * moe.n_experts // cfg.parallel.ep * 3 * m.dim * moe.expert_dim
    return dense, experts


def estimate_memory(cfg: TrainerConfig, device_type: str = "cpu", dp_shard: int | None = None) -> MemoryEstimate:
    """A rough estimate of one rank's memory, on the low side (no allocator slack): a config
    over it cannot run, one under it may still not. Weights, gradients and the optimizer's
    moments (``train.optimizer``) sharded over FSDP2's ranks, the bf16 copies autocast or
    FSDP2 gathers and FP8's casts; one micro-batch's activations (accumulation frees each
    micro-batch's before the next) as the recompute mode keeps them; the logits."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    shard = cfg.parallel.dp_shard if dp_shard is None else dp_shard
    bf16 = device_type == "cuda" and t.dtype in ("auto", "bf16")
    value = 2 if bf16 else 4
    dense, experts = _params(cfg)
    total = dense + experts
    per_param = MASTER_AND_GRAD + state_bytes_per_param(t.optimizer)
    params = per_param * total // shard
    if bf16:  # the bf16 copies of the weights a step works with (autocast's casts, FSDP2's gathers)
        params += 2 * (total if shard == 1 or not cfg.parallel.fsdp_reshard_after_forward else total // m.n_layers)
    if t.fp8 != "off":  # the FP8 casts of the linear layers' weights, forward and backward
        params += 2 * dense
    tokens = t.micro_batch * t.seq_len
    per_dim, per_wide = ACTIVATIONS[t.recompute]
    full_dim, full_wide = ACTIVATIONS["none"]
    moe = m.moe
    kept = 0
    for i in range(m.n_layers):
        wide = moe.top_k * moe.expert_dim if is_moe_layer(m, i) else m.ffn_dim
        kept += tokens * (per_dim * m.dim + per_wide * wide) // tp
    if t.recompute != "none":  # one block's activations while it is recomputed
        wide = max(m.ffn_dim, moe.top_k * moe.expert_dim)
        kept += tokens * (full_dim * m.dim + full_wide * wide) // tp
    # the logits, and the fp32 log-probabilities and gradient of the loss over them
    logits = (value + 8) * tokens * m.vocab_size // tp
    return MemoryEstimate(params, value * kept, logits)


def device_memory(device_type: str, index: int = 0) -> tuple[int, str]:
    """Total memory of the device (bytes) and its name in messages."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(index).total_memory), "the GPU"
    physical = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    limit = _cgroup_limit()
    return (limit, "this container's memory limit") if limit and limit < physical else (physical, "host RAM")


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (a container's), None where there is none."""
    for path in CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def check_fits(cfg: TrainerConfig, device_type: str, index: int = 0) -> None:
    """ConfigError naming the key when the config cannot run on this device."""
    t = cfg.train
    if device_type != "cuda" and t.sdpa_backend not in CPU_SDPA_BACKENDS:
        raise ConfigError(
            f"config key 'train.sdpa_backend': {t.sdpa_backend} needs a GPU (on a CPU: {', '.join(CPU_SDPA_BACKENDS)})"
        )
    need = estimate_memory(cfg, device_type)
    have, where = device_memory(device_type, index)
    if need.total > have:
        key, remedy = need.largest_key, need.remedy
        one_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=1))
        one = estimate_memory(one_cfg, device_type)
        if one.total > have:  # no micro-batch fits: the model (or its sequence) is what to change
            key, remedy = one.model_key, "it does not fit at micro-batch 1 either: shard it or make it smaller"
            layer = dataclasses.replace(one_cfg, model=dataclasses.replace(one_cfg.model, n_layers=1))
            if cfg.model.n_layers > 1 and estimate_memory(layer, device_type).total <= have:
                key = "model.n_layers"  # one layer would fit: the depth is what does not
        raise ConfigError(f"config key {key!r}: the config needs {need.line()}, more than {where}"
                          f" ({have / 2**30:,.1f} GiB); {remedy}")
