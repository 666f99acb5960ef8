"""The step tuner for a user's script: ``primus-tune step --out DIR -- train.py ARGS``, the
script unmodified.

1. the script profiled (``primus-profile run --stop``: a window of its steps, in a child) into
   ``DIR``, and analyzed: the advice that names a lever orders the search (``search.profile_advice``);
2. its first measured run (``measured.run_script``: the plan applied from outside by
   ``hooks``, or by a known program's own flags, ``own_flags``; its own steps timed) says what
   it builds (the model, its blocks, the optimizer, FSDP2 or DDP, an HF Trainer, the knobs it
   asked for, a known program's settings): :class:`~.levers.ScriptContext`, which says which
   levers apply here and their values;
3. the search (``search.Search``, as for the trainer) over the levers' script parts, each
   candidate a run of the script against runs of the incumbent: :meth:`ScriptSession.measure`
   runs incumbent, candidate, incumbent, ... on the same GPUs and pairs each candidate run with
   the incumbent runs on both sides of it (the last incumbent run opens the next trial's
   chain); judged by the one rule. A one-GPU script on a machine with more GPUs measures a
   lever's values at once, one chain on each GPU (:class:`ScriptLane`);
4. the plan against the default, ``final_blocks`` chains; the loss guard from those runs (the
   default's runs give its own spread; the plan passes within it plus the FP8 rule);
5. ``DIR/plan.yaml`` (``python -m primus_perf.launch --plan DIR/plan.yaml -- train.py ARGS``
   runs it) and ``DIR/step_plan.json`` (every run and trial; the analyzer shows the measured
   rows beside its advice).

Under torchrun every rank runs this, in lockstep over a CPU process group of their own: each
rank starts its child of each run (the children meet on a port rank 0 picks) and rank 0's
figures decide.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primus_perf.base.entry import Log
from primus_perf.base.errors import OutOfMemory, UserError
from primus_perf.tuner.step import lanes as lane_replies
from primus_perf.tuner.step import measured
from primus_perf.tuner.step.levers import Lever, ScriptContext, Setting, script_levers
from primus_perf.tuner.step.search import Advice, Search, SearchResult, profile_advice
from primus_perf.tuner.step.tune import (
    LossGuard,
    StepTuneResult,
    checked_plan,
    plan_verdict,
    rank0s,
    write_plan,
)


def _labels(setting: Setting) -> dict[str, str]:
    """A setting as a plan: the levers set (those at the program's own choice, "", left out)."""
    return {k: v for k, v in setting.values.items() if v != ""}


@dataclass
class Run:
    """One measured run: its setting's plan, its result, where it ran."""

    plan: dict[str, str]
    result: measured.RunResult
    devices: str | None

    def row(self) -> dict[str, Any]:
        r = self.result
        return {"plan": dict(self.plan), "status": r.status, "median_ms": r.median_s * 1e3 if r.median_s else None,
                "step_ms": [t * 1e3 for t in r.step_s], "loss_sum": r.loss_sum, "loss_mean": r.loss_mean,
                "reason": r.reason, "peak_gib": r.peak_gib, "seconds": round(r.seconds, 1), "devices": self.devices,
                "notes": r.applied.get("notes", [])}


class ScriptSession:
    """The search's session for a script (module docstring, step 3): ``switch`` only records
    the setting (each run starts from the script); :meth:`measure` runs chains."""

    def __init__(self, target: Sequence[str], *, warmup: int, steps: int, devices: str | None = None,
                 agree: Callable[[Any], Any] = lambda x: x, distributed: bool = False, log_file: Path | None = None,
                 timeout_s: float = 1800.0) -> None:
        self.target = list(target)
        self.warmup, self.steps = warmup, steps
        self.devices, self.agree, self.distributed = devices, agree, distributed
        self.log_file, self.timeout_s = log_file, timeout_s
        self.setting = Setting()
        self.runs: list[Run] = []
        self._last: tuple[dict[str, str], float] | None = None  # the last run, of the incumbent: (plan, seconds)

    # ---- what the search calls --------------------------------------------------------------

    def value(self, key: str) -> str:
        return self.setting.values.get(key, "")

    def switch(self, setting: Setting) -> None:
        self.setting = setting

    recover = reset = switch

    def close(self) -> None:
        pass

    def run(self, setting: Setting) -> measured.RunResult:
        """One measured run of ``setting`` (every rank its child; rank 0's result)."""
        plan = _labels(setting)
        port = self.agree(measured._free_port()) if self.distributed else None
        result = measured.run_script(self.target, plan, warmup=self.warmup, steps=self.steps, devices=self.devices,
                                     port=port, timeout_s=self.timeout_s, log_file=self.log_file)
        result = self.agree(result)
        self.runs.append(Run(plan, result, self.devices))
        return result

    def seconds(self, setting: Setting, *, reuse: bool = False) -> float:
        """The median step seconds of a run of ``setting`` (``reuse``: the last run's where it was
        of this setting); OutOfMemory or UserError where the run could not be measured."""
        plan = _labels(setting)
        if reuse and self._last is not None and self._last[0] == plan:
            return self._last[1]
        result = self.run(setting)
        name = " ".join(f"{k}={v}" for k, v in plan.items()) or "the script as it is"
        if result.status == measured.OUT_OF_MEMORY:
            raise OutOfMemory(f"{name}: {result.reason}")
        if result.status != measured.OK or result.median_s is None:
            raise UserError(f"{name}: {result.status} ({result.reason})")
        self._last = (plan, result.median_s)
        return result.median_s

    def measure(self, base: Setting, other: Setting, *, blocks: int, block_steps: int,
                settle: int) -> tuple[list[float], list[float]]:
        """``blocks`` runs of ``other`` between runs of ``base`` (base, other, base, ...; the
        first base run the last one where it was of ``base``): per candidate run two pairs, one
        with the base run on each side. ``block_steps`` and ``settle`` are the session's own
        (each run's timed and warm-up steps)."""
        before = self.seconds(base, reuse=True)
        base_s, other_s = [], []
        for _ in range(blocks):
            mine = self.seconds(other)
            after = self.seconds(base)
            base_s += [before, after]
            other_s += [mine, mine]
            before = after
        return base_s, other_s


class ScriptLane:
    """Another GPU measuring a lever's value at the same time as the session (``search``'s
    lanes): a session of its own on that GPU, its chain in a thread."""

    def __init__(self, index: int, devices: str, target: Sequence[str], *, warmup: int, steps: int,
                 log_file: Path | None, timeout_s: float) -> None:
        self.name = f"GPU {devices}"
        self.session = ScriptSession(target, warmup=warmup, steps=steps, devices=devices, log_file=log_file,
                                     timeout_s=timeout_s)
        self._thread: threading.Thread | None = None
        self._reply: tuple[str, Any] | None = None

    def submit(self, incumbent: dict[str, str], candidate: dict[str, str], blocks: int, block_steps: int,
               settle: int) -> None:
        def work() -> None:
            try:
                times = self.session.measure(Setting(dict(incumbent)), Setting(dict(candidate)), blocks=blocks,
                                             block_steps=block_steps, settle=settle)
                self._reply = (lane_replies.OK, times)
            except OutOfMemory as exc:
                self._reply = (lane_replies.OOM, str(exc))
            except UserError as exc:
                self._reply = (lane_replies.USER_ERROR, str(exc))
            except Exception as exc:  # a failure of the lane itself
                self._reply = (lane_replies.BROKEN, f"{type(exc).__name__}: {exc}")

        self._reply = None
        self._thread = threading.Thread(target=work, name=f"primus-perf-{self.name}", daemon=True)
        self._thread.start()

    def result(self, timeout_s: float) -> tuple[str, Any]:
        assert self._thread is not None
        self._thread.join(timeout_s)
        if self._thread.is_alive() or self._reply is None:
            return lane_replies.BROKEN, f"no answer within {timeout_s:.0f} s"
        return self._reply

    def close(self) -> None:
        pass


# ---- the whole ------------------------------------------------------------------------------------


@dataclass
class ScriptTuneResult(StepTuneResult):
    """``StepTuneResult`` of a script: its runs too."""

    runs: list[Run] = field(default_factory=list)
    where: dict[str, Any] = field(default_factory=dict)
    program: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(program=self.program, runs=[r.row() for r in self.runs], found=self.where)
        return out


def _knob_label(name: str, knob: dict[str, Any]) -> str:
    """``micro_batch=2 of 1, 2, 4, 8 (torchtitan)``: a knob, its value now, its legal values."""
    choices = f" of {', '.join(map(str, knob['choices']))}" if knob.get("choices") else ""
    return f"{name}={knob.get('default')}{choices}" + (f" ({knob['via']})" if knob.get("via") else "")


def script_where(first: measured.RunResult, cache: str | None) -> ScriptContext:
    from primus_perf.tuner.step.own_flags import own_values

    found = dict(first.applied.get("found", {}))
    return ScriptContext(found, dict(first.applied.get("knobs", {})), "cpu" if found.get("device") == "cpu" else "cuda",
                       cache, bool(found.get("fp8_formats")), bool(found.get("torchao")), own_values(found))


def loss_of(runs: Sequence[measured.RunResult], stat: str) -> float | None:
    """The mean loss of ``runs``' timed steps under ``stat`` ("loss_sum" or "loss_mean")."""
    values = [v for r in runs for v in getattr(r, stat) if v is not None]
    return statistics.fmean(values) if values else None


def script_guard(default: Sequence[measured.RunResult], plan: Sequence[measured.RunResult],
                 threshold: float) -> LossGuard | None:
    """The plan's runs' loss against the default's runs': the statistic (the step's backward
    scalars summed, or their mean) on which they agree best; the default's farthest run from its
    mean gives its spread. None where the script's steps gave no loss."""
    best: LossGuard | None = None
    for stat in ("loss_sum", "loss_mean"):
        d, p = loss_of(default, stat), loss_of(plan, stat)
        if d is None or p is None:
            continue
        per_run = [x for x in (loss_of([r], stat) for r in default) if x is not None]
        other = max(per_run, key=lambda x: abs(x - d)) if len(per_run) > 1 else None
        guard = LossGuard(len(default[0].step_s) if default else 0, len(default[0].step_s) if default else 0, d, p,
                          threshold, other, "the default's farthest run")
        if best is None or guard.rel_diff < best.rel_diff:
            best = guard
    return best


def tune_script(target: Sequence[str], out: str | Path, *, levers: Sequence[Lever] | None = None,
                cache: str | None = None, budget_min: float = 20.0, warmup: int = 4, steps: int = 8,
                blocks: int = 1, final_blocks: int = 3, passes: int = 2, threshold: float | None = None,
                profile: bool = True, lanes: Sequence[str] = (), devices: str | None = None,
                log: Log = lambda _m: None, agree: Callable[[Any], Any] = lambda x: x,
                distributed: bool = False, is_main: bool = True, timeout_s: float = 1800.0) -> ScriptTuneResult:
    """Search ``target``'s step (module docstring) within ``budget_min`` minutes and write the
    plan to ``out``. ``warmup``, ``steps``: each run's untimed and timed steps; ``lanes``: other
    GPUs' CUDA_VISIBLE_DEVICES for a one-GPU script; ``devices``: the session's."""
    from primus_perf.tuner.fp8 import LOSS_THRESHOLD

    t0 = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = out / "runs.log"
    threshold = LOSS_THRESHOLD if threshold is None else threshold
    levers = script_levers() if levers is None else list(levers)
    label = " ".join(target)
    advice: list[Advice] = []
    if profile:
        port = agree(measured._free_port()) if distributed else None
        advice = profile_advice(["--", *target], out, env=measured.child_env(devices, port, target), log_file=log_file,
                                timeout_s=timeout_s, log=log, agree=agree, is_main=is_main)
    session = ScriptSession(target, warmup=warmup, steps=steps, devices=devices, agree=agree,
                            distributed=distributed, log_file=log_file, timeout_s=timeout_s)
    start = Setting({lv.key: "" for lv in levers})
    session.switch(start)
    log(f"measuring the script as it is ({warmup} warm-up and {steps} timed steps a run)")
    first = session.run(start)
    if first.status != measured.OK:
        raise UserError(f"the script as it is could not be measured: {first.status} ({first.reason}); its output: {log_file}")
    session._last = ({}, first.median_s)
    where = script_where(first, cache)
    found = where.found
    log(f"found: {found.get('model') or 'no model'} ({found.get('params', 0) / 1e6:,.1f} M parameters, "
        f"{found.get('blocks', 0)} blocks of {found.get('block') or '-'}), optimizer {found.get('optimizer') or '-'}"
        + (f", its {'model' if found['compiled'] == 'model' else 'blocks'} compiled by the program"
           if found.get("compiled") else "") + (f", its blocks recomputed ({found['recompute']})" if found.get("recompute") else "")
        + (", FSDP2" if found.get("fsdp2") else "") + (", DDP" if found.get("ddp") else "")
        + (", HF Trainer" if found.get("hf_trainer") else "")
        + (f"; {found['program']}, its own flags now: " + " ".join(f"{k}={v}" for k, v in found.get("own", {}).items())
           if found.get("program") else "")
        + (f"; knobs asked: {', '.join(_knob_label(k, v) for k, v in where.knobs.items())}" if where.knobs
           else "; no knob asked")
        + f"; {first.median_s * 1e3:.1f} ms a step")
    running = [ScriptLane(i, d, target, warmup=warmup, steps=steps, log_file=log_file, timeout_s=timeout_s)
               for i, d in enumerate(lanes)] if not distributed else []
    if running:
        log(f"measuring on {len(running) + 1} GPUs at once: the session's and " + ", ".join(r.name for r in running))
    search = Search(session, levers, where, advice=advice, blocks=blocks, block_steps=steps, settle=warmup,
                    passes=passes, deadline=t0 + budget_min * 60, reserve_s=(2 * final_blocks + 1) * first.seconds,
                    first_trial_s=2 * blocks * first.seconds, log=log, agree=agree, fits=lambda _s: None, lanes=running, distributed=distributed)
    found_plan: SearchResult = search.run(start)
    for lane in running:
        session.runs += lane.session.runs
    plan = found_plan.best
    result = ScriptTuneResult(label, [], found_plan, Setting(), None, device=str(found.get("device", "")),
                              where=found, program=list(target))
    if plan.values != start.values:
        log(f"the plan against the default: {final_blocks} runs of it between runs of the default")
        result.default_s, result.plan_s = session.measure(start, plan, blocks=final_blocks, block_steps=steps,
                                                         settle=warmup)
        result.verdict = plan_verdict(result.default_s, result.plan_s)
        last = session.runs[-(2 * final_blocks + 1):]  # the default's and the plan's runs just made: their loss
        defaults = [r.result for r in last if r.plan == _labels(start)]
        plans = [r.result for r in last if r.plan == _labels(plan)]
        plan = checked_plan(result, start, plan, log=log, guard=lambda: script_guard(defaults, plans, threshold),
                            measure=lambda kept: session.measure(start, kept, blocks=final_blocks, block_steps=steps,
                                                                 settle=warmup))
    result.plan = Setting(_labels(Setting({k: v for k, v in plan.values.items() if v != start.values.get(k)})))
    result.runs = list(session.runs)
    result.minutes = (time.monotonic() - t0) / 60
    if is_main:
        result.out = out
        write_plan(out, result, program=list(target))
    return result


def tune_program(target: Sequence[str], out: str | Path, *, lanes: int = 0, log: Log = lambda _m: None,
                 **kwargs: Any) -> ScriptTuneResult:
    """:func:`tune_script` as ``primus-tune step -- script.py`` runs it: under torchrun every
    rank in lockstep over a CPU (gloo) process group of their own, rank 0 speaking and writing;
    otherwise the script on the first GPU and, with ``lanes`` (0: every GPU visible, 1: one),
    a lane on each other GPU. This process never starts CUDA: the runs' children hold the GPUs."""
    from primus_perf.base import environment

    if environment.get("WORLD_SIZE") > 1:
        from primus_perf.trainer.parallel import torchrun_job

        with torchrun_job(cuda=False) as main:
            return tune_script(target, out, log=log if main else (lambda _m: None), agree=rank0s, distributed=True,
                               is_main=main, **kwargs)
    import torch

    from primus_perf.tuner.step.lanes import visible_devices

    count = torch.cuda.device_count()  # NVML: no CUDA context in this process
    gpus = visible_devices(count) if count else []
    wanted = count if lanes == 0 else min(lanes, count)
    return tune_script(target, out, log=log, devices=gpus[0] if gpus else None, lanes=gpus[1:max(1, wanted)],
                       **kwargs)
