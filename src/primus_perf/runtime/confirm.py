"""Confirmation of cached choices inside the real steps: a choice stays only if it wins
where it runs.

An isolated race (each candidate timed alone, GPU idle, L2 flushed) or a few online samples
can pick a kernel whose gain does not hold inside the program's step, next to its
neighbours. While a :class:`Confirmer` is active (``routes.confirm_with``), the one routing
path (``routes.gemm``, ``routes.grouped``) answers the calls of every problem whose cached
choice is not the baseline (torch's kernel for a GEMM; the caller's fallback for a grouped
GEMM: the trainer's backend, or torch's ``_grouped_mm``) alternately with the choice and
with the baseline, in ABBA order (choice, baseline, baseline, choice, ...), and times each
call where it runs: between two device events recorded on the current stream
(:class:`DeviceClock`; on a CPU the host clock, :class:`HostClock`). Events are read once
they have completed (``query``), never waited for inside a step; :meth:`Confirmer.finish`
synchronizes once at the end and reads the rest.

A grouped GEMM is confirmed per problem *shape* (its key without the skew bucket,
``passes.shape_problem_of``): the router decides by shape, and a call's shape needs no host
read of its counts. A shape whose entries name different choices by skew is confirmed as
one (the router's answer, whichever bucket a call falls in, against the baseline), and a
verdict applies to every entry of its shape; a call in a bucket with no entry runs the
baseline and gives its turn to the next call. A grouped choice whose backend takes no
device ``offs`` (the loop, padded bmm) and whose calls mostly read the program's device
``offs`` on the host (under a program's ``aten::_grouped_mm``) is dropped even where its
calls won: the wait for the device stalls the program's host, which the call's device
events do not see. Consecutive calls of a
problem make a pair (one call of each side); the first
``ConfirmPolicy.warmup`` pairs are not counted (a cold first call, the allocator growing,
lazy initialisation). After ``ConfirmPolicy.samples`` counted pairs the problem gets its
:class:`Verdict`: the in-step speedup is the median of the per-pair ratios (baseline time /
choice time), its spread their quartiles (q1-q3), and the choice is kept only when the
median beats 1 by more than ``max(margin, (q3 - q1) / 2)``, a margin above the measured
noise; otherwise the baseline runs from then on. The online tuner confirms its locks with
the same state machine (:class:`ProblemConfirmation`) and the same verdict.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from primus_perf.kernels.gemm import torch_mm
from primus_perf.kernels.grouped.passes import shape_problem_of
from primus_perf.kernels.grouped.router import MIXED, GroupedChoice
from primus_perf.kinds import GEMM, GROUPED

CHOICE, BASELINE = "choice", "baseline"
KEPT, DROPPED, UNCONFIRMED = "kept", "dropped", "unconfirmed"
TORCH = "torch"  # a GEMM's baseline: torch's own kernel
GEMM_KIND = GEMM.name
GROUPED_KIND = GROUPED.name  # its verdicts are per problem shape (every skew bucket of it)
# how the figures were measured (stored with each in-step figure)
DEVICE_METHOD = "in the step: alternating calls (ABBA), device events on the current stream, median of per-pair ratios"
HOST_METHOD = "in the step: alternating calls (ABBA), host clock, median of per-pair ratios"
BY_SKEW = "its choices by skew bucket"  # a grouped shape whose entries differ by skew: confirmed as one
# why a grouped choice that won its calls is dropped where the program's offs are on the device
WAITED = ("it reads the call's offs on the host, a wait for the device that its device events do not"
          " measure (the program's other work queues behind it)")


class Clock(Protocol):
    """Marks on the timeline where the calls run; ``elapsed`` is None until both completed."""

    method: str

    def mark(self) -> Any: ...

    def elapsed(self, start: Any, end: Any) -> float | None: ...  # seconds

    def settle(self) -> None: ...  # wait for every mark (once, at the end)


class DeviceClock:
    """CUDA (or HIP) events on torch's current stream, read without waiting."""

    method = DEVICE_METHOD

    def mark(self) -> Any:
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed(self, start: Any, end: Any) -> float | None:
        if not end.query():
            return None
        return start.elapsed_time(end) / 1e3

    def settle(self) -> None:
        import torch

        torch.cuda.synchronize()


