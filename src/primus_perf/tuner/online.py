"""Online tuning: the problems a cache does not hold are tuned inside the real steps.

For each new problem (a GEMM, a grouped GEMM, or an attention call) the router takes the
offline tuner's pool for it (``tuner/gemm``: torch's own choice and the BLAS-Lt heuristic's
candidates; ``tuner/attention``: torch's default SDPA, each SDPA backend and the Triton
configs the cache holds; ``tuner/grouped``: the caller's backend, the other backends and
Triton configs), validates every candidate once against the fp32 reference on a side
buffer (the plugin's ``error``; a candidate over the tolerance never runs on the
program's tensors), then races each other candidate (a *contender*) against the default
on the problem's real calls, in pairs: two consecutive calls of the problem, one run by
the contender and one by the default, in ABBA order, each between two device events
(``measure.DeviceClock``), read later, when they have completed (never a synchronize
inside a step). Every figure is thus measured the way the choice will run: in the step,
next to its neighbours, against what the call would have run.

:class:`ProblemTuning` is the state machine of one problem:

1. warm-up: the problem's first ``warmup`` calls run the default, untimed (a cold first
   call, the allocator growing);
2. racing: each pair goes to the live contender with the fewest pairs placed (two calls
   of one kind, ``KindAdapter.pairing``; an adapter whose calls can run twice on the same
   operands, ``KindAdapter.shadow``, places a whole pair on one call, both sides one after
   the other, the program getting the default's result); a contender goes as soon as its pairs show it
   cannot win: their median ``drop_ratio`` x slower than the default, or not faster by the
   ``margin`` after ``drop_after`` pairs; no contender gets more than ``drop_after`` pairs until the ``finalists``
   fastest are known, and only they go on;
3. verdict: after ``pairs`` counted pairs a contender gets the one decision rule's verdict
   (``decide.judge``: the median per-pair ratio must beat 1 by more than ``max(margin,
   noise)`` and save ``min_saving_s`` a call, what routing costs the host, which device
   events do not see); a pair whose sample was lost (a forward whose backward did not run)
   is placed again, ``lost_pairs`` at most;
4. lock: once every live contender has its verdict (or none is left), the kept contender
   with the best median, else the default. The problem runs it for the rest of the run,
   and it is written to the cache with its in-step figure (``TuningCache.put``: under the
   file lock, merged with what other ranks wrote), so the next run starts tuned and does
   no tuning. A lock for want of evidence (``max_calls`` timed calls spent, or samples
   still in flight after ``lost_after`` calls with nothing left to place) runs the
   default for this run only and writes nothing.

A problem the cache holds whose choice no step confirmed (an offline tuner's, timed alone) is
raced the same way, its cached choice the one contender (``KindAdapter.cached``): the default
stays where the choice loses in the step, and the entry is written with its in-step figure.

The log line of a lock prints that figure with its spread ("locked heur2: 1.031x torch in
the step [1.012-1.049], 12 calls", or "locked torch: no contender beat it in the step
(heur2 0.990x, 6 pairs; ...)"). Every lock reports the problem's tuning cost: GPU time
spent on slower candidates (their samples minus the chosen one's median), host time in
this module, and validation time. The state machine runs on the CPU with an injected
clock and fake candidates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from primus_perf import kinds as registry
from primus_perf.base.devices import DeviceIdentity
from primus_perf.base.errors import CacheError
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.routing import UNSUPPORTED
from primus_perf.tuner.core import cache_entry, confirmed_entry, solution_of, validate
from primus_perf.tuner.decide import (
    DROP_RATIO,
    DROPPED,
    MARGIN,
    MIN_SAVING_S,
    UNCONFIRMED,
    Rule,
    Verdict,
)
from primus_perf.tuner.measure import BASELINE, CHOICE, Clock, DeviceClock, Pairs, Sample, bracket


class _Validating:
    """Process-wide: while a new problem's pool is validated, every call an online router
    sees goes to torch, from any thread. The validation's own reference GEMMs also run in
    its backward pass, on the autograd engine's device thread, where a thread-local flag
    is not set: measured on an H200, those one-off batched GEMMs then started tuning and
    never finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.depth = 0

    def __enter__(self) -> None:
        with self._lock:
            self.depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.depth -= 1


