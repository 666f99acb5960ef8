"""The main job in one call: the loop the toolkit closes.

1. train a preset under the profiler (``profiler.capture.capture_trainer``): a trace and a
   manifest in ``OUT/profile``;
2. analyze the trace (``tracelens.analyze``) and write the HTML report (``OUT/report.html``);
3. on a GPU, tune the trace's problems of every kind (``tuner.kinds.tune``) into
   ``OUT/tuning_cache.json``;
4. on a GPU, confirm the choices inside real steps (:func:`confirm_trainer`): each routed
   problem's choice (GEMM, grouped GEMM, attention with its backward) against the baseline,
   alternating calls; the cache keeps only the choices that win where they run (in a
   host-bound step, ``decide.host_bound``, with their host time counted);
5. on a GPU, the final check (:func:`check_cache`, ``tuner.final_check``): one trainer, blocks
   of steps with the cache's routers on and off in turn (interleaved, so both sides see the
   same clocks, memory and data); a cache that does not win the step past the noise loses the
   kinds that do not win it alone, down to none ("1.00x: torch's own kernels kept").

On a machine without a GPU the loop stops after the report and says why: tuning measures
GPU kernels. Everything the CLI prints comes from the returned :class:`LoopResult`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primus_perf.base.devices import gpu_vendor
from primus_perf.tuner.decide import host_bound

Say = Callable[[str], None]


@dataclass
class SpeedupMeasurement:
    """Step times of one trainer with the cache's routers off (default) and on (tuned)."""

    default_s: list[float]
    tuned_s: list[float]
    routed_calls: int
    fallback_calls: int
    loss_default: float  # one batch's loss, the same weights and data, with the routers off
    loss_tuned: float  # and on

    LOSS_TOLERANCE = 1e-2  # relative: bf16 GEMMs that sum in another order, not a wrong kernel

    @property
    def losses_match(self) -> bool:
        d, t = self.loss_default, self.loss_tuned
        return math.isfinite(t) and abs(d - t) <= self.LOSS_TOLERANCE * max(abs(d), 1e-6)

    @property
    def speedup(self) -> float:
        return statistics.median(self.default_s) / statistics.median(self.tuned_s)

    def spread(self, side: str) -> tuple[float, float]:
        values = self.default_s if side == "default" else self.tuned_s
        return min(values), max(values)


@dataclass
class LoopResult:
    out_dir: Path
    run_dir: Path
    report: Path
    device: str
    step_time_s: float | None  # the profiled steps' median step time (GPU; on a CPU run the host's)
    problems: dict[str, int]  # kind -> unique problems of the trace (attention: fwd + bwd is one)
    notes: list[str] = field(default_factory=list)
    tuning_skipped: str | None = None  # why the loop stopped after the report
    tune_run: Any = None  # tuner.core.TuneRun
    cache: Path | None = None
    measurement: SpeedupMeasurement | None = None  # of the cache the final check kept (None: nothing kept)
    fp8: Any = None  # tuner.fp8.Fp8TuneResult (with fp8=True)
    confirmation: Any = None  # tuner.confirm.ConfirmRun: the choices checked inside the steps
    final: Any = None  # tuner.final_check.FinalCheck: the step with the cache against without
    host_bound: float | None = None  # the GPU's busy share of a host-bound profiled step
    step: Any = None  # tuner.step.StepTuneResult (with step=True)


def _host_step(analysis: Any) -> float | None:
    """The median wall-clock time of the profiled steps (a CPU run has no GPU step)."""
    walls = analysis.wall_steps
    return float(walls["wall_s"].median()) if len(walls) else None


def trace_problems(analysis: Any) -> list[Any]:
    """The trace's problems of every kind in the order of its problems file
    (``tracelens.shapes.ranked_problems``: most expensive first, an attention problem's
    forward and backward as one item), each once (a GEMM may be listed per direction)."""
    from primus_perf.tracelens.shapes import ranked_problems

    return list({it.problem.key(): it.problem for it in ranked_problems(analysis)}.values())


def tunable_problems(problems: Sequence[Any], tuners: Mapping[str, Any]) -> tuple[list[Any], list[str]]:
    """The problems their kind's plugin (``tuners``: kind -> plugin, the ones that then tune
    them) takes, and a note for each one it does not."""
    from primus_perf.base.errors import UserError
    from primus_perf.tuner.kinds import kind_of

    tunable, notes = [], []
    for p in problems:
        try:
            tuners[kind_of(p)].check(p)
        except UserError as exc:
            notes.append(f"not tuned: {exc}")
            continue
        tunable.append(p)
    return tunable, notes


