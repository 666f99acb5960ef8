"""An FP8 plan: which linear layers of a model run FP8, and with what recipe.

The problem (:class:`Fp8PlanProblem`) is the model's identity as its GEMMs see it: the
linear layers (name, out features, in features), the rows of their forward GEMM per step
(``tokens``: micro-batch x sequence on one rank; FP8 pays only where GEMMs are large) and
the high-precision dtype. The solution is the plan: layer name -> recipe name or ``bf16``.
A cache entry of kind ``fp8_plan`` stores it with the measured step times (``tuned_ms``
with the plan, ``default_ms`` all bf16, and their spreads) and the loss check (the
relative loss difference as the entry's ``error``; the check's figures in the solution's
config). Device and library identity (torch, CUDA/HIP, torchao) are checked as for every
entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from primus_perf.kernels.fp8.recipes import BF16, RECIPES
from primus_perf.problems.fp8 import KIND, Fp8PlanProblem

__all__ = ["KIND", "VERSIONED_LIBRARIES", "Fp8Plan", "Fp8PlanProblem", "LossCheck"]

VERSIONED_LIBRARIES = ("torch", "cuda", "hip", "torchao")


@dataclass
class LossCheck:
    """The A/B from one seed: bf16 and the plan, ``steps`` steps each; ``loss_*`` is the
    mean loss of the last ``window`` steps (the same batches on both sides)."""

    steps: int
    window: int
    loss_bf16: float
    loss_fp8: float
    threshold: float  # relative

    @property
    def rel_diff(self) -> float:
        return abs(self.loss_fp8 - self.loss_bf16) / max(abs(self.loss_bf16), 1e-12)

    @property
    def passed(self) -> bool:
        return self.rel_diff <= self.threshold

    def line(self) -> str:
        verdict = "within" if self.passed else "beyond"
        return (f"loss check over {self.steps} steps from one seed: bf16 {self.loss_bf16:.4f}, FP8 plan "
                f"{self.loss_fp8:.4f} ({self.rel_diff:.2%} relative, {verdict} the {self.threshold:.1%} threshold)")

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "window": self.window, "loss_bf16": self.loss_bf16, "loss_fp8": self.loss_fp8,
                "threshold": self.threshold, "rel_diff": self.rel_diff, "passed": self.passed}


@dataclass
class Fp8Plan:
    problem: Fp8PlanProblem
    layers: dict[str, str]  # layer name -> recipe name or "bf16"
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # group -> measured figures

    def __post_init__(self) -> None:
        names = {n for n, _, _ in self.problem.layers}
        unknown = sorted(set(self.layers) - names)
        if unknown:
            raise ValueError(f"plan names layers the model does not have: {unknown[:3]}")
        bad = sorted({r for r in self.layers.values() if r != BF16 and r not in RECIPES})
        if bad:
            raise ValueError(f"plan names unknown FP8 recipes {bad}")

    @property
    def fp8_layers(self) -> dict[str, str]:
        return {n: r for n, r in self.layers.items() if r != BF16}

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for r in self.layers.values():
            counts[r] = counts.get(r, 0) + 1
        return ", ".join(f"{n} {r}" for r, n in sorted(counts.items()))


def library_versions() -> dict[str, str]:
    """The versions an ``fp8_plan`` entry must match: torch, its CUDA or HIP, torchao."""
    import importlib.metadata

    from primus_perf.base.devices import library_versions as all_versions

    versions = {k: v for k, v in all_versions().items() if k in VERSIONED_LIBRARIES}
    try:
        versions["torchao"] = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        versions["torchao"] = "none"
    return versions


def plan_solution(plan: Fp8Plan, loss: LossCheck | None) -> dict[str, Any]:
    """The cache entry's solution: the readable plan, its groups' figures, the loss check."""
    config: dict[str, Any] = {"layers": dict(sorted(plan.layers.items())), "groups": plan.groups}
    if loss is not None:
        config["loss_check"] = loss.to_dict()
    return {"config": config, "blob": b""}


def plan_from_entry(problem: Fp8PlanProblem, config: Mapping[str, Any]) -> Fp8Plan:
    return Fp8Plan(problem, dict(config.get("layers", {})), dict(config.get("groups", {})))


def matching(problems: Sequence[Fp8PlanProblem], layers: Sequence[tuple[str, int, int]],
             tokens: int | None) -> list[Fp8PlanProblem]:
    """The problems among ``problems`` for this set of layers (and these tokens, if given)."""
    digest = Fp8PlanProblem(tuple(layers), 0).layers_digest
    return [p for p in problems if p.layers_digest == digest and (tokens is None or p.tokens == tokens)]