_building = _Validating()


def _autocast_off() -> contextlib.ExitStack:
    """Autocast off on every device type where it is on: a pool is validated against an
    fp32 reference, which autocast (the validation runs inside the program's forward)
    would compute in bf16; on an H200 that made torch's own SDPA fail its check."""
    import torch

    stack = contextlib.ExitStack()
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


@dataclass(frozen=True)
class OnlinePolicy:
    """How a problem is tuned (module docstring). Defaults: 5 candidates at most (the
    default and the pool's first 4, in the plugin's order: the library heuristic's
    ranking); 2 warm-up calls; a contender goes when the median of its pairs is
    ``decide.DROP_RATIO`` (1.25) x slower than the default, or not 1% faster after 2
    pairs; 2 finalists; 6 counted pairs for a verdict, which must also save
    ``decide.MIN_SAVING_S`` (5 us) a call, what a routed call costs the host beyond
    torch's own launch and device events do not see; up to 2 more pairs for a contender
    whose samples were lost; a bound of 40 timed calls; a problem whose samples are still
    in flight after 160 calls with nothing left to place locks with what it has. A problem
    called once a step, 4 contenders, locks after 10 calls when every contender is clearly
    slower, 18 when they are within 1.25x, 26 when one wins, 34 when two finalists go on
    (events read a step later add about one step per phase); with a whole pair a call
    (``shadow``: GEMMs) after 6, 10, 14 and 18."""

    pairs: int = 6
    warmup: int = 2
    drop_after: int = 2
    drop_ratio: float = DROP_RATIO
    finalists: int = 2
    max_calls: int = 40
    max_candidates: int = 5
    margin: float = MARGIN
    min_saving_s: float = MIN_SAVING_S
    lost_pairs: int = 2
    lost_after: int = 160

    def __post_init__(self) -> None:
        if self.pairs < 2 or self.drop_after < 1 or self.finalists < 1 or self.max_candidates < 1:
            raise ValueError("OnlinePolicy needs pairs >= 2, drop_after >= 1, finalists >= 1, max_candidates >= 1")

    def race(self, clock: Clock) -> Pairs:
        """One contender's pairs against the default (no warm-up of its own: the problem's
        warm-up calls come first)."""
        return Pairs(clock, samples=self.pairs, max_calls=2 * (self.pairs + self.lost_pairs))

    def rule(self, least: int | None = None) -> Rule:
        return Rule(self.margin, self.min_saving_s, self.pairs if least is None else least)


@dataclass
class Pooled:
    """A validated candidate: ``run(*call_args)`` answers one call (timing is the adapter's)."""

    name: str
    solution: dict[str, Any]  # {"config": {"name": ..., ...}, "blob": bytes}, as a cache entry stores it
    error: float
    run: Callable[..., Any]