class CacheSteps:
    """One trainer of ``config`` with the cache enabled: :meth:`measure` interleaves blocks of
    its steps with the cache's routers of some kinds on and with none (``tuner.measure.blocks``:
    one settling step after each switch), both sides in one trainer (the same clocks, memory and
    data); :meth:`losses` is one batch's loss without and with them."""

    def __init__(self, config: str, overrides: Sequence[str], cache: Path | str, *, blocks: int = 4,
                 block_steps: int = 5, router_kinds: Any = None, say: Say = lambda _m: None) -> None:
        from primus_perf.runtime.handle import enable
        from primus_perf.trainer.config import load_config
        from primus_perf.trainer.loop import Trainer
        from primus_perf.tuner.online import InStepTuning

        self.blocks, self.block_steps, self.say = blocks, block_steps, say
        self.trainer = Trainer(load_config(config, overrides), online=InStepTuning())
        try:
            self.handle = enable(cache, None, device_type=self.trainer.device.type, router_kinds=router_kinds, log=None)
        except BaseException:
            self.trainer.close()
            raise
        try:
            for _ in range(2):  # warm-up: compile, allocate, plan
                self.trainer.train_step()
        except BaseException:
            self.close()
            raise

    def measure(self, kinds: Sequence[str] | None = None) -> tuple[list[float], list[float]]:
        """Per block, the median step seconds without the cache and with its ``kinds`` (None: all)."""
        from primus_perf.tuner.measure import blocks as measure_blocks

        times = measure_blocks({"default": self.handle.suspend, "tuned": lambda: self.handle.resume(kinds)},
                               lambda: self.trainer.train_step().step_time_s, blocks=self.blocks,
                               block_steps=self.block_steps, say=self.say)
        return times["default"], times["tuned"]

    def losses(self, kinds: Sequence[str] | None = None) -> tuple[float, float]:
        """One batch's loss through the same weights without the cache and with its ``kinds``
        (the training losses of the two sides are of different data)."""
        self.handle.suspend()
        loss_default = self.trainer.batch_loss(self.trainer.step)
        self.handle.resume(kinds)
        loss_tuned = self.trainer.batch_loss(self.trainer.step)
        return loss_default, loss_tuned

    def calls(self) -> tuple[int, int]:
        """Calls routed to a cached choice, and calls that fell back, so far."""
        summary = self.handle.summary()
        return (sum(row.get("routed", 0) for row in summary.values()),
                sum(row.get("fallback", 0) for row in summary.values()))

    def close(self) -> None:
        self.handle.disable()
        self.trainer.close()


def measure_speedup(config: str, overrides: Sequence[str], cache: Path, *, blocks: int = 4,
                    block_steps: int = 5, say: Say = lambda _m: None) -> SpeedupMeasurement:
    """Train ``config`` with the cache enabled and suspended in interleaved blocks of
    ``block_steps`` steps, ``blocks`` blocks a side, one trainer for both (:class:`CacheSteps`)."""
    steps = CacheSteps(config, overrides, cache, blocks=blocks, block_steps=block_steps, say=say)
    try:
        default_s, tuned_s = steps.measure()
        routed, fallback = steps.calls()
        loss_default, loss_tuned = steps.losses()
    finally:
        steps.close()
    return SpeedupMeasurement(default_s, tuned_s, routed, fallback, loss_default, loss_tuned)


def check_cache(config: str, overrides: Sequence[str], cache: Path, *, blocks: int = 4, block_steps: int = 5,
                host_bound: float | None = None, router_kinds: Any = None,
                say: Say = lambda _m: None) -> tuple[Any, SpeedupMeasurement | None]:
    """The final check (``tuner.final_check``) of ``cache`` in ``config``'s steps: the kinds that
    do not win the step are reset to their baseline in the cache. Returns the check and the
    measurement of what it kept (None: nothing kept)."""
    from primus_perf.tuner.final_check import drop, final_check

    steps = CacheSteps(config, overrides, cache, blocks=blocks, block_steps=block_steps, router_kinds=router_kinds)
    try:
        routed = steps.handle.routing
        check = final_check(steps.measure, routed, host_bound=host_bound, say=say)
        kept = check.figure
        measurement = None
        if kept is not None:
            routed_calls, fallback = steps.calls()
            measurement = SpeedupMeasurement(kept.default_s, kept.tuned_s, routed_calls, fallback,
                                             *steps.losses(kept.kinds))
        activation = steps.handle.activation
    finally:
        steps.close()
    return drop(check, routed, str(cache), activation), measurement


