"""Timing: CUDA events around each call (each call isolated, see tuner/bench.py), medians;
wall clock on the CPU interpreter."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_calls(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        out = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
        return out
    # each call alone, after GPU idle and a memory-bound flush: as inside a training step
    # (the reasons, and what back-to-back timing did to GEMM choices: tuner/bench.py)
    from primus_perf.tuner.bench import time_isolated

    return [t * 1e3 for t in time_isolated({"fn": lambda _i: fn()}, 1, reps)["fn"]]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> tuple[float, float]:
    """(min, max) of a sample; (nan, nan) when empty."""
    return (min(values), max(values)) if values else (float("nan"), float("nan"))
