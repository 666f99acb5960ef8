"""The kinds online tuning knows (``online.KindAdapter``): GEMM, with the GEMM plugin's pool
and the kernels' table; attention, with the attention plugin's SDPA backends and the
Triton configs the cache holds; grouped GEMM, with the grouped plugin's backends, Triton's
default config, the vendor's seed configs and the Triton configs the cache holds, raced
against the caller's backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from primus_perf import kinds as registry
from primus_perf.cache.store import ONLINE_SUFFIX
from primus_perf.devices import gpu_vendor
from primus_perf.kernels import gemm
from primus_perf.kernels.attention.backends import TRITON
from primus_perf.kernels.attention.router import problem_of as attention_problem_of
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.passes import problem_of as grouped_problem_of
from primus_perf.kernels.grouped.passes import run_backend
from primus_perf.kernels.grouped.router import GroupedChoice, shape_key
from primus_perf.problems import GroupedGemmProblem
from primus_perf.runtime import routes
from primus_perf.tuner.attention.plugin import TUNER_VERSION as ATTENTION_VERSION
from primus_perf.tuner.attention.plugin import AttentionTuner, triton_candidate
from primus_perf.tuner.core import solution_of, validate
from primus_perf.tuner.gemm.plugin import TUNER_VERSION as GEMM_VERSION
from primus_perf.tuner.gemm.plugin import GemmTuner
from primus_perf.tuner.grouped.plugin import TUNER_VERSION as GROUPED_VERSION
from primus_perf.tuner.grouped.plugin import GroupedGemmTuner
from primus_perf.tuner.grouped.space import ONLINE_SEEDS
from primus_perf.tuner.online import Clock, OnlinePolicy, Pooled, Sample, online_routers


def validated(session: Any, limit: int) -> list[Pooled]:
    """The session's candidates that pass the core's validation (``core.validate``: the
    default first, at most ``limit``), pooled with their cache solutions as offline tuning
    writes them (``core.solution_of``); TuneError when the default fails."""
    return [Pooled(c.name, solution_of(c), err, c.run) for c, err in validate(session, session.candidates(), limit=limit)]


def bracketed(adapter: Any, cand: Pooled, clock: Clock, *args: Any) -> tuple[Any, Sample]:
    """``adapter.run(cand, *args)`` between two marks: one sample of one call."""
    start = clock.mark()
    out = adapter.run(cand, *args)
    return out, Sample([(start, clock.mark())])


class GemmOnline:
    """GEMM calls ``(a, b, bias)``: the problem with ``kernels.gemm.problem_of``; the pool of
    the GEMM plugin (one input set, for validation); kernels from the router's table."""

    kind = GemmTuner.kind
    tuner_version = GEMM_VERSION + ONLINE_SUFFIX

    def __init__(self, kernels: Mapping[str, gemm.KernelFactory] | None = None, limit: int = 8) -> None:
        self.kernels = gemm.KERNELS if kernels is None else kernels
        self.limit = limit
        self._memo: dict[tuple, tuple[str, Any] | None] = {}

    def key(self, a: Any, b: Any, bias: Any = None) -> tuple[str, Any] | None:
        """The problem of a call, memoized per signature; None (torch's kernel, which says what
        is wrong) for operands on different devices or a bias of another device or dtype: a
        library kernel must never be handed a pointer of another device."""
        if a.device != b.device or (bias is not None and (bias.device != a.device or bias.dtype != a.dtype)):
            return None
        sig = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, bias is not None)
        if sig not in self._memo:
            try:
                p = gemm.problem_of(a, b)
            except ValueError:
                self._memo[sig] = None
            else:
                p = dataclasses.replace(p, epilogue="bias") if bias is not None else p
                self._memo[sig] = (p.key(), p)
        return self._memo[sig]

    def pool(self, problem: Any, a: Any, b: Any, bias: Any = None) -> list[Pooled]:
        plain = dataclasses.replace(problem, epilogue="none")
        session = GemmTuner(device=a.device.type, sets=1).open(plain, None, lambda _label: None)
        try:
            found = validated(session, self.limit)
        finally:
            session.close()
        out = []
        for c in found:  # the program's calls run the router's kernels of the same solutions
            source = gemm.solution_source(c.solution)
            factory = gemm.torch_kernel if source == gemm.TORCH_SOURCE else self.kernels.get(source)
            kernel = factory(plain, c.solution, a.device) if factory is not None else None
            if kernel is not None:
                out.append(Pooled(c.name, c.solution, c.error, kernel))
        return out

    def run(self, cand: Pooled, a: Any, b: Any, bias: Any = None) -> Any:
        if bias is not None and cand.solution["config"].get("source") == gemm.TORCH_SOURCE:
            return gemm.torch_mm(a, b, bias)  # torch's own addmm, as the program would run it
        out = cand.run(a, b)
        return out if bias is None else out.add_(bias)

    def timed(self, cand: Pooled, clock: Clock, *args: Any) -> tuple[Any, Sample]:
        return bracketed(self, cand, clock, *args)


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
    tuner_version = ATTENTION_VERSION + ONLINE_SUFFIX

    def __init__(self, triton_configs: list[Any] = (), limit: int = 8) -> None:
        self.triton_configs = list(triton_configs)
        self.limit = limit

    def key(self, q: Any, k: Any, v: Any, causal: bool) -> tuple[str, Any] | None:
        try:
            p = attention_problem_of(q, k, v, causal)
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


