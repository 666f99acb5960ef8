"""Online tuning of attention: the calls of the attention dispatch ``(q, k, v, causal)`` in
(batch, seq, heads, head_dim) layout, forward and backward raced in the step."""

from __future__ import annotations

from typing import Any

from primus_perf.cache.store import ONLINE_SUFFIX
from primus_perf.kernels.attention.backends import DEFAULT, TRITON
from primus_perf.kernels.attention.router import AttentionChoice, problem_of
from primus_perf.runtime.attention import records_backward, timed_attention
from primus_perf.tuner.attention.plugin import TUNER_VERSION, AttentionTuner, triton_candidate
from primus_perf.tuner.measure import Clock, Sample
from primus_perf.tuner.online import Adapter, Pooled, validated


class AttentionOnline(Adapter):
    """Attention calls ``(q, k, v, causal)`` in (batch, seq, heads, dim) layout: the pool of
    the attention plugin without a search (torch's default, each raced SDPA backend) plus
    the cache's Triton configs; forward and backward are timed (the backward between two
    identity nodes around the call)."""

    kind = AttentionTuner.kind
    tuner_version = TUNER_VERSION + ONLINE_SUFFIX

    def key(self, q: Any, k: Any, v: Any, causal: bool) -> tuple[str, Any] | None:
        try:
            p = problem_of(q, k, v, causal)
        except ValueError:
            return None
        return p.key(), p

    def pool(self, problem: Any, q: Any, k: Any, v: Any, causal: bool) -> list[Pooled]:
        extra = [triton_candidate(cfg, f"triton{i}") for i, cfg in enumerate(self.triton_configs)]
        return validated(AttentionTuner(strategy=None, extra=extra, device=q.device.type), problem, self.limit)

    def cached(self, solution: Any, problem: Any, q: Any, k: Any, v: Any, causal: bool) -> list[Pooled]:
        """torch's SDPA and a cached choice (validated when it was tuned), to race in the step."""
        choice = AttentionChoice.from_solution(solution["config"])
        default = AttentionChoice(DEFAULT)
        return [Pooled(DEFAULT, {"config": default.to_solution(), "blob": b""}, 0.0, default.implementation()),
                Pooled(choice.label(), dict(solution), 0.0, choice.implementation())]

    def run(self, cand: Pooled, q: Any, k: Any, v: Any, causal: bool) -> Any:
        return cand.run(q, k, v, causal)

    @staticmethod
    def pairing(q: Any, k: Any, v: Any, causal: bool) -> bool:
        """Whether the call's backward is timed with it: a pair's two calls must agree (with
        activation checkpointing a no-grad forward and its recompute share the problem)."""
        return records_backward(q, k, v)

    def timed(self, cand: Pooled, clock: Clock, q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Sample]:
        sample = Sample()
        out = timed_attention(lambda a, b, c: cand.run(a, b, c, causal), sample, clock, q, k, v)
        return out, sample



def adapter(router: Any) -> AttentionOnline:
    """The adapter of an installed attention router (the Triton configs of its choices)."""
    choices = getattr(router, "choices", {}) or {}
    return AttentionOnline(list(dict.fromkeys(c.config for c in choices.values() if c.backend == TRITON)))
