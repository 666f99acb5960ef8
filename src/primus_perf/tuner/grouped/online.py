"""Online tuning of grouped GEMMs: the calls of the grouped dispatch ``(phase, a, b, offsets,
baseline)``, raced in the step against the caller's backend."""

from __future__ import annotations

from typing import Any

from primus_perf.base.devices import gpu_vendor
from primus_perf.cache.store import ONLINE_SUFFIX
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.passes import run_offsets, shape_problem_of
from primus_perf.kernels.grouped.router import GroupedChoice, shape_key
from primus_perf.problems import GroupedGemmProblem
from primus_perf.tuner.grouped.plugin import TUNER_VERSION, GroupedGemmTuner
from primus_perf.tuner.grouped.space import ONLINE_SEEDS
from primus_perf.tuner.online import Adapter, Pooled, validated


class GroupedGemmOnline(Adapter):
    """Grouped-GEMM calls of the dispatch ``(phase, a, b, offsets, baseline)``: the problem of
    the call's shape (at skew 1: the token bucket, not the skew, so the counts of later steps
    keep one problem); the pool of the grouped plugin without
    its Triton search plus Triton's default config, the vendor's seed configs and the cache's
    Triton configs, validated on the bucket's operands, raced against the caller's ``baseline``
    backend (a lock must beat what the call would have run); each call timed between two marks
    on the call's groups, the counts read on the host only by a backend that needs them."""

    kind = GroupedGemmTuner.kind
    tuner_version = TUNER_VERSION + ONLINE_SUFFIX

    def key(self, phase: str, a: Any, b: Any, offsets: Any, baseline: str) -> tuple[str, Any] | None:
        """The call's shape (its problem at skew 1, ``router.shape_key``), read without the
        counts: one tuning per shape, so routing that drifts during training (a new skew
        bucket) starts no new tuning mid-run."""
        try:
            shape = shape_problem_of(phase, a, b, offsets.groups)
        except ValueError:
            return None
        return shape.key(), shape

    def tuned_key(self, entry_key: str) -> str:
        """The shape key of a cache entry's problem (entries of other kinds: as they are)."""
        try:
            return shape_key(GroupedGemmProblem.from_key(entry_key))
        except ValueError:
            return entry_key

    def pool(self, problem: Any, phase: str, a: Any, b: Any, offsets: Any, baseline: str) -> list[Pooled]:
        """The validated pool: the caller's backend first, then the Triton configs (the default
        config, the vendor's ``ONLINE_SEEDS``, the cache's), then the other backends: the
        router keeps the first ``max_candidates``."""
        vendor = gpu_vendor() if a.is_cuda else "cpu"
        configs = list(dict.fromkeys([GroupedGemmConfig(), *ONLINE_SEEDS[vendor], *self.triton_configs]))
        tuner = GroupedGemmTuner(configs=configs, device=a.device.type, sets=1,
                                 baseline=GroupedChoice.of_backend(baseline))
        found = validated(tuner, problem, self.limit)
        return found[:1] + sorted(found[1:], key=lambda c: not _is_triton(c))

    def run(self, cand: Pooled, phase: str, a: Any, b: Any, offsets: Any, baseline: str) -> Any:
        return run_offsets(cand.run, phase, a, b, offsets)  # the counts read only where it needs them


def _is_triton(c: Pooled) -> bool:
    return GroupedChoice.from_solution(c.solution["config"]).config is not None


def adapter(router: Any) -> GroupedGemmOnline:
    """The adapter of an installed grouped router (the Triton configs of its choices)."""
    choices = getattr(router, "choices", {}) or {}
    return GroupedGemmOnline(list(dict.fromkeys(c.config for c in choices.values() if c.config is not None)))
