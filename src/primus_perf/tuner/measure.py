"""The tuner's one clock layer: every time a choice is made on is read here, and goes to
:mod:`.decide` as pairs.

Clocks (:class:`Clock`): device events on torch's current stream, read once complete and never
waited for inside a step (:class:`DeviceClock`); the host's ``perf_counter``
(:class:`HostClock`); this process's CPU time (:class:`CpuClock`: other processes on a loaded
machine do not inflate it).

Three ways to time a candidate against the baseline:

- alone (the offline race), a timer ``timer(calls, n_sets, reps, seed) -> {key: [s, ...]}``:
  every call once a round, rounds shuffled, inputs rotated through ``n_sets`` sets.
  :func:`time_isolated` runs each call after about 1 ms of GPU idle and an L2-evicting zeroing,
  as inside a step where GEMMs alternate with lighter kernels and the clock recovers between
  them (back to back, :func:`time_interleaved`, the GPU sits at its power limit and picks
  other winners); :func:`time_launch_bound` waits for an idle GPU instead of sleeping, so a
  call that launches many kernels pays its launches; :func:`time_cpu` on the CPU.
- inside a running program, a problem's consecutive calls in ABBA pairs (:class:`Pairs`: the
  in-step confirmation and the online race), each call between two marks.
- whole steps in interleaved blocks (:func:`blocks`: the FP8 plan, the closed loop, the step
  tuner), a side's block being the median of its steps after a settling step.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from primus_perf.tuner.decide import Rule, Verdict, judge

SLEEP_CYCLES_PER_CALL = 50_000
L2_FLUSH_BYTES = 100 * 2**20  # rotate through inputs larger than 2x the biggest L2 (H100: 50 MB)
ISOLATION_BYTES = 256 * 2**20  # zeroed before each isolated call: memory-bound, evicts L2
IDLE_CYCLES = 2_000_000  # GPU sleep before each isolated call: about 1 ms at H100 clocks
CHOICE, BASELINE = "choice", "baseline"
DEVICE_METHOD = "in the step: alternating calls (ABBA), device events on the current stream, median of per-pair ratios"
HOST_METHOD = "in the step: alternating calls (ABBA), host clock, median of per-pair ratios"


# ---- clocks ---------------------------------------------------------------------------------


class Clock(Protocol):
    method: str

    def mark(self) -> Any: ...

    def elapsed(self, start: Any, end: Any) -> float | None: ...  # seconds; None until both completed

    def settle(self) -> None: ...  # wait for every mark (once, at the end)


class DeviceClock:
    """CUDA (or HIP) events on torch's current stream."""

    method = DEVICE_METHOD

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def mark(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed(self, start: Any, end: Any) -> float | None:
        return start.elapsed_time(end) / 1e3 if end.query() else None

    def settle(self) -> None:
        self._torch.cuda.synchronize()


class HostClock:
    method = HOST_METHOD

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, start: float, end: float) -> float:
        return end - start

    def settle(self) -> None:
        pass


class CpuClock(HostClock):
    def mark(self) -> float:
        return time.process_time()


def default_clock() -> Clock:
    """Device events where torch sees a GPU, else the host clock."""
    import torch

    return DeviceClock() if torch.cuda.is_available() else HostClock()


# ---- alone: the offline race's timers ----------------------------------------------------------


class Timer(Protocol):
    def __call__(self, calls: dict[Hashable, Callable[[int], object]], n_sets: int, reps: int,
                 seed: int = 0) -> dict[Hashable, list[float]]: ...


class DeviceOps(Protocol):
    """A clock on the device, with what isolation needs; :class:`CudaOps` is the real one."""

    def sleep(self, cycles: int) -> None: ...  # queue GPU idle
    def flush(self) -> None: ...  # queue the L2-evicting zeroing
    def synchronize(self) -> None: ...
    def mark(self) -> object: ...
    def elapsed(self, start: object, end: object) -> float: ...


