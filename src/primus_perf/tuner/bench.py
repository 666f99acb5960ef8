"""GPU timing harness: device events, warm-up, rotating inputs, interleaved rounds, medians.

Two conditions. ``time_isolated`` (what the tuner uses) times each call alone, after about
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
from collections.abc import Callable

SLEEP_CYCLES_PER_CALL = 50_000
L2_FLUSH_BYTES = 100 * 2**20  # rotate through inputs larger than 2x the biggest L2 (H100: 50 MB)
ISOLATION_BYTES = 256 * 2**20  # zeroed before each isolated call: memory-bound, evicts L2
IDLE_CYCLES = 2_000_000  # GPU sleep before each isolated call: about 1 ms at H100 clocks


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
    fns: dict[str, Callable[[int], object]],
    n_sets: int,
    reps: int,
    seed: int = 0,
    idle_cycles: int = IDLE_CYCLES,
) -> dict[str, list[float]]:
    """Seconds of each call of each ``fn(set_index)``, ``reps`` calls per candidate: rounds
    in a shuffled order, each call alone between two events after ``idle_cycles`` of GPU
    sleep and a 256 MB zeroing."""
    import torch

    rng = random.Random(seed)
    names = list(fns)
    flush = torch.empty(ISOLATION_BYTES, dtype=torch.uint8, device="cuda")
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        fns[name](0)
    torch.cuda.synchronize()
    pending: list[tuple[str, object, object]] = []
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


def _collect(pending: list, times: dict[str, list[float]]) -> None:
    import torch

    torch.cuda.synchronize()
    for name, start, end in pending:
        times[name].append(start.elapsed_time(end) / 1e3)
    pending.clear()


def summarize(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return {"median_s": statistics.median(samples), "q1_s": q[0], "q3_s": q[2], "n": len(samples)}
