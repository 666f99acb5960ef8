"""The FP8 plan tuner: measure each layer group's recipes in the training step, choose,
measure the whole plan against bf16, check the loss, write the cache entry.

A *session* is anything that trains step by step with a switchable plan: ``set_fp8(layers)``
(layer -> recipe or ``bf16``), ``train_step()`` returning an object with ``step_time_s`` and
``loss``, and ``close()``. The trainer (``trainer.loop.Trainer``) is one; tests pass their own.

1. groups: a group is the layers of one role and shape (every block's ``mlp.w13``); each
   candidate recipe against bf16 in ``blocks`` pairs of interleaved blocks of ``block_steps``
   timed steps (``measure.blocks``; ``settle`` untimed steps after each switch: compilation,
   allocation), the rest of the model in bf16. The one decision rule (``decide.judge`` on the
   paired blocks, margin ``min_gain`` of the step) keeps a recipe only past the noise; the
   best kept recipe wins the group, else it stays bf16 (small GEMMs, where the quantization
   costs more than the FP8 GEMM saves);
2. the plan against all-bf16, interleaved the same way and judged by the same rule: the
   stored speedup (a plan the whole step does not bear out becomes all-bf16);
3. the numerics guard (:func:`loss_check`): two fresh sessions from the same seed, bf16
   and the plan, ``check_steps`` steps each; a plan whose loss differs by more than
   ``threshold`` (relative, on the mean of the last tenth of the steps) is refused with one
   line and not written.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from primus_perf.base.devices import current_device
from primus_perf.base.entry import Log
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.kernels.fp8.plan import (
    KIND,
    Fp8Plan,
    Fp8PlanProblem,
    LossCheck,
    library_versions,
    plan_solution,
)
from primus_perf.kernels.fp8.recipes import BF16, DEFAULT_CANDIDATES, gemm_shape_ok, recipe
from primus_perf.tuner.decide import STEP_MARGIN, Rule, Verdict, decide, judge
from primus_perf.tuner.measure import blocks as measure_blocks

CHECK_STEPS = 50  # default length of the loss A/B
LOSS_THRESHOLD = 0.015  # default: the plan's loss may differ from bf16's by 1.5% relative
TUNER_VERSION = "fp8-plan-1"



class Session(Protocol):
    def set_fp8(self, layers: dict[str, str]) -> None: ...
    def train_step(self) -> Any: ...
    def close(self) -> None: ...


@dataclass
class GroupMeasurement:
    group: str
    recipe: str
    bf16_s: list[float]  # per block: median step time with the group in bf16
    fp8_s: list[float]  # per block: median step time with the group in ``recipe``

    def verdict(self, min_gain: float = STEP_MARGIN) -> Verdict:
        return judge(list(zip(self.bf16_s, self.fp8_s)), Rule(margin=min_gain, least=1), choice=self.recipe,
                     baseline=BF16)

    @property
    def saving_s(self) -> float:
        return statistics.median(self.bf16_s) - statistics.median(self.fp8_s)

    @property
    def speedup(self) -> float:
        return statistics.median(self.bf16_s) / statistics.median(self.fp8_s)

    def to_dict(self) -> dict[str, Any]:
        v = self.verdict()
        return {"recipe": self.recipe, "bf16_ms": statistics.median(self.bf16_s) * 1e3,
                "fp8_ms": statistics.median(self.fp8_s) * 1e3, "saving_ms": self.saving_s * 1e3,
                "noise": v.threshold, "speedup": self.speedup, "verdict": v.status}


def choose(groups: Mapping[str, Iterable[str]], measured: Iterable[GroupMeasurement],
           *, min_gain: float = STEP_MARGIN) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """(layer -> recipe or bf16, group -> its choice and every candidate's figures)."""
    by_group: dict[str, list[GroupMeasurement]] = {}
    for m in measured:
        by_group.setdefault(m.group, []).append(m)
    layers: dict[str, str] = {}
    summary: dict[str, dict[str, Any]] = {}
    for group, names in groups.items():
        cands = by_group.get(group, [])
        choice = decide(BF16, {m.recipe: m.verdict(min_gain) for m in cands})
        names = list(names)
        layers.update(dict.fromkeys(names, choice))
        summary[group] = {"choice": choice, "layers": len(names), "candidates": [m.to_dict() for m in cands]}
    return layers, summary


@dataclass
class PlanTiming:
    bf16_s: list[float]  # per block medians, all bf16
    plan_s: list[float]  # per block medians, the plan

    @property
    def speedup(self) -> float:
        return statistics.median(self.bf16_s) / statistics.median(self.plan_s)

    def verdict(self, min_gain: float = STEP_MARGIN) -> Verdict:
        return judge(list(zip(self.bf16_s, self.plan_s)), Rule(margin=min_gain, least=1), choice="plan",
                     baseline=BF16)

    def times(self) -> dict[str, float]:
        return {"default_ms": statistics.median(self.bf16_s) * 1e3, "tuned_ms": statistics.median(self.plan_s) * 1e3,
                "default_min_ms": min(self.bf16_s) * 1e3, "default_max_ms": max(self.bf16_s) * 1e3,
                "tuned_min_ms": min(self.plan_s) * 1e3, "tuned_max_ms": max(self.plan_s) * 1e3}


@dataclass
class Fp8TuneResult:
    plan: Fp8Plan
    timing: PlanTiming | None  # None when the plan runs nothing in FP8
    loss: LossCheck | None
    losses: dict[str, list[float]] = field(default_factory=dict)  # the A/B's per-step losses
    written: Path | None = None
    refused: str | None = None  # the one line saying why the plan was not written

    def lines(self) -> list[str]:
        out = [f"FP8 plan: {self.plan.summary()}"]
        for group, g in self.plan.groups.items():
            cands = ", ".join(f"{c['recipe']} {c['speedup']:.3f}x (saves {c['saving_ms']:.2f} ms, "
                              f"needs > {1 + c['noise']:.3f}x)" for c in g["candidates"]) or "no FP8 candidate"
            out.append(f"  {group} ({g['layers']} layers): {g['choice']} [{cands}]")
        if self.timing is not None:
            t = self.timing.times()
            out.append(f"FP8 plan speedup in the step: {self.timing.speedup:.3f}x (bf16 {t['default_ms']:.2f} ms "
                       f"[{t['default_min_ms']:.2f}-{t['default_max_ms']:.2f}], plan {t['tuned_ms']:.2f} ms "
                       f"[{t['tuned_min_ms']:.2f}-{t['tuned_max_ms']:.2f}])")
        if self.loss is not None:
            out.append(self.loss.line())
        return out


def interleaved(session: Session, a: dict[str, str], b: dict[str, str], *, blocks: int, block_steps: int,
                settle: int) -> tuple[list[float], list[float]]:
    """Per-block median step times of plans ``a`` and ``b``, ``blocks`` blocks each, interleaved."""
    times = measure_blocks({"a": lambda: session.set_fp8(a), "b": lambda: session.set_fp8(b)},
                           lambda: session.train_step().step_time_s, blocks=blocks, block_steps=block_steps,
                           settle=settle)
    return times["a"], times["b"]


def layer_groups(problem: Fp8PlanProblem, group_of: Callable[[str], str]) -> dict[str, list[str]]:
    """Group -> its layers, a group holding one shape (the role's name, with the shape
    added where one role has several)."""
    groups: dict[str, list[tuple[str, int, int]]] = {}
    for layer in problem.layers:
        groups.setdefault(group_of(layer[0]), []).append(layer)
    out: dict[str, list[str]] = {}
    for g, members in groups.items():
        shapes = {(o, i) for _, o, i in members}
        for n, o, i in members:
            out.setdefault(g if len(shapes) == 1 else f"{g} {o}x{i}", []).append(n)
    return out


def measure_groups(session: Session, problem: Fp8PlanProblem, groups: Mapping[str, Sequence[str]],
                   candidates: Sequence[str], *, blocks: int = 2, block_steps: int = 3, settle: int = 1,
                   log: Log = lambda _m: None) -> list[GroupMeasurement]:
    shapes = {n: (o, i) for n, o, i in problem.layers}
    bf16 = {n: BF16 for n in shapes}
    out = []
    for group, names in groups.items():
        if not all(gemm_shape_ok(*shapes[n]) for n in names):
            log(f"{group}: bf16 (a shape torch._scaled_mm cannot take)")
            continue
        for name in candidates:
            trial = {**bf16, **{n: name for n in names}}
            b, f = interleaved(session, bf16, trial, blocks=blocks, block_steps=block_steps, settle=settle)
            m = GroupMeasurement(group, name, b, f)
            out.append(m)
            log(f"{group} {name}: {m.speedup:.3f}x of the step (saves {m.saving_s * 1e3:.2f} ms): "
                f"{m.verdict().status}")
    return out


def _release(session: Session) -> None:
    """Close a session and free its memory before the next one is built (a model of 8B
    dimensions fits once on a GPU); Dynamo's caches go too, so no compiled code keeps the
    old model's modules alive."""
    import gc

    import torch

    session.close()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def loss_check(make_session: Callable[[], Session], layers: dict[str, str], *, steps: int = CHECK_STEPS,
               threshold: float = LOSS_THRESHOLD) -> tuple[LossCheck, dict[str, list[float]]]:
    """bf16 and the plan from the same seed, ``steps`` steps each (fresh sessions)."""
    losses: dict[str, list[float]] = {}
    for side, plan in (("bf16", {n: BF16 for n in layers}), ("fp8", layers)):
        session = make_session()
        try:
            session.set_fp8(plan)
            losses[side] = [float(session.train_step().loss) for _ in range(steps)]
        finally:
            _release(session)
            del session
    window = max(1, steps // 10)
    check = LossCheck(steps, window, statistics.fmean(losses["bf16"][-window:]),
                      statistics.fmean(losses["fp8"][-window:]), threshold)
    return check, losses


def plan_entry(plan: Fp8Plan, timing: PlanTiming | None, loss: LossCheck | None) -> CacheEntry:
    p = plan.problem
    return CacheEntry(kind=KIND, problem_key=p.key(), problem=p.to_dict(), device=current_device().to_dict(),
                      versions=library_versions(), solution=plan_solution(plan, loss),
                      times=timing.times() if timing else {}, error=loss.rel_diff if loss else None,
                      tuner_version=TUNER_VERSION)


def tune_plan(make_session: Callable[[], Session], problem_of: Callable[[Any], Fp8PlanProblem],
              group_of: Callable[[str], str], *, cache: str | Path | None,
              candidates: Iterable[str] = DEFAULT_CANDIDATES, blocks: int = 2, block_steps: int = 3,
              settle: int = 1, plan_blocks: int = 3, check_steps: int = CHECK_STEPS,
              threshold: float = LOSS_THRESHOLD, min_gain: float = STEP_MARGIN,
              log: Log = lambda _m: None) -> Fp8TuneResult:
    """Tune a plan on one session from ``make_session`` (``problem_of(session)``: its layers),
    check its loss on two fresh ones, and write it to ``cache`` unless refused. One session
    lives at a time."""
    names = [recipe(c).name for c in candidates]
    session = make_session()
    try:
        problem = problem_of(session)
        log(f"FP8 plan: {problem.label()}")
        groups = layer_groups(problem, group_of)
        measured = measure_groups(session, problem, groups, names, blocks=blocks, block_steps=block_steps,
                                  settle=settle, log=log)
        layers, summary = choose(groups, measured, min_gain=min_gain)
        plan = Fp8Plan(problem, layers, summary)
        timing = None
        if plan.fp8_layers:
            bf16 = {n: BF16 for n in layers}
            b, f = interleaved(session, bf16, layers, blocks=plan_blocks, block_steps=block_steps, settle=settle)
            timing = PlanTiming(b, f)
            log(f"plan vs bf16: {timing.speedup:.3f}x")
            if not timing.verdict(min_gain).kept:  # the groups' savings did not add up in the whole step
                log("the whole step does not bear the plan out against bf16: every layer stays bf16")
                layers = {n: BF16 for n in layers}
                plan = Fp8Plan(problem, layers, summary)
                timing = None
    finally:
        _release(session)
        del session
    result = Fp8TuneResult(plan, timing, None)
    if plan.fp8_layers:
        t0 = time.perf_counter()
        result.loss, result.losses = loss_check(make_session, layers, steps=check_steps, threshold=threshold)
        log(f"{result.loss.line()} ({time.perf_counter() - t0:.0f} s)")
        if not result.loss.passed:
            result.refused = f"FP8 plan refused: {result.loss.line()}; not written"
            return result
    if cache is not None:
        TuningCache(cache).put(plan_entry(plan, timing, result.loss))
        result.written = Path(cache)
    return result


def trainer_sessions(config: str, overrides: Sequence[str]) -> Callable[[], Any]:
    """Trainers of ``config`` + ``overrides`` with ``train.fp8`` off (the plan is switched in
    place). The loss check runs the first steps of the learning-rate schedule the config
    trains with: forcing ``train.steps`` to the check's length would put the whole check at
    the peak rate, where a short schedule's loss is chaotic (an 8B at 3e-4 on 200 steps
    swings between 1.6 and 14 from step to step, bf16 alone) and no A/B of two runs means
    anything."""
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer

    base = [o for o in overrides if not o.startswith("train.fp8=")] + ["train.fp8=off"]
    load_config(config, base)  # a config error surfaces before any model is built
    return lambda: Trainer(load_config(config, base))


def trainer_problem(trainer: Any) -> Fp8PlanProblem:
    from primus_perf.trainer.fp8 import problem_of

    t = trainer.cfg.train
    return problem_of(trainer.model, t.micro_batch * t.seq_len, "bf16" if trainer.autocast else "fp32")


def tune_trainer(config: str, overrides: Sequence[str], cache: str | Path | None, *,
                 log: Log = lambda _m: None, **kwargs: Any) -> Fp8TuneResult:
    """:func:`tune_plan` on the trainer of ``config`` + ``overrides``."""
    from primus_perf.trainer.fp8 import group_of

    make = trainer_sessions(config, overrides)
    return tune_plan(make, trainer_problem, group_of, cache=cache, log=log, **kwargs)
