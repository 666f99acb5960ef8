"""Confirmation of a cache's choices inside the real steps: a choice stays only if it wins where
it runs.

An isolated race can pick a kernel whose gain does not hold inside the program's step, next to
its neighbours. :func:`confirm_run` enables the cache and makes every kind's dispatch hand its
routed calls to a :class:`Confirmer` (``Dispatch.interpose``) while ``run()`` runs the program's
steps (the reference trainer: ``cache_check.confirm_trainer``; any script: ``primus-tune
confirm -- script.py``). Each problem whose cached choice is not the caller's own runs the
choice and the baseline (torch's kernel; the caller's grouped backend) on alternating calls in
ABBA pairs, each timed where it runs (``measure.Pairs``); after ``ConfirmPolicy.samples``
counted pairs the problem gets the one decision rule's verdict (``decide.judge``). A grouped
GEMM is confirmed per problem *shape* (the key its dispatch routes by; a shape whose entries
differ by skew is confirmed as one). A choice whose calls mostly waited for the device to read
their ``offs`` on the host is dropped though its calls won: the wait stalls the program's host,
which the call's device events do not see. The kept choices of a kind must also pay for routing
every call of the kind (:meth:`Confirmer.routing_pays`). :func:`apply_verdicts` then writes each
verdict into its cache entries: the in-step figure, and the baseline's solution in place of a
choice the step did not bear out. What is kind-specific (a verdict's entries, a baseline's
solution, the routing's price) each kind's dispatch says.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.runtime import dispatch
from primus_perf.tuner.core import confirmed_entry
from primus_perf.tuner.decide import DROPPED, KEPT, MARGIN, WAITED_SHARE, Rule, Verdict
from primus_perf.tuner.measure import CHOICE, Pairs, Sample, default_clock, host_cost_us

# why a choice that won its calls is dropped where the program's offs are on the device
WAITED = ("it reads the call's offs on the host, a wait for the device that its device events do not"
          " measure (the program's other work queues behind it)")


@dataclass(frozen=True)
class ConfirmPolicy:
    """``samples`` counted pairs per problem (after ``warmup`` pairs not counted) before the
    verdict; ``margin``: the least in-step gain that keeps a choice when the noise is smaller;
    ``max_calls``: the bound on a problem's confirming calls (samples that never complete: a
    forward whose backward does not run)."""

    samples: int = 8
    warmup: int = 2
    margin: float = MARGIN
    max_calls: int = 80

    def __post_init__(self) -> None:
        if self.samples < 2 or self.warmup < 0 or self.margin < 0:
            raise ValueError("ConfirmPolicy needs samples >= 2, warmup >= 0 and margin >= 0")

    def pairs(self, clock: Any) -> Pairs:
        return Pairs(clock, samples=self.samples, warmup=self.warmup, max_calls=self.max_calls)

    def rule(self) -> Rule:
        return Rule(margin=self.margin, least=self.samples)


class Confirmer:
    """The confirmation of a cache's routed choices (module docstring), the interposer of every
    kind's dispatch while it runs; :meth:`finish` ends it and returns the verdicts. While
    ``timing`` is False the calls run their choice untimed (a program's first step). ``busy``:
    the share of the step the GPU is busy where the step is host-bound (``decide.host_bound``),
    else None: a kept choice must then also save more device time, at that share, than it
    costs the host (:meth:`_host_check`)."""

    def __init__(self, policy: ConfirmPolicy | None = None, clock: Any = None,
                 log: Callable[[str], None] | None = None, busy: float | None = None) -> None:
        self.policy = policy or ConfirmPolicy()
        self.clock = clock or default_clock()
        self.log = log or (lambda _line: None)
        self.busy = busy
        self.timing = True
        self.states: dict[tuple[str, str], Pairs] = {}
        self.names: dict[tuple[str, str], tuple[str, str]] = {}  # (kind, key) -> (choice, baseline)
        self.verdicts: dict[tuple[str, str], Verdict] = {}
        self.unrouted: set[tuple[str, str]] = set()  # the choice declined its calls
        self.slot_calls: dict[tuple[str, str], int] = {}  # calls of each confirmed problem
        self.waited: dict[tuple[str, str], int] = {}  # choice calls that read the device offs on the host
        self.pairings: dict[tuple[str, str], Any] = {}  # the pairing of a problem's timed calls
        self.handle: Any = None  # the enabled cache (runtime.handle.Handle) while confirm_run runs

    def call(self, owner: Any, key: str, choice: Callable[[], Any], baseline: Callable[[], Any],
             probe: Callable[[], bool] | None = None, *, timed: Callable[[bool, Any, Any], Any] | None = None,
             pairing: Any = None) -> Any:
        """A routed call of ``owner`` (a kind's dispatch): the choice or the baseline, alternately.
        ``choice()`` answers None where it declines the call (or failed); ``timed(is_choice,
        sample, clock)`` runs a side timed where two marks around the call do not hold its work
        (attention: its backward); only calls of the problem's first ``pairing`` are timed."""
        slot = (owner.kind, key)
        self.slot_calls[slot] = self.slot_calls.get(slot, 0) + 1
        if self.pairings.setdefault(slot, pairing) != pairing:  # another pairing (a forward without backward)
            verdict = self.verdicts.get(slot)
            if verdict is not None and verdict.status == DROPPED:
                return baseline()
            out = choice()
            return baseline() if out is None else out
        return self._call(owner, slot, choice, baseline, probe, timed)

    def _call(self, owner: Any, slot: tuple[str, str], choice: Callable[[], Any], baseline: Callable[[], Any],
              probe: Callable[[], bool] | None, timed: Callable[[bool, Any, Any], Any] | None) -> Any:
        key = slot[1]
        verdict = self.verdicts.get(slot)
        if verdict is not None and verdict.status == DROPPED:
            return baseline()
        if verdict is not None or slot in self.unrouted or not self.timing:
            out = choice()
            return baseline() if out is None else out
        state = self.states.get(slot)
        if state is None:
            state = self.states[slot] = self.policy.pairs(self.clock)
            self.names[slot] = (owner.label(key), owner.baseline_name())
        state.poll()
        if state.ready():
            self._decide(slot)
            return self._call(owner, slot, choice, baseline, probe, timed)
        side = state.next_side()
        if side is None:  # calls spent, samples in flight: the baseline, untimed
            return baseline()
        sample = Sample()
        if timed is not None:
            out = timed(side == CHOICE, sample, self.clock)
        else:
            sample.begin(self.clock)
            out = choice() if side == CHOICE else baseline()
            sample.end(self.clock)
        if out is None:  # the choice declined the call: the baseline, and no more confirming
            self.unrouted.add(slot)
            self.states.pop(slot, None)
            return baseline()
        state.add(side, sample)
        if side == CHOICE and probe is not None and probe():
            self.waited[slot] = self.waited.get(slot, 0) + 1
        return out

    def _decide(self, slot: tuple[str, str]) -> Verdict:
        state = self.states.pop(slot)
        choice, baseline = self.names[slot]
        verdict = state.verdict(self.policy.rule(), kind=slot[0], key=slot[1], choice=choice, baseline=baseline)
        # device events do not see the host's wait: a choice whose calls often waited is dropped
        if verdict.kept and self.waited.get(slot, 0) > WAITED_SHARE * self.slot_calls.get(slot, 0):
            verdict = dataclasses.replace(verdict, status=DROPPED, reason=WAITED)
        if verdict.kept:
            verdict = self._host_check(verdict, state.host_extra_s())
        self.verdicts[slot] = verdict
        self.log(f"confirm {slot[0]} {slot[1]}: {verdict.text()}")
        return verdict

    def _host_check(self, verdict: Verdict, host_extra_s: float | None) -> Verdict:
        """In a host-bound step a call's host time is the step's: a kept choice that costs the
        host more than its kernel saves at the GPU's busy share is dropped."""
        if self.busy is None or host_extra_s is None or verdict.saving_us is None:
            return verdict
        extra_us, gain_us = host_extra_s * 1e6, verdict.saving_us * self.busy
        if extra_us <= gain_us:
            return verdict
        return dataclasses.replace(verdict, status=DROPPED, reason=(
            f"the step is host-bound (the GPU busy {self.busy:.0%} of it) and a call of the choice costs the host"
            f" {extra_us:.1f} us more, over the {gain_us:.1f} us its kernel saves there"))

    def finish(self) -> list[Verdict]:
        """Wait for the samples in flight (one synchronize), give every problem still confirming
        its verdict (unconfirmed when its pairs are too few) and return them all."""
        self.clock.settle()
        for slot in list(self.states):
            self.states[slot].poll()
            self._decide(slot)
        return list(self.verdicts.values())

    def routing_pays(self, cost_us: Mapping[str, float], calls: Mapping[str, int]) -> list[Verdict]:
        """Every verdict, each kind's kept choices checked against what routing costs: every call
        of a kind pays ``cost_us[kind]`` of host time once any of its problems is routed, so the
        kept choices stay only where the time they saved over the run (us a call x their calls;
        in a host-bound step, at the GPU's busy share) exceeds the routing of all the kind's
        ``calls[kind]``; otherwise they are dropped together (the kind then routes nothing and
        its override is not installed)."""
        share = 1.0 if self.busy is None else self.busy
        for kind, each in cost_us.items():
            kept = [v for v in self.verdicts.values() if v.kind == kind and v.kept]
            saved = share * sum((v.saving_us or 0.0) * self.slot_calls.get((v.kind, v.key), 0) for v in kept)
            cost = each * calls.get(kind, 0)
            if not kept or saved > cost:
                continue
            why = (f"the {len(kept)} kept {kind} choice(s) saved {saved / 1e3:.2f} ms over the run, less than routing"
                   f" its {calls.get(kind, 0)} calls costs ({each:.1f} us each: {cost / 1e3:.2f} ms)")
            self.log(f"confirm {kind}: {why}: the baseline kept for every problem")
            for v in kept:
                self.verdicts[(v.kind, v.key)] = dataclasses.replace(v, status=DROPPED, reason=why)
        return list(self.verdicts.values())

    @property
    def confirming(self) -> int:
        """Problems still alternating."""
        return len(self.states)


@dataclass
class ConfirmRow:
    """One problem: its cache entry before the confirmation (a grouped shape's first entry), the
    verdict, and the entry written (None: left as it was)."""

    problem: str
    before: CacheEntry | None
    verdict: Verdict
    after: CacheEntry | None = None
    entries: int = 1  # cache entries the verdict covers (a grouped GEMM's: every skew bucket of its shape)


@dataclass
class ConfirmRun:
    """What :func:`confirm_run` did: a row per problem confirmed, how many usable entries were
    not confirmed (``unseen``: never called, or the caller's own choice), the program's exit code."""

    cache: str
    rows: list[ConfirmRow] = field(default_factory=list)
    unseen: int = 0
    exit_code: int = 0
    interrupted: bool = False

    def count(self, status: str) -> int:
        return sum(r.verdict.status == status for r in self.rows)


def apply_verdicts(cache: str | os.PathLike, verdicts: Iterable[Verdict], activation: Any,
                   covers: Mapping[tuple[str, str], list[str]],
                   baselines: Mapping[tuple[str, str], dict[str, Any] | None]) -> list[ConfirmRow]:
    """Write each decided verdict (kept or dropped) into the usable cache entries it covers
    (``covers``: (kind, key) -> entry keys, its dispatch's ``entry_keys``; this device,
    ``activation.versions``): the in-step figure, and for a dropped choice the baseline's
    solution (``baselines``: (kind, baseline name) -> solution). Unconfirmed ones leave
    their entries as they were."""
    store = TuningCache(cache)
    usable: dict[tuple[str, str], CacheEntry] = {}
    entries = store.entries()
    for kind in {e.kind for e in entries}:
        mine = [e for e in entries if e.kind == kind]
        for key, e in store.select(mine, activation.device, activation.versions.get(kind)).items():
            usable[kind, key] = e
    rows, changed = [], []
    for v in verdicts:
        mine = [usable[v.kind, k] for k in covers.get((v.kind, v.key), [v.key]) if (v.kind, k) in usable]
        before = mine[0] if mine else None
        label = (before.label() if before else v.key) + (f" (+{len(mine) - 1} skew buckets)" if len(mine) > 1 else "")
        row = ConfirmRow(label, before, v, entries=len(mine))
        if mine and v.status in (KEPT, DROPPED):
            corrected = [confirmed_entry(e, v.figure(), baselines.get((v.kind, v.baseline))) for e in mine]
            row.after = corrected[0]
            changed += corrected
        rows.append(row)
    store.put_many(changed)
    return rows


def confirm_run(
    cache: str | os.PathLike,
    run: Callable[[Confirmer], int],
    *,
    policy: ConfirmPolicy | None = None,
    clock: Any = None,
    kinds_: Iterable[str] | None = None,
    device_type: str | None = None,
    router_kinds: Any = None,
    log: Callable[[str], None] | None = None,
    busy: float | None = None,
) -> ConfirmRun:
    """Enable ``cache``, confirm its routed choices while ``run(confirmer)`` runs the program (it
    returns the program's exit code; it may stop early once ``confirmer.confirming`` is 0 after
    the first steps), then write the verdicts. Ctrl-C stops the program; what was decided is
    still written. Kept choices must also pay for routing every call of their kind
    (:meth:`Confirmer.routing_pays`, priced on the overrides in place); ``busy``: the GPU's busy
    share of a host-bound step (:class:`Confirmer`)."""
    from primus_perf.runtime.handle import enable

    handle = enable(cache, None, kinds_, device_type=device_type, router_kinds=router_kinds, log=None)
    confirmer = Confirmer(policy, clock, log, busy)
    confirmer.handle = handle  # what a final check in the same run switches
    out = ConfirmRun(str(cache))
    dispatches = [dispatch.of(kind) for kind in handle.routers]  # an idle one's calls too, where they come
    for d in dispatches:
        d.interpose(confirmer)
    try:
        out.exit_code = run(confirmer)
    except KeyboardInterrupt:
        out.interrupted = True
    finally:
        for d in dispatches:
            d.interpose(None)
        confirmer.finish()
        try:
            summary = handle.summary()
            calls = {k: row.get("routed", 0) + row.get("fallback", 0) for k, row in summary.items()}
            verdicts = confirmer.routing_pays(_routing_costs(confirmer, dispatches, handle.device_type), calls)
            covers = {(v.kind, v.key): dispatch.of(v.kind).entry_keys(v.key) for v in verdicts}
            baselines = {(v.kind, v.baseline): dispatch.of(v.kind).baseline_solution(v.baseline) for v in verdicts}
        finally:
            handle.disable()
    out.rows = apply_verdicts(cache, verdicts, handle.activation, covers, baselines)
    usable = sum(len(keys) for keys in handle.activation.keys.values())
    out.unseen = max(0, usable - sum(r.entries for r in out.rows))
    return out


def _routing_costs(confirmer: Confirmer, dispatches: list[Any], device_type: str) -> dict[str, float]:
    """Host us a call of each kind with a kept choice pays for its routing (its dispatch's
    ``cost_probe``, priced on the overrides in place), for the kinds that price it."""
    import torch

    kept = {v.kind for v in confirmer.verdicts.values() if v.kept}
    out = {}
    for d in dispatches:
        probe = d.cost_probe() if d.kind in kept else None
        if probe is not None:
            out[d.kind] = host_cost_us(*probe, torch.device(device_type))
    return out