class CudaOps(DeviceClock):
    def __init__(self) -> None:
        super().__init__()
        self._flush = self._torch.empty(ISOLATION_BYTES, dtype=self._torch.uint8, device="cuda")

    def sleep(self, cycles: int) -> None:
        self._torch.cuda._sleep(cycles)

    def flush(self) -> None:
        self._flush.zero_()

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def elapsed(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3


def default_timer() -> Timer:
    """Isolated GPU timing where a GPU is visible, CPU time otherwise (the Triton interpreter)."""
    import torch

    return time_isolated if torch.cuda.is_available() else time_cpu


def launch_bound_timer() -> Timer:
    import torch

    return time_launch_bound if torch.cuda.is_available() else time_cpu


def buffer_sets(bytes_per_set: int, minimum: int = 2, maximum: int = 64) -> int:
    """How many input sets to rotate through so that one rotation exceeds L2."""
    return max(minimum, min(maximum, -(-L2_FLUSH_BYTES // max(1, bytes_per_set))))


def time_cpu(calls: dict[Hashable, Callable[[int], object]], n_sets: int, reps: int,
             seed: int = 0) -> dict[Hashable, list[float]]:
    """CPU seconds of each call, one warm-up call each, shuffled rounds."""
    return _rounds(calls, n_sets, reps, seed, CpuClock(), before=None)


def time_isolated(fns: dict[Hashable, Callable[[int], object]], n_sets: int, reps: int, seed: int = 0,
                  idle_cycles: int = IDLE_CYCLES, ops: DeviceOps | None = None) -> dict[Hashable, list[float]]:
    """Each call alone after ``idle_cycles`` of GPU sleep and the zeroing (queued while the GPU
    sleeps: its GPU time)."""
    ops = ops or CudaOps()

    def before() -> None:
        if idle_cycles:
            ops.sleep(idle_cycles)
        ops.flush()

    return _rounds(fns, n_sets, reps, seed, ops, before)


def time_launch_bound(fns: dict[Hashable, Callable[[int], object]], n_sets: int, reps: int, seed: int = 0,
                      ops: DeviceOps | None = None) -> dict[Hashable, list[float]]:
    """Each call as a step pays it when launching may be slower than the GPU: the zeroing, the
    host waits for an idle GPU, then the call's launches between two events."""
    ops = ops or CudaOps()

    def before() -> None:
        ops.flush()
        ops.synchronize()

    return _rounds(fns, n_sets, reps, seed, ops, before)


def _rounds(fns: dict[Hashable, Callable[[int], object]], n_sets: int, reps: int, seed: int, clock: Any,
            before: Callable[[], None] | None) -> dict[Hashable, list[float]]:
    rng = random.Random(seed)
    names = list(fns)
    times: dict[Hashable, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        fns[name](0)
    settle = getattr(clock, "synchronize", None) or clock.settle
    settle()
    pending: list[tuple[Hashable, object, object]] = []
    cursor = 0
    for _ in range(reps):
        rng.shuffle(names)
        for name in names:
            if before is not None:
                before()
            start = clock.mark()
            fns[name](cursor % n_sets)
            pending.append((name, start, clock.mark()))
            cursor += 1
        if len(pending) >= 256:  # bound the queue (and the events alive)
            _collect(clock, settle, pending, times)
    _collect(clock, settle, pending, times)
    return times


def _collect(clock: Any, settle: Callable[[], None], pending: list, times: dict[Hashable, list[float]]) -> None:
    settle()
    for name, start, end in pending:
        times[name].append(clock.elapsed(start, end))
    pending.clear()


def time_interleaved(fns: dict[str, Callable[[int], object]], n_sets: int, rounds: int, inner: int,
                     seed: int = 0) -> dict[str, list[float]]:
    """Back to back: ``inner`` calls of a candidate between two events, candidates shuffled each
    round, the GPU kept busy while a round is launched (seconds per call)."""
    import torch

    rng = random.Random(seed)
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:
        for i in range(min(n_sets, 3)):
            fns[name](i)
    torch.cuda.synchronize()
    cursor = 0
    for _ in range(rounds):
        rng.shuffle(names)
        events = []
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


def host_cost_us(route: Callable[[Any, Any], Any], plain: Callable[[Any, Any], Any], device: Any,
                 calls: int = 2000, rounds: int = 3) -> float:
    """Host microseconds a call of ``route(a, b)`` costs beyond ``plain(a, b)``: the best of
    ``rounds`` rounds of ``calls`` calls each on 16x16 operands (what routing costs the host)."""
    import torch

    dtype = torch.bfloat16 if getattr(device, "type", "cpu") == "cuda" else torch.float32
    a = torch.randn(16, 16, device=device, dtype=dtype)
    b = torch.randn(16, 16, device=device, dtype=dtype)

    def best(fn: Callable[[Any, Any], Any]) -> float:
        out = float("inf")
        for _ in range(rounds):
            fn(a, b)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(a, b)
            if a.is_cuda:
                torch.cuda.synchronize(a.device)
            out = min(out, (time.perf_counter() - t0) / calls)
        return out

    return max(0.0, (best(route) - best(plain)) * 1e6)


def summarize(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return {"median_s": statistics.median(samples), "q1_s": q[0], "q3_s": q[2], "n": len(samples)}


# ---- inside a program: ABBA pairs of a problem's calls --------------------------------------


@dataclass
class Sample:
    """One timed call: ``pairs`` of marks (attention adds its backward's later); complete when
    ``expect`` pairs are in and each has finished. ``host_s``: the host time between the marks
    of each pair (what the call cost the program's host, which device events do not see)."""

    pairs: list[tuple[Any, Any]] = field(default_factory=list)
    expect: int = 1
    host_s: float = 0.0
    _host0: float = 0.0

    def begin(self, clock: Any) -> None:
        """A pair of marks opens (the call, or its backward, starts)."""
        self.pairs.append((clock.mark(), None))
        self._host0 = time.perf_counter()

    def end(self, clock: Any) -> None:
        """The open pair closes."""
        self.host_s += time.perf_counter() - self._host0
        self.pairs[-1] = (self.pairs[-1][0], clock.mark())

    def seconds(self, clock: Any) -> float | None:
        if len(self.pairs) < self.expect:
            return None
        total = 0.0
        for start, end in self.pairs:
            t = None if end is None else clock.elapsed(start, end)
            if t is None:
                return None
            total += t
        return total


def bracket(clock: Clock, run: Callable[[], Any]) -> tuple[Any, Sample]:
    """``run()`` between two marks: one sample of one call."""
    sample = Sample()
    sample.begin(clock)
    out = run()
    sample.end(clock)
    return out, sample


class Pairs:
    """One candidate against the baseline on a problem's calls: which side the next call runs
    (choice, baseline, baseline, choice, ...), the samples in flight, the timed pairs. The first
    ``warmup`` pairs are not counted; ``max_calls`` bounds the calls placed (samples that never
    complete: a forward whose backward does not run)."""

    def __init__(self, clock: Any, *, samples: int, warmup: int = 0, max_calls: int = 80) -> None:
        self.clock = clock
        self.samples, self.warmup, self.max_calls = samples, warmup, max_calls
        self.calls = 0
        self.pending: list[tuple[int, str, Sample]] = []
        self.times: dict[int, dict[str, float]] = {}  # pair -> side -> seconds
        self.host: dict[int, dict[str, float]] = {}  # pair -> side -> host seconds of the call
        self._waits = 0

    def next_side(self) -> str | None:
        """The side of the next call, or None at the bound (the call then runs the baseline,
        untimed, until the samples in flight are in)."""
        if self.calls >= self.max_calls:
            self._waits += 1
            return None
        i = self.calls
        self.calls += 1
        first = CHOICE if (i // 2) % 2 == 0 else BASELINE
        return first if i % 2 == 0 else (BASELINE if first == CHOICE else CHOICE)

    def add(self, side: str, sample: Sample) -> None:
        self.pending.append(((self.calls - 1) // 2, side, sample))

    def poll(self) -> None:
        still = []
        for pair, side, sample in self.pending:
            t = sample.seconds(self.clock)
            if t is None:
                still.append((pair, side, sample))
            else:
                self.times.setdefault(pair, {})[side] = t
                self.host.setdefault(pair, {})[side] = sample.host_s
        self.pending = still

    def counted(self) -> list[tuple[float, float]]:
        """(baseline s, choice s) of the complete pairs after the warm-up."""
        return [(p[BASELINE], p[CHOICE]) for i, p in sorted(self.times.items()) if i >= self.warmup and len(p) == 2]

    def host_extra_s(self) -> float | None:
        """What a call of the choice costs the host beyond the baseline's: the median of the
        counted pairs' host-time differences (None without a counted pair)."""
        counted = [i for i, p in sorted(self.times.items()) if i >= self.warmup and len(p) == 2]
        diffs = [self.host[i][CHOICE] - self.host[i][BASELINE] for i in counted]
        return statistics.median(diffs) if diffs else None

    def ratios(self) -> list[float]:
        return [b / c for b, c in self.counted() if c > 0]

    def ready(self) -> bool:
        if len(self.counted()) >= self.samples:
            return True
        return self.calls >= self.max_calls and (not self.pending or self._waits >= self.max_calls)

    def lost(self) -> int:
        """Pairs with a sample in flight while a later pair completed (a forward whose backward
        did not run)."""
        last = max((i for i, sides in self.times.items() if len(sides) == 2), default=-1)
        return len({pair for pair, _side, _sample in self.pending if pair < last})

    def verdict(self, rule: Rule, **names: str) -> Verdict:
        return judge(self.counted(), rule, method=getattr(self.clock, "method", DEVICE_METHOD), **names)


# ---- whole steps: interleaved blocks ---------------------------------------------------------


def blocks(sides: Mapping[str, Callable[[], None]], step: Callable[[], float], *, blocks: int, block_steps: int,
           settle: int = 1, log: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Per side, the median step seconds of each of its ``blocks`` blocks: ``sides[name]()``
    switches the program to a side, ``settle`` untimed steps follow (compilation, allocation),
    then ``block_steps`` timed ones (``step()`` returns one step's seconds). The sides take turns
    in an order that rotates each block, so no side always follows the same one."""
    names = list(sides)
    out: dict[str, list[float]] = {n: [] for n in names}
    for b in range(blocks):
        order = names[b % len(names):] + names[: b % len(names)]
        for name in order:
            sides[name]()
            for _ in range(settle):
                step()
            out[name].append(statistics.median(step() for _ in range(block_steps)))
            if log is not None:
                log(f"block {b + 1}/{blocks} {name}: median {out[name][-1] * 1e3:.2f} ms/step")
    return out
