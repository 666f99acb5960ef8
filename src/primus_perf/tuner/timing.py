"""The tuner's timers: device events, warm-up, rotating inputs, shuffled rounds, medians.

A timer is ``timer(calls, n_sets, reps, seed=0) -> {key: [seconds, ...]}``: ``calls`` maps
a key to ``fn(set_index)``, ``n_sets`` is how many input sets the calls rotate through, and
every call is timed ``reps`` times. The tuner core takes one (tests pass a fake);
:func:`default_timer` is :func:`time_isolated` on a GPU and :func:`time_cpu` without one.

Two GPU conditions. ``time_isolated`` (what the tuner uses) times each call alone, after about
1 ms of GPU idle and a 256 MB memory-bound kernel that also evicts L2: as inside a
training step, where GEMMs alternate with lighter kernels and the GPU's power draw, and so
the clock its power limit allows, recovers between them. ``time_interleaved`` runs calls
back to back, the GPU at its power limit for milliseconds on end: on an H100 that moved
one GEMM's torch time from 0.59 to 0.60-0.71 ms between runs, and picked algorithms that
were up to 18% slower in the trainer (benchmarks/gemm_timing_conditions.py).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Protocol

SLEEP_CYCLES_PER_CALL = 50_000
L2_FLUSH_BYTES = 100 * 2**20  # rotate through inputs larger than 2x the biggest L2 (H100: 50 MB)
ISOLATION_BYTES = 256 * 2**20  # zeroed before each isolated call: memory-bound, evicts L2
IDLE_CYCLES = 2_000_000  # GPU sleep before each isolated call: about 1 ms at H100 clocks


class Timer(Protocol):
    def __call__(
        self, calls: dict[Hashable, Callable[[int], object]], n_sets: int, reps: int, seed: int = 0
    ) -> dict[Hashable, list[float]]: ...


def default_timer() -> Timer:
    """Isolated-call GPU timing when a GPU is visible, wall-clock timing otherwise (the
    Triton interpreter on the CPU)."""
    import torch

    return time_isolated if torch.cuda.is_available() else time_cpu


def time_cpu(
    calls: dict[Hashable, Callable[[int], object]], n_sets: int, reps: int, seed: int = 0
) -> dict[Hashable, list[float]]:
    """CPU seconds this process spends in each call (the Triton interpreter, CPU kernels),
    one warm-up call each, shuffled rounds. Process CPU time, not the wall clock: other
    processes on a loaded machine do not inflate it, so choices do not flip with the load."""
    rng = random.Random(seed)
    names = list(calls)
    for name in names:
        calls[name](0)
    times: dict[Hashable, list[float]] = {n: [] for n in names}
    cursor = 0
    for _ in range(reps):
        rng.shuffle(names)
        for name in names:
            start = time.process_time()
            calls[name](cursor % n_sets)
            times[name].append(time.process_time() - start)
            cursor += 1
    return times


def buffer_sets(bytes_per_set: int, minimum: int = 2, maximum: int = 64) -> int:
    """How many input sets to rotate through so that one rotation exceeds L2."""
    return max(minimum, min(maximum, -(-L2_FLUSH_BYTES // max(1, bytes_per_set))))


def time_interleaved(
    fns: dict[str, Callable[[int], object]],
    n_sets: int,
    rounds: int,
    inner: int,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Seconds per call of each ``fn(set_index)``: every round runs each candidate ``inner``
    times (rotating input sets) between two events, candidates in a shuffled order."""
    import torch

    rng = random.Random(seed)
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        for i in range(min(n_sets, 3)):
            fns[name](i)
    torch.cuda.synchronize()
    cursor = 0
    for _ in range(rounds):
        rng.shuffle(names)
        events = []
        # keep the GPU busy while the round is launched, so that launch overhead is hidden
        # and the events time the GPU (about 25 us of queue per call)
        torch.cuda._sleep(int(SLEEP_CYCLES_PER_CALL * inner * len(names)))
        for name in names:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fns[name](cursor % n_sets)
                cursor += 1
            end.record()
            events.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in events:
            times[name].append(start.elapsed_time(end) / 1e3 / inner)
    return times


def time_isolated(
    fns: dict[Hashable, Callable[[int], object]],
    n_sets: int,
    reps: int,
    seed: int = 0,
    idle_cycles: int = IDLE_CYCLES,
) -> dict[Hashable, list[float]]:
    """Seconds of each call of each ``fn(set_index)``, ``reps`` calls per candidate: rounds
    in a shuffled order, each call alone between two events after ``idle_cycles`` of GPU
    sleep and a 256 MB zeroing."""
    import torch

    rng = random.Random(seed)
    names = list(fns)
    flush = torch.empty(ISOLATION_BYTES, dtype=torch.uint8, device="cuda")
    times: dict[Hashable, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        fns[name](0)
    torch.cuda.synchronize()
    pending: list[tuple[Hashable, object, object]] = []
    cursor = 0
    for _ in range(reps):
        rng.shuffle(names)
        for name in names:
            if idle_cycles:
                torch.cuda._sleep(idle_cycles)
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name](cursor % n_sets)
            end.record()
            cursor += 1
            pending.append((name, start, end))
        if len(pending) >= 256:  # bound the queue (and the events alive)
            _collect(pending, times)
    _collect(pending, times)
    return times


def _collect(pending: list, times: dict[Hashable, list[float]]) -> None:
    import torch

    torch.cuda.synchronize()
    for name, start, end in pending:
        times[name].append(start.elapsed_time(end) / 1e3)
    pending.clear()


def summarize(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return {"median_s": statistics.median(samples), "q1_s": q[0], "q3_s": q[2], "n": len(samples)}