class HostClock:
    """The host's ``perf_counter``: where the calls run on the CPU (they end when they return)."""

    method = HOST_METHOD

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, start: float, end: float) -> float:
        return end - start

    def settle(self) -> None:
        pass


def default_clock() -> Clock:
    """Device events where torch sees a GPU, else the host clock."""
    import torch

    return DeviceClock() if torch.cuda.is_available() else HostClock()


@dataclass
class Sample:
    """One timed call: ``pairs`` of marks (attention adds its backward's pair later);
    complete when ``expect`` pairs are in and every pair has finished."""

    pairs: list[tuple[Any, Any]] = field(default_factory=list)
    expect: int = 1

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


@dataclass(frozen=True)
class ConfirmPolicy:
    """``samples`` counted pairs per problem (after ``warmup`` pairs not counted) before the
    verdict; ``margin``: the least in-step gain that keeps a choice when the noise is
    smaller; ``max_calls``: the bound on a problem's confirming calls (samples that never
    complete: a forward whose backward does not run)."""

    samples: int = 8
    warmup: int = 2
    margin: float = 0.01
    max_calls: int = 80

    def __post_init__(self) -> None:
        if self.samples < 2 or self.warmup < 0 or self.margin < 0:
            raise ValueError("ConfirmPolicy needs samples >= 2, warmup >= 0 and margin >= 0")



@dataclass
class Verdict:
    """A problem's confirmation: ``status`` is "kept", "dropped" (the baseline runs) or
    "unconfirmed" (too few samples: nothing is concluded); ``speedup`` is the median of
    the per-pair ratios (baseline / choice), ``low``/``high`` their quartiles."""

    kind: str
    key: str
    choice: str
    baseline: str
    status: str
    speedup: float | None
    low: float | None
    high: float | None
    pairs: int
    choice_ms: float | None
    baseline_ms: float | None
    threshold: float
    method: str
    wanted: int = 0  # counted pairs a verdict needs
    reason: str = ""  # why a choice that won its calls was dropped (Confirmer.routing_pays)

    @property
    def kept(self) -> bool:
        return self.status == KEPT

    def figure(self) -> dict[str, Any]:
        """What a cache entry stores of it (``CacheEntry.in_step``)."""
        return {
            "method": self.method, "baseline": self.baseline, "choice": self.choice, "verdict": self.status,
            "speedup": self.speedup, "low": self.low, "high": self.high, "samples": self.pairs,
            "choice_ms": self.choice_ms, "baseline_ms": self.baseline_ms, "threshold": self.threshold,
            "saving_us": self.saving_us, **({"reason": self.reason} if self.reason else {}),
        }

    @property
    def saving_us(self) -> float | None:
        """What the choice saves a call in the step (median times; negative: it costs)."""
        if self.choice_ms is None or self.baseline_ms is None:
            return None
        return (self.baseline_ms - self.choice_ms) * 1e3

    def spread(self) -> str:
        if self.speedup is None:
            return f"{self.pairs} of {self.wanted} pairs"
        return f"{self.speedup:.3f}x [{self.low:.3f}-{self.high:.3f}], {2 * self.pairs} calls"

    def text(self) -> str:
        """One line: ``heur2: 1.030x torch in the step [1.010-1.050], 16 calls, 2.1 us saved a
        call: kept``."""
        if self.status == KEPT:
            return (f"{self.choice}: {self.speedup:.3f}x {self.baseline} in the step [{self.low:.3f}-{self.high:.3f}],"
                    f" {2 * self.pairs} calls, {self.saving_us:.1f} us saved a call: kept")
        if self.status == DROPPED and self.reason:
            return f"{self.choice}: {self.spread()} in the step, but {self.reason}: {self.baseline} kept"
        if self.status == DROPPED:
            return (f"{self.choice} not confirmed in the step ({self.spread()}; needs >"
                    f" {1 + self.threshold:.3f}x): {self.baseline} kept")
        return f"{self.choice} unconfirmed in the step ({self.spread()}): too few samples"


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of at least one value."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