class ProblemTuning:
    """The state machine of one problem (module docstring): each contender's pairs are
    ``measure.Pairs`` against the default."""

    def __init__(self, pool: list[Pooled], policy: OnlinePolicy, clock: Clock) -> None:
        if not pool:
            raise ValueError("online tuning needs at least the default candidate")
        self.pool = {c.name: c for c in pool}
        self.default = pool[0].name
        self.policy = policy
        self.clock = clock
        self.races = {name: policy.race(clock) for name in list(self.pool)[1:]}
        self.alive = list(self.races)
        self.dropped: list[str] = []
        self.verdicts: dict[str, Verdict] = {}  # live contenders whose pairs the verdict kept
        self.calls = 0  # timed calls
        self.seen = 0  # calls, the warm-up's included
        self.chosen: str | None = None
        self._open: str | None = None  # the contender whose pair has one call placed
        self._open_kind: Any = None  # the kind of call (``KindAdapter.pairing``) that placed it
        self._waits = 0  # calls answered by the default while nothing was left to place

    def _cut_known(self) -> bool:
        """Whether the finalists are known (every live contender has ``drop_after`` counted
        pairs, or no more than ``finalists`` are left): until then no contender gets more
        than ``drop_after`` pairs, so the bound cannot run out before any verdict."""
        p = self.policy
        return len(self.alive) <= p.finalists or all(len(self.races[n].ratios()) >= p.drop_after for n in self.alive)

    def median(self, name: str) -> float:
        """The median of contender ``name``'s counted per-pair ratios (it has some)."""
        return statistics.median(self.races[name].ratios())

    def _placeable(self) -> list[str]:
        p = self.policy
        pairs = p.pairs if self._cut_known() else p.drop_after
        return [n for n in self.undecided()
                if self.races[n].calls < 2 * min(pairs + self.races[n].lost(), pairs + p.lost_pairs)]

    def next(self, kind: Any = None) -> tuple[Pooled, str, str] | None:
        """``(candidate, contender, side)`` of the next call, or None: the call runs the
        default, untimed (a warm-up call; a call of another ``kind`` than the open pair's
        first; nothing left to place while samples are in flight; the bound reached)."""
        self.seen += 1
        if self.seen <= self.policy.warmup:
            return None
        name = self._open if self._open in self.alive else None
        if name is not None and kind != self._open_kind:  # a pair compares like with like
            return None
        if name is None:
            name = self._contender()
        if name is None:
            return None
        cand, side = self._place(name)
        self._open, self._open_kind = (name, kind) if self.races[name].calls % 2 else (None, None)
        return cand, name, side

    def next_pair(self) -> tuple[str, list[tuple[Pooled, str]]] | None:
        """A whole pair placed on one call (an adapter whose calls can run twice on the same
        operands, ``shadow``: a GEMM's output is a new tensor): the contender and both sides in
        ABBA order, or None as :meth:`next` (the call then runs the default, untimed)."""
        self.seen += 1
        if self.seen <= self.policy.warmup:
            return None
        name = self._contender()
        if name is None:
            return None
        return name, [self._place(name), self._place(name)]

    def _contender(self) -> str | None:
        """The live contender with the fewest calls placed, or None (counted as a wait)."""
        placeable = self._placeable() if self.calls < self.policy.max_calls else []
        if not placeable:
            self._waits += 1
            return None
        return min(placeable, key=lambda n: self.races[n].calls)

    def _place(self, name: str) -> tuple[Pooled, str]:
        side = self.races[name].next_side()
        assert side is not None  # a contender is placeable only with calls left
        self.calls += 1
        return self.pool[name if side == CHOICE else self.default], side

    def add(self, name: str, side: str, sample: Sample) -> None:
        """The sample of the call :meth:`next` placed for contender ``name`` on ``side``."""
        self.races[name].add(side, sample)

    def poll(self) -> None:
        """Read the samples whose events have completed; let go of contenders that cannot
        win; give the verdict to those with all their pairs."""
        p = self.policy
        for name in list(self.alive):
            race = self.races[name]
            race.poll()
            ratios = race.ratios()
            if not ratios:
                continue
            med = statistics.median(ratios)
            if med * p.drop_ratio < 1 or (len(ratios) >= p.drop_after and med <= 1 + p.margin):
                self._drop(name)
            elif len(ratios) >= p.pairs and name not in self.verdicts:
                verdict = race.verdict(p.rule(), choice=name, baseline=self.default)
                if verdict.kept:
                    self.verdicts[name] = verdict
                else:
                    self._drop(name)
        if len(self.alive) > p.finalists and self._cut_known():
            for name in sorted(self.alive, key=lambda n: -self.median(n))[p.finalists:]:
                self._drop(name)

    def _drop(self, name: str) -> None:
        self.alive.remove(name)
        self.dropped.append(name)
        self.verdicts.pop(name, None)

    def ready(self) -> bool:
        if all(n in self.verdicts for n in self.alive):  # every live contender judged, or none left
            return True
        placing = self.calls < self.policy.max_calls and (self._placeable() or self._open in self.alive)
        # nothing left to place: once the samples in flight are in (or, after many calls,
        # never come: a forward whose backward does not run)
        return not placing and (not any(self.races[n].pending for n in self.alive) or self._waits >= self.policy.lost_after)

    def undecided(self) -> list[str]:
        """Live contenders with no verdict (the lock came from the bound, or lost samples)."""
        return [n for n in self.alive if n not in self.verdicts]

    def lock(self) -> str:
        """The choice: the kept contender with the best in-step median, else the default."""
        kept = {n: v for n, v in self.verdicts.items() if n in self.alive}
        self.chosen = max(kept, key=lambda n: kept[n].speedup or 0.0) if kept else self.default
        return self.chosen

    def figure(self, name: str, kind: str, key: str) -> Verdict:
        """Contender ``name``'s in-step figure: its verdict; let go before it, the figure of
        the pairs it had, "dropped"; still racing (the bound), "unconfirmed"."""
        if name in self.verdicts:
            return dataclasses.replace(self.verdicts[name], kind=kind, key=key)
        race = self.races[name]
        verdict = race.verdict(self.policy.rule(max(1, len(race.counted()))), kind=kind, key=key, choice=name,
                               baseline=self.default)
        if verdict.speedup is None:
            return verdict
        if name in self.alive:
            return dataclasses.replace(verdict, status=UNCONFIRMED, reason="")
        reason = verdict.reason
        if verdict.kept:
            reason = f"not among the {self.policy.finalists} fastest after {self.policy.drop_after} pairs each"
        return dataclasses.replace(verdict, status=DROPPED, reason=reason)

    def tried(self) -> list[str]:
        """The contenders with at least one counted pair, the fastest first."""
        return sorted((n for n in self.races if self.races[n].ratios()), key=lambda n: -self.median(n))

    def samples(self) -> dict[str, list[float]]:
        """Every counted call's seconds by candidate (the default's from every contender's pairs)."""
        out: dict[str, list[float]] = {n: [] for n in self.pool}
        for name, race in self.races.items():
            for base, choice in race.counted():
                out[name].append(choice)
                out[self.default].append(base)
        return out

    def times(self) -> dict[str, float]:
        """Medians (seconds) of every candidate with samples."""
        return {n: statistics.median(ts) for n, ts in self.samples().items() if ts}

    def gpu_overhead_s(self) -> float:
        """Device time the tuning calls took beyond the chosen candidate's median."""
        assert self.chosen is not None
        samples = self.samples()
        best = statistics.median(samples[self.chosen]) if samples[self.chosen] else 0.0
        return sum(t - best for ts in samples.values() for t in ts if t > best)


