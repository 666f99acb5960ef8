"""The step search: a coordinate search over the levers with interaction passes, every
candidate measured in the real step against the incumbent.

The advice: a profile made in a child process, its recommendations that name a lever
(:func:`profile_advice`). Order: the levers the analyzer advised (:class:`Advice`, most saving first), their advised
value first; then the rest in registry order. Where two levers or more have an advised value
they can take, those values run first, before any lever's other values (a short budget gets
the advice's plan; with lanes, the lever's next values beside each). For each lever, each value it can take here is a candidate: the incumbent with
that one key changed (with the lever's companions where the value alone does not fit the
memory estimate); on an ordered lever (the micro-batch), once a value won against another,
not that other nor those beyond it. A candidate runs in blocks of steps interleaved
with the incumbent (``measure.blocks``: one session, switched in place between blocks), judged
by the one rule (``decide.judge``, ``STEP_MARGIN`` of the step, at least two pairs of blocks);
the best kept value of a lever becomes the incumbent's. With lanes (:mod:`.lanes`: a
single-GPU config on a machine with more GPUs), a lever's values run at the same time, one on
the session's GPU and one on each lane's, each against the incumbent on its own GPU.

Interaction: the levers interact and flip sign between settings (FP8 pays only compiled; a
recompute mode pays only where it lets a larger micro-batch fit). After a pass that changed
the incumbent, each lever measured against an older incumbent is measured again (every value
other than the incumbent's, the default included, less an ordered lever's losing side), until
a pass changes nothing, ``passes`` passes ran, or the budget ends. A candidate that does not
fit, cannot run here, or runs out of memory is recorded as such and the search goes on (a
candidate that made the loss non-finite, or whose step raised a library's error, leaves a
fresh trainer of the incumbent behind). Under torchrun, a failure inside a step is one rank's
while the others wait in a collective: it stops the search with one line naming the candidate.

Under torchrun every rank runs the same search (the same switches and steps, in lockstep);
rank 0's times decide, and ``agree`` hands its verdicts to every rank.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primus_perf.base.entry import Log
from primus_perf.base.errors import ConfigError, DivergedError, OutOfMemory, UserError, one_line
from primus_perf.tuner.decide import KEPT, STEP_MARGIN, Rule, judge
from primus_perf.tuner.step import lanes as lanes_mod
from primus_perf.tuner.step.levers import Lever, Setting, TrainerContext, shown, text

# what became of a candidate besides the rule's kept / dropped / unconfirmed
DOES_NOT_FIT, CANNOT_RUN, OUT_OF_MEMORY = "does not fit", "cannot run", "out of memory"
ADVISED = "the advised values"  # the stage before the passes: each advised value first
# A candidate whose memory estimate comes within this fraction of the GPU's memory is not tried.
# Measured on H100s (79.2 GiB): estimates at 97.6% (mixtral-8x7b micro-batch 16) and 98.5%
# (llama3-8b FSDP2 over 2 GPUs, micro-batch 4) ran out of memory; 88.7% (llama3-8b micro-batch 4) ran.
GPU_HEADROOM = 0.05
LANE_TIMEOUT_S = 1800.0  # a lane's trial (blocks of steps, a first compile) answers within this
PROFILE = {"baseline": 1, "wait": 1, "warmup": 1, "steps": 3}  # the profile's window, then it stops


@dataclass(frozen=True)
class Advice:
    """One of the analyzer's recommendations that names a lever's value: its estimated saving
    (ms per step) and its words."""

    key: str
    value: Any  # typed as the lever's values
    estimate_ms: float | None
    text: str = ""


def advised(recommendations: Any, *, script: bool = False) -> list[Advice]:
    """The analyzer's recommendations that name a lever, as ``Advice`` in their rank: each of a
    recommendation's ``settings`` (key -> value as JSON types it), the estimate (ms a step) with
    its first. For primus-train a config key, its value read by the config's schema
    (``train.compile: true`` is ``pointwise``); for a script (``script``) a trainer's key
    (``train.compile``) or a script lever's name (``micro_batch``), its value as the script
    lever takes it (the hooks' text)."""
    from primus_perf.trainer.config import SCHEMA
    from primus_perf.tuner.step.levers import LEVERS, lever_of

    out: list[Advice] = []
    for _, rec in (recommendations.iterrows() if recommendations is not None else ()):
        estimate, settings, action = rec.get("estimated_saving_ms"), rec.get("settings"), str(rec.get("action", ""))
        for i, (key, value) in enumerate(settings.items() if isinstance(settings, dict) else ()):
            est = float(estimate) if i == 0 and estimate is not None and estimate == estimate else None
            lever = lever_of(key) or (LEVERS.get(key) if script else None)
            if lever is None or (script and lever.script is None):
                continue
            if script:
                mine = lever.script.from_trainer(text(value)) if lever.key == key else text(value)
                out += [Advice(lever.name, mine, est, action)] if mine else []
                continue
            try:
                out.append(Advice(key, SCHEMA[key].read(value), est, action))
            except ConfigError:
                continue
    return out


def profile_advice(program: Sequence[str], out: Path, *, env: Mapping[str, str], log_file: Path, timeout_s: float,
                   log: Log, agree: Callable[[Any], Any], is_main: bool) -> list[Advice]:
    """``primus-profile run`` in a child process (``env``), its output appended to ``log_file``:
    ``program`` is ``["--", script, args...]`` (the script stopped after the window, rank 0
    traced) or ``["-c", config, overrides...]`` (the reference trainer); then the analyzer's
    advice on ``out`` (read on the main rank, handed to every rank by ``agree``). A script's
    profile that could not be made is a line, and no advice (the levers go in the registry's
    order); a config's is an error (the search would build the same trainer)."""
    import sys

    from primus_perf.base.errors import Interrupted
    from primus_perf.tuner.step.measured import run_logged, tail

    script = program[0] == "--"
    log(f"profiling {' '.join(program[1:])} (a window of {sum(PROFILE.values())} steps) -> {out}")
    cmd = [sys.executable, "-m", "primus_perf.cli.profile", "run", "-o", str(out), "--overwrite", "--after", "0",
           *(f"--{k}={v}" for k, v in PROFILE.items()), *(("--stop", "--ranks", "0") if script else ()), *program]
    try:
        code = run_logged(cmd, env, log_file, timeout_s)
    except KeyboardInterrupt:
        raise Interrupted(f"during the profile run, before the search; its output: {log_file}") from None
    advice: list[Advice] = []
    if code != 0:
        why = (f"the profile run did not end within {timeout_s / 60:.1f} min" if code is None else
               f"the profile run exited with {code}: {tail(log_file).removeprefix('error: ')}") + f"; its output: {log_file}"
        if not script:
            raise UserError(f"{why} (--no-profile skips the profile)")
        log(f"no profile ({why}): the levers go in the registry's order")
    elif is_main:
        from primus_perf.tracelens.analyze import analyze

        advice = advised(analyze([out]).recommendations, script=script)
        for a in advice:
            log(f"advised: {a.key}={text(a.value)}" + (f" (saves ~{a.estimate_ms:.1f} ms a step)"
                                                     if a.estimate_ms is not None else ""))
    return agree(advice)


@dataclass
class Trial:
    """One candidate against the incumbent of its time."""

    lever: str
    key: str
    value: Any
    changes: dict[str, Any]  # the keys it set (the lever's, and a companion's)
    against: str  # the incumbent's label
    status: str
    incumbent_s: list[float] = field(default_factory=list)  # per block, median step seconds
    candidate_s: list[float] = field(default_factory=list)
    speedup: float | None = None
    low: float | None = None
    high: float | None = None
    threshold: float | None = None
    estimate_ms: float | None = None  # the analyzer's, where it advised this value
    reason: str = ""
    seconds: float = 0.0  # wall time the trial took
    measured_on: str = ""  # the lane that measured it ("": the session's device)

    @property
    def kept(self) -> bool:
        return self.status == KEPT

    @property
    def measured_ms(self) -> float | None:
        """The saving per step (ms): the incumbent's median block minus the candidate's."""
        if not self.incumbent_s or not self.candidate_s:
            return None
        return (statistics.median(self.incumbent_s) - statistics.median(self.candidate_s)) * 1e3

    def label(self) -> str:
        return Setting(self.changes).label()

    def line(self) -> str:
        on = f" (on {self.measured_on})" if self.measured_on else ""
        if self.speedup is None:
            return f"{self.label()}: {self.status}" + (f" ({self.reason})" if self.reason else "") + on
        return (f"{self.label()}: {self.speedup:.3f}x [{self.low:.3f}-{self.high:.3f}] of {self.against}"
                f" ({self.measured_ms:+.2f} ms a step saved; needs > {1 + (self.threshold or 0):.3f}x): {self.status}"
                + on)

    def row(self) -> dict[str, Any]:
        """A row of step_plan.json's ``measured`` (what the analyzer shows beside its advice)."""
        return {"lever": self.key, "value": self.value, "changes": dict(self.changes), "against": self.against,
                "status": self.status, "kept": self.kept, "speedup": self.speedup, "low": self.low,
                "high": self.high, "threshold": self.threshold, "estimate_ms": self.estimate_ms,
                "measured_ms": self.measured_ms, "incumbent_ms": [t * 1e3 for t in self.incumbent_s],
                "candidate_ms": [t * 1e3 for t in self.candidate_s], "reason": self.reason,
                "seconds": round(self.seconds, 1), "measured_on": self.measured_on}


@dataclass
class SearchResult:
    default: Setting
    best: Setting
    trials: list[Trial]
    passes: int
    skipped: dict[str, str]  # lever -> why it does not apply here
    stopped: str = ""  # why the search stopped before it converged (the budget)
    chained: float = 1.0  # Search.chained: the best's rough figure against the default


def _order(levers: Sequence[Lever], advice: Sequence[Advice]) -> list[Lever]:
    advised = [a.key for a in advice]
    rank = {lv.name: (advised.index(lv.key) if lv.key in advised else len(advised) + i)
            for i, lv in enumerate(levers)}
    return sorted(levers, key=lambda lv: rank[lv.name])


def _others(lever: Lever, where: TrainerContext, current: Any, values: Sequence[Any]) -> list[Any]:
    """``values`` less ``current`` and, for an ordered lever, ``current`` spelled otherwise (a
    script's "" as written and its own value, "2")."""
    return [v for v in values if v != current and (
        lever.scale is None or lever.scale(where, v) != lever.scale(where, current))]


def _advised(lever: Lever, where: TrainerContext, current: Any, advice: Sequence[Advice]) -> list[Any]:
    """The lever's first advised value it can take here, other than ``current``, if any (a list
    of at most one)."""
    values = _others(lever, where, current, lever.values(where))
    return [a.value for a in advice if a.key == lever.key and a.value in values][:1]


def _values(lever: Lever, where: TrainerContext, current: Any, advice: Sequence[Advice]) -> list[Any]:
    first = _advised(lever, where, current, advice)
    return first + [v for v in lever.values(where) if v != current and v not in first]


def _best(kept: Sequence[Trial]) -> Trial:
    return max(kept, key=lambda t: t.speedup or 0.0)


class Search:
    def __init__(self, session: Any, levers: Sequence[Lever], where: TrainerContext, *, advice: Sequence[Advice] = (),
                 blocks: int = 2, block_steps: int = 2, settle: int = 1, passes: int = 3,
                 deadline: float = float("inf"), reserve_steps: int = 0, reserve_s: float = 0.0,
                 first_trial_s: float = 0.0, log: Log = lambda _m: None,
                 agree: Callable[[Any], Any] = lambda x: x, fits: Callable[[Setting], str | None] | None = None,
                 lanes: Sequence[Any] = (), distributed: bool = False) -> None:
        self.session, self.where, self.advice = session, where, list(advice)
        self.distributed = distributed  # under torchrun: a failure inside a step stops the search
        self.lanes = list(lanes)  # other GPUs measuring candidates at the same time (.lanes)
        self.levers = _order(levers, advice)
        self.blocks, self.block_steps, self.settle, self.passes = blocks, block_steps, settle, passes
        self.deadline, self.reserve_steps = deadline, reserve_steps
        self.reserve_s = reserve_s  # kept back besides the steps (the loss guard's trainer builds)
        self.first_trial_s = first_trial_s  # what a trial takes before one ran, start-ups included (a script's runs)
        self.log, self.agree = log, agree
        self.fits = fits or self._fits
        self.trials: list[Trial] = []
        self._default = Setting()
        self.chosen: list[Trial] = []  # the trials that changed the incumbent
        self.step_s: float | None = None  # the incumbent's latest median step
        self.incumbent = Setting()  # the best so far (run() starts it at the start setting)
        self._version = 0  # how many times the incumbent changed
        self._tried: dict[tuple[str, Any], int] = {}  # (lever, value) -> the version it was measured against
        self._won: dict[str, list[tuple[Any, Any]]] = {}  # ordered lever -> (incumbent's value, value kept over it)
        self._said: set[tuple[str, Any]] = set()  # (lever, value) an ordered lever's line named as not measured

    # ---- one candidate ---------------------------------------------------------------------

    def _fits(self, setting: Setting) -> str | None:
        """Why ``setting`` is not tried: the trainer's own memory rule, and on a GPU an estimate
        within :data:`GPU_HEADROOM` of its memory (a trial that runs out costs as much as one that
        runs, and under torchrun a fresh trainer besides)."""
        from primus_perf.trainer.resources import check_fits, device_memory, estimate_memory

        cfg = self.session.cfg_of(setting)
        try:
            check_fits(cfg, self.where.device_type)
        except ConfigError as exc:
            return str(exc)
        if self.where.device_type == "cuda":
            need = estimate_memory(cfg, "cuda")
            have, where = device_memory("cuda")
            if need.total > (1 - GPU_HEADROOM) * have:
                return (f"the config needs {need.line()}, within {GPU_HEADROOM:.0%} of {where} ({have / 2**30:,.1f}"
                        " GiB): the allocator's fragmentation takes that")
        return None

    def trial_cost_s(self) -> float:
        """About what a trial takes: its steps at the incumbent's pace, plus switching."""
        steps = 2 * self.blocks * (self.settle + self.block_steps)
        spent = [t.seconds for t in self.trials if t.candidate_s]
        return max(steps * (self.step_s or 0.0), max(spent[-3:], default=self.first_trial_s))

    def reserve(self) -> float:
        """The seconds kept back for the plan's final measurement and loss guard."""
        return self.reserve_steps * (self.step_s or 0.0) + self.reserve_s

    def over_budget(self, trials: int = 1) -> bool:
        """Whether ``trials`` more would leave too little for what is kept back."""
        return bool(self.agree(time.monotonic() + trials * self.trial_cost_s() + self.reserve() > self.deadline))

    def out_of_budget(self, stage: str, lever: Lever, value: Any) -> str:
        """Why the search stops here: where it was, and before any trial what a trial and the
        final measurement take (what the budget would need)."""
        where = f"in {stage}, at {lever.name}={shown(value)}"
        if self.trials:
            return f"the budget ran out {where}"
        left = max(0.0, self.deadline - time.monotonic())
        trial, reserve = self.trial_cost_s(), self.reserve()
        if trial <= 0.0:  # nothing to go by yet
            return f"the budget ran out before any trial ({left / 60:.1f} min left {where})"
        more = max(1, math.ceil((4 * trial + reserve - left) / 60))
        return (f"the budget left no time for one trial ({left / 60:.1f} min left {where}; a trial takes about "
                f"{trial / 60:.1f} min and the plan's final measurement keeps {reserve / 60:.1f} min back): "
                f"raising --budget-min by about {more} min allows four trials")

    def _changes(self, lever: Lever, incumbent: Setting, value: Any) -> tuple[dict[str, Any], str | None]:
        """The keys a candidate sets (the lever's, with a companion where the value alone does
        not fit the memory estimate), and why it does not fit (None: it does)."""
        changes = {lever.key: value}
        why = self.fits(incumbent.with_(changes))
        if why is not None:
            for extra in lever.companions:
                if all(incumbent.values.get(k) != v for k, v in extra.items()) and self.fits(
                        incumbent.with_({**changes, **extra})) is None:
                    return {**changes, **extra}, None
        return changes, why

    def _trial(self, lever: str, key: str, value: Any, incumbent: Setting, changes: dict[str, Any]) -> Trial:
        return Trial(lever, key, value, changes, incumbent.label(self._default.values), DOES_NOT_FIT,
                     estimate_ms=next((a.estimate_ms for a in self.advice if (a.key, a.value) == (key, value)), None))

    def _judge(self, trial: Trial, incumbent_s: list[float], candidate_s: list[float]) -> None:
        trial.incumbent_s, trial.candidate_s = incumbent_s, candidate_s
        v = judge(list(zip(trial.incumbent_s, trial.candidate_s)), Rule(margin=STEP_MARGIN, least=2),
                  choice=trial.label(), baseline=trial.against)
        trial.status, trial.speedup, trial.low, trial.high, trial.threshold = (
            v.status, v.speedup, v.low, v.high, v.threshold)
        self.step_s = statistics.median(trial.incumbent_s)

    def measure_batch(self, lever: Lever, incumbent: Setting, values: Sequence[Any]) -> list[Trial]:
        """``values`` of one lever against ``incumbent``: with lanes, the first that fits on the
        session and the others each on a lane, at the same time; in ``values``' order."""
        plans = [(v, *self._changes(lever, incumbent, v)) for v in values]
        runnable = [(v, ch) for v, ch, why in plans if why is None]
        sent: dict[Any, tuple[Any, dict[str, Any], float]] = {}
        for lane, (v, ch) in zip(list(self.lanes), runnable[1:]):
            try:
                lane.submit(incumbent.values, incumbent.with_(ch).values, self.blocks, self.block_steps, self.settle)
            except OSError:
                self._drop(lane, "its pipe closed")
                continue
            sent[v] = (lane, ch, time.monotonic())
        trials = {v: self.measure_changes(lever.name, lever.key, v, incumbent, ch, why)
                  for v, ch, why in plans if v not in sent}
        for v, (lane, ch, t0) in sent.items():
            # past the budget by 5 minutes, a lane that has not answered is taken for broken
            status, payload = lane.result(timeout_s=min(LANE_TIMEOUT_S, max(120.0, self.deadline - time.monotonic()
                                                                                 + 300.0)))
            if status == lanes_mod.BROKEN:
                self._drop(lane, str(payload))
                trials[v] = self.measure_changes(lever.name, lever.key, v, incumbent, ch)
                continue
            trial = self._trial(lever.name, lever.key, v, incumbent, ch)
            if status == lanes_mod.OK:
                self._judge(trial, *payload)
            else:
                trial.status = OUT_OF_MEMORY if status == lanes_mod.OOM else CANNOT_RUN
                trial.reason = str(payload)
            trial.measured_on = lane.name
            trial.seconds = time.monotonic() - t0
            trials[v] = trial
        return [trials[v] for v in values]

    def stop_under_torchrun(self, label: str, exc: BaseException) -> None:
        """Under torchrun a failure inside a step other than running out of memory is one
        rank's: the others wait in a collective that never comes, so it stops the search
        (torchrun ends every rank) with one line."""
        if self.distributed:
            raise UserError(f"{label} failed on this rank ({one_line(exc)}); under torchrun that stops the search on "
                            "every rank: leave its lever out (--levers) and run again") from exc

    def out_of_memory(self, setting: Setting) -> None:
        """Back to ``setting`` after a step ran out of memory. Under torchrun every rank of a
        symmetric layout (FSDP2, data parallel) runs out at the same allocation of the same step
        (measured: both ranks of an FSDP2 run at step 45): the ranks meet in one broadcast, then
        each builds a fresh trainer from the seed (FSDP2's state, stopped inside a step, is not
        trusted). A rank alone out of memory leaves the others in a collective until the process
        group's timeout ends them."""
        if self.distributed:
            self.agree(OUT_OF_MEMORY)
            self.session.reset(setting)
        else:
            self.session.recover(setting)

    def _drop(self, lane: Any, why: str) -> None:
        self.lanes.remove(lane)
        lane.close()
        self.log(f"{lane.name} left the search ({why.strip().splitlines()[-1] if why.strip() else '?'}); "
                 f"{len(self.lanes) + 1} GPU(s) measure on")

    def measure_changes(self, lever: str, key: str, value: Any, incumbent: Setting, changes: dict[str, Any],
                        why: str | None = None) -> Trial:
        """``incumbent`` with ``changes`` against ``incumbent`` (``why``: it does not fit)."""
        trial = self._trial(lever, key, value, incumbent, changes)
        if why is not None:
            trial.reason = why
            return trial
        candidate = incumbent.with_(changes)
        t0 = time.monotonic()
        back: Callable[[Setting], None] | None = None  # how the session gets back to the incumbent
        try:
            times = self.session.measure(incumbent, candidate, blocks=self.blocks, block_steps=self.block_steps,
                                         settle=self.settle)
        except OutOfMemory as exc:
            trial.status, trial.reason = OUT_OF_MEMORY, str(exc)
            back = self.out_of_memory
        except DivergedError as exc:  # the weights are non-finite now: a fresh trainer from the seed
            self.stop_under_torchrun(trial.label(), exc)
            trial.status, trial.reason = CANNOT_RUN, str(exc)
            back = self.session.reset
        except UserError as exc:  # the trainer cannot run it here (the same answer on every rank)
            trial.status, trial.reason = CANNOT_RUN, str(exc)
            back = self.session.recover
        except Exception as exc:  # a library's error in the step: recorded, the search goes on
            self.stop_under_torchrun(trial.label(), exc)
            trial.status = CANNOT_RUN
            trial.reason = one_line(exc)
            back = self.session.reset
        else:
            self._judge(trial, *self.agree(times))
        if back is not None:
            # after the except block: the error's traceback held the failed step's frames and,
            # through them, its tensors (seen on H100s: the trial after an out-of-memory one ran
            # out at 74 GiB with an estimate of 36)
            back(incumbent)
        trial.seconds = time.monotonic() - t0
        return trial

    # ---- the search ----------------------------------------------------------------------------

    def run(self, start: Setting) -> SearchResult:
        self._default = self.incumbent = start
        skipped = {lv.name: why for lv in self.levers if (why := lv.legal(self.where)) is not None}
        levers = [lv for lv in self.levers if lv.name not in skipped]
        for name, why in skipped.items():
            self.log(f"{name}: not here ({why})")
        self._version, self._tried, self._won, self._said = 0, {}, {}, set()
        measured_at: dict[str, int] = {}  # lever -> the incumbent version it was last measured against
        stopped, passes = "", 0
        advised = [(lv, v) for lv in levers for v in _advised(lv, self.where, start.values[lv.key], self.advice)]
        if len(advised) > 1:  # each advised value first, the levers' other values after
            self.log(f"the advised values first: {', '.join(f'{lv.name}={shown(v)}' for lv, v in advised)}")
            for lever, value in advised:  # with lanes, the lever's next values beside it
                values = _values(lever, self.where, self.incumbent.values[lever.key], self.advice)
                if value in values and (stopped := self._lever(lever, values[:1 + len(self.lanes)], ADVISED)):
                    break
        while not stopped and passes < self.passes:
            passes, before = passes + 1, self._version
            for lever in levers:
                if measured_at.get(lever.name, -1) == self._version:
                    continue  # measured against this incumbent already
                values = _values(lever, self.where, self.incumbent.values[lever.key], self.advice)
                stopped = self._lever(lever, values, f"pass {passes}")
                measured_at[lever.name] = self._version
                if stopped:
                    break
            if self._version == before:
                break
        self.session.switch(self.incumbent)
        return SearchResult(start, self.incumbent, self.trials, passes, skipped, stopped, self.chained())

    def _lever(self, lever: Lever, values: list[Any], stage: str) -> str:
        """``values`` of ``lever`` against the incumbent (those measured against it already, an
        ordered lever's incumbent value spelled otherwise, and its losing side, left out); the
        best kept one becomes the incumbent's.
        Why the budget stopped it ("": it did not)."""
        current, incumbent, version = self.incumbent.values[lever.key], self.incumbent, self._version
        values = [v for v in _others(lever, self.where, current, values) if self._tried.get((lever.name, v)) != version]
        values = self._same_side(lever, values, [])
        kept: list[Trial] = []
        stopped = ""
        while values:
            if self.over_budget():
                stopped = self.out_of_budget(stage, lever, values[0])
                break
            batch, values = values[:1 + len(self.lanes)], values[1 + len(self.lanes):]
            for trial in self.measure_batch(lever, incumbent, batch):
                self.trials.append(trial)
                self.log(f"({'advised' if stage == ADVISED else stage}) {trial.line()}")
                self._tried[(lever.name, trial.value)] = version
                if trial.kept:
                    kept.append(trial)
            values = self._same_side(lever, values, [(current, _best(kept).value)] if kept else [])
        if kept:  # also where the budget ran out inside the lever: what it measured stands
            best = _best(kept)
            self._won.setdefault(lever.name, []).append((current, best.value))  # the visit's best: one side
            self.incumbent = incumbent.with_(best.changes)
            self.chosen.append(best)
            self.step_s = statistics.median(best.candidate_s)
            self._version += 1
            self.log(f"best so far: {self.incumbent.label(self._default.values)}, about {self.chained():.2f}x the"
                     " default (the kept speedups multiplied, each against the best before it)")
        return stopped

    def _same_side(self, lever: Lever, values: list[Any], visit: list[tuple[Any, Any]]) -> list[Any]:
        """``values`` less those an ordered lever's (``Lever.scale``) wins rule out (each visit's
        best over the incumbent of its time, and ``visit``'s so far), newly left out ones said in
        one line: the step is taken to be unimodal along it, so once a value won against the
        incumbent's, the incumbent's and those beyond it on the other side are not measured in
        this search (a larger micro-batch that wins leaves the smaller ones out)."""
        won = [*self._won.get(lever.name, []), *visit]
        if lever.scale is None or not won or not values:
            return values

        def scale(v: Any) -> float:
            return lever.scale(self.where, v)

        def said(v: Any) -> str:  # a script's "": its own value, as written
            return text(v) or f"{scale(v):g} {shown(v)}"

        out = {v: (w, c) for v in values for c, w in won if scale(w) != scale(c)  # a script's "" and its own value
               and (scale(v) == scale(c) or (scale(v) > scale(c)) != (scale(w) > scale(c)))}
        new = {v: wc for v, wc in out.items() if (lever.name, v) not in self._said}
        if new:
            self._said.update((lever.name, v) for v in new)
            why = "; ".join(dict.fromkeys(f"{said(w)} won against {said(c)}" for w, c in new.values()))
            self.log(f"{lever.name}: {', '.join(said(v) for v in new)} not measured ({why}: the step is"
                     f" taken to be unimodal in {lever.name})")
        return [v for v in values if v not in out]

    def chained(self) -> float:
        """The speedups of the trials that changed the incumbent, multiplied: a rough figure of
        the incumbent against the default, each factor measured against the incumbent before it
        (the plan's own measurement against the default, interleaved, is the one that counts)."""
        chain = 1.0
        for t in self.chosen:
            chain *= t.speedup or 1.0
        return chain
