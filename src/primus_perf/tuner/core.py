"""The tuner core: one path from a problem to a cache entry, the same for every kind.

For each problem a kind's :class:`Tuner` opens a :class:`Session` (operands, library
plans, a search where the kind has one), and the core runs:

1. ``candidates()``: the pool; the first candidate is the default (what runs untuned:
   torch's own choice);
2. validation: ``error(candidate)`` is its relative error against the fp32 reference; a
   candidate above the session's tolerance (or NaN, or one that cannot run) is rejected
   and never chosen; if the default itself fails, the problem fails (:class:`TuneError`).
   A candidate a search found carries the error the search measured (``Candidate.error``)
   and is not run against the reference again;
3. measurement through the injected timer (``tuner.measure``; seconds; without one, the
   plugin's own ``default_timer()`` where it has one, else ``measure.default_timer()``): a rough pass of
   ``reps.rough`` calls (a searched candidate: the search's own timed calls,
   ``Candidate.samples``) drops candidates slower than ``decide.DROP_RATIO`` x the best, then
   the finalists get ``reps.final_min`` to ``reps.final_max`` calls each, as many as the
   problem's time budget allows. A candidate may have several parts (attention: forward
   and backward); its time is the sum of its parts' medians;
4. selection by the one decision rule (``decide``): each finalist paired with the default
   round by round, kept only where its median ratio clears ``max(margin, noise)`` and it
   saves ``MIN_SAVING_S`` a call; the best kept one, else the default;
5. a :class:`~primus_perf.cache.store.CacheEntry` (:func:`cache_entry`; times in ms there,
   as the file keeps them: the isolated figure);
6. confirmation inside real steps (``tuner.confirm``; online tuning races every candidate
   this way): a choice the step does not bear out is replaced by the baseline
   (:func:`confirmed_entry`).

Validation (:func:`validate`) and entry building are the same for tuning inside the
program's steps (``tuner.online``): only the timing differs.

:func:`tune` is the loop over problems: dedupe by key, skip problems already cached for
this device and library versions (resume), write the cache after each problem (one
problem is :meth:`Runner.handle`), report progress, and on Ctrl-C stop keeping every
finished entry: the :class:`TuneRun` says which problems are done and which remain.

A kind's plugin is a class of the :class:`Tuner` shape, its record's ``tuner`` part
(``primus_perf.kinds``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from primus_perf.base.devices import DeviceIdentity, current_device
from primus_perf.base.errors import one_line
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.tuner import measure
from primus_perf.tuner.decide import DROP_RATIO, MIN_SAVING_S, Rule, decide, judge, paired
from primus_perf.tuner.measure import Timer

OFFLINE_RULE = Rule(min_saving_s=MIN_SAVING_S)  # a kernel choice routed at run time must save the routing
TIMER_OVERHEAD_S = 1.2e-3  # per timed call beyond the call itself (GPU idle + flush), for the budget
BUDGET_SHARE = 0.6  # share of the time left in a problem's budget given to the final pass

Step = Callable[[str], None]


class TuneError(RuntimeError):
    """A problem cannot be tuned (its default fails the reference check)."""


@dataclass(frozen=True)
class Reps:
    """Timed calls per candidate: the rough pass, and the bounds of the final pass."""

    rough: int = 5
    final_min: int = 10
    final_max: int = 40


@dataclass
class Candidate:
    """One way to run a problem. ``config`` (readable) and ``blob`` (opaque) go into the
    cache entry when it is chosen; ``run`` is what the plugin needs to run it.

    A candidate a session's search found comes with what the search measured on this
    problem: ``error`` (its check against the fp32 reference, so :func:`validate` does not
    run it again) and ``samples`` (part -> timed calls in seconds, through the run's timer,
    which stand for its rough pass)."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    blob: bytes = b""
    run: Any = None
    error: float | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)


class Session(Protocol):
    """One problem, opened by a :class:`Tuner`; closed by the core."""

    n_sets: int  # input sets the calls rotate through (the timer's ``n_sets``)
    tolerance: float  # largest relative error against the fp32 reference
    details: dict[str, Any]  # what the kind reports beside the candidates (its search)

    def candidates(self) -> list[Candidate]: ...  # the default first

    def error(self, candidate: Candidate) -> float: ...  # relative error vs fp32; raises if it cannot run

    def calls(self, candidate: Candidate) -> dict[str, Callable[[int], object]]: ...  # part -> fn(set)

    def close(self) -> None: ...


