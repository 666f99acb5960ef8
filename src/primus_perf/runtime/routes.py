"""The routers in use, and the one path a routed call takes.

:func:`install` puts one router per kind in place (``kernels`` routers built from a tuning
cache by ``activate``, or the online tuner's), one per kind of ``primus_perf.kinds``; :func:`gemm`,
:func:`attention` and :func:`grouped` are what every routed call runs: the dispatcher
overrides of ``intercept.py`` call them, and so do the routing points of ``seams.py``
directly (the fast path: no trip through the dispatcher). A router answers with the tuned kernel's
tensor or None; None runs torch's own kernel, reached past the overrides (``torch_mm``,
and SDPA with the overrides bypassed), so a call is never routed twice. Which SDPA calls
have a route is one predicate, :func:`routable_sdpa`: the eager override asks it of the
call's tensors, the compiled path (``compiled.py``) of the traced call's fake tensors.

Grouped GEMMs reach :func:`grouped` from two points, each giving its fallback as a callable:
``seams.grouped_mm`` (every pass of it, the trainer's MoE layer; the fallback is the
caller's backend) and the override of ``aten::_grouped_mm`` (``grouped_intercept``: other
programs' ``torch._grouped_mm`` / ``F.grouped_mm``; the fallback is torch's kernel). Both run inside the grouped re-entrancy
guard (``kernels.grouped.in_grouped``): the GEMMs a grouped GEMM makes itself are torch's.

While a confirmation runs (:func:`confirm_with`, ``confirm.Confirmer``), :func:`gemm` and
:func:`grouped` hand their routed calls to it: it answers each problem with a cached
choice alternately with the choice and the baseline (torch's kernel, or the fallback) and
times both where they run.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.nn.functional as F

from primus_perf import kinds
from primus_perf.kernels.attention.backends import sdpa_bshd
from primus_perf.kernels.gemm import torch_mm
from primus_perf.kernels.grouped.passes import in_grouped
from primus_perf.runtime import native

TORCH = "torch"  # the baseline of a call whose fallback is torch's own kernel
KINDS = kinds.names()  # the kinds a router can be installed for
GEMM, GROUPED, ATTENTION = kinds.GEMM.name, kinds.GROUPED.name, kinds.ATTENTION.name

_routers: dict[str, Any] = {}
_confirmer: Any = None  # confirm.Confirmer while a confirmation runs (confirm_with)
_local = threading.local()  # .bypass: > 0 while a routed attention runs (its SDPA is torch's)


def install(routers: Mapping[str, Any]) -> None:
    """Install one router per kind (replacing any installed for that kind); a router whose
    every choice is torch's own (``routes_nothing``) is left out: its calls go straight to
    torch."""
    unknown = set(routers) - set(KINDS)
    if unknown:
        raise ValueError(f"no routing point for router kind(s) {sorted(unknown)}")
    for kind, router in routers.items():
        _routers.pop(kind, None)
        if not getattr(router, "routes_nothing", False):
            _routers[kind] = router
    _follow()


def remove(kinds: Iterable[str] | None = None) -> None:
    """Remove the installed routers (of ``kinds``; default: every one): their calls go to
    torch again."""
    if kinds is None:
        _routers.clear()
    for kind in kinds or ():
        _routers.pop(kind, None)
    _follow()


def _follow() -> None:
    """Tell the native GEMM dispatch which router answers from its table (none while a
    confirmation alternates the choices: every call then goes through :func:`gemm`)."""
    native.follow(_routers.get(GEMM) if _confirmer is None else None)


def installed(kind: str) -> Any:
    return _routers.get(kind)


def confirm_with(confirmer: Any) -> None:
    """While ``confirmer`` (``confirm.Confirmer``) is set, :func:`gemm` and :func:`grouped`
    hand it their routed calls: it alternates each problem's cached choice with the
    baseline and times both in the step. None ends it."""
    global _confirmer
    _confirmer = confirmer
    _follow()


def confirming() -> Any:
    return _confirmer


def gemm(a: Any, b: Any, bias: Any = None) -> Any:
    """``a @ b`` (``torch.bmm`` for 3-D operands; ``+ bias`` when given): the router's
    answer when it gives one, else torch's own kernel (always inside a grouped GEMM:
    ``kernels.grouped.in_grouped``)."""
    router = _routers.get(GEMM)
    if router is not None and not in_grouped():  # a grouped GEMM's own GEMMs are torch's
        if _confirmer is not None:
            return _confirmer.gemm(router, a, b, bias)
        out = router(a, b, bias)
        if out is not None:
            return out
    return torch_mm(a, b, bias)


def grouped(phase: str, a: Any, b: Any, counts: Any, fallback: Callable[[], Any], baseline: str = TORCH) -> Any:
    """One grouped-GEMM pass of the routing point (``seams.grouped_pass``, host ``counts``):
    the router's answer when it gives one, else ``fallback()`` (the caller's backend;
    ``baseline`` names it for a confirmation)."""
    router = _routers.get(GROUPED)
    if router is None:
        return fallback()
    return grouped_routed(phase, a, b, len(counts), lambda: router(phase, a, b, counts), fallback, baseline)


def grouped_routed(phase: str, a: Any, b: Any, groups: int, routed: Callable[[], Any], fallback: Callable[[], Any],
                   baseline: str = TORCH) -> Any:
    """A grouped-GEMM pass whose router answer is ``routed()`` (None: not routed), else
    ``fallback()``; the ``aten::_grouped_mm`` override calls it with the router's
    device-offs entry and torch's kernel. While a confirmation runs, it alternates the two."""
    outer = getattr(_local, "grouped_baseline", None)
    _local.grouped_baseline = baseline
    try:
        if _confirmer is not None:
            return _confirmer.grouped(_routers.get(GROUPED), phase, a, b, groups, routed, fallback, baseline)
        out = routed()
    finally:
        _local.grouped_baseline = outer
    return fallback() if out is None else out