class ProblemConfirmation:
    """One problem's confirmation (module docstring): which side the next call runs, its
    samples, and the verdict."""

    def __init__(self, policy: ConfirmPolicy, clock: Any) -> None:
        self.policy = policy
        self.clock = clock
        self.calls = 0
        self.pending: list[tuple[int, str, Sample]] = []
        self.times: dict[int, dict[str, float]] = {}  # pair -> side -> seconds
        self._waits = 0

    def next_side(self) -> str | None:
        """The side of the next call (ABBA order; calls go on alternating while samples are
        in flight), or None at the bound (the call then runs the baseline, untimed, until
        the samples in flight are in)."""
        if self.calls >= self.policy.max_calls:
            self._waits += 1
            return None
        i = self.calls
        self.calls += 1
        first = CHOICE if (i // 2) % 2 == 0 else BASELINE
        return first if i % 2 == 0 else (BASELINE if first == CHOICE else CHOICE)

    def give_back(self) -> None:
        """The call :meth:`next_side` just placed ran no sample: the next call takes its
        turn (so a choice that declines some calls is not timed against one kind of call)."""
        self.calls -= 1

    def add(self, side: str, sample: Sample) -> None:
        """The sample of the call :meth:`next_side` gave ``side``."""
        self.pending.append(((self.calls - 1) // 2, side, sample))

    def poll(self) -> None:
        still = []
        for pair, side, sample in self.pending:
            t = sample.seconds(self.clock)
            if t is None:
                still.append((pair, side, sample))
            else:
                self.times.setdefault(pair, {})[side] = t
        self.pending = still

    def counted(self) -> list[dict[str, float]]:
        """The complete pairs after the warm-up."""
        return [p for i, p in sorted(self.times.items()) if i >= self.policy.warmup and len(p) == 2]

    def ready(self) -> bool:
        if len(self.counted()) >= self.policy.samples:
            return True
        return self.calls >= self.policy.max_calls and (not self.pending or self._waits >= self.policy.max_calls)

    def lost(self) -> int:
        """Pairs with a sample still in flight while a later pair completed: lost (a forward
        whose backward did not run)."""
        last = max((i for i, sides in self.times.items() if len(sides) == 2), default=-1)
        return len({pair for pair, _side, _sample in self.pending if pair < last})

    def ratios(self) -> list[float]:
        """Baseline time / choice time of each counted pair, in order."""
        return [p[BASELINE] / p[CHOICE] for p in self.counted() if p[CHOICE] > 0]

    def verdict(self, kind: str, key: str, choice: str, baseline: str, least: int | None = None) -> Verdict:
        """The verdict on the counted pairs; ``least``: the pairs it needs (the policy's
        ``samples`` unless given: online tuning states the figure of a contender it let go
        after fewer)."""
        pairs = self.counted()
        least = self.policy.samples if least is None else least
        method = getattr(self.clock, "method", DEVICE_METHOD)
        base = Verdict(kind, key, choice, baseline, UNCONFIRMED, None, None, None, len(pairs), None, None,
                       self.policy.margin, method, least)
        ratios = self.ratios()
        if len(pairs) < least or len(ratios) < len(pairs):
            return base
        q1, med, q3 = quartiles(ratios)
        threshold = max(self.policy.margin, (q3 - q1) / 2)
        base.status = KEPT if med > 1 + threshold else DROPPED
        base.speedup, base.low, base.high, base.threshold = med, q1, q3, threshold
        base.choice_ms = statistics.median(p[CHOICE] for p in pairs) * 1e3
        base.baseline_ms = statistics.median(p[BASELINE] for p in pairs) * 1e3
        return base


def _choice_name(router: Any, key: str) -> str:
    """The readable name of a GEMM router's cached choice for ``key`` (the entry's config name)."""
    entry = (getattr(router, "entries", None) or {}).get(key)
    if entry is not None:
        config = entry.solution.get("config") or {}
        return str(config.get("name") or config.get("source") or "cached")
    return "cached"


def gemm_routing_cost_us(route: Callable[[Any, Any], Any], plain: Callable[[Any, Any], Any], device: Any,
                         calls: int = 2000, rounds: int = 3) -> float:
    """Host microseconds a GEMM call pays for its routing: ``route(a, b)`` (the path the
    program's GEMMs take while routed, on a shape no entry names) against ``plain(a, b)``
    (torch's), best of ``rounds`` rounds of ``calls`` calls each on 16x16 operands."""
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


def _reads_counts(choice: Any, phase: str) -> bool:
    """True for a single choice whose backend takes no device ``offs`` for ``phase`` (the
    loop, padded bmm: they read the counts on the host); a shape's choices by skew read a
    call site's counts once to pick its bucket, which is not a wait a call makes."""
    if not isinstance(choice, GroupedChoice):
        return False
    impl = choice.implementation()
    return (impl.wgrad_offs if phase == "wgrad" else impl.mm_offs) is None


class Confirmer:
    """The offline confirmation of a cache's choices (module docstring): installed with
    ``routes.confirm_with``; :meth:`finish` ends it and returns the verdicts."""

    def __init__(self, policy: ConfirmPolicy | None = None, clock: Any = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.policy = policy or ConfirmPolicy()
        self.clock = clock or default_clock()
        self.log = log or (lambda _line: None)
        self.states: dict[tuple[str, str], ProblemConfirmation] = {}
        self.names: dict[tuple[str, str], tuple[str, str]] = {}  # (kind, key) -> (choice, baseline)
        self.verdicts: dict[tuple[str, str], Verdict] = {}
        self.unrouted: set[tuple[str, str]] = set()  # the cached choice is the baseline itself
        self.gemm_calls = 0  # every GEMM call the routing path saw (each pays the routing)
        self.slot_calls: dict[tuple[str, str], int] = {}  # calls of each confirmed problem
        self.waited: dict[tuple[str, str], int] = {}  # grouped shapes: choice calls that read device offs on the host
        self.gemm_device: Any = None  # the device of the GEMMs (where the routing is priced)

    # ---- the routing path's calls ----------------------------------------------------------

    def gemm(self, router: Any, a: Any, b: Any, bias: Any = None) -> Any:
        """``routes.gemm`` while confirming: the router's kernel or torch's, alternately."""
        self.gemm_calls += 1
        if self.gemm_device is None:
            self.gemm_device = a.device
        key = router.key_of(a, b, bias)  # the router's own resolution of the call's signature

        def choice() -> Any:
            return router(a, b, bias)

        def baseline() -> Any:
            return torch_mm(a, b, bias)

        if key is None:
            out = choice()
            return baseline() if out is None else out
        return self._call(GEMM_KIND, key, choice, baseline, lambda: (_choice_name(router, key), TORCH))

    def grouped(self, router: Any, phase: str, a: Any, b: Any, groups: int, routed: Callable[[], Any],
                fallback: Callable[[], Any], baseline: str) -> Any:
        """``routes.grouped_routed`` while confirming: the router's answer (``routed()``) or
        the caller's fallback (``baseline`` names it), alternately, per problem *shape*
        (``shape_problem_of``: the router decides by shape, and the key needs no host read
        of the call's counts). A shape whose entries name different choices by skew is
        confirmed as one (:data:`BY_SKEW`)."""
        try:
            key = shape_problem_of(phase, a, b, groups).key()
        except ValueError:
            key = None
        choice = (getattr(router, "shapes", None) or {}).get(key) if key is not None else None
        name = choice.label() if hasattr(choice, "label") else (BY_SKEW if choice == MIXED else None)
        own = GroupedChoice.of_backend(baseline)
        if name is None or name == (own.label() if own is not None else baseline):  # none, or the caller's own
            out = routed()
            return fallback() if out is None else out
        reads = getattr(router, "offs_reads", None)
        if reads is None or not _reads_counts(choice, phase):
            return self._call(GROUPED_KIND, key, routed, fallback, lambda: (name, baseline))
        slot = (GROUPED_KIND, key)

        def watched() -> Any:  # the backend read this call's device offs on the host: it waited for the device
            before = sum(reads.values())
            out = routed()
            if sum(reads.values()) > before:
                self.waited[slot] = self.waited.get(slot, 0) + 1
            return out

        return self._call(GROUPED_KIND, key, watched, fallback, lambda: (name, baseline))

    def _call(self, kind: str, key: str, choice: Callable[[], Any], baseline: Callable[[], Any],
              names: Callable[[], tuple[str, str]]) -> Any:
        slot = (kind, key)
        self.slot_calls[slot] = self.slot_calls.get(slot, 0) + 1
        if slot in self.unrouted:
            out = choice()
            return baseline() if out is None else out
        verdict = self.verdicts.get(slot)
        if verdict is not None:
            if verdict.status == DROPPED:
                return baseline()
            out = choice()
            return baseline() if out is None else out
        state = self.states.get(slot)
        if state is None:
            state = self.states[slot] = ProblemConfirmation(self.policy, self.clock)
            self.names[slot] = names()
        state.poll()
        if state.ready():
            self._decide(slot)
            return self._call(kind, key, choice, baseline, names)
        side = state.next_side()
        if side is None:  # calls spent, samples in flight: the baseline, untimed
            return baseline()
        start = self.clock.mark()
        out = choice() if side == CHOICE else baseline()
        if out is None:  # the router does not route it (torch's own choice, no entry, a failed kernel)
            if self.names[slot][0] == BY_SKEW:  # a skew bucket with no entry: the next call takes the turn
                state.give_back()
                return baseline()
            self.unrouted.add(slot)
            self.states.pop(slot, None)
            self.names.pop(slot, None)
            return baseline()
        state.add(side, Sample([(start, self.clock.mark())]))
        return out

    def _decide(self, slot: tuple[str, str]) -> Verdict:
        state = self.states.pop(slot)
        choice, baseline = self.names.pop(slot)
        verdict = state.verdict(slot[0], slot[1], choice, baseline)
        # device events do not see the host's wait: a choice whose calls mostly waited is
        # dropped (a call site's one first read, as a shape by skew makes, is not)
        if verdict.kept and self.waited.get(slot, 0) * 4 > self.slot_calls.get(slot, 0):
            verdict = dataclasses.replace(verdict, status=DROPPED, reason=WAITED)
        self.verdicts[slot] = verdict
        self.log(f"confirm {slot[0]} {slot[1]}: {verdict.text()}")
        return verdict

    def finish(self) -> list[Verdict]:
        """Wait for the samples in flight (one synchronize), give every problem still
        confirming its verdict (unconfirmed when its pairs are too few) and return them all."""
        self.clock.settle()
        for slot in list(self.states):
            self.states[slot].poll()
            self._decide(slot)
        return list(self.verdicts.values())

    def routing_pays(self, cost_us: float) -> list[Verdict]:
        """Every verdict, the GEMM ones checked against what routing costs: each GEMM call
        the program makes pays ``cost_us`` (host time of the override or seam, measured by
        :func:`gemm_routing_cost_us`) once any GEMM is routed, so the kept GEMM choices
        stay only where the time they saved over the run (microseconds a call x their calls)
        exceeds the routing of all the run's GEMM calls; otherwise they are dropped
        together (the cache then routes no GEMM and the override is not installed)."""
        kept = [v for v in self.verdicts.values() if v.kind == GEMM_KIND and v.kept]
        saved = sum((v.saving_us or 0.0) * self.slot_calls.get((v.kind, v.key), 0) for v in kept)
        cost = cost_us * self.gemm_calls
        if not kept or saved > cost:
            return list(self.verdicts.values())
        why = (f"the {len(kept)} kept GEMM choice(s) saved {saved / 1e3:.2f} ms over the run, less than routing "
               f"its {self.gemm_calls} GEMM calls costs ({cost_us:.1f} us each: {cost / 1e3:.2f} ms)")
        self.log(f"confirm gemm: {why}: torch kept for every GEMM")
        for v in kept:
            self.verdicts[(v.kind, v.key)] = dataclasses.replace(v, status=DROPPED, reason=why)
        return list(self.verdicts.values())

    @property
    def confirming(self) -> int:
        """Problems still alternating."""
        return len(self.states)