class Tuner(Protocol):
    """A kind's plugin."""

    kind: str  # the cache entries' kind
    version: str  # the cache entries' tuner_version
    problem_type: type  # the problems it takes
    reps: Reps

    def versions(self) -> dict[str, str]: ...  # running library versions an entry must match

    def check(self, problem: Any) -> None: ...  # UserError for a problem it cannot take

    def open(self, problem: Any, timer: Timer, step: Step) -> Session: ...


@dataclass
class CandidateStats:
    """What happened to one candidate: ``status`` is "chosen", "measured", "dropped" (by
    the rough pass) or "rejected" (failed validation or could not run; ``reason``)."""

    name: str
    status: str
    config: dict[str, Any] = field(default_factory=dict)
    error: float | None = None
    parts: dict[str, dict[str, float]] = field(default_factory=dict)  # part -> measure.summarize()
    reason: str = ""

    @property
    def total_s(self) -> float:
        return sum(p["median_s"] for p in self.parts.values()) if self.parts else math.inf


@dataclass
class TuneResult:
    """One problem's outcome, for every kind. Times in seconds."""

    kind: str
    problem: Any
    chosen: str
    config: dict[str, Any]
    tuned_s: float | None
    default_s: float | None
    error: float | None
    entry: CacheEntry  # what the cache holds for it
    candidates: list[CandidateStats] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    cached: bool = False  # found in the cache, not tuned in this run
    tuning_s: float = 0.0

    @property
    def speedup(self) -> float | None:
        """The default's time over the chosen one's (the cache entry's ``speedup``)."""
        return self.entry.speedup

    @classmethod
    def from_entry(cls, entry: CacheEntry, problem: Any) -> TuneResult:
        config = dict(entry.solution.get("config") or {})
        tuned, default = entry.times.get("tuned_ms"), entry.times.get("default_ms")
        return cls(
            kind=entry.kind, problem=problem, chosen=str(config.get("name", "")), config=config,
            tuned_s=tuned / 1e3 if tuned else None, default_s=default / 1e3 if default else None,
            error=entry.error, cached=True, entry=entry,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "problem": self.problem.to_dict(), "problem_key": self.problem.key(),
            "chosen": self.chosen, "config": self.config, "tuned_s": self.tuned_s,
            "default_s": self.default_s, "speedup": self.speedup, "error": self.error,
            "cached": self.cached, "tuning_s": self.tuning_s, "details": self.details,
            "candidates": [
                {"name": c.name, "status": c.status, "config": c.config, "error": c.error, "parts": c.parts,
                 "reason": c.reason}
                for c in self.candidates
            ],
        }


@dataclass
class TuneRun:
    """What :func:`tune` did: the results in order, and on Ctrl-C the problems left.
    ``failures``: workers that died or failed (multi-GPU tuning), one line each; what was
    left undone is in ``remaining``."""

    results: list[TuneResult]
    remaining: list[Any]
    interrupted: bool
    cache_path: str
    failures: list[str] = field(default_factory=list)

    @property
    def tuned(self) -> int:
        return sum(not r.cached for r in self.results)

    @property
    def cached(self) -> int:
        return sum(r.cached for r in self.results)


class Progress:
    """Hooks :func:`tune` calls; override what you show (the CLI draws rich bars)."""

    def start(self, total: int) -> None:
        """``total`` unique problems will be handled."""

    def problem(self, problem: Any, index: int) -> None:
        """Work on ``problem`` (0-based ``index``) begins."""

    def step(self, label: str) -> None:
        """A step inside the current problem (a search trial, a timing pass)."""

    def done(self, result: TuneResult) -> None:
        """The current problem is finished (tuned, or found in the cache)."""


# ---- one problem ----------------------------------------------------------------------


def validate(session: Session, pool: Sequence[Candidate], *, limit: int | None = None,
             reject: Callable[[Candidate, float | None, str], None] | None = None) -> list[tuple[Candidate, float]]:
    """The candidates of ``pool`` (the default first) that pass the session's reference
    check, with their relative errors, in pool order, at most ``limit`` (validation stops
    there). ``reject(candidate, error, reason)`` hears of each one that fails (over the
    tolerance, NaN, or it cannot run). :class:`TuneError` when the default fails: there is
    nothing to tune against."""
    out: list[tuple[Candidate, float]] = []
    for i, c in enumerate(pool):
        if limit is not None and len(out) >= limit:
            break
        err: float | None = c.error
        try:
            if err is None:
                err = session.error(c)
            reason = "" if err <= session.tolerance else f"relative error {err:.3g} > {session.tolerance}"  # NaN fails
        except Exception as exc:  # the candidate cannot run this problem
            reason = one_line(exc)
        if not reason:
            out.append((c, err))
            continue
        if reject is not None:
            reject(c, err, reason)
        if i == 0:
            raise TuneError(f"the default ({c.name}) fails the reference check: {reason}")
    return out


