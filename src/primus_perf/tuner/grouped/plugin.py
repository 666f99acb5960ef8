"""The grouped-GEMM kind of the tuner core: the per-expert loop (the default), the other
backends of ``kernels.grouped`` that can run the problem here (``torch._grouped_mm``,
padded ``bmm``) and the Triton grouped GEMM with every config of its search space that the
validity rules keep (``space.py``: a grid pruned by ``kernels.grouped.configs``; at
most ``max_configs`` of them, the rest cut and reported; the core's rough pass drops the
slow ones). Each pass (fwd, dgrad, wgrad) is its
own problem.

Operands come from the problem's token-distribution bucket
(:meth:`~primus_perf.problems.GroupedGemmProblem.example_counts`): ``tokens`` rows in all
(the bucket's total, a power of two), the first group holding ``skew`` x the mean and the
rest spread evenly; random normal values in the problem's dtype, the weight stored as the
problem says (``trans_w``: ``[G, N, K]`` used transposed). Candidates are timed on these
counts; they are validated on the same operands with :func:`validation_counts` (the same
total with the last group empty and the one before it holding one token) against an fp32
product of each group (relative Frobenius error, per-dtype tolerance).

Timing: :func:`~primus_perf.tuner.measure.time_launch_bound` on a GPU (the
:meth:`GroupedGemmTuner.default_timer` the core uses when no timer is injected): the loop
launches one GEMM per expert, and a CPU-bound step pays those launches, which the isolated
timer of dense GEMMs hides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from primus_perf.base.devices import require_gpu
from primus_perf.base.errors import UserError
from primus_perf.kernels.grouped.backends import BACKENDS
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.passes import run_backend
from primus_perf.kernels.grouped.router import TRITON, GroupedChoice, library_versions
from primus_perf.problems import DTYPE_BYTES, GroupedGemmProblem, torch_dtype
from primus_perf.tuner import measure
from primus_perf.tuner.core import Candidate, Reps, Step
from primus_perf.tuner.grouped.space import SearchSpace, default_space, prune
from primus_perf.tuner.measure import Timer

TUNER_VERSION = "grouped-gemm-1"
TOLERANCE = {"bf16": 2e-2, "f16": 5e-3, "f32": 1e-4}
DEFAULT = "loop"
RACED = ("grouped_mm", "padded_bmm")  # the other torch backends, raced where they can run
MAX_CONFIGS = 16


def choice_candidate(choice: GroupedChoice, name: str | None = None) -> Candidate:
    """The candidate running a cached-choice value (``name`` defaults to its label)."""
    return Candidate(name or choice.label(), choice.to_solution(), run=choice.implementation())


def validation_counts(counts: Sequence[int]) -> list[int]:
    """``counts`` with the last group emptied and the one before it left one token, their
    tokens spread over the others (same total): every candidate must handle both."""
    out = [int(c) for c in counts]
    if len(out) < 3 or sum(out) < len(out):
        return out
    moved = out[-1] + out[-2] - 1
    out[-1], out[-2] = 0, 1
    share, extra = divmod(moved, len(out) - 2)
    for g in range(len(out) - 2):
        out[g] += share + (1 if g < extra else 0)
    return out


class GroupedGemmTuner:
    """Backends (``backends``: rows of ``kernels.grouped.BACKENDS`` raced beside the
    loop) and Triton configs (``configs`` if given, else ``space`` or the vendor's default
    space; ``triton=False``: none) raced against the per-expert loop, plus any ``extra``
    candidates; ``device``: where the operands live ("cpu": the Triton interpreter);
    ``baseline``: the choice the others race against (first in the pool, the one a
    choice must beat by the margin, never dropped; default the loop), e.g. the caller's
    own backend where online tuning answers a program's calls."""

    kind = GroupedGemmProblem.kind
    version = TUNER_VERSION
    problem_type = GroupedGemmProblem
    reps = Reps(rough=5, final_min=10, final_max=40)

    def __init__(
        self,
        *,
        backends: Sequence[str] = RACED,
        triton: bool = True,
        space: SearchSpace | None = None,
        configs: Sequence[GroupedGemmConfig] | None = None,
        max_configs: int = MAX_CONFIGS,
        extra: Sequence[Candidate] = (),
        device: str = "cuda",
        sets: int | None = None,
        baseline: GroupedChoice | None = None,
    ) -> None:
        unknown = [b for b in backends if b not in BACKENDS or b == TRITON]
        if unknown:
            raise UserError(f"unknown grouped GEMM backend(s) {unknown} (one of {', '.join(RACED)})")
        if max_configs < 0:
            raise UserError("max_configs must be >= 0")
        self.backends = tuple(backends)
        self.triton = triton
        self.space = space
        self.configs = None if configs is None else list(configs)
        self.max_configs = max_configs
        self.extra = list(extra)
        self.device = device
        self.sets = sets
        self.baseline = baseline or GroupedChoice(DEFAULT)

    def versions(self) -> dict[str, str]:
        return library_versions()

    def default_timer(self) -> Timer:
        """What the core times these candidates with when no timer is injected."""
        return measure.launch_bound_timer()

    def check(self, problem: GroupedGemmProblem) -> None:
        if problem.dtype not in TOLERANCE:
            raise UserError(f"{problem}: grouped GEMM tuning has no reference tolerance for {problem.dtype}")

    def open(self, problem: GroupedGemmProblem, timer: Timer, step: Step) -> GroupedGemmSession:
        return GroupedGemmSession(self, problem, step)


