"""Timing: CUDA events around each call, medians; wall clock on the CPU interpreter."""

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
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> tuple[float, float]:
    """(min, max) of a sample; (nan, nan) when empty."""
    return (min(values), max(values)) if values else (float("nan"), float("nan"))