def confirm_trainer(config: str, overrides: Sequence[str], cache: Path | str, *, steps: int = 30,
                    policy: Any = None, clock: Any = None, busy: float | None = None, router_kinds: Any = None,
                    say: Say = lambda _m: None) -> Any:
    """Confirm the cache's choices inside ``steps`` training steps of ``config`` at most
    (``tuner.confirm.confirm_run``: each routed problem's choice against the baseline,
    alternating calls, from the second step on; it stops once every problem has its verdict)
    and correct the cache. ``busy``: the GPU's busy share of a host-bound step.
    Returns the ``tuner.confirm.ConfirmRun``."""
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer
    from primus_perf.tuner.confirm import confirm_run
    from primus_perf.tuner.online import InStepTuning

    cfg = load_config(config, overrides)

    def run(confirmer: Any) -> int:
        trainer = Trainer(cfg, online=InStepTuning())  # built as the final check builds it
        try:
            confirmer.timing = False  # the first step (allocation, library set-up) is not timed
            trainer.train_step()
            confirmer.timing = True
            for i in range(steps - 1):
                trainer.train_step()
                if i >= 1 and not confirmer.confirming:  # every problem seen has its verdict
                    break
        finally:
            trainer.close()
        return 0

    return confirm_run(cache, run, policy=policy, clock=clock, log=say, busy=busy, router_kinds=router_kinds)


@dataclass
class ProgramConfirmation:
    """What :func:`confirm_program` did: the confirmation, the final check (None: it could not
    run, ``unchecked`` says why)."""

    confirmation: Any  # tuner.confirm.ConfirmRun
    final: Any = None  # tuner.final_check.FinalCheck
    unchecked: str = ""


def confirm_program(cache: Path | str, target: Sequence[str], *, policy: Any = None, blocks: int = 4,
                    block_steps: int = 5, router_kinds: Any = None, say: Say = lambda _m: None) -> ProgramConfirmation:
    """Confirm ``cache``'s choices in the steps of the program ``target`` (``script.py args``, or
    ``-m module args``; ``tuner.confirm.confirm_run``), then, in the same run, once every routed
    problem has its verdict, the final check (``tuner.final_check``) driven by the program's own
    steps (``programs.DrivenSteps``: it is held at each step's end while the cache is switched):
    kinds that do not win the step are reset to their baseline. The program must run long
    enough: its first step, the confirmation, then 2 x ``blocks`` x (1 + ``block_steps``) steps."""
    from primus_perf.base.programs import (
        DrivenSteps,
        ProgramEnded,
        StepMarks,
        exit_code,
        run_target,
    )
    from primus_perf.tuner.confirm import confirm_run
    from primus_perf.tuner.final_check import drop, final_check
    from primus_perf.tuner.measure import blocks as measure_blocks

    driven = DrivenSteps()
    box: dict[str, Any] = {}

    def drive(steps: DrivenSteps) -> None:
        handle = box["handle"]
        box["routed"] = routed = handle.routing

        def measure(kinds: tuple[str, ...]) -> tuple[list[float], list[float]]:
            t = measure_blocks({"default": lambda: steps.call(handle.suspend),
                                "tuned": lambda: steps.call(lambda: handle.resume(kinds))}, steps.step,
                               blocks=blocks, block_steps=block_steps)
            return t["default"], t["tuned"]

        try:
            box["check"] = final_check(measure, routed, say=say)
        except ProgramEnded as exc:
            box["unchecked"] = f"{exc}: the final check needs {2 * blocks * (1 + block_steps)} steps after the" \
                               " confirmation; run the program longer"
        except Exception as exc:  # the program's step failed under a switch: said, the confirmation stands
            from primus_perf.base.errors import one_line

            box["unchecked"] = f"the final check stopped: {one_line(exc)}"
        finally:
            if not steps.ended:
                steps.call(handle.resume)  # the confirmed routing, for the rest of the run

    def program(confirmer: Any) -> int:
        box["handle"] = confirmer.handle  # cold first calls: the policy's warm-up pairs (a program may mark no step)

        def on_mark(i: int, _seconds: float, _loss: Any) -> None:
            box["marks"] = i + 1
            if driven.driving:
                driven.at_mark(_seconds)
            elif i >= 2 and not confirmer.confirming and "check" not in box and "unchecked" not in box \
                    and "thread" not in box:
                say("final check: the step with the cache against the step without it, interleaved, by the"
                    " program's own steps")
                box["thread"] = driven.start(drive)

        try:
            with StepMarks(on_mark):
                run_target(target)
        except SystemExit as exc:
            return exit_code(exc)
        finally:
            driven.program_ended()
            thread = box.get("thread")
            if thread is not None:
                thread.join()
        return 0

    run = confirm_run(cache, program, policy=policy, log=say, router_kinds=router_kinds)
    out = ProgramConfirmation(run, unchecked=box.get("unchecked", ""))
    if "check" in box:
        out.final = drop(box["check"], box["routed"], str(cache), box["handle"].activation)
    elif not out.unchecked and not box.get("marks"):
        out.unchecked = ("the program marked no step: a step ends at each optimizer.step() of its first optimizer,"
                         " or at each primus_perf.profile_step()")
    elif not out.unchecked:
        out.unchecked = (f"the program ended after {box['marks']} steps, before every routed problem had its"
                         " verdict" if "thread" not in box else "the final check did not finish")
    return out


