"""Tune one attention problem: search Triton tile configs, then race the tuned kernel
against every torch SDPA backend (forward + backward, interleaved) and pick the fastest.

``tune_problem`` returns an ``AttentionTuneResult``: the search's record, every
backend's times, the selected backend and config, the speedup over torch's default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primus_perf.devices import DeviceIdentity, require_gpu
from primus_perf.problems import AttentionProblem
from primus_perf.tuner.attention.backends import DEFAULT, SDPA_BACKENDS, TRITON, implementation
from primus_perf.tuner.attention.configs import AttnConfig, SearchSpace, default_space, known_good
from primus_perf.tuner.attention.search import (
    Evaluator,
    Progress,
    SearchResult,
    grid_search,
    grid_size,
    tpe_search,
)
from primus_perf.tuner.attention.select import BackendTiming, fastest, tflops, time_backends
from primus_perf.tuner.attention.spec import STRATEGIES

TUNER_VERSION = "attention-1"


def library_versions() -> dict[str, str]:
    """torch, Triton and cuDNN versions (what a cache entry must match to be used)."""
    from primus_perf.tuner.attention.cache_io import running_versions

    return running_versions()


@dataclass
class AttentionTuneResult:
    problem: AttentionProblem
    device: DeviceIdentity
    versions: dict[str, str]
    search: SearchResult
    timings: dict[str, BackendTiming]
    selected: str
    config: AttnConfig | None  # the Triton config found (used when selected == "triton")
    numerics_error: float

    def ms(self, backend: str) -> float:
        t = self.timings.get(backend)
        return t.total_ms if t and t.status == "ok" else math.inf

    @property
    def speedup(self) -> float:
        """torch default SDPA time over the selected backend's time (fwd + bwd)."""
        sel = self.ms(self.selected)
        return self.ms(DEFAULT) / sel if sel and math.isfinite(sel) else float("nan")

    def rows(self) -> list[dict[str, Any]]:
        """One row per backend, for the result table."""
        out = []
        base = self.ms(DEFAULT)
        for name, t in self.timings.items():
            out.append(
                {
                    "backend": name,
                    "selected": name == self.selected,
                    "config": self.config.label() if name == TRITON and self.config else "",
                    "status": t.status,
                    "fwd_tflops": tflops(self.problem.forward_flops, t.fwd_ms),
                    "bwd_tflops": tflops(self.problem.backward_flops, t.bwd_ms),
                    "total_ms": t.total_ms,
                    "speedup": base / t.total_ms if t.status == "ok" else float("nan"),
                }
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "problem": self.problem.to_dict(),
            "problem_key": self.problem.key(),
            "device": self.device.to_dict(),
            "versions": self.versions,
            "selected": self.selected,
            "config": self.config.to_dict() if self.config else None,
            "numerics_error": self.numerics_error,
            "speedup_vs_default": self.speedup,
            "search": {
                "strategy": self.search.strategy,
                "trials": self.search.trials,
                "measured": self.search.measured,
                "fwd_ms": self.search.fwd_ms,
                "bwd_ms": self.search.bwd_ms,
            },
            "backends": {k: v.to_dict(self.problem) for k, v in self.timings.items()},
        }


def search_problem(
    problem: AttentionProblem,
    *,
    strategy: str = "grid",
    trials: int | None = None,
    space: SearchSpace | None = None,
    storage: str | Path | None = None,
    arch: str | None = None,
    vendor: str | None = None,
    device: str = "cuda",
    reps: int = 20,
    validate: bool = True,
    seed: int = 0,
    progress: Progress | None = None,
) -> SearchResult:
    """Only the Triton config search (no backend race)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    ident = None
    if arch is None or vendor is None:
        ident = require_gpu() if device != "cpu" else None
    arch = arch or (ident.arch if ident else "cpu")
    vendor = vendor or (ident.vendor if ident else "cpu")
    space = space or default_space(vendor, problem.head_dim)
    ev = Evaluator(problem, arch=arch, device=device, reps=reps, validate=validate, seed=seed)
    if strategy == "grid":
        return grid_search(ev, space, progress)
    n_f, n_b = grid_size(space, problem, arch)
    n = trials if trials is not None else max(4, int(0.2 * (n_f + n_b)))
    return tpe_search(
        ev, space, n, storage=storage, seeds=known_good(vendor, problem.head_dim), seed=seed,
        study_name=f"{problem.key()}|{arch}", progress=progress,
    )


def tune_problem(
    problem: AttentionProblem,
    *,
    strategy: str = "grid",
    trials: int | None = None,
    space: SearchSpace | None = None,
    storage: str | Path | None = None,
    rounds: int = 5,
    reps: int = 10,
    progress: Progress | None = None,
) -> AttentionTuneResult:
    """Search Triton configs, then pick the fastest of Triton and every SDPA backend."""
    ident = require_gpu()
    result = search_problem(
        problem, strategy=strategy, trials=trials, space=space, storage=storage,
        arch=ident.arch, vendor=ident.vendor, progress=progress,
    )
    candidates = {DEFAULT: implementation(DEFAULT)}
    for name in SDPA_BACKENDS:
        candidates[name] = implementation(name)
    if result.config is not None:
        candidates[TRITON] = implementation(TRITON, result.config)
    timings = time_backends(problem, candidates, rounds=rounds, reps=reps)
    selected = fastest(timings) or DEFAULT
    errors = [m.error for m in result.measurements if result.config and m.config in (result.config.fwd, result.config.bwd)]
    return AttentionTuneResult(
        problem=problem,
        device=ident,
        versions=library_versions(),
        search=result,
        timings=timings,
        selected=selected,
        config=result.config,
        numerics_error=max((e for e in errors if not math.isnan(e)), default=float("nan")),
    )