def solution_of(candidate: Candidate) -> dict[str, Any]:
    """A candidate as a cache entry stores it: its readable config (named) and its blob."""
    return {"config": {"name": candidate.name, **candidate.config}, "blob": candidate.blob}


def cache_entry(kind: str, version: str, problem: Any, solution: dict[str, Any], *, tuned_s: float | None,
                default_s: float | None, error: float | None, device: DeviceIdentity,
                versions: dict[str, str]) -> CacheEntry:
    """The cache entry of a choice, for every kind and timing strategy (times in ms)."""
    return CacheEntry(
        kind=kind, problem_key=problem.key(), problem=problem.to_dict(), device=device.to_dict(),
        versions=dict(versions), solution=solution,
        times={"tuned_ms": (tuned_s or 0.0) * 1e3, "default_ms": (default_s or 0.0) * 1e3},
        error=error, tuner_version=version,
    )


def confirmed_entry(entry: CacheEntry, figure: dict[str, Any], baseline: dict[str, Any] | None) -> CacheEntry:
    """``entry`` as a confirmation inside real steps left it (``decide.Verdict``):
    ``in_step`` holds the figure; a choice the step did not bear out ("dropped") is
    replaced by the ``baseline`` solution (torch's own, the caller's backend), its
    ``times`` kept as the isolated figure they are; ``created`` is now, so the corrected
    entry wins a merge over the claim it corrects."""
    dropped = figure.get("verdict") == "dropped" and baseline is not None
    solution = dict(baseline if dropped else entry.solution)
    return dataclasses.replace(entry, solution=solution, in_step=dict(figure), created=time.time())


def timer_for(tuner: Tuner) -> Timer:
    """The timer a plugin's candidates are measured with when none is injected: its own
    ``default_timer()`` (grouped GEMM: launches counted), else ``measure.default_timer()``."""
    own = getattr(tuner, "default_timer", None)
    return own() if own is not None else measure.default_timer()


def tune_problem(
    tuner: Tuner,
    problem: Any,
    *,
    timer: Timer | None = None,
    budget_s: float = 5.0,
    step: Step | None = None,
    device: DeviceIdentity | None = None,
    versions: dict[str, str] | None = None,
) -> TuneResult:
    """Tune one problem with ``tuner`` (see the module docstring)."""
    t0 = time.perf_counter()
    timer = timer or timer_for(tuner)
    step = step or (lambda _label: None)
    session = tuner.open(problem, timer, step)
    try:
        pool = session.candidates()
        default = pool[0].name
        stats = {c.name: CandidateStats(c.name, "rejected", c.config) for c in pool}
        valid: dict[str, Candidate] = {}
        calls: dict[tuple[str, str], Callable[[int], object]] = {}
        parts: dict[str, list[str]] = {}
        step("validating")

        def reject(c: Candidate, err: float | None, reason: str) -> None:
            stats[c.name].error, stats[c.name].reason = err, reason

        try:
            passed = validate(session, pool, reject=reject)
        except TuneError as exc:
            raise TuneError(f"{problem}: {exc}") from None
        for c, err in passed:
            stats[c.name].error = err
            try:
                mine = session.calls(c)
            except Exception as exc:  # the candidate cannot run the real problem
                stats[c.name].reason = one_line(exc)
                continue
            valid[c.name] = c
            parts[c.name] = list(mine)
            calls.update({(c.name, part): fn for part, fn in mine.items()})
        if default not in valid:
            raise TuneError(f"{problem}: the default ({default}) fails the reference check: {stats[default].reason}")
        reps = tuner.reps
        step("timing (rough)")
        searched = {k for k in calls if k[1] in valid[k[0]].samples}  # timed by the search already
        rough = timer({k: fn for k, fn in calls.items() if k not in searched}, session.n_sets, reps.rough)
        rough.update({k: list(valid[k[0]].samples[k[1]]) for k in searched})
        med = {n: sum(statistics.median(rough[(n, part)]) for part in parts[n]) for n in valid}
        best = min(med.values())
        finalists = [n for n in valid if med[n] <= DROP_RATIO * best or n == default]
        for n in valid:
            stats[n].status = "measured" if n in finalists else "dropped"
            stats[n].parts = {part: measure.summarize(rough[(n, part)]) for part in parts[n]}
        left = budget_s - (time.perf_counter() - t0)
        per_round = sum(med[n] + TIMER_OVERHEAD_S * len(parts[n]) for n in finalists)
        final_reps = int(max(reps.final_min, min(reps.final_max, left / max(per_round, 1e-6) * BUDGET_SHARE)))
        step(f"timing ({final_reps} calls each)")
        final = timer({k: fn for k, fn in calls.items() if k[0] in finalists}, session.n_sets, final_reps, seed=1)
        for n in finalists:
            stats[n].parts = {part: measure.summarize(final[(n, part)]) for part in parts[n]}
        rounds = {n: [sum(t) for t in zip(*(final[(n, part)] for part in parts[n]))] for n in finalists}
        totals = {n: statistics.median(rounds[n]) for n in finalists}  # what the rule judged
        verdicts = {n: judge(pairs, OFFLINE_RULE) for n, pairs in paired(rounds, default).items()}
        chosen = decide(default, verdicts)
        stats[chosen].status = "chosen"
        details = dict(session.details)
    finally:
        session.close()
    solution = solution_of(valid[chosen])
    config = solution["config"]
    device = device or current_device()
    versions = tuner.versions() if versions is None else versions
    entry = cache_entry(tuner.kind, tuner.version, problem, solution, tuned_s=totals[chosen],
                        default_s=totals[default], error=stats[chosen].error, device=device, versions=versions)
    return TuneResult(
        kind=tuner.kind, problem=problem, chosen=chosen, config=config, tuned_s=totals[chosen],
        default_s=totals[default], error=stats[chosen].error, entry=entry,
        candidates=list(stats.values()), details=details, tuning_s=time.perf_counter() - t0,
    )


