"""GPU timing harness: device events, warm-up, rotating inputs, interleaved rounds, medians."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

SLEEP_CYCLES_PER_CALL = 50_000
L2_FLUSH_BYTES = 100 * 2**20  # rotate through inputs larger than 2x the biggest L2 (H100: 50 MB)


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


def summarize(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return {"median_s": statistics.median(samples), "q1_s": q[0], "q3_s": q[2], "n": len(samples)}
