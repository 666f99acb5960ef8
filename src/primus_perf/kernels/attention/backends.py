"""The attention implementations: torch SDPA restricted to one backend, and the names the
cache and the trainer's config give them. The one table of SDPA backends.

Cache names: ``triton`` (our kernels with a tile config), ``sdpa:<backend>`` for torch SDPA
restricted to one row of :data:`SDPA_BACKENDS`, and ``sdpa:default`` for torch's own choice
(the baseline of every speedup, and what uncached problems run). The trainer's
``train.sdpa_backend`` takes the bare row names. All take and return tensors in the
trainer layout (batch, seq, heads, head_dim).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]

# torch SDPA backends by name
SDPA_BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,  # the unfused reference path: selectable, never raced
}
RACED = ("cudnn", "flash", "efficient")  # the rows the tuner times against Triton
SDPA_PREFIX = "sdpa:"
DEFAULT = "sdpa:default"
TRITON = "triton"


def sdpa_name(backend: str) -> str:
    """The cache name of an SDPA row: ``"flash"`` -> ``"sdpa:flash"``."""
    return SDPA_PREFIX + backend


def check_backend_name(name: str) -> None:
    """ValueError unless ``name`` is a cache name of an attention implementation."""
    sdpa_row = name.startswith(SDPA_PREFIX) and name.removeprefix(SDPA_PREFIX) in SDPA_BACKENDS
    if name not in (TRITON, DEFAULT) and not sdpa_row:
        raise ValueError(f"unknown attention backend {name!r}")


def sdpa_bshd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backend: str | None = None
) -> torch.Tensor:
    """torch SDPA on trainer-layout tensors; ``backend``: a row of :data:`SDPA_BACKENDS`,
    or None for torch's own choice."""
    if q.shape[2] != k.shape[2]:  # GQA: expand kv heads so that every backend applies
        rep = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if backend is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    else:
        with sdpa_kernel([SDPA_BACKENDS[backend]]):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return out.transpose(1, 2)


def sdpa_implementation(name: str) -> AttentionFn:
    """``fn(q, k, v, causal)`` for a cache name ``sdpa:default`` or ``sdpa:<backend>``."""
    check_backend_name(name)
    if name == TRITON:
        raise ValueError("the triton implementation needs a config (function.triton_attention)")
    backend = None if name == DEFAULT else name.removeprefix(SDPA_PREFIX)
    return lambda q, k, v, causal: sdpa_bshd(q, k, v, causal, backend)