# ---- the loop -------------------------------------------------------------------------


def _tuner_for(problem: Any, tuners: Sequence[Tuner]) -> Tuner:
    for t in tuners:
        if isinstance(problem, t.problem_type):
            return t
    raise ValueError(f"no tuner for {type(problem).__name__} problems among {[t.kind for t in tuners]}")


class Runner:
    """What a run keeps across its problems: the cache, the device identity, and each
    kind's library versions and timer (one per kind for the run). :meth:`handle` is one
    problem: the cache's entry when it holds one for this device and these versions
    (resume), else the problem tuned and its entry written. :func:`tune` loops over a list
    with one; a multi-GPU worker builds one at start-up and handles what it is handed."""

    def __init__(
        self,
        cache: str | os.PathLike,
        tuners: Sequence[Tuner],
        *,
        timer: Timer | None = None,
        budget_s: float = 5.0,
        device: DeviceIdentity | None = None,
    ) -> None:
        self.store = TuningCache(cache)
        self.tuners = list(tuners)
        self.versions = {t.kind: t.versions() for t in self.tuners}
        self.device = device or current_device()
        self.timers = {t.kind: timer or timer_for(t) for t in self.tuners}
        self.budget_s = budget_s

    def handle(self, problem: Any, step: Step | None = None) -> TuneResult:
        t = _tuner_for(problem, self.tuners)
        existing = self.store.get(t.kind, problem.key(), self.device, self.versions[t.kind])
        if existing is not None:
            return TuneResult.from_entry(existing, problem)
        result = tune_problem(t, problem, timer=self.timers[t.kind], budget_s=self.budget_s, step=step,
                              device=self.device, versions=self.versions[t.kind])
        self.store.put(result.entry)
        return result


def tune(
    problems: Sequence[Any],
    *,
    cache: str | os.PathLike,
    tuners: Sequence[Tuner],
    timer: Timer | None = None,
    progress: Progress | None = None,
    budget_s: float = 5.0,
    device: DeviceIdentity | None = None,
) -> TuneRun:
    """Tune every unique problem not yet in the cache for this device and library
    versions, writing the cache after each one. Ctrl-C stops the loop: the finished
    entries stay in the cache, and the returned run has ``interrupted`` and ``remaining``."""
    todo: dict[tuple[str, str], tuple[Any, Tuner]] = {}
    for p in problems:
        t = _tuner_for(p, tuners)
        todo.setdefault((t.kind, p.key()), (p, t))
    for p, t in todo.values():
        t.check(p)
    kinds = {t.kind: t for _, t in todo.values()}
    runner = Runner(cache, list(kinds.values()), timer=timer, budget_s=budget_s, device=device)
    progress = progress or Progress()
    results: list[TuneResult] = []
    items = [p for p, _ in todo.values()]
    progress.start(len(items))
    for i, p in enumerate(items):
        try:
            progress.problem(p, i)
            result = runner.handle(p, progress.step)
        except KeyboardInterrupt:
            return TuneRun(results, items[i:], True, str(cache))
        results.append(result)
        progress.done(result)
    return TuneRun(results, [], False, str(cache))
