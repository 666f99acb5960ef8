"""A tuning cache checked in real steps, driven by the reference trainer (:class:`CacheSteps`:
:func:`confirm_trainer`, :func:`check_cache`, :func:`measure_speedup`) or by a program's own
steps (:func:`confirm_program`): the confirmation (``confirm``: each routed problem's choice
against its baseline, alternating calls) and the final check (``final_check``: blocks of steps
with the cache's routers on and off, interleaved), the cache corrected by both."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primus_perf.base.entry import Log


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


class CacheSteps:
    """One trainer of ``config`` with the cache enabled: :meth:`measure` interleaves blocks of
    its steps with the cache's routers of some kinds on and with none (``tuner.measure.blocks``:
    one settling step after each switch), both sides in one trainer (the same clocks, memory and
    data); :meth:`losses` is one batch's loss without and with them."""

    def __init__(self, config: str, overrides: Sequence[str], cache: Path | str, *, blocks: int = 4,
                 block_steps: int = 5, router_kinds: Any = None, log: Log = lambda _m: None) -> None:
        from primus_perf.runtime.handle import enable
        from primus_perf.trainer.config import load_config
        from primus_perf.trainer.loop import Trainer
        from primus_perf.tuner.online import InStepTuning

        self.blocks, self.block_steps, self.log = blocks, block_steps, log
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
                               block_steps=self.block_steps, log=self.log)
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
                    block_steps: int = 5, log: Log = lambda _m: None) -> SpeedupMeasurement:
    """Train ``config`` with the cache enabled and suspended in interleaved blocks of
    ``block_steps`` steps, ``blocks`` blocks a side, one trainer for both (:class:`CacheSteps`)."""
    steps = CacheSteps(config, overrides, cache, blocks=blocks, block_steps=block_steps, log=log)
    try:
        return SpeedupMeasurement(*steps.measure(), *steps.calls(), *steps.losses())
    finally:
        steps.close()


def check_cache(config: str, overrides: Sequence[str], cache: Path, *, blocks: int = 4, block_steps: int = 5,
                host_bound: float | None = None, router_kinds: Any = None,
                log: Log = lambda _m: None) -> tuple[Any, SpeedupMeasurement | None]:
    """The final check (``tuner.final_check``) of ``cache`` in ``config``'s steps: the kinds that
    do not win the step are reset to their baseline in the cache. Returns the check and the
    measurement of what it kept (None: nothing kept)."""
    from primus_perf.tuner.final_check import drop, final_check

    steps = CacheSteps(config, overrides, cache, blocks=blocks, block_steps=block_steps, router_kinds=router_kinds)
    try:
        routed = steps.handle.routing
        check = final_check(steps.measure, routed, host_bound=host_bound, log=log)
        kept = check.figure
        measurement = None
        if kept is not None:
            measurement = SpeedupMeasurement(kept.default_s, kept.tuned_s, *steps.calls(), *steps.losses(kept.kinds))
        activation = steps.handle.activation
    finally:
        steps.close()
    return drop(check, routed, str(cache), activation), measurement


def confirm_trainer(config: str, overrides: Sequence[str], cache: Path | str, *, steps: int = 30,
                    policy: Any = None, clock: Any = None, busy: float | None = None, router_kinds: Any = None,
                    log: Log = lambda _m: None) -> Any:
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

    return confirm_run(cache, run, policy=policy, clock=clock, log=log, busy=busy, router_kinds=router_kinds)


@dataclass
class ProgramConfirmation:
    """What :func:`confirm_program` did: the confirmation, the final check (None: it could not
    run, ``unchecked`` says why)."""

    confirmation: Any  # tuner.confirm.ConfirmRun
    final: Any = None  # tuner.final_check.FinalCheck
    unchecked: str = ""


def confirm_program(cache: Path | str, target: Sequence[str], *, policy: Any = None, blocks: int = 4,
                    block_steps: int = 5, router_kinds: Any = None, log: Log = lambda _m: None) -> ProgramConfirmation:
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
            box["check"] = final_check(measure, routed, log=log)
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
                log("final check: the step with the cache against the step without it, interleaved, by the"
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

    run = confirm_run(cache, program, policy=policy, log=log, router_kinds=router_kinds)
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