class KindAdapter(Protocol):
    """What online tuning needs of one kind."""

    kind: str
    tuner_version: str

    def key(self, *args: Any) -> tuple[str, Any] | None: ...  # (problem key, problem) of a call (its dispatch's arguments)

    def pool(self, problem: Any, *args: Any) -> list[Pooled]: ...  # validated, the default first

    def run(self, cand: Pooled, *args: Any) -> Any: ...  # answer a call with a candidate

    def timed(self, cand: Pooled, clock: Clock, *args: Any) -> tuple[Any, Sample]: ...

    # optional: ``tuned_key(entry_key) -> key``, the key (as ``key`` gives it) under which a
    # cache entry's problem answers calls, where the two differ (grouped GEMMs: its shape's)
    # optional: ``pairing(*args) -> kind``, calls of one problem that time differently
    # (attention: with or without its backward); a pair's two calls are of one kind
    # optional: ``shadow = True``, a call may run twice on its operands: a pair a call
    # optional: ``cached(solution, problem, *args) -> [default, choice]``, a cached choice no step
    # confirmed, raced against the default


class Adapter:
    """What the kinds' adapters share: ``triton_configs`` (the cache's, raced beside the
    plugin's pool), ``limit`` (the validated candidates a pool keeps at most), and a call
    timed between two marks (``measure.bracket``)."""

    def __init__(self, triton_configs: list[Any] = (), limit: int = 8) -> None:
        self.triton_configs = list(triton_configs)
        self.limit = limit

    def timed(self, cand: Pooled, clock: Clock, *args: Any) -> tuple[Any, Sample]:
        return bracket(clock, lambda: self.run(cand, *args))  # type: ignore[attr-defined]