def grouped_baseline() -> str | None:
    """The backend name of the caller of the grouped-GEMM call being routed on this thread
    (``fallback``'s: primus-train's configured backend, ``grouped_mm`` for a program's
    ``aten::_grouped_mm``): what an online tuner races its candidates against."""
    return getattr(_local, "grouped_baseline", None)


def bypassed() -> bool:
    """True while a routed attention call runs (its own SDPA calls are torch's)."""
    return getattr(_local, "bypass", 0) > 0


class _Bypass:
    """While entered, this thread's SDPA calls are torch's (:func:`bypassed`)."""

    def __enter__(self) -> None:
        _local.bypass = getattr(_local, "bypass", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.bypass -= 1


_bypass = _Bypass()


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for sizes; a symbolic size (a compiled graph's) counts only when the
    equality is known without adding a guard."""
    if type(a) is int and type(b) is int:
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


def routable_sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: Any = 0.0, is_causal: Any = False,
                  scale: Any = None, enable_gqa: Any = False) -> bool:
    """Whether an SDPA call (torch's layout: batch, heads, seq, head_dim) is one an attention
    router takes: no mask, no dropout, 4-D, the default scale, one head dim for q, k and v,
    kv heads equal to q's or dividing them under ``enable_gqa``. The tensors may be fake
    (a traced call): heads and head dim must then be concrete, batch and sequence may be
    symbolic, and an argument that is not a constant (a traced value) is not routable."""
    if attn_mask is not None or type(is_causal) is not bool or type(enable_gqa) is not bool:
        return False
    if type(dropout_p) not in (int, float) or dropout_p != 0.0:
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    heads_q, heads_kv, dim = q.shape[1], k.shape[1], q.shape[3]
    fixed = (heads_q, heads_kv, dim, v.shape[1], k.shape[3], v.shape[3])
    if any(type(n) is not int for n in fixed) or fixed[3:] != (heads_kv, dim, dim):
        return False
    if heads_q != heads_kv and not (enable_gqa and heads_q % heads_kv == 0):
        return False
    if not (_same(q.shape[0], k.shape[0]) and _same(k.shape[0], v.shape[0]) and _same(k.shape[2], v.shape[2])):
        return False
    return scale is None or (type(scale) in (int, float) and math.isclose(scale, 1.0 / math.sqrt(dim)))


def routed_attention(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """The attention router's answer for (batch, seq, heads, head_dim) tensors, or None
    (no router, or "not mine"): the caller runs torch's SDPA as it would have."""
    router = _routers.get(ATTENTION)
    if router is None:
        return None
    with _bypass:
        return router(q, k, v, causal)


def attention_may_route(q: Any, k: Any, v: Any, causal: bool) -> bool:
    """Whether the attention router may answer a call of these (batch, seq, heads,
    head_dim) tensors, fake ones of a traced call included (``Router.may_route``)."""
    router = _routers.get(ATTENTION)
    return router is not None and router.may_route(q, k, v, causal)


def torch_attention(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """torch's SDPA on (batch, seq, heads, head_dim) tensors as a program calls it (fewer kv
    heads through ``enable_gqa``), past the overrides."""
    with _bypass:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def attention(q: Any, k: Any, v: Any, causal: bool, backend: str | None = None) -> Any:
    """Attention on (batch, seq, heads, head_dim) tensors: the router's answer when it gives
    one, else torch SDPA (``backend``: a row of the SDPA table, None: torch picks)."""
    out = routed_attention(q, k, v, causal)
    if out is not None:
        return out
    with _bypass:
        return sdpa_bshd(q, k, v, causal, backend)
