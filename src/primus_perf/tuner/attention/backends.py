"""The attention implementations that compete per problem.

``triton`` (our kernels with a tile config) and torch SDPA restricted to one backend
(``sdpa:cudnn``, ``sdpa:flash``, ``sdpa:efficient``); ``sdpa:default`` is torch's own
choice, the baseline of every speedup and what uncached problems run. All take and return
tensors in the trainer layout (batch, seq, heads, head_dim).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from primus_perf.tuner.attention.configs import AttnConfig

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]

# Selectable SDPA backends, by the name stored in the cache.
SDPA_BACKENDS: dict[str, SDPBackend] = {
    "sdpa:cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa:flash": SDPBackend.FLASH_ATTENTION,
    "sdpa:efficient": SDPBackend.EFFICIENT_ATTENTION,
}
DEFAULT = "sdpa:default"
TRITON = "triton"


def sdpa_bshd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backend: str = DEFAULT
) -> torch.Tensor:
    """torch SDPA on trainer-layout tensors, optionally restricted to one backend."""
    if q.shape[2] != k.shape[2]:  # GQA: expand kv heads, as the trainer does, so that
        rep = q.shape[2] // k.shape[2]  # every backend applies
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if backend == DEFAULT:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    else:
        try:
            kind = SDPA_BACKENDS[backend]
        except KeyError:
            raise ValueError(f"unknown attention backend {backend!r}") from None
        with sdpa_kernel([kind]):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return out.transpose(1, 2)


def implementation(backend: str, config: AttnConfig | None = None) -> AttentionFn:
    """The callable ``fn(q, k, v, causal)`` for a backend name (and Triton config)."""
    if backend == TRITON:
        from primus_perf.tuner.attention.function import triton_attention

        cfg = config or AttnConfig()
        return lambda q, k, v, causal: triton_attention(q, k, v, causal=causal, config=cfg)
    if backend != DEFAULT and backend not in SDPA_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}")
    return lambda q, k, v, causal: sdpa_bshd(q, k, v, causal, backend)
