"""Online tuning of attention: the calls of the attention dispatch ``(q, k, v, causal)`` in
(batch, seq, heads, head_dim) layout, forward and backward raced in the step."""

from __future__ import annotations

from typing import Any

import torch

from primus_perf.cache.store import ONLINE_SUFFIX
from primus_perf.kernels.attention.backends import TRITON
from primus_perf.kernels.attention.router import problem_of
from primus_perf.tuner.attention.plugin import TUNER_VERSION, AttentionTuner, triton_candidate
from primus_perf.tuner.measure import Clock, Sample
from primus_perf.tuner.online import Pooled, validated


class _BackwardEnd(torch.autograd.Function):
    """Identity on q, k, v; its backward (after the attention's) marks the end."""

    @staticmethod
    def forward(ctx, sample, clock, q, k, v):  # type: ignore[override]
        ctx.sample, ctx.clock = sample, clock
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):  # type: ignore[override]
        ctx.sample.pairs[-1] = (ctx.sample.pairs[-1][0], ctx.clock.mark())
        return None, None, dq, dk, dv


class _BackwardStart(torch.autograd.Function):
    """Identity on the output; its backward (before the attention's) marks the start."""

    @staticmethod
    def forward(ctx, sample, clock, out):  # type: ignore[override]
        ctx.sample, ctx.clock = sample, clock
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        ctx.sample.pairs.append((ctx.clock.mark(), None))
        return None, None, dout


class AttentionOnline:
    """Attention calls ``(q, k, v, causal)`` in (batch, seq, heads, dim) layout: the pool of
    the attention plugin without a search (torch's default, each raced SDPA backend) plus
    the cache's Triton configs; forward and backward are timed (the backward between two
    identity nodes around the call)."""

    kind = AttentionTuner.kind
    tuner_version = TUNER_VERSION + ONLINE_SUFFIX

    def __init__(self, triton_configs: list[Any] = (), limit: int = 8) -> None:
        self.triton_configs = list(triton_configs)
        self.limit = limit

    def key(self, q: Any, k: Any, v: Any, causal: bool) -> tuple[str, Any] | None:
        try:
            p = problem_of(q, k, v, causal)
        except ValueError:
            return None
        return p.key(), p

    def pool(self, problem: Any, q: Any, k: Any, v: Any, causal: bool) -> list[Pooled]:
        extra = [triton_candidate(cfg, f"triton{i}") for i, cfg in enumerate(self.triton_configs)]
        tuner = AttentionTuner(strategy=None, extra=extra, device=q.device.type)
        session = tuner.open(problem, None, lambda _label: None)
        try:
            return validated(session, self.limit)
        finally:
            session.close()

    def run(self, cand: Pooled, q: Any, k: Any, v: Any, causal: bool) -> Any:
        return cand.run(q, k, v, causal)

    @staticmethod
    def pairing(q: Any, k: Any, v: Any, causal: bool) -> bool:
        """Whether the call's backward is timed with it: a pair's two calls must agree (with
        activation checkpointing a no-grad forward and its recompute share the problem)."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))

    def timed(self, cand: Pooled, clock: Clock, q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Sample]:
        sample = Sample()
        grad = self.pairing(q, k, v, causal)
        if grad:
            q, k, v = _BackwardEnd.apply(sample, clock, q, k, v)
            sample.expect = 2
        start = clock.mark()
        out = cand.run(q, k, v, causal)
        sample.pairs.append((start, clock.mark()))
        if grad:
            out = _BackwardStart.apply(sample, clock, out)
        return out, sample



def adapter(router: Any) -> AttentionOnline:
    """The adapter of an installed attention router (the Triton configs of its choices)."""
    choices = getattr(router, "choices", {}) or {}
    return AttentionOnline(list(dict.fromkeys(c.config for c in choices.values() if c.backend == TRITON)))
