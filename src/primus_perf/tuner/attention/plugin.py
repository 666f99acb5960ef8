"""The attention kind of the tuner core: torch's default SDPA (the default), SDPA restricted
to each raced backend, and our Triton kernel with the tile config a search found (grid or
optuna TPE, ``search.py``); every candidate is validated (forward and gradients) against the
fp32 reference on a small problem of the same shape class, and timed forward and backward
(two parts) on the real one. The searched candidate is validated and rough-timed by its
search, config by config (``searched_candidate``: the core takes those figures instead of
measuring it again), and raced in the core's final pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from primus_perf.base.devices import require_gpu
from primus_perf.base.errors import UserError
from primus_perf.kernels.attention.backends import DEFAULT, RACED, TRITON, sdpa_name
from primus_perf.kernels.attention.configs import HEAD_DIMS, AttnConfig
from primus_perf.kernels.attention.reference import (
    check_numerics,
    random_qkv,
    tolerance,
    validation_shape,
)
from primus_perf.kernels.attention.router import AttentionChoice, library_versions
from primus_perf.problems import AttentionProblem, torch_dtype
from primus_perf.tuner.attention.space import STRATEGIES, SearchSpace, default_space

if TYPE_CHECKING:
    from primus_perf.tuner.attention.search import SearchResult
from primus_perf.tuner.core import Candidate, Reps, Step
from primus_perf.tuner.measure import Timer

TUNER_VERSION = "attention-2"  # 2: the core's validation, timing and selection


def choice_candidate(choice: AttentionChoice, name: str | None = None) -> Candidate:
    """The candidate running a cached-choice value (``name`` defaults to its backend)."""
    return Candidate(name or choice.backend, choice.to_solution(), run=choice.implementation())


def triton_candidate(config: AttnConfig, name: str = TRITON) -> Candidate:
    return choice_candidate(AttentionChoice(TRITON, config), name)


def searched_candidate(found: SearchResult) -> Candidate:
    """The search's best forward and backward configs as one candidate, with what the search
    measured of them on this problem: the worse of their reference checks and their timed
    calls (the core neither validates nor rough-times it again)."""
    assert found.config is not None
    best = {m.part: m for m in found.measurements if m.ok and m.config in (found.config.fwd, found.config.bwd)}
    c = triton_candidate(found.config)
    if set(best) == {"fwd", "bwd"}:
        errors = [best[part].error for part in ("fwd", "bwd")]
        c.error = None if any(math.isnan(e) for e in errors) else max(errors)  # NaN: not validated there
        c.samples = {part: list(best[part].samples_s) for part in ("fwd", "bwd") if best[part].samples_s}
    return c


class AttentionTuner:
    """Triton tiles (``strategy``: "grid" or "tpe"; None: no Triton candidate) raced against
    torch's SDPA backends (``backends``: rows of ``kernels.attention.backends``) and any
    ``extra`` candidates; ``device``: where the inputs live ("cpu": the Triton interpreter)."""

    kind = AttentionProblem.kind
    version = TUNER_VERSION
    problem_type = AttentionProblem
    reps = Reps(rough=5, final_min=20, final_max=50)

    def __init__(
        self,
        *,
        strategy: str | None = "grid",
        trials: int | None = None,
        space: SearchSpace | None = None,
        storage: str | Path | None = None,
        backends: Sequence[str] = RACED,
        extra: Sequence[Candidate] = (),
        device: str = "cuda",
    ) -> None:
        if strategy is not None and strategy not in STRATEGIES:
            raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if trials is not None and trials <= 0:
            raise UserError("--trials must be positive")
        self.strategy = strategy
        self.trials = trials
        self.space = space
        self.storage = storage
        self.backends = tuple(backends)
        self.extra = list(extra)
        self.device = device

    def versions(self) -> dict[str, str]:
        return library_versions()

    def check(self, problem: AttentionProblem) -> None:
        """One-line UserError for problems the Triton kernel cannot take."""
        if problem.dtype not in ("bf16", "f16"):
            raise UserError(f"{problem}: attention tuning needs bf16 or f16, not {problem.dtype}")
        if problem.head_dim not in HEAD_DIMS:
            raise UserError(f"{problem}: head_dim must be one of {HEAD_DIMS}")
        if problem.causal and problem.seq_q != problem.seq_kv:
            raise UserError(f"{problem}: causal problems need seq_q == seq_kv")

    def open(self, problem: AttentionProblem, timer: Timer, step: Step) -> AttentionSession:
        return AttentionSession(self, problem, timer, step)


class AttentionSession:
    def __init__(self, tuner: AttentionTuner, problem: AttentionProblem, timer: Timer, step: Step) -> None:
        if tuner.device == "cpu":
            self.arch, self.vendor = "cpu", "cpu"
        else:
            ident = require_gpu()
            self.arch, self.vendor = ident.arch, ident.vendor
        self.tuner, self.problem, self.timer, self.step = tuner, problem, timer, step
        p = problem
        self.dtype = torch_dtype(p.dtype)
        q, k, v = random_qkv(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_kv, p.head_dim, self.dtype,
                             tuner.device, seed=1234)
        self.q, self.k, self.v = q, k, v
        self.do = torch.randn_like(q)
        # the same storage as q, k, v (no candidate writes its inputs), as leaves that take gradients
        self.grad_inputs = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
        self.n_sets = 1
        self.tolerance = tolerance(self.dtype)
        self.details: dict[str, Any] = {}
        self._seed = 0

    def candidates(self) -> list[Candidate]:
        pool = [choice_candidate(AttentionChoice(DEFAULT))]
        pool += [choice_candidate(AttentionChoice(sdpa_name(b))) for b in self.tuner.backends]
        t = self.tuner
        if t.strategy is not None:
            from primus_perf.tuner.attention.search import Evaluator, search  # Triton on demand

            space = t.space or default_space(self.vendor, self.problem.head_dim)
            ev = Evaluator(self.problem, arch=self.arch, device=t.device, timer=self.timer,
                           inputs=(self.q, self.k, self.v, self.do))
            found = search(ev, space, strategy=t.strategy, trials=t.trials, storage=t.storage,
                           vendor=self.vendor, progress=self.step)
            self.details["search"] = {"strategy": found.strategy, "trials": found.trials,
                                      "measured": found.measured, "fwd_ms": found.fwd_ms, "bwd_ms": found.bwd_ms}
            if found.config is not None:
                pool.append(searched_candidate(found))
        return pool + t.extra

    def error(self, c: Candidate) -> float:
        """Worst relative error of output, dQ, dK and dV on a small problem of this shape class."""
        b, hq, hkv, s = validation_shape(self.problem)
        self._seed += 1
        q, k, v = random_qkv(b, hq, hkv, s, s, self.problem.head_dim, self.dtype, self.tuner.device, self._seed)
        return check_numerics(c.run, q, k, v, causal=self.problem.causal, seed=self._seed).worst

    def calls(self, c: Candidate) -> dict[str, Any]:
        """Forward (no grad) and backward (``autograd.grad`` of one retained graph) on the real
        problem; raises when the candidate cannot run it (an SDPA backend that rejects it)."""
        fn, causal = c.run, self.problem.causal
        q, k, v, do, grads = self.q, self.k, self.v, self.do, self.grad_inputs
        with torch.no_grad():
            fn(q, k, v, causal)
        out = fn(*grads, causal)
        torch.autograd.grad(out, grads, do, retain_graph=True)

        def fwd(_i: int) -> None:
            with torch.no_grad():
                fn(q, k, v, causal)

        def bwd(_i: int) -> None:
            torch.autograd.grad(out, grads, do, retain_graph=True)

        return {"fwd": fwd, "bwd": bwd}

    def close(self) -> None:
        del self.q, self.k, self.v, self.do, self.grad_inputs
