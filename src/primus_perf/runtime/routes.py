"""The routers in use, and the one path a routed call takes.

:func:`install` puts one router per kind in place (``kernels`` routers built from a tuning
cache by ``cache.runtime.activate``, or the online tuner's); :func:`gemm` and
:func:`attention` are what every routed call runs: the dispatcher overrides of
``intercept.py`` call them, and so does the reference trainer's dispatch directly (its
fast path: no trip through the dispatcher). A router answers with the tuned kernel's
tensor or None; None runs torch's own kernel, reached past the overrides (``torch_mm``,
and SDPA with the overrides bypassed), so a call is never routed twice.

Grouped GEMMs have no aten operator to override: their one dispatch point is
``kernels.grouped_gemm.run`` (every pass of ``kernels.grouped_gemm.grouped_mm``, which the
trainer's MoE layer and any program may call). Installing a ``grouped_gemm`` router sets
that seam's router to :func:`grouped_gemm`; None there runs the caller's backend.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from primus_perf.kernels import grouped_gemm as grouped
from primus_perf.kernels.attention.backends import sdpa_bshd
from primus_perf.kernels.gemm import torch_mm

KINDS = ("gemm", "attention", "grouped_gemm")  # the kinds a router can be installed for

_routers: dict[str, Any] = {}
_local = threading.local()  # .bypass: > 0 while a routed attention runs (its SDPA is torch's)


def install(routers: Mapping[str, Any]) -> None:
    """Install one router per kind (replacing any installed for that kind)."""
    unknown = set(routers) - set(KINDS)
    if unknown:
        raise ValueError(f"no routing point for router kind(s) {sorted(unknown)}")
    _routers.update(routers)
    if "grouped_gemm" in routers:
        grouped.set_router(grouped_gemm)


def remove() -> None:
    """Remove every installed router: every call goes to torch again."""
    _routers.clear()
    if grouped.get_router() is grouped_gemm:
        grouped.set_router(None)


def installed(kind: str) -> Any:
    return _routers.get(kind)


def gemm(a: Any, b: Any, bias: Any = None) -> Any:
    """``a @ b`` (``torch.bmm`` for 3-D operands; ``+ bias`` when given): the router's
    answer when it gives one, else torch's own kernel."""
    router = _routers.get("gemm")
    if router is not None:
        out = router(a, b, bias)
        if out is not None:
            return out
    return torch_mm(a, b, bias)


def grouped_gemm(phase: str, a: Any, b: Any, counts: Any) -> Any:
    """The grouped-GEMM router's answer for one pass of the seam, or None (the caller's
    backend runs)."""
    router = _routers.get("grouped_gemm")
    return None if router is None else router(phase, a, b, counts)


def bypassed() -> bool:
    """True while a routed attention call runs (its own SDPA calls are torch's)."""
    return getattr(_local, "bypass", 0) > 0


def routed_attention(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """The attention router's answer for (batch, seq, heads, head_dim) tensors, or None
    (no router, or "not mine"): the caller runs torch's SDPA as it would have."""
    router = _routers.get("attention")
    if router is None:
        return None
    _local.bypass = getattr(_local, "bypass", 0) + 1
    try:
        return router(q, k, v, causal)
    finally:
        _local.bypass -= 1


def attention(q: Any, k: Any, v: Any, causal: bool, backend: str | None = None) -> Any:
    """Attention on (batch, seq, heads, head_dim) tensors: the router's answer when it gives
    one, else torch SDPA (``backend``: a row of the SDPA table, None: torch picks)."""
    out = routed_attention(q, k, v, causal)
    if out is not None:
        return out
    _local.bypass = getattr(_local, "bypass", 0) + 1
    try:
        return sdpa_bshd(q, k, v, causal, backend)
    finally:
        _local.bypass -= 1