class GroupedGemmOnline:
    """Grouped-GEMM passes of the routing point ``(phase, a, b, counts)``: the problem of
    the call's shape (``kernels.grouped.problem_of`` at skew 1: the token bucket, not the
    skew, so the counts of later steps keep one problem); the pool of the grouped plugin without its Triton
    search (the loop, the other torch backends) plus Triton's default config, the vendor's
    seed configs and the cache's Triton configs, validated on the bucket's operands, raced
    against the caller's own backend (``routes.grouped_baseline``: a lock must beat what
    the call would have run); each call timed between two marks."""

    kind = GroupedGemmTuner.kind
    tuner_version = GROUPED_VERSION + ONLINE_SUFFIX

    def __init__(self, triton_configs: list[Any] = (), limit: int = 8) -> None:
        self.triton_configs = list(triton_configs)
        self.limit = limit

    def key(self, phase: str, a: Any, b: Any, counts: Any) -> tuple[str, Any] | None:
        """The call's shape (its problem at skew 1, ``router.shape_key``): one tuning per
        shape, as the offline router decides where a shape's entries agree, so routing
        that drifts during training (a new skew bucket) starts no new tuning mid-run."""
        try:
            p = grouped_problem_of(phase, a, b, counts)
        except ValueError:
            return None
        shape = dataclasses.replace(p, skew=1.0)
        return shape.key(), shape

    def tuned_key(self, entry_key: str) -> str:
        """The shape key of a cache entry's problem (entries of other kinds: as they are)."""
        try:
            return shape_key(GroupedGemmProblem.from_key(entry_key))
        except ValueError:
            return entry_key

    def pool(self, problem: Any, phase: str, a: Any, b: Any, counts: Any) -> list[Pooled]:
        """The validated pool: the caller's backend first, then the Triton configs (the
        default config, the vendor's :data:`~.grouped.space.ONLINE_SEEDS`, the cache's),
        then the other backends: the router keeps the first ``max_candidates``."""
        baseline = GroupedChoice.of_backend(routes.grouped_baseline())
        vendor = gpu_vendor() if a.is_cuda else "cpu"
        configs = list(dict.fromkeys([GroupedGemmConfig(), *ONLINE_SEEDS[vendor], *self.triton_configs]))
        tuner = GroupedGemmTuner(configs=configs, device=a.device.type, sets=1, baseline=baseline)
        session = tuner.open(problem, None, lambda _label: None)
        try:
            found = validated(session, self.limit)
        finally:
            session.close()
        return found[:1] + sorted(found[1:], key=lambda c: not _is_triton(c))


    def run(self, cand: Pooled, phase: str, a: Any, b: Any, counts: Any) -> Any:
        return run_backend(cand.run, phase, a, b, counts)

    def timed(self, cand: Pooled, clock: Clock, *args: Any) -> tuple[Any, Sample]:
        return bracketed(self, cand, clock, *args)


def _is_triton(c: Pooled) -> bool:
    return GroupedChoice.from_solution(c.solution["config"]).config is not None


def _triton_configs(router: Any, is_triton: Any) -> list[Any]:
    """The distinct configs of the router's cached choices that ``is_triton``."""
    choices = getattr(router, "choices", {}) or {}
    return list(dict.fromkeys(c.config for c in choices.values() if is_triton(c)))


# each adapter from the kind's installed router: the GEMM one uses the router's kernel
# table; the attention and grouped-GEMM ones the Triton configs of the router's choices
registry.attach(GemmOnline.kind, online=lambda router: GemmOnline(getattr(router, "kernels", None)))
registry.attach(AttentionOnline.kind,
                online=lambda router: AttentionOnline(_triton_configs(router, lambda c: c.backend == TRITON)))
registry.attach(GroupedGemmOnline.kind,
                online=lambda router: GroupedGemmOnline(_triton_configs(router, lambda c: c.config is not None)))


def default_adapters(routers: Mapping[str, Any]) -> dict[str, Any]:
    """The adapters for the kinds installed (each kind's ``online`` part, from its router)."""
    return {kind: make(routers[kind]) for kind, make in registry.with_part("online", among=routers).items()}


@dataclass
class InStepTuning:
    """Online tuning as the runtime takes it (``runtime.OnlineTuning``): the cache's routers
    of the kinds with an adapter (``adapters``, default: :func:`default_adapters` of the
    routers) wrapped in ``online.OnlineRouter``; ``policy``, ``clock``: theirs (``clock``
    None: device events, so a GPU is needed)."""

    adapters: Mapping[str, Any] | None = None
    policy: OnlinePolicy | None = None
    clock: Clock | None = None

    @property
    def needs_gpu(self) -> bool:
        return self.clock is None

    def wrap(self, routers: Mapping[str, Any], activation: Any, cache: str | Path,
             log: Callable[[str], None] | None) -> dict[str, Any]:
        adapters = default_adapters(routers) if self.adapters is None else self.adapters
        return online_routers(routers, activation, cache, adapters=adapters, policy=self.policy,
                              clock=self.clock, log=log)