def _pass_operands(p: GroupedGemmProblem, dtype: torch.dtype, device: str, g: torch.Generator):
    """``(a, b)`` of one call of the pass (the routing point's operands)."""
    T, K, N, G = p.tokens, p.k, p.n, p.groups

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    if p.phase == "wgrad":
        return randn(T, K), randn(T, N)
    weight = randn(G, N, K).transpose(1, 2) if p.trans_w else randn(G, K, N)  # the forward's [G, K, N]
    if p.phase == "fwd":
        return randn(T, K), weight
    return randn(T, N), weight.transpose(1, 2)


class GroupedGemmSession:
    def __init__(self, tuner: GroupedGemmTuner, problem: GroupedGemmProblem, step: Step | None = None) -> None:
        self.step = step or (lambda _label: None)
        if tuner.device == "cpu":
            self.arch, self.vendor = "cpu", "cpu"
        else:
            ident = require_gpu()
            self.arch, self.vendor = ident.arch, ident.vendor
        self.tuner, self.problem = tuner, problem
        self.dtype = torch_dtype(problem.dtype)
        self.device = torch.device(tuner.device)
        self.counts = problem.example_counts()
        self.check_counts = validation_counts(self.counts)
        p = problem
        per_set = (p.tokens * (p.k + p.n) + p.groups * p.k * p.n) * DTYPE_BYTES[p.dtype]
        self.n_sets = tuner.sets or measure.buffer_sets(per_set, minimum=1)
        gen = torch.Generator(device=tuner.device).manual_seed(1234)
        self.sets = [_pass_operands(problem, self.dtype, tuner.device, gen) for _ in range(self.n_sets)]
        self.tolerance = TOLERANCE[problem.dtype]
        self.details: dict[str, Any] = {"counts": self.counts, "validation_counts": self.check_counts}
        self._ref: torch.Tensor | None = None

    def _triton_configs(self) -> list[GroupedGemmConfig]:
        t = self.tuner
        if not t.triton or BACKENDS[TRITON].unsupported(self.device, self.dtype, self.problem.k, self.problem.n):
            return []
        if t.configs is not None:
            kept, self.details["pruned"] = prune(t.configs, self.problem, self.arch)
        else:
            kept = (t.space or default_space(self.vendor)).configs(self.problem, self.arch)
        self.details["triton_configs"] = min(len(kept), t.max_configs)
        if len(kept) > t.max_configs:  # reported, not silent: the result's details and a progress line
            self.details["triton_configs_cut"] = len(kept) - t.max_configs
            self.step(f"{len(kept)} valid Triton configs: racing the first {t.max_configs} (max_configs)")
        return kept[: t.max_configs]

    def candidates(self) -> list[Candidate]:
        p = self.problem
        base = self.tuner.baseline
        others = [GroupedChoice(DEFAULT)]
        others += [GroupedChoice(b) for b in self.tuner.backends
                   if BACKENDS[b].unsupported(self.device, self.dtype, p.k, p.n) is None]
        others += [GroupedChoice(TRITON, cfg) for cfg in self._triton_configs()]
        return [choice_candidate(c) for c in [base] + [c for c in others if c != base]] + self.tuner.extra

    def error(self, c: Candidate) -> float:
        """Relative (Frobenius) error against the fp32 product on the validation counts."""
        a, b = self.sets[0]
        if self._ref is None:
            self._ref = run_backend(BACKENDS["loop"], self.problem.phase, a.float(), b.float(), self.check_counts)
        out = run_backend(c.run, self.problem.phase, a, b, self.check_counts)
        if out.shape != self._ref.shape:
            raise ValueError(f"output shape {tuple(out.shape)}, expected {tuple(self._ref.shape)}")
        ref_norm = self._ref.norm().item() or 1.0
        return (out.float() - self._ref).norm().item() / ref_norm

    def calls(self, c: Candidate) -> dict[str, Any]:
        phase, sets, counts, backend = self.problem.phase, self.sets, self.counts, c.run
        return {self.problem.kind: lambda i: run_backend(backend, phase, sets[i][0], sets[i][1], counts)}

    def close(self) -> None:
        self.sets.clear()
        self._ref = None
