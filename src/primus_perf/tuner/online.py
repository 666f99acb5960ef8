"""Online tuning: the problems a cache does not hold are tuned inside the real steps.

For each new problem (a GEMM, or an attention call) the router takes the offline tuner's
pool for it (``tuner/gemm``: torch's own choice and the BLAS-Lt heuristic's candidates;
``tuner/attention``: torch's default SDPA, each SDPA backend and the Triton configs the
cache holds for this device), validates every candidate once against the fp32 reference
on a side buffer (the plugin's ``error``; a candidate over the tolerance never runs on the
program's tensors), then answers the problem's real calls round-robin over the
candidates, each call between two device events (:class:`CudaClock`). The events are read
later, when they have completed (``query``, never a synchronize inside a step).

:class:`ProblemTuning` is the state machine of one problem:

1. sampling: each call runs the next live candidate and records a :class:`Sample`;
2. early drop: once every live candidate has ``drop_after`` samples, those whose median is
   over ``drop_ratio`` x the best median are dropped (torch's own choice never is; the
   ratio is the core's :data:`~.core.DROP_RATIO`, as in the offline rough pass);
3. locking: when every live candidate has ``min_samples`` samples, or after ``max_calls``
   tuning calls of the problem (the bound), the choice is made by the tuner's one
   selection policy (``core.select``, with its margin for keeping the default);
4. confirmation: a choice other than the default is confirmed in the step before it is
   final (``runtime.confirm.ProblemConfirmation``, as offline confirmation does): the
   choice and the default on alternating calls (ABBA), warm-up pairs not counted, the
   choice kept only when the median of the per-pair ratios clears a margin above their
   spread. The problem runs the final choice for the rest of the run, and it is written to
   the cache with its in-step figure (``TuningCache.put``: under the file lock, merged with
   what other ranks wrote), so the next run starts tuned and does no tuning.

The log line of a lock prints that in-step figure with its spread ("locked heur2: 1.031x
torch in the step [1.012-1.049], 16 calls", or "heur2 not confirmed in the step (0.990x
[...]): torch kept"), never the tuning samples' ratio: three round-robin samples per
candidate, one of them possibly the first timed call, and each a single call between two
events on a stream the host may be starving (then the interval is the host's launch time,
not the kernel's), gave claims such as "12.093x torch" for a GEMM whose step moved by less
than 1%.

Every lock reports the problem's tuning cost: GPU time spent on slower candidates (their
samples minus the chosen one's median), host time in this module, and validation time.
The state machine runs on the CPU with an injected clock and fake candidates.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from primus_perf.cache.store import TuningCache
from primus_perf.devices import DeviceIdentity
from primus_perf.errors import CacheError
from primus_perf.kernels.routing import Router
from primus_perf.runtime.confirm import (
    BASELINE,
    CHOICE,
    KEPT,
    Clock,
    ConfirmPolicy,
    DeviceClock,
    ProblemConfirmation,
    Sample,
    Verdict,
)
from primus_perf.tuner.core import (
    DROP_RATIO,
    KEEP_DEFAULT_MARGIN,
    cache_entry,
    confirmed_entry,
    select,
)


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
    """How long a problem is tuned. Defaults: 6 candidates at most (the default and the
    pool's first 5, in the plugin's order: the library heuristic's ranking), dropped after
    2 samples each when :data:`~.core.DROP_RATIO` (1.25) x slower than the best (the
    offline rough pass's ratio), locked at 3 samples each or after 18
    tuning calls: a problem called once per step (a language-model head) locks within
    about 19 steps. On an H200 (llama3-8b, 4 layers) 8 candidates x 5 samples and a 64-call
    bound left the head's two GEMMs sampling at step 40, while the other 13 problems, called
    4 to 12 times a step, locked by step 10."""

    min_samples: int = 3
    drop_after: int = 2
    drop_ratio: float = DROP_RATIO
    max_calls: int = 18
    max_candidates: int = 6
    margin: float = KEEP_DEFAULT_MARGIN
    confirm: ConfirmPolicy = field(default_factory=ConfirmPolicy)  # the lock's confirmation against the default


CudaClock = DeviceClock  # CUDA (or HIP) events on torch's current stream, read without waiting


@dataclass
class Pooled:
    """A validated candidate: ``run(*call_args)`` answers one call (timing is the adapter's)."""

    name: str
    solution: dict[str, Any]  # {"config": {"name": ..., ...}, "blob": bytes}, as a cache entry stores it
    error: float
    run: Callable[..., Any]


class ProblemTuning:
    """The state machine of one problem (module docstring)."""

    def __init__(self, pool: list[Pooled], policy: OnlinePolicy, clock: Clock) -> None:
        if not pool:
            raise ValueError("online tuning needs at least the default candidate")
        self.pool = {c.name: c for c in pool}
        self.default = pool[0].name
        self.policy = policy
        self.clock = clock
        self.alive = list(self.pool)
        self.dropped: list[str] = []
        self.samples: dict[str, list[float]] = {n: [] for n in self.pool}
        self.pending: list[tuple[str, Sample]] = []
        self.calls = 0
        self.chosen: str | None = None
        self._turn = 0
        self._waits = 0  # calls since the bound was reached

    def next(self) -> Pooled | None:
        """The candidate for the next call, or None once the bound is reached (the call
        then runs the default, untimed, until the pending samples are in)."""
        if self.calls >= self.policy.max_calls:
            self._waits += 1
            return None
        name = self.alive[self._turn % len(self.alive)]
        self._turn += 1
        self.calls += 1
        return self.pool[name]

    def add(self, name: str, sample: Sample) -> None:
        self.pending.append((name, sample))

    def poll(self) -> None:
        """Read the samples whose events have completed; drop clearly slower candidates."""
        still = []
        for name, sample in self.pending:
            t = sample.seconds(self.clock)
            if t is None:
                still.append((name, sample))
            elif name in self.alive:
                self.samples[name].append(t)
        self.pending = still
        self._drop_slow()

    def _medians(self, names: list[str]) -> dict[str, float]:
        return {n: statistics.median(self.samples[n]) for n in names if self.samples[n]}

    def _drop_slow(self) -> None:
        p = self.policy
        if len(self.alive) < 2 or any(len(self.samples[n]) < p.drop_after for n in self.alive):
            return
        med = self._medians(self.alive)
        best = min(med.values())
        slow = [n for n in self.alive if n != self.default and med[n] > p.drop_ratio * best]
        for n in slow:
            self.alive.remove(n)
            self.dropped.append(n)

    def ready(self) -> bool:
        if all(len(self.samples[n]) >= self.policy.min_samples for n in self.alive):
            return True
        # at the bound: once the samples in flight are in (or never come: a forward whose
        # backward does not run)
        return self.calls >= self.policy.max_calls and (not self.pending or self._waits >= self.policy.max_calls)

    def lock(self) -> str:
        """The choice: ``core.select`` over the live candidates' medians."""
        med = self._medians(self.alive)
        if self.default not in med:  # no sample of the default completed: keep it
            self.chosen = self.default
        else:
            self.chosen = select(med, self.default, self.policy.margin)
        return self.chosen

    def times(self) -> dict[str, float]:
        """Medians (seconds) of every candidate with samples."""
        return self._medians(list(self.pool))

    def gpu_overhead_s(self) -> float:
        """Device time the tuning calls took beyond the chosen candidate's median."""
        assert self.chosen is not None
        best = statistics.median(self.samples[self.chosen]) if self.samples[self.chosen] else 0.0
        return sum(t - best for ts in self.samples.values() for t in ts if t > best)


class KindAdapter(Protocol):
    """What online tuning needs of one kind."""

    kind: str
    tuner_version: str

    def key(self, *args: Any) -> tuple[str, Any] | None: ...  # (problem key, problem) of a call

    def pool(self, problem: Any, *args: Any) -> list[Pooled]: ...  # validated, the default first

    def run(self, cand: Pooled, *args: Any) -> Any: ...  # answer a call with a candidate

    def timed(self, cand: Pooled, clock: Clock, *args: Any) -> tuple[Any, Sample]: ...

    # optional: ``tuned_key(entry_key) -> key``, the key (as ``key`` gives it) under which a
    # cache entry's problem answers calls, where the two differ (grouped GEMMs: its shape's)


@dataclass
class _Confirming:
    """A problem whose lock is being confirmed in the step."""

    problem: Any
    state: ProblemTuning
    confirmation: ProblemConfirmation


@dataclass
class _Report:
    validation_s: float = 0.0
    host_s: float = 0.0


class OnlineRouter(Router):
    """A router that tunes what ``offline`` (the cache's router of this kind, holding the
    problems ``offline_keys``: ``Activation.keys``) does not hold; ``summary()`` adds
    ``tuning`` (tuning calls per problem) and ``online`` (per locked problem: the final
    choice, the one tried, the in-step figure, ``confirm_calls``, the tuning cost)."""

    def __init__(
        self,
        adapter: KindAdapter,
        offline: Any,
        cache: str | Path,
        device: DeviceIdentity,
        versions: dict[str, str],
        *,
        offline_keys: set[str] = frozenset(),
        policy: OnlinePolicy | None = None,
        clock: Clock | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        self.adapter = adapter
        self.offline = offline
        tuned_key = getattr(adapter, "tuned_key", None)
        self.offline_keys = {tuned_key(k) for k in offline_keys} if tuned_key else set(offline_keys)
        self.cache = TuningCache(cache)
        self.device = device
        self.versions = versions
        self.policy = policy or OnlinePolicy()
        self.clock = clock or CudaClock()
        self.log = log or (lambda _line: None)
        self.tuning: dict[str, ProblemTuning] = {}
        self.confirming: dict[str, _Confirming] = {}
        self.locked: dict[str, Pooled] = {}
        self.reports: dict[str, _Report] = {}
        self.tuning_calls: dict[str, int] = {}
        self.confirm_calls: dict[str, int] = {}  # calls that confirmed a lock in the step
        self.online: dict[str, dict[str, Any]] = {}
        self.unusable = getattr(offline, "unusable", set())

    def __call__(self, *args: Any) -> Any:
        if _building.depth:  # the validation's own calls (its fp32 reference ...), from any thread
            return None
        found = self.adapter.key(*args)
        if found is None:
            self._fall_back("unsupported")
            return None
        key, problem = found
        if key in self.offline_keys:
            return self.offline(*args)
        cand = self.locked.get(key)
        if cand is not None:
            return self._run(key, lambda: self.adapter.run(cand, *args))
        if key in self.failed:
            self._fall_back(key)
            return None
        if key in self.confirming:
            return self._confirm_call(key, args)
        t0 = time.perf_counter()
        state = self.tuning.get(key)
        if state is None:
            state = self._start(key, problem, args)
            if state is None:
                self._fall_back(key)
                return None
        report = self.reports[key]
        state.poll()
        if state.ready():
            report.host_s += time.perf_counter() - t0
            self._lock(key, problem, state)
            if key in self.confirming:
                return self._confirm_call(key, args)
            cand = self.locked[key]
            return self._run(key, lambda: self.adapter.run(cand, *args))
        cand = state.next()
        report.host_s += time.perf_counter() - t0
        if cand is None:  # bound reached, samples still in flight: torch's default
            self._fall_back(key)
            return None
        out, sample = self.adapter.timed(cand, self.clock, *args)
        state.add(cand.name, sample)
        self.tuning_calls[key] = self.tuning_calls.get(key, 0) + 1
        return out

    def _start(self, key: str, problem: Any, args: tuple) -> ProblemTuning | None:
        t0 = time.perf_counter()
        try:
            with _building, _autocast_off():
                pool = self.adapter.pool(problem, *args)
        except Exception as exc:  # the default itself cannot be validated, no library, ...
            self.failed.add(key)
            self.log(f"online {self.adapter.kind} {problem}: not tuned ({type(exc).__name__}: {exc}); using torch")
            return None
        self.reports[key] = _Report(validation_s=time.perf_counter() - t0)
        state = self.tuning[key] = ProblemTuning(pool[: self.policy.max_candidates], self.policy, self.clock)
        return state

    def _lock(self, key: str, problem: Any, state: ProblemTuning) -> None:
        """The tuning's choice; one other than the default is confirmed in the step
        (:meth:`_confirm_call`) before it is final."""
        chosen = state.lock()
        del self.tuning[key]
        _close_runs(c for name, c in state.pool.items() if name not in (chosen, state.default))
        if chosen == state.default:
            self._final(key, problem, state, None)
            return
        self.confirming[key] = _Confirming(problem, state, ProblemConfirmation(self.policy.confirm, self.clock))

    def _confirm_call(self, key: str, args: tuple) -> Any:
        """One call of a problem whose lock is being confirmed: the locked choice and the
        default on alternating calls, each timed; the verdict makes the lock final."""
        c = self.confirming[key]
        c.confirmation.poll()
        if c.confirmation.ready():
            del self.confirming[key]
            state = c.state
            verdict = c.confirmation.verdict(self.adapter.kind, key, state.chosen, state.default)
            self._final(key, c.problem, state, verdict)
            cand = self.locked[key]
            return self._run(key, lambda: self.adapter.run(cand, *args))
        side = c.confirmation.next_side()
        pool = c.state.pool
        if side is None:  # calls spent, samples in flight: the default, untimed
            return self._run(key, lambda: self.adapter.run(pool[c.state.default], *args))
        cand = pool[c.state.chosen if side == CHOICE else c.state.default]
        try:
            out, sample = self.adapter.timed(cand, self.clock, *args)
        except Exception as exc:
            del self.confirming[key]
            return self._failure(key, exc)
        c.confirmation.add(CHOICE if side == CHOICE else BASELINE, sample)
        self.confirm_calls[key] = self.confirm_calls.get(key, 0) + 1
        return out

    def _final(self, key: str, problem: Any, state: ProblemTuning, verdict: Verdict | None) -> None:
        """The lock made final (the tuning's choice, or the default when the step did not
        bear it out), written to the cache with how its figure was measured, and logged."""
        chosen, default = state.chosen, state.default
        final = chosen if verdict is None or verdict.status == KEPT else default
        self.locked[key] = state.pool[final]
        _close_runs(state.pool[name] for name in {chosen, default} if name != final)
        times = state.times()
        report = self.reports.pop(key)
        cand = state.pool[chosen]
        entry = cache_entry(self.adapter.kind, self.adapter.tuner_version, problem, cand.solution,
                            tuned_s=times.get(chosen), default_s=times.get(default), error=cand.error,
                            device=self.device, versions=self.versions)
        sampled = entry.speedup
        if verdict is not None:
            entry = confirmed_entry(entry, verdict.figure(), state.pool[default].solution)
        info = {
            "chosen": final, "tried": chosen, "calls": state.calls, "candidates": len(state.pool),
            "dropped": list(state.dropped), "speedup": verdict.speedup if verdict is not None else 1.0,
            "tuning_speedup": sampled, "in_step": verdict.figure() if verdict is not None else None,
            "confirm_calls": self.confirm_calls.get(key, 0),
            "gpu_overhead_ms": state.gpu_overhead_s() * 1e3, "host_ms": report.host_s * 1e3,
            "validation_ms": report.validation_s * 1e3,
        }
        self.online[key] = info
        try:
            self.cache.put(entry)
            written = f"written to {self.cache.path}"
        except CacheError as exc:
            written = f"not written ({exc})"
        head = f"online {self.adapter.kind} {problem}: "
        if verdict is None:
            head += f"locked {default} (no candidate beat it by the margin in the tuning samples)"
        elif verdict.status == KEPT:
            head += (f"locked {chosen}: {verdict.speedup:.3f}x {default} in the step [{verdict.low:.3f}-"
                     f"{verdict.high:.3f}], {2 * verdict.pairs} calls, {verdict.saving_us:.1f} us saved a call")
        elif verdict.speedup is not None:
            head += (f"{chosen} not confirmed in the step ({verdict.speedup:.3f}x [{verdict.low:.3f}-"
                     f"{verdict.high:.3f}], {2 * verdict.pairs} calls): {default} kept")
        else:
            head += (f"{chosen} unconfirmed in the step ({verdict.pairs} of {verdict.wanted} pairs complete):"
                     f" {default} kept")
        self.log(
            f"{head}; tuned over {state.calls} calls, {len(state.pool)} candidates ({len(state.dropped)} dropped"
            f" early); tuning cost {info['gpu_overhead_ms']:.2f} ms GPU, {info['host_ms']:.2f} ms host,"
            f" {info['validation_ms']:.1f} ms validation; {written}"
        )

    def summary(self) -> dict[str, Any]:
        own = super().summary()
        if self.offline is not None:
            off = self.offline.summary()
            for part in ("routed", "fallback"):
                own[part] = {**off[part], **own[part]}
            own["failed"] = sorted(set(own["failed"]) | set(off["failed"]))
        own["tuning"] = dict(self.tuning_calls)
        own["online"] = {k: dict(v) for k, v in self.online.items()}
        return own

    def close(self) -> None:
        if self.offline is not None:
            self.offline.close()
        _close_runs(self.locked.values())
        _close_runs(c for state in self.tuning.values() for c in state.pool.values())
        _close_runs(c for conf in self.confirming.values() for c in conf.state.pool.values()
                    if c.name in (conf.state.chosen, conf.state.default))
        self.locked.clear()
        self.tuning.clear()
        self.confirming.clear()


def _close_runs(cands: Any) -> None:
    """Release the kernels of candidates (library plans) that will not run again."""
    for c in cands:
        close = getattr(c.run, "close", None)
        if close is not None:
            close()


def online_routers(
    routers: Mapping[str, Any],
    activation: Any,
    cache: str | Path,
    *,
    adapters: Mapping[str, KindAdapter],
    policy: OnlinePolicy | None = None,
    clock: Clock | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The cache's routers (``runtime.activate.Activation``), each of a kind ``adapters``
    (kind -> adapter) has wrapped in an :class:`OnlineRouter`."""
    out = dict(routers)
    for kind, router in routers.items():
        adapter = adapters.get(kind)
        if adapter is not None:
            out[kind] = OnlineRouter(adapter, router, cache, activation.device, activation.versions.get(kind, {}),
                                     offline_keys=activation.keys.get(kind, set()), policy=policy, clock=clock,
                                     log=log)
    return out
