"""The trainer's attention router: the cached choice per problem, torch's default otherwise.

A cached choice is ``AttentionChoice(backend, config)``: ``backend`` is ``"triton"`` (our
kernel with ``config``) or one SDPA backend (``"sdpa:cudnn"``, ``"sdpa:flash"``,
``"sdpa:efficient"``) or ``"sdpa:default"`` when torch's own choice measured fastest. Install with ``trainer.dispatch.set_attention_router(router)``;
the router returns None for problems it has no choice for, and the dispatch then runs
torch's default SDPA. ``summary()`` counts calls per problem for the end-of-run summary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from primus_perf.problems import AttentionProblem, dtype_name
from primus_perf.tuner.attention.backends import DEFAULT, SDPA_BACKENDS, TRITON, sdpa_bshd
from primus_perf.tuner.attention.configs import AttnConfig


@dataclass(frozen=True)
class AttentionChoice:
    backend: str
    config: AttnConfig | None = None

    def __post_init__(self) -> None:
        if self.backend not in (TRITON, DEFAULT) and self.backend not in SDPA_BACKENDS:
            raise ValueError(f"unknown attention backend {self.backend!r}")
        if self.backend == TRITON and self.config is None:
            raise ValueError("a triton choice needs a config")

    def to_solution(self) -> dict[str, Any]:
        """The readable ``config`` part of a cache entry's solution."""
        out: dict[str, Any] = {"backend": self.backend}
        if self.config is not None:
            out.update(self.config.to_dict())
        return out

    @classmethod
    def from_solution(cls, data: Mapping[str, Any]) -> AttentionChoice:
        try:
            backend = str(data["backend"])
        except (KeyError, TypeError):
            raise ValueError(f"not an attention solution: {data!r}") from None
        config = AttnConfig.from_dict(dict(data)) if backend == TRITON else None
        return cls(backend, config)

    def label(self) -> str:
        return f"triton {self.config.label()}" if self.config else self.backend


def problem_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> AttentionProblem:
    """The problem of a trainer-layout call (batch, seq, heads, head_dim)."""
    b, sq, hq, d = q.shape
    _, skv, hkv, _ = k.shape
    return AttentionProblem(
        batch=b, heads_q=hq, heads_kv=hkv, seq_q=sq, seq_kv=skv, head_dim=d,
        dtype=dtype_name(q.dtype), causal=bool(causal), layout="bshd",
    )


class AttentionRouter:
    """Callable ``(q, k, v, causal) -> Tensor | None`` over a table of cached choices."""

    def __init__(self, choices: Mapping[str, AttentionChoice] | Iterable[tuple[str, AttentionChoice]]):
        self.choices: dict[str, AttentionChoice] = dict(choices)
        self._memo: dict[tuple, tuple[str, AttentionChoice | None]] = {}
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()

    def _lookup(self, q, k, causal) -> tuple[str, AttentionChoice | None]:
        sig = (tuple(q.shape), tuple(k.shape), q.dtype, bool(causal))
        found = self._memo.get(sig)
        if found is None:
            try:
                prob = problem_of(q, k, k, causal)
            except ValueError:
                found = ("", None)
            else:
                key = prob.key()
                choice = self.choices.get(key)
                if choice is None and prob.heads_kv != prob.heads_q:
                    # traces of the trainer show GQA after the kv heads were expanded for
                    # SDPA: a choice tuned for the expanded problem applies here as well
                    choice = self.choices.get(replace(prob, heads_kv=prob.heads_q).key())
                found = (key, choice)
            self._memo[sig] = found
        return found

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
        key, choice = self._lookup(q, k, causal)
        if choice is None:
            self.misses[key] += 1
            return None
        self.hits[key] += 1
        if choice.backend == DEFAULT:  # torch's own choice measured fastest
            return None
        if choice.backend == TRITON:
            from primus_perf.tuner.attention.function import triton_attention  # Triton on demand

            return triton_attention(q, k, v, causal=causal, config=choice.config)
        return sdpa_bshd(q, k, v, causal, choice.backend)

    def _choice_of(self, key: str) -> str:
        for memo_key, choice in self._memo.values():
            if memo_key == key and choice is not None:
                return choice.label()
        return ""

    def summary(self) -> dict[str, Any]:
        """Calls per problem: routed to a cached choice, or left to torch's default."""
        return {
            "cached_problems": len(self.choices),
            "routed": {k: {"calls": n, "choice": self._choice_of(k)} for k, n in self.hits.items()},
            "default": dict(self.misses),
        }
