"""Will a config run here? The checks that need the device, made before the model is built:
the SDPA backend exists on this device, and the memory the config needs (a rough estimate:
parameters, gradients and AdamW state, plus activations) fits in the device's memory (host
RAM on a CPU). A config that does not fit is one ConfigError naming the key that costs the
most, instead of an allocation that takes minutes to fail or kills the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from primus_perf.errors import ConfigError
from primus_perf.trainer.config import TrainerConfig
from primus_perf.trainer.flops import linear_layers

# Rows of kernels.attention.backends.SDPA_BACKENDS that torch runs on a CPU.
CPU_SDPA_BACKENDS = ("auto", "flash", "math")
# fp32 master weight + gradient + AdamW's two moments.
BYTES_PER_PARAM = 4 + 4 + 8
# Activation values kept per token and layer, in units of model.dim and model.ffn_dim
# (inputs of the norms, projections, attention output, SwiGLU's three ffn-wide tensors).
ACTIVATIONS_PER_DIM = 16
ACTIVATIONS_PER_FFN = 6


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a config needs on one rank, by part; ``largest_key`` is the config key that
    drives the largest part (what to reduce)."""

    params: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.params + self.activations + self.logits

    @property
    def largest_key(self) -> str:
        part = max(("params", self.params), ("activations", self.activations), ("logits", self.logits),
                   key=lambda kv: kv[1])[0]
        return {"params": "model.dim", "activations": "train.micro_batch", "logits": "model.vocab_size"}[part]


def estimate_memory(cfg: TrainerConfig, device_type: str = "cpu") -> MemoryEstimate:
    """A rough estimate of one rank's memory, on the low side (no attention scores, no
    allocator slack): a config over it cannot run, one under it may still not."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    params = sum(layer.out_features * layer.in_features for layer in linear_layers(m, tp))
    params += m.vocab_size * m.dim // tp + (2 * m.n_layers + 1) * m.dim  # embedding, norms
    value = 2 if device_type == "cuda" and t.dtype in ("auto", "bf16") else 4  # bf16 autocast or fp32
    tokens = t.micro_batch * t.seq_len
    per_layer = tokens * (ACTIVATIONS_PER_DIM * m.dim + ACTIVATIONS_PER_FFN * m.ffn_dim) // tp
    # recompute keeps each block's input and one block's activations at a time
    kept = per_layer + tokens * m.dim * m.n_layers if t.recompute else per_layer * m.n_layers
    logits = value * tokens * m.vocab_size // tp
    return MemoryEstimate(params * BYTES_PER_PARAM, value * kept, logits)


def device_memory(device_type: str, index: int = 0) -> tuple[int, str]:
    """Total memory of the device (bytes) and its name in messages."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(index).total_memory), "the GPU"
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host RAM"


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
        gib = 2**30
        raise ConfigError(
            f"config key {need.largest_key!r}: the config needs about {need.total / gib:,.1f} GiB"
            f" (parameters and optimizer {need.params / gib:,.1f}, activations {need.activations / gib:,.1f},"
            f" logits {need.logits / gib:,.1f}), more than {where} ({have / gib:,.1f} GiB)"
        )