@dataclass
class _Report:
    validation_s: float = 0.0
    host_s: float = 0.0


class OnlineRouter:
    """A router that tunes what ``offline`` (the cache's router of this kind, holding the
    problems ``offline_keys``: ``Activation.keys``) does not hold: ``route(*call)`` answers a
    call as every router does (``kernels.routing``), with the call's candidate for a problem
    still racing. :meth:`details` gives its dispatch's summary ``tuning`` (tuning calls per
    problem) and ``online`` (per locked problem: the choice, the contender whose figure it
    states, the in-step figure, the tuning cost)."""

    def __init__(
        self,
        adapter: KindAdapter,
        offline: Any,
        cache: str | Path,
        device: DeviceIdentity,
        versions: dict[str, str],
        *,
        offline_keys: set[str] = frozenset(),
        unconfirmed: Mapping[str, Any] | None = None,
        policy: OnlinePolicy | None = None,
        clock: Clock | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.adapter = adapter
        self.offline = offline
        tuned_key = getattr(adapter, "tuned_key", None)
        self.offline_keys = {tuned_key(k) for k in offline_keys} if tuned_key else set(offline_keys)
        # cached choices no step confirmed, raced against the default where the adapter can run them
        self.unconfirmed = dict(unconfirmed or {}) if hasattr(adapter, "cached") else {}
        self.cache = TuningCache(cache)
        self.device = device
        self.versions = versions
        self.policy = policy or OnlinePolicy()
        self.clock = clock or DeviceClock()
        self.log = log or (lambda _line: None)
        self.tuning: dict[str, ProblemTuning] = {}
        self.locked: dict[str, Pooled] = {}
        self.failed: set[str] = set()  # problems whose pool could not be built
        self.reports: dict[str, _Report] = {}
        self.tuning_calls: dict[str, int] = {}
        self.online: dict[str, dict[str, Any]] = {}
        self.unusable = getattr(offline, "unusable", set())

    def route(self, *args: Any) -> tuple[str, Any]:
        if _building.depth:  # the validation's own calls (its fp32 reference ...), from any thread
            return UNSUPPORTED, None
        found = self.adapter.key(*args)
        if found is None:
            return UNSUPPORTED, None
        key, problem = found
        cand = self.locked.get(key)
        if cand is not None:
            return key, lambda: self.adapter.run(cand, *args)
        if key in self.offline_keys and (key not in self.unconfirmed or key in self.failed):
            return self.offline.route(*args)
        if key in self.failed:
            return key, None
        t0 = time.perf_counter()
        state = self.tuning.get(key)
        if state is None:
            state = self._start(key, problem, args)
            if state is None:
                return self.offline.route(*args) if key in self.offline_keys else (key, None)
        report = self.reports[key]
        state.poll()
        if state.ready():
            report.host_s += time.perf_counter() - t0
            self._lock(key, problem, state)
            cand = self.locked[key]
            return key, lambda: self.adapter.run(cand, *args)
        if getattr(self.adapter, "shadow", False):
            placed = state.next_pair()
        else:
            pairing = getattr(self.adapter, "pairing", None)
            one = state.next(pairing(*args) if pairing is not None else None)
            placed = None if one is None else (one[1], [(one[0], one[2])])
        report.host_s += time.perf_counter() - t0
        if placed is None:  # a warm-up call, or samples in flight: the default's own path
            return key, None
        contender, sides = placed

        def timed() -> Any:
            outs = {}
            try:
                for cand, side in sides:
                    out, sample = self.adapter.timed(cand, self.clock, *args)
                    state.add(contender, side, sample)
                    outs[side] = out
            except Exception:  # the dispatch says so once and runs the baseline for it from now on
                self.failed.add(key)
                self.tuning.pop(key, None)
                self.reports.pop(key, None)
                _close_runs(state.pool.values())
                raise
            self.tuning_calls[key] = self.tuning_calls.get(key, 0) + 1
            return outs.get(BASELINE, out)  # a whole pair: the default's result, as the program had it

        return key, timed

    def _start(self, key: str, problem: Any, args: tuple) -> ProblemTuning | None:
        t0 = time.perf_counter()
        entry = self.unconfirmed.get(key)
        try:
            with _building, _autocast_off():
                pool = (self.adapter.pool(problem, *args) if entry is None else
                        self.adapter.cached(entry.solution, problem, *args))
        except Exception as exc:  # the default itself cannot be validated, no library, ...
            self.failed.add(key)
            self.log(f"online {self.adapter.kind} {problem}: not tuned ({type(exc).__name__}: {exc}); using torch")
            return None
        self.reports[key] = _Report(validation_s=time.perf_counter() - t0)
        state = self.tuning[key] = ProblemTuning(pool[: self.policy.max_candidates], self.policy, self.clock)
        return state

    def _lock(self, key: str, problem: Any, state: ProblemTuning) -> None:
        """The lock made final: written to the cache with its in-step figure, and logged."""
        chosen, default = state.lock(), state.default
        del self.tuning[key]
        self.locked[key] = state.pool[chosen]
        _close_runs(c for name, c in state.pool.items() if name != chosen)
        kind = self.adapter.kind
        tried = state.tried()
        best = chosen if chosen != default else (tried[0] if tried else None)
        verdict = state.figure(best, kind, key) if best is not None else None
        times = state.times()
        report = self.reports.pop(key)
        cand = state.pool[best if best is not None else default]
        entry = cache_entry(kind, self.adapter.tuner_version, problem, cand.solution,
                            tuned_s=times.get(cand.name), default_s=times.get(default), error=cand.error,
                            device=self.device, versions=self.versions)
        if verdict is not None and verdict.speedup is not None:
            entry = confirmed_entry(entry, verdict.figure(), state.pool[default].solution)
        # the default for want of evidence (the bound, or samples lost): this run only
        undecided = chosen == default and (state.undecided() or (state.races and not tried))
        info = {
            "chosen": chosen, "tried": best, "calls": state.calls, "candidates": len(state.pool),
            "dropped": list(state.dropped), "undecided": bool(undecided),
            "speedup": verdict.speedup if chosen != default and verdict is not None else 1.0,
            "in_step": verdict.figure() if verdict is not None and verdict.speedup is not None else None,
            "gpu_overhead_ms": state.gpu_overhead_s() * 1e3, "host_ms": report.host_s * 1e3,
            "validation_ms": report.validation_s * 1e3,
        }
        self.online[key] = info
        if undecided:
            written = "not written: the next run tunes it again"
        else:
            try:
                self.cache.put(entry)
                written = f"written to {self.cache.path}"
            except CacheError as exc:
                written = f"not written ({exc})"
        counted = {n: len(state.races[n].ratios()) for n in tried}
        raced = "; ".join(f"{n} {state.median(n):.3f}x, {counted[n]} pair{'s' if counted[n] > 1 else ''}"
                          for n in tried)
        head = f"online {kind} {problem}: "
        if chosen != default:
            head += (f"locked {chosen}: {verdict.speedup:.3f}x {default} in the step [{verdict.low:.3f}-"
                     f"{verdict.high:.3f}], {2 * verdict.pairs} calls, {verdict.saving_us:.1f} us saved a call")
        elif undecided:
            head += (f"{default} for this run: {', '.join(state.undecided()) or 'every contender'} undecided in the"
                     f" step (samples lost, or the bound)" + (f" ({raced})" if raced else ""))
        else:
            head += f"locked {default}: no contender beat it in the step" + (f" ({raced})" if raced else "")
        self.log(
            f"{head}; {state.calls} timed calls, {len(state.pool)} candidates; tuning cost"
            f" {info['gpu_overhead_ms']:.2f} ms GPU, {info['host_ms']:.2f} ms host,"
            f" {info['validation_ms']:.1f} ms validation; {written}"
        )

    def details(self) -> dict[str, Any]:
        return {"tuning": dict(self.tuning_calls), "online": {k: dict(v) for k, v in self.online.items()}}

    def label(self, key: str) -> str | None:
        label = getattr(self.offline, "label", None)
        return label(key) if label is not None else None

    def may_route(self, *call: Any) -> bool:
        return True

    def idle(self, baseline: str) -> bool:
        return False

    def close(self) -> None:
        if self.offline is not None:
            self.offline.close()
        _close_runs(self.locked.values())
        _close_runs(c for state in self.tuning.values() for c in state.pool.values())
        self.locked.clear()
        self.tuning.clear()


def _close_runs(cands: Any) -> None:
    """Release the kernels of candidates (library plans) that will not run again."""
    for c in cands:
        close = getattr(c.run, "close", None)
        if close is not None:
            close()


def validated(tuner: Any, problem: Any, limit: int) -> list[Pooled]:
    """The candidates of ``tuner``'s session of ``problem`` (opened without a timer, closed
    here) that pass the core's validation (``core.validate``: the default first, at most
    ``limit``), pooled with their cache solutions as offline tuning writes them
    (``core.solution_of``); TuneError when the default fails."""
    session = tuner.open(problem, None, lambda _label: None)
    try:
        return [Pooled(c.name, solution_of(c), err, c.run)
                for c, err in validate(session, session.candidates(), limit=limit)]
    finally:
        session.close()


def default_adapters(routers: Mapping[str, Any]) -> dict[str, Any]:
    """The adapters of the kinds installed: each kind's ``online`` part, made from its router."""
    return {kind: make(routers[kind]) for kind, make in registry.with_part("online", among=routers).items()}


@dataclass
class InStepTuning:
    """Online tuning as the runtime takes it (``runtime.handle.OnlineTuning``): the cache's
    routers of the kinds with an adapter (``adapters``, default: :func:`default_adapters`)
    wrapped in :class:`OnlineRouter`; ``policy``, ``clock``: theirs (``clock`` None: device
    events, so a GPU is needed)."""

    adapters: Mapping[str, Any] | None = None
    policy: OnlinePolicy | None = None
    clock: Clock | None = None

    @property
    def needs_gpu(self) -> bool:
        return self.clock is None

    def wrap(self, routers: Mapping[str, Any], activation: Any, cache: str | Path,
             log: Callable[[str], None] | None) -> dict[str, Any]:
        adapters = default_adapters(routers) if self.adapters is None else self.adapters
        out = dict(routers)
        for kind, router in routers.items():
            adapter = adapters.get(kind)
            if adapter is not None:
                out[kind] = OnlineRouter(adapter, router, cache, activation.device, activation.versions.get(kind, {}),
                                         offline_keys=activation.keys.get(kind, set()),
                                         unconfirmed=activation.unconfirmed.get(kind), policy=self.policy,
                                         clock=self.clock, log=log)
        return out