def run_loop(config: str = "tiny", overrides: Sequence[str] = (), out_dir: str | Path = "runs/quickstart",
             *, steps: int = 3, budget_s: float = 2.0, blocks: int = 4, block_steps: int = 5,
             say: Say = lambda _m: None, tune_progress: Any = None, fp8: bool = False, step: bool = False,
             step_budget_min: float = 20.0) -> LoopResult:
    """Profile, analyze, report; on a GPU also tune and measure (see the module docstring);
    ``fp8``: then tune the FP8 plan (``tuner.fp8.tune_trainer``) into the same cache; ``step``:
    then the step tuner (:func:`step_tune` into ``out_dir/step``, the kernel cache one of its
    levers), on a CPU too."""
    result = _kernel_loop(config, overrides, out_dir, steps=steps, budget_s=budget_s, blocks=blocks,
                          block_steps=block_steps, say=say, tune_progress=tune_progress, fp8=fp8)
    interrupted = result.tune_run is not None and result.tune_run.interrupted
    if step and not interrupted:
        cache = result.cache if result.cache is not None and result.cache.is_file() else None
        say(f"step: searching the step's levers{' with the kernel cache' if cache else ''} -> {result.out_dir / 'step'}")
        result.step = step_tune(config, overrides, result.out_dir / "step", overwrite=True, say=say,
                                cache=str(cache) if cache else None, budget_min=step_budget_min)
    return result


def _kernel_loop(config: str, overrides: Sequence[str], out_dir: str | Path, *, steps: int, budget_s: float,
                 blocks: int, block_steps: int, say: Say, tune_progress: Any, fp8: bool) -> LoopResult:
    from primus_perf.profiler.capture import Schedule, capture_trainer
    from primus_perf.tracelens.analyze import analyze
    from primus_perf.tracelens.report import report_from_analysis
    from primus_perf.tracelens.report_html import write_html
    from primus_perf.tuner.online import InStepTuning

    out = Path(out_dir)
    run_dir = out / "profile"
    say(f"1/5 training {config} under the profiler -> {run_dir}")
    # the loop owns OUT/profile: a rerun replaces the run it left there
    capture_trainer(config, list(overrides), run_dir, Schedule(active=steps, warmup=1, wait=1, baseline=2, after=1),
                    overwrite=True, online=InStepTuning())
    say("2/5 analyzing the trace")
    analysis = analyze([run_dir])
    report = write_html(report_from_analysis(analysis, title=f"{config}: profiled run"), out / "report.html")
    problems = trace_problems(analysis)
    result = LoopResult(
        out_dir=out, run_dir=run_dir, report=report, device=str(analysis.device["name"]),
        step_time_s=analysis.totals.get("step_time_s") or _host_step(analysis),
        problems={kind: int(df["key"].nunique()) for kind, df in analysis.problem_tables().items()},
        notes=list(analysis.notes),
        host_bound=host_bound(analysis.totals.get("gpu_busy_s_per_step"), analysis.totals.get("step_time_s")),
    )
    if result.host_bound is not None:
        say(f"the step is host-bound: the GPU is busy {result.host_bound:.0%} of its {result.step_time_s * 1e3:.2f} ms;"
            " a routed call's host time counts in full, its kernel's saving at that share")
    if gpu_vendor() == "cpu":
        result.tuning_skipped = ("tuning measures GPU kernels and needs a CUDA or ROCm GPU; "
                                 "on this machine the loop ends with the report")
        return result
    if not problems:
        result.tuning_skipped = "the trace has no problems to tune (was it recorded with shapes?)"
        return result
    from primus_perf.tuner import core
    from primus_perf.tuner.kinds import default_tuners

    tuners = default_tuners()
    tunable, not_tunable = tunable_problems(problems, tuners)
    result.notes += not_tunable
    if not tunable:
        result.tuning_skipped = "no problem of the trace can be tuned (see the notes)"
        return result
    cache = out / "tuning_cache.json"
    say(f"3/5 tuning {len(tunable)} problems -> {cache}")
    result.cache = cache
    result.tune_run = core.tune(tunable, cache=cache, tuners=list(tuners.values()), budget_s=budget_s,
                                progress=tune_progress)
    if result.tune_run.interrupted:
        return result
    say("4/5 confirming the choices inside the steps (each against the baseline, alternating calls)")
    result.confirmation = confirm_trainer(config, overrides, cache, busy=result.host_bound, say=say)
    say("5/5 the final check: training with and without the cache, interleaved (a cache never ships slower)")
    result.final, result.measurement = check_cache(config, overrides, cache, blocks=blocks, block_steps=block_steps,
                                                   host_bound=result.host_bound, say=say)
    if fp8:
        from primus_perf.tuner.fp8 import tune_trainer

        say(f"FP8: tuning the plan (layer groups in the step, then the loss check) -> {cache}")
        result.fp8 = tune_trainer(config, overrides, cache, say=say)
    return result


