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

``time_isolated`` queues each call while the GPU sleeps, so the call's CPU launch cost is
hidden: right for one-kernel calls (a GEMM, an attention), wrong for a call that launches
many kernels (the per-expert loop of a grouped GEMM: one ``torch.mm`` per expert), whose
launches a CPU-bound step pays in full. :func:`time_launch_bound` (what the grouped-GEMM
tuner uses) times what such a step sees: before each call the L2-evicting zeroing runs and
the host waits for the GPU to go idle (a synchronize, no sleep); the start event is recorded
right before the call's first launch and the end event after its last, so the interval
covers the GPU work and any gap the host's launching leaves in it: about ``max(GPU time,
CPU launch time)`` plus one launch latency, which every candidate pays alike.

The device primitives every GPU timer uses (sleep, the zeroing, synchronize, events) are
one :class:`DeviceOps` object, so tests run the timers with a simulated stream and clock.
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


class DeviceOps(Protocol):
    """What the GPU timers do to the device; :class:`CudaOps` is the real one."""

    def sleep(self, cycles: int) -> None: ...  # queue GPU idle
    def flush(self) -> None: ...  # queue the L2-evicting zeroing
    def synchronize(self) -> None: ...  # wait on the host until the GPU is idle
    def mark(self) -> object: ...  # record an event on the stream
    def elapsed(self, start: object, end: object) -> float: ...  # seconds between two completed marks


class CudaOps:
    """Torch's current CUDA (or HIP) stream: ``torch.cuda._sleep``, a 256 MB zeroing,
    timing events."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._flush = torch.empty(ISOLATION_BYTES, dtype=torch.uint8, device="cuda")

    def sleep(self, cycles: int) -> None:
        self._torch.cuda._sleep(cycles)

    def flush(self) -> None:
        self._flush.zero_()

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def mark(self) -> object:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed(self, start: object, end: object) -> float:
        return start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]


def default_timer() -> Timer:
    """Isolated-call GPU timing when a GPU is visible, wall-clock timing otherwise (the
    Triton interpreter on the CPU)."""
    import torch

    return time_isolated if torch.cuda.is_available() else time_cpu


def launch_bound_timer() -> Timer:
    """:func:`time_launch_bound` when a GPU is visible, CPU timing otherwise (which counts
    the host's launching anyway)."""
    import torch

    return time_launch_bound if torch.cuda.is_available() else time_cpu


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
    ops: DeviceOps | None = None,
) -> dict[Hashable, list[float]]:
    """Seconds of each call of each ``fn(set_index)``, ``reps`` calls per candidate: rounds
    in a shuffled order, each call alone between two events after ``idle_cycles`` of GPU
    sleep and a 256 MB zeroing (the call is queued during the sleep: its GPU time)."""
    return _time_each(fns, n_sets, reps, seed, ops, idle_cycles=idle_cycles, wait_idle=False)


def time_launch_bound(
    fns: dict[Hashable, Callable[[int], object]],
    n_sets: int,
    reps: int,
    seed: int = 0,
    ops: DeviceOps | None = None,
) -> dict[Hashable, list[float]]:
    """Seconds of each call as a step pays it when launching may be slower than the GPU
    (module docstring): the zeroing, the host waits for an idle GPU, then start event,
    the call's launches, end event. Same rounds and warm-up as :func:`time_isolated`."""
    return _time_each(fns, n_sets, reps, seed, ops, idle_cycles=0, wait_idle=True)


def _time_each(
    fns: dict[Hashable, Callable[[int], object]],
    n_sets: int,
    reps: int,
    seed: int,
    ops: DeviceOps | None,
    *,
    idle_cycles: int,
    wait_idle: bool,
) -> dict[Hashable, list[float]]:
    ops = ops or CudaOps()
    rng = random.Random(seed)
    names = list(fns)
    times: dict[Hashable, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        fns[name](0)
    ops.synchronize()
    pending: list[tuple[Hashable, object, object]] = []
    cursor = 0
    for _ in range(reps):
        rng.shuffle(names)
        for name in names:
            if idle_cycles:
                ops.sleep(idle_cycles)
            ops.flush()
            if wait_idle:
                ops.synchronize()
            start = ops.mark()
            fns[name](cursor % n_sets)
            end = ops.mark()
            cursor += 1
            pending.append((name, start, end))
        if len(pending) >= 256:  # bound the queue (and the events alive)
            _collect(ops, pending, times)
    _collect(ops, pending, times)
    return times


def _collect(ops: DeviceOps, pending: list, times: dict[Hashable, list[float]]) -> None:
    ops.synchronize()
    for name, start, end in pending:
        times[name].append(ops.elapsed(start, end))
    pending.clear()


def summarize(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return {"median_s": statistics.median(samples), "q1_s": q[0], "q3_s": q[2], "n": len(samples)}
