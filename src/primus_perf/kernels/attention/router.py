"""The attention router: the cached choice per problem, torch's default otherwise.

A cached choice is ``AttentionChoice(backend, config)``: ``backend`` is ``"triton"`` (our
kernel with ``config``), one SDPA backend (``"sdpa:cudnn"``, ``"sdpa:flash"``, ...) or
``"sdpa:default"`` when torch's own choice measured fastest (names: ``backends``). The
router answers None for problems it has no choice for and :data:`~..routing.OWN` for
``sdpa:default``: the call then runs torch's SDPA as the program called it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from primus_perf.base.errors import CacheError
from primus_perf.kernels.attention.backends import (
    DEFAULT,
    TRITON,
    check_backend_name,
    sdpa_implementation,
)
from primus_perf.kernels.attention.configs import AttnConfig
from primus_perf.kernels.routing import (
    OWN,
    UNSUPPORTED,
    CachedChoice,
    choice_solution,
    solution_backend,
)
from primus_perf.problems import AttentionProblem, dtype_name

VERSIONED_LIBRARIES = ("torch", "triton", "cudnn")


def library_versions() -> dict[str, str]:
    """The library versions an attention cache entry must match: torch, Triton, cuDNN."""
    from primus_perf.base.devices import library_versions as all_versions

    return {k: v for k, v in all_versions().items() if k in VERSIONED_LIBRARIES}


@dataclass(frozen=True)
class AttentionChoice:
    backend: str
    config: AttnConfig | None = None

    def __post_init__(self) -> None:
        check_backend_name(self.backend)
        if self.backend == TRITON and self.config is None:
            raise ValueError("a triton choice needs a config")

    def to_solution(self) -> dict[str, Any]:
        """The readable ``config`` part of a cache entry's solution."""
        return choice_solution(self.backend, self.config)

    @classmethod
    def from_solution(cls, data: Mapping[str, Any]) -> AttentionChoice:
        backend = solution_backend(data, "an attention")
        config = AttnConfig.from_dict(dict(data)) if backend == TRITON else None
        return cls(backend, config)

    def label(self) -> str:
        return f"triton {self.config.label()}" if self.config else self.backend

    def implementation(self):
        """``fn(q, k, v, causal)`` running this choice."""
        if self.backend == TRITON:
            from primus_perf.kernels.attention.function import triton_attention  # Triton on demand

            config = self.config
            return lambda q, k, v, causal: triton_attention(q, k, v, causal=causal, config=config)
        return sdpa_implementation(self.backend)


def problem_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> AttentionProblem:
    """The problem of a trainer-layout call (batch, seq, heads, head_dim)."""
    b, sq, hq, d = q.shape
    _, skv, hkv, _ = k.shape
    return AttentionProblem(
        batch=b, heads_q=hq, heads_kv=hkv, seq_q=sq, seq_kv=skv, head_dim=d,
        dtype=dtype_name(q.dtype), causal=bool(causal), layout="bshd",
    )


class AttentionRouter:
    """``route(q, k, v, causal)`` over a table of cached choices (``kernels.routing``)."""

    def __init__(self, choices: Mapping[str, AttentionChoice] | Iterable[tuple[str, AttentionChoice]]):
        self.choices: dict[str, AttentionChoice] = dict(choices)
        self._memo: dict[tuple, tuple[str, AttentionChoice | None]] = {}
        self._impls: dict[AttentionChoice, Any] = {}

    @classmethod
    def from_entries(cls, entries: Iterable[CachedChoice]) -> AttentionRouter:
        """The router over usable cache entries; CacheError for an unreadable solution."""
        choices: dict[str, AttentionChoice] = {}
        for entry in entries:
            try:
                choices[entry.problem_key] = AttentionChoice.from_solution(entry.solution["config"])
            except (KeyError, ValueError) as exc:
                raise CacheError(f"attention cache entry {entry.problem_key}: {exc}") from None
        return cls(choices)

    def idle(self, baseline: str = DEFAULT) -> bool:
        """True when the cache has choices and every one is torch's default SDPA: every call
        would be torch's. With no choice at all the router stays: its dispatch counts the calls."""
        return bool(self.choices) and all(c.backend == DEFAULT for c in self.choices.values())

    def _lookup(self, q, k, causal) -> tuple[str, AttentionChoice | None]:
        sig = (tuple(q.shape), tuple(k.shape), q.dtype, bool(causal))
        found = self._memo.get(sig)
        if found is None:
            try:
                prob = problem_of(q, k, k, causal)
            except ValueError:
                found = (UNSUPPORTED, None)
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

    def route(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[str, Any]:
        """``(key, run)`` of a call in (batch, seq, heads, head_dim) layout."""
        key, choice = self._lookup(q, k, causal)
        if choice is None:
            return key, None
        if choice.backend == DEFAULT:  # torch's own choice measured fastest
            return key, OWN
        impl = self.implementation(choice)
        return key, lambda: impl(q, k, v, causal)

    def may_route(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
        """Yes when the cache holds a choice other than torch's default for these shapes, or
        when the shapes are symbolic (a dynamic-shape compile: decided per call)."""
        if not all(type(n) is int for n in (*q.shape, *k.shape)):
            return True
        _key, choice = self._lookup(q, k, causal)
        return choice is not None and choice.backend != DEFAULT

    def label(self, key: str) -> str | None:
        choice = self.choices.get(key)
        return choice.label() if choice is not None else None

    def implementation(self, choice: AttentionChoice):
        """``fn(q, k, v, causal)`` running a cached choice (made once per choice)."""
        impl = self._impls.get(choice)
        if impl is None:
            impl = self._impls[choice] = choice.implementation()
        return impl

    def close(self) -> None:
        self._impls.clear()
        self._memo.clear()