# ---- the step tuner from a profile ---------------------------------------------------------------


def step_advice(recommendations: Any) -> list[Any]:
    """The analyzer's recommendations that name a lever of the step tuner, as ``Advice`` in
    their rank: each of a recommendation's settings, its value read by the config's schema
    (``train.compile: true`` is ``pointwise``); the estimate goes with the first."""
    from primus_perf.base.errors import ConfigError
    from primus_perf.trainer.config import SCHEMA
    from primus_perf.tuner.step import Advice
    from primus_perf.tuner.step.levers import lever_of
    from primus_perf.tuner.step.search import advice_parts

    out: list[Any] = []
    for key, value, estimate, action in advice_parts(recommendations):
        if lever_of(key) is None:
            continue
        try:
            read = SCHEMA[key].read(value)
        except ConfigError:
            continue
        out.append(Advice(key, read, estimate, action))
    return out


def step_tune(config: str, overrides: Sequence[str], out_dir: str | Path, *, profile: bool = True,
              profile_steps: int = 3, overwrite: bool = False, say: Say = lambda _m: None, **kwargs: Any) -> Any:
    """``primus-tune step``: profile the config into ``out_dir`` (a run folder) and read the
    analyzer's advice from it, then ``tuner.step.tune_step`` ordered by that advice, its plan
    and measurements written beside the trace (``primus-profile analyze out_dir`` then shows
    each estimate beside its measurement). Under torchrun every rank runs it, in lockstep, and
    rank 0 decides and writes. Returns the ``StepTuneResult``."""
    import torch
    import torch.distributed as dist

    from primus_perf.trainer.parallel import forget_groups, join_torchrun
    from primus_perf.tuner.step import tune_step

    # under torchrun the group of every trainer the step tuner builds: made here, none owns it
    owns_group = join_torchrun(torch.cuda.is_available())
    try:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank != 0:
            say = lambda _m: None  # noqa: E731 (rank 0 speaks for every rank)
        advice: list[Any] = []
        out = Path(out_dir)
        if profile:
            from primus_perf.profiler.capture import Schedule, capture_trainer
            from primus_perf.tracelens.analyze import analyze
            from primus_perf.tuner.step.levers import text

            say(f"profiling {config} ({profile_steps} steps) -> {out}")
            capture_trainer(config, list(overrides), out, Schedule(active=profile_steps, warmup=1, wait=1),
                            overwrite=overwrite)
            if rank == 0:
                analysis = analyze([out])
                advice = step_advice(analysis.recommendations)
                for a in advice:
                    say(f"advised: {a.key}={text(a.value)}" + (f" (saves ~{a.estimate_ms:.1f} ms a step)"
                                                         if a.estimate_ms is not None else ""))
            advice = _agree(advice)
        return tune_step(config, overrides, out=out, advice=advice, say=say, agree=_agree, is_main=rank == 0,
                         **kwargs)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
            forget_groups()


def _agree(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (itself in one process)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
