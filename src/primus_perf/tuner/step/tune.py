"""``primus-tune step`` on the reference trainer: search the whole training step at a fixed
recipe, then check and measure the plan, and write it.

(:func:`tune_config` first profiles the config in a child process: ``search.profile_advice``.)
0. the session: one trainer switched between settings between steps, in place where the
   trainer can (``trainer.knobs.reconfigure``), else by a new trainer of the setting (the same seed:
   the same weights), one alive at a time (:class:`StepSession`; the lanes run one each);
1. the search (:mod:`.search`) on one session of the config, from its own settings;
2. the plan against the default in one session, interleaved (``final_blocks`` pairs of blocks):
   the speedup that is reported and stored, judged by the one rule (a plan the step does not
   bear out is no plan: the default is written);
3. the loss guard: the default and the plan from one seed, and the default from the next
   seed, in fresh trainers, ``check_steps`` steps each: the plan's mean of the last tenth
   within the default's own spread (its two seeds) plus ``threshold`` (the FP8 rule);
   a plan beyond it loses the levers that change the numerics (FP8, bf16 moments), and what
   remains is measured again;
4. ``DIR/plan.yaml`` (the config keys the plan sets: ``primus-train --plan``) and
   ``DIR/step_plan.json`` (every trial, the per-lever table, the figures; the analyzer shows its
   ``measured`` rows beside its advice when it reads ``DIR`` as a run folder).

Under torchrun all ranks run it in lockstep, the same switches and steps; rank 0 decides and
writes.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primus_perf.base import environment
from primus_perf.base.entry import Log
from primus_perf.base.errors import OutOfMemory
from primus_perf.tuner.decide import STEP_MARGIN, Rule, Verdict, judge
from primus_perf.tuner.fp8 import CHECK_STEPS, LOSS_THRESHOLD
from primus_perf.tuner.step import levers as levers_mod
from primus_perf.tuner.step.lanes import start_lanes, visible_devices
from primus_perf.tuner.step.levers import LEVERS, Lever, Setting, lever_of, shown, trainer_levers
from primus_perf.tuner.step.search import (
    OUT_OF_MEMORY,
    Advice,
    Search,
    SearchResult,
    profile_advice,
)

SCHEMA = "primus-perf-step-plan/1"
PLAN_FILE, RESULT_FILE = "plan.yaml", "step_plan.json"
WARM_UP_STEPS = 3  # untimed steps of a new session (a fresh CPU session's steps 2-8 ran 15-100x the steady ones)


# ---- the session ---------------------------------------------------------------------------------


RECOMPILES = 64  # compiled code kept per function: micro-batch shapes x recompute modes x FP8 plans


def _allow_recompiles() -> None:
    """One session compiles each block (or pointwise op) once per setting it runs: a shape per
    micro-batch, a graph per recompute mode and FP8 plan; past Dynamo's default limit of 8 it
    would fall back to eager and time that as the compiled side."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILES)


def interleaved(session: Any, base: Setting, other: Setting, *, blocks: int, block_steps: int,
                settle: int) -> tuple[list[float], list[float]]:
    """Per block, the median step seconds of ``base`` and of ``other`` on one session (any
    object with ``switch`` and ``step``), their blocks interleaved (``tuner.measure.blocks``)."""
    from primus_perf.tuner.measure import blocks as measure_blocks

    times = measure_blocks({"base": lambda: session.switch(base), "other": lambda: session.switch(other)},
                           session.step, blocks=blocks, block_steps=block_steps, settle=settle)
    return times["base"], times["other"]


class StepSession:
    """``switch(setting)`` then ``step()`` (one optimizer step's seconds); ``measure`` two
    settings against each other (what the search calls)."""

    def __init__(self, config: str, base: Sequence[str], setting: Setting) -> None:
        from primus_perf.trainer.config import load_config
        from primus_perf.trainer.loop import Trainer

        self._make = Trainer
        _allow_recompiles()
        self.base_cfg = load_config(config, base)  # the command line's, once: a setting is typed over it
        self.setting = setting
        self.trainer: Any = Trainer(self.cfg_of(setting))

    def cfg_of(self, setting: Setting) -> Any:
        from primus_perf.trainer.config import with_settings

        return with_settings(self.base_cfg, setting.values)

    def measure(self, base: Setting, other: Setting, *, blocks: int, block_steps: int,
                settle: int) -> tuple[list[float], list[float]]:
        return interleaved(self, base, other, blocks=blocks, block_steps=block_steps, settle=settle)

    def switch(self, setting: Setting) -> None:
        """Run ``setting`` from the next step. A ConfigError (it does not fit, it cannot run
        here) leaves the session as it was."""
        from primus_perf.trainer.knobs import NotSwitchable, reconfigure

        if setting.values == self.setting.values:
            return
        cfg = self.cfg_of(setting)
        try:
            try:
                reconfigure(self.trainer, cfg)
            except NotSwitchable:
                self._rebuild(cfg)
        except Exception as exc:  # torch's own out-of-memory (allocating the new setting's state)
            if type(exc).__name__ != "OutOfMemoryError":
                raise
            raise OutOfMemory(f"out of memory switching to {setting.label()}: "
                              f"{(str(exc).splitlines() or [''])[0]}") from None
        self.setting = setting

    def _rebuild(self, cfg: Any) -> None:
        """A new trainer of ``cfg`` (one alive at a time); where it cannot be built, the
        session's own setting is built again before the error goes on."""
        from primus_perf.trainer.resources import check_fits

        check_fits(cfg, self.trainer.device.type, self.trainer.device.index or 0)
        previous = self.cfg_of(self.setting)
        self.close()
        try:
            self.trainer = self._make(cfg)
        except BaseException:
            self.trainer = self._make(previous)
            raise

    def reset(self, setting: Setting) -> None:
        """A fresh trainer of ``setting`` from the seed (after a candidate left the weights
        non-finite, or failed in a way that leaves the trainer's state unknown)."""
        self.close()
        gc.collect()
        self._empty_cache()
        self.trainer = self._make(self.cfg_of(setting))
        self.setting = setting

    def warm_up(self, steps: int) -> None:
        """Untimed steps: allocator, autotuning and the first compile settle before any block."""
        for _ in range(steps):
            self.step()

    def step(self) -> float:
        return float(self.trainer.train_step().step_time_s)

    def recover(self, setting: Setting) -> None:
        """After an out-of-memory step: the gradients dropped, back to ``setting``."""
        if self.trainer is None:  # a rebuild that failed past its own recovery
            self.reset(setting)
            return
        self.trainer.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        self._empty_cache()
        try:
            self.switch(setting)
        except OutOfMemory:  # pragma: no cover - the incumbent ran before
            self._rebuild(self.cfg_of(setting))
            self.setting = setting

    def _empty_cache(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
            gc.collect()
            self._empty_cache()


@dataclass
class LossGuard:
    """The plan's loss against the default's: ``loss_default`` and ``loss_plan`` from one seed,
    ``loss_other_seed`` the default from another seed, whose distance from the first
    (``spread``, relative) is the run-to-run spread of the default itself; the plan passes
    within that spread plus ``threshold`` (the FP8 rule)."""

    steps: int
    window: int
    loss_default: float
    loss_plan: float
    threshold: float
    loss_other_seed: float | None = None
    spread_from: str = "the default from another seed"  # what ``loss_other_seed`` is

    @property
    def rel_diff(self) -> float:
        return abs(self.loss_plan - self.loss_default) / max(abs(self.loss_default), 1e-12)

    @property
    def spread(self) -> float:
        if self.loss_other_seed is None:
            return 0.0
        return abs(self.loss_other_seed - self.loss_default) / max(abs(self.loss_default), 1e-12)

    @property
    def passed(self) -> bool:
        return self.rel_diff <= self.spread + self.threshold

    def line(self) -> str:
        seeds = (f", {self.spread_from} {self.loss_other_seed:.4f} (spread {self.spread:.2%})"
                 if self.loss_other_seed is not None else "")
        return (f"loss guard over {self.steps} steps: default {self.loss_default:.4f}, plan {self.loss_plan:.4f}"
                f" ({self.rel_diff:.2%} relative){seeds}: {'within' if self.passed else 'beyond'} the spread plus"
                f" {self.threshold:.1%}")

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "window": self.window, "loss_default": self.loss_default,
                "loss_plan": self.loss_plan, "loss_other_seed": self.loss_other_seed, "spread": self.spread,
                "threshold": self.threshold, "rel_diff": self.rel_diff, "passed": self.passed}


@dataclass
class StepTuneResult:
    config: str
    overrides: list[str]
    search: SearchResult
    plan: Setting  # the keys the plan sets (those that differ from the default)
    verdict: Verdict | None  # the plan against the default, interleaved
    default_s: list[float] = field(default_factory=list)
    plan_s: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    guard: LossGuard | None = None
    dropped_by_guard: dict[str, str] = field(default_factory=dict)  # key -> why
    minutes: float = 0.0
    fp8_minutes: float = 0.0  # of which the FP8 plan per layer group
    device: str = ""
    out: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.verdict.speedup if self.verdict is not None and self.verdict.speedup else 1.0

    def tokens_s(self, side: str) -> float | None:
        times = self.default_s if side == "default" else self.plan_s
        return self.tokens_per_step / statistics.median(times) if times else None

    def lever_table(self) -> list[dict[str, Any]]:
        """Per lever: the advised value and estimate, each value measured, what the plan keeps."""
        rows = []
        for name in dict.fromkeys(t.lever for t in self.search.trials):
            trials = [t for t in self.search.trials if t.lever == name]
            key = trials[0].key
            advised = next((t for t in trials if t.estimate_ms is not None), None)
            rows.append({"lever": name, "key": key, "plan": self.plan.values.get(key, self.search.default.values[key]),
                         "advised": advised.value if advised else None,
                         "estimate_ms": advised.estimate_ms if advised else None,
                         "measured": [{"value": t.value, "status": t.status, "speedup": t.speedup,
                                       "measured_ms": t.measured_ms} for t in trials]})
        for name, why in self.search.skipped.items():
            rows.append({"lever": name, "key": LEVERS[name].key if name in LEVERS else "", "plan": None,
                         "advised": None, "estimate_ms": None, "measured": [], "skipped": why})
        return rows

    def lines(self) -> list[str]:
        out = [f"step plan for {self.config}{' ' + ' '.join(self.overrides) if self.overrides else ''}:"
               f" {self.plan.label()}"]
        table = self.lever_table()
        width = max([15, *(len(row["lever"]) for row in table)])
        for row in table:
            if "skipped" in row:
                out.append(f"  {row['lever']:<{width}} not here: {row['skipped']}")
                continue
            est = (f"advised {shown(row['advised'])} (saves ~{row['estimate_ms']:.1f} ms)" if row["advised"] is not None
                   else "not advised")
            meas = ", ".join(f"{shown(m['value'])} {m['speedup']:.3f}x {m['status']}" if m["speedup"] else
                             f"{shown(m['value'])} {m['status']}" for m in row["measured"])
            out.append(f"  {row['lever']:<{width}} {shown(row['plan']):<12} {est}; measured: {meas}")
        if self.verdict is not None and self.verdict.speedup is not None:
            if self.tokens_per_step:
                d, p = self.tokens_s("default"), self.tokens_s("plan")
                figures = f"tokens/s ({d:,.0f} -> {p:,.0f})"
            else:
                figures = (f"step time ({statistics.median(self.default_s) * 1e3:.1f} ->"
                           f" {statistics.median(self.plan_s) * 1e3:.1f} ms)")
            out.append(f"plan vs default, measured interleaved: {self.verdict.speedup:.3f}x [{self.verdict.low:.3f}-"
                       f"{self.verdict.high:.3f}] {figures}: {self.verdict.status}"
                       f" (the search's product of kept speedups said about {self.search.chained:.2f}x)")
        if self.guard is not None:
            out.append(self.guard.line())
        for key, why in self.dropped_by_guard.items():
            out.append(f"  dropped {key}: {why}")
        if self.search.stopped:
            out.append(f"search stopped early: {self.search.stopped}")
        out.extend(self.notes)
        passes = f"{self.search.passes} pass(es)" if self.search.passes else "the advised values only"
        fp8 = f"; the FP8 plan {self.fp8_minutes:.1f} min" if self.fp8_minutes else ""
        out.append(f"search took {self.minutes:.1f} min ({len(self.search.trials)} trials, {passes}{fp8})"
                   + (f"; plan written to {self.out}" if self.out else ""))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "config": self.config, "overrides": self.overrides, "device": self.device,
            "plan": dict(self.plan.values), "speedup": self.speedup,
            "verdict": self.verdict.figure() if self.verdict is not None else None,
            "default_tokens_s": self.tokens_s("default"), "tuned_tokens_s": self.tokens_s("plan"),
            "default_ms": [t * 1e3 for t in self.default_s], "plan_ms": [t * 1e3 for t in self.plan_s],
            "search_min": round(self.minutes, 2), "fp8_plan_min": round(self.fp8_minutes, 2), "passes": self.search.passes, "stopped": self.search.stopped,
            "loss_guard": self.guard.to_dict() if self.guard else None, "dropped_by_guard": self.dropped_by_guard,
            "levers": self.lever_table(), "measured": [t.row() for t in self.search.trials], "notes": self.notes,
        }


# ---- the pieces ----------------------------------------------------------------------------------


def where_of(session: StepSession, cache: str | None) -> levers_mod.TrainerContext:
    from primus_perf.base.errors import UserError
    from primus_perf.kernels.fp8.recipes import running_formats

    tr = session.trainer
    try:
        running_formats(tr.device)
        fp8 = True
    except UserError:
        fp8 = False
    return levers_mod.TrainerContext(tr.cfg, tr.device.type, tr.groups.dp, tr.groups.dp_shard, tr.grouped is not None, cache, fp8)


def lane_devices(session: StepSession, lanes: int) -> list[str | None]:
    """The devices of the lanes (:mod:`.lanes`) beside the session's: under torchrun none; on
    GPUs every other one (``lanes`` 0) or up to ``lanes`` in all; on a CPU ``lanes`` - 1
    processes sharing its cores (for tests: they time each other's load)."""
    import torch

    if environment.get("WORLD_SIZE") > 1:
        return []
    device = session.trainer.device
    if device.type == "cuda":
        count = torch.cuda.device_count()
        wanted = count if lanes == 0 else min(lanes, count)
        mine = device.index or 0
        return [d for i, d in enumerate(visible_devices(count)) if i != mine][:max(0, wanted - 1)]
    return [None] * max(0, lanes - 1)


def start_setting(session: StepSession, levers: Sequence[Lever]) -> Setting:
    """Every lever's key at the config's own value (what the search starts from)."""
    from primus_perf.trainer.config import flat

    return Setting({lv.key: flat(session.trainer.cfg)[lv.key] for lv in levers})


def plan_verdict(default_s: list[float], plan_s: list[float]) -> Verdict:
    """The plan against the default over paired blocks, by the one rule."""
    return judge(list(zip(default_s, plan_s)), Rule(margin=STEP_MARGIN, least=2), choice="plan", baseline="default")


def checked_plan(result: StepTuneResult, start: Setting, plan: Setting, *, guard: Callable[[], LossGuard | None],
                 measure: Callable[[Setting], tuple[list[float], list[float]]], log: Log,
                 goes_with: Callable[[dict[str, Any]], dict[str, Any]] = lambda numeric: numeric) -> Setting:
    """What the plan keeps, after ``result.verdict`` (the plan against ``start``): the default
    where the step did not bear it out; else the plan where its loss holds (``guard``: None where
    no loss was seen); else the plan without what changes the numerics (``goes_with``: those keys
    and the keys that go with them), measured against the default again (``measure``) and kept
    where it wins."""
    if result.verdict is None or not result.verdict.kept:
        result.notes.append("the whole step did not bear the plan out against the default: the default stays")
        return start
    result.guard = guard()
    if result.guard is None:
        result.notes.append("no loss seen (no .backward() on a scalar, no profile_step(loss=...)): no loss guard")
        return plan
    if result.guard.passed:
        return plan
    numeric = numerics_changes(plan, start)
    result.dropped_by_guard = {k: f"{shown(v)}: the loss beyond the default's spread plus the threshold"
                               for k, v in numeric.items()}
    plan = plan.with_({k: start.values[k] for k in goes_with(numeric)})
    if not numeric or plan.values == start.values:
        if not numeric:
            result.notes.append("the loss guard failed and nothing in the plan changes the numerics: the default stays")
        return start
    log(f"the loss guard dropped {', '.join(numeric)}: the rest of the plan against the default again")
    result.default_s, result.plan_s = measure(plan)
    result.verdict = plan_verdict(result.default_s, result.plan_s)
    return plan if result.verdict.kept else start


def loss_guard(make: Callable[[Setting], StepSession], default: Setting, plan: Setting, *, steps: int,
               threshold: float) -> LossGuard:
    """The default and the plan from one seed, and the default from the next seed (its own
    run-to-run spread), ``steps`` optimizer steps each (fresh trainers, one alive at a time)."""
    losses: dict[str, list[float]] = {}
    seed = None
    for side in ("default", "plan", "other seed"):
        setting = {"default": default, "plan": plan}.get(side) or default.with_({"train.seed": seed + 1})
        session = make(setting)
        try:
            seed = session.trainer.cfg.train.seed if seed is None else seed
            losses[side] = [float(session.trainer.train_step().loss) for _ in range(steps)]
        finally:
            session.close()
    window = max(1, steps // 10)
    return LossGuard(steps, window, statistics.fmean(losses["default"][-window:]),
                     statistics.fmean(losses["plan"][-window:]), threshold,
                     statistics.fmean(losses["other seed"][-window:]))


def fp8_plan_trial(search: Search, session: StepSession, plan: Setting, cache: Path, *, blocks: int,
                   block_steps: int, settle: int, log: Log, agree: Callable[[Any], Any]) -> Any:
    """The FP8 plan per layer group, tuned under the plan's own settings (its compile scope and
    micro-batch): each group in the best FP8 recipe the search measured, against the rest in
    bf16 (``tuner.fp8.measure_groups``), the groups that pay kept (``tuner.fp8.choose``); where
    that differs from one recipe for every layer, the plan with it (``train.fp8=auto`` from
    ``cache``, a copy of the plan's kernel cache with the FP8 entry added) is one more trial
    against the plan. None where FP8 was not measured or no group pays."""
    from primus_perf.cache.store import TuningCache
    from primus_perf.kernels.fp8.plan import Fp8Plan
    from primus_perf.trainer.fp8 import BF16, group_of, recipe_plan
    from primus_perf.tuner.fp8 import (
        choose,
        layer_groups,
        measure_groups,
        plan_entry,
        trainer_problem,
    )

    measured = [t for t in search.trials if t.key == "train.fp8" and t.speedup and t.value not in ("off", "auto")]
    current = plan.values.get("train.fp8", "off")
    recipe = current if current not in ("off", "auto") else (
        max(measured, key=lambda t: t.speedup or 0.0).value if measured else None)
    if recipe is None:
        return None
    base = plan.with_({"train.fp8": "off"})
    session.switch(base)
    trainer = session.trainer
    problem = trainer_problem(trainer)
    groups = layer_groups(problem, group_of)
    if search.over_budget(trials=len(groups) + 1):  # a trial per group, then the plan against the plan
        log(f"FP8 plan: {len(groups)} layer groups would need about "
            f"{(len(groups) + 1) * search.trial_cost_s() / 60:.1f} min: more than the budget leaves")
        session.switch(plan)
        return None
    log(f"FP8 plan: {len(groups)} layer groups in {recipe}, each against bf16 under {base.label(search._default.values)}")
    failed = ""
    try:
        found = measure_groups(trainer, problem, groups, [recipe], blocks=blocks, block_steps=block_steps,
                               settle=settle, log=log)
    except Exception as exc:  # out of memory (the layers' FP8 copies beside the compiled graphs), a library's error
        from primus_perf.base.errors import OutOfMemory, one_line

        if not isinstance(exc, OutOfMemory):
            search.stop_under_torchrun("the FP8 plan per layer group", exc)
        elif search.distributed:
            search.agree(OUT_OF_MEMORY)  # every rank ran out at the same step (Search.out_of_memory)
        failed = one_line(exc)
    if failed:  # after the except block: the error held the failed step's tensors
        log(f"FP8 plan: measuring the layer groups failed ({failed}): one recipe for every layer stays")
        del trainer
        session.reset(plan)  # the layers were switched one group at a time: a fresh trainer from the seed
        return None
    layers, summary = agree(choose(groups, found))
    trainer.set_fp8({n: BF16 for n in layers})  # back to the session's setting
    if not any(r != BF16 for r in layers.values()) or layers == recipe_plan(trainer.model, recipe):
        log(f"FP8 plan: {'no group pays' if not any(r != BF16 for r in layers.values()) else 'every group'}"
            f" in {recipe}: nothing beyond one recipe")
        return None
    if search.agree(True):
        store = TuningCache(cache)
        kernels = plan.values.get("tuning.cache")
        if kernels:
            store.merge_from(kernels)
        store.put(plan_entry(Fp8Plan(problem, layers, summary), None, None))
    changes = {"train.fp8": "auto", "tuning.cache": str(cache)}
    trial = search.measure_changes("fp8", "train.fp8", "plan", plan, changes, search.fits(plan.with_(changes)))
    search.trials.append(trial)
    log(f"(FP8 plan) {trial.line()}")
    return trial


def numerics_changes(plan: Setting, default: Setting) -> dict[str, Any]:
    """The plan's keys whose values change the numerics (FP8, bf16 moments)."""
    out = {}
    for key, value in plan.values.items():
        lever = lever_of(key) or LEVERS.get(key)  # a trainer's config key, or a script lever's name
        if value != default.values.get(key) and lever is not None and lever.changes_numerics(value):
            out[key] = value
    return out


def write_plan(out: Path, result: StepTuneResult, program: Sequence[str] | None = None) -> None:
    """``out/plan.yaml`` (the trainer's config keys: ``trainer.config.plan_yaml``; a script's ``levers:`` by name,
    with its ``program``) and ``out/step_plan.json``."""
    import yaml

    from primus_perf.base.files import write_json, write_text
    from primus_perf.trainer.config import plan_yaml

    out.mkdir(parents=True, exist_ok=True)
    per = "tokens/s" if result.tokens_per_step else "steps/s"
    figure = (f"{result.speedup:.3f}x {per} over the default (interleaved)" if result.plan.values
              else "no plan, the default stays")
    if program is not None:
        doc: dict[str, Any] = {"program": list(program),
                               "levers": {k: _yaml_value(v) for k, v in result.plan.values.items()}}
        head = (f"# primus-perf step plan for {' '.join(program)} on {result.device}: {figure}.\n"
                "# python -m primus_perf.launch --plan plan.yaml -- SCRIPT ARGS (torchrun ... -m primus_perf.launch"
                " ... under torchrun); details: step_plan.json\n")
        body = yaml.safe_dump(doc, sort_keys=False)
    else:
        head = (f"# primus-perf step plan for {result.config} {' '.join(result.overrides)}".rstrip() +
                f" on {result.device}: {figure}.\n"
                "# primus-train --config CONFIG --plan plan.yaml [the same overrides: the plan's keys win]; details:"
                " step_plan.json\n")
        body = plan_yaml(result.plan.values)
    write_text(out / PLAN_FILE, head + body)
    write_json(out / RESULT_FILE, result.to_dict())


def _yaml_value(value: str) -> Any:  # a script lever's value (the hooks' text) in YAML
    if value in ("true", "false"):
        return value == "true"
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        return value


# ---- the whole ------------------------------------------------------------------------------------


def rank0s(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (itself in one process)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def tune_config(config: str, overrides: Sequence[str], out: str | Path, *, profile: bool = True,
                log: Log = lambda _m: None, timeout_s: float = 1800.0, **kwargs: Any) -> StepTuneResult:
    """``primus-tune step --config``: the config profiled in a child process into ``out`` (a run
    folder) and analyzed (``search.profile_advice``), then :func:`tune_step` ordered by that
    advice, its plan and measurements written beside the trace (``primus-profile analyze out``
    then shows each estimate beside its measurement). Under torchrun every rank runs it, in
    lockstep (their profile's children meet on a port rank 0 picks); rank 0 decides and writes."""
    import torch
    import torch.distributed as dist

    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.parallel import torchrun_job
    from primus_perf.tuner.step.measured import _free_port, child_env

    load_config(config, list(overrides))  # a config that cannot be read says so before anything runs
    with torchrun_job(torch.cuda.is_available()) as main:  # the group of every trainer the search builds
        log = log if main else (lambda _m: None)
        advice: list[Advice] = []
        if profile:
            out = Path(out)
            out.mkdir(parents=True, exist_ok=True)
            port = rank0s(_free_port()) if dist.is_initialized() else None
            advice = profile_advice(["-c", config, *overrides], out, env=child_env(None, port),
                                    log_file=out / "runs.log", timeout_s=timeout_s, log=log, agree=rank0s, is_main=main)
        return tune_step(config, overrides, out=out, advice=advice, log=log, agree=rank0s, is_main=main, **kwargs)


def tune_step(config: str, overrides: Sequence[str] = (), *, out: str | Path | None = None,
              levers: Sequence[Lever] | None = None, advice: Sequence[Advice] = (), cache: str | None = None,
              budget_min: float = 20.0, blocks: int = 2, block_steps: int = 2, settle: int = 1,
              final_blocks: int = 3, passes: int = 3, check_steps: int = CHECK_STEPS,
              threshold: float = LOSS_THRESHOLD, log: Log = lambda _m: None,
              agree: Callable[[Any], Any] = lambda x: x, is_main: bool = True, lanes: int = 0) -> StepTuneResult:
    """Search ``config`` + ``overrides``'s step over ``levers`` (default: every registered one)
    within ``budget_min`` minutes, check the plan's loss, measure it against the default and
    write it to ``out``. ``lanes``: devices measuring candidates at once (:func:`lane_devices`)."""
    from primus_perf.base.devices import current_device

    t0 = time.monotonic()
    levers = trainer_levers() if levers is None else list(levers)
    base = list(overrides)

    def make(setting: Setting) -> StepSession:
        return StepSession(config, base, setting)

    fp8_cache = Path(out).resolve() / "tuning_cache.json" if out is not None else None
    t_build = time.monotonic()
    session = StepSession(config, base, Setting())
    build_s = time.monotonic() - t_build
    try:
        start = start_setting(session, levers)
        session.setting = start
        where = where_of(session, cache)
        tokens = session.trainer.tokens_per_step
        # steps kept back for the plan's measurement and the loss guard
        reserve = 2 * final_blocks * (settle + block_steps) + 3 * check_steps
        session.warm_up(WARM_UP_STEPS)
        devices = lane_devices(session, lanes)
        running = start_lanes(StepSession, config, base, start.values, devices, log, WARM_UP_STEPS) if devices else []
        if running:
            log(f"measuring on {len(running) + 1} devices at once: the session's and "
                + ", ".join(lane.name for lane in running))
        search = Search(session, levers, where, advice=advice, blocks=blocks, block_steps=block_steps,
                        settle=settle, passes=passes, deadline=t0 + budget_min * 60, reserve_steps=reserve,
                        reserve_s=3 * build_s,
                        log=log, agree=agree, lanes=running, distributed=environment.get("WORLD_SIZE") > 1)
        try:
            found = search.run(start)
        finally:
            for lane in search.lanes:
                lane.close()
        plan = found.best
        fp8 = LEVERS.get("fp8")
        if out is not None and fp8 in levers and fp8.legal(where) is None and where.dp_shard == 1 \
                and not search.over_budget():
            t_fp8 = time.monotonic()
            trial = fp8_plan_trial(search, session, plan, fp8_cache, blocks=blocks,
                                   block_steps=block_steps, settle=settle, log=log, agree=agree)
            if trial is not None and trial.kept:
                plan = plan.with_(trial.changes)
            fp8_minutes = (time.monotonic() - t_fp8) / 60
        else:
            fp8_minutes = 0.0
        result = StepTuneResult(config, base, found, Setting(), None, tokens_per_step=tokens,
                                device=current_device().name, fp8_minutes=fp8_minutes)
        measure = {"blocks": final_blocks, "block_steps": block_steps, "settle": settle}
        if plan.values != start.values:  # the figures: once, in StepTuneResult.lines()
            log(f"measuring the plan against the default, interleaved ({final_blocks} pairs of blocks)")
            result.default_s, result.plan_s = agree(session.measure(start, plan, **measure))
            result.verdict = plan_verdict(result.default_s, result.plan_s)
    finally:
        session.close()

    proposed = plan  # what the closures below judge (``plan`` becomes what is kept)

    def guard() -> LossGuard:
        log(f"loss guard: the default and the plan from one seed, {check_steps} steps each")
        return loss_guard(make, start, proposed, steps=check_steps, threshold=threshold)

    def again(kept: Setting) -> tuple[list[float], list[float]]:
        fresh = make(start)
        try:
            return agree(fresh.measure(start, kept, **measure))
        finally:
            fresh.close()

    def goes_with(numeric: dict[str, Any]) -> dict[str, Any]:  # the FP8 plan's cache goes with it
        if numeric.get("train.fp8") == "auto" and proposed.values.get("tuning.cache") == str(fp8_cache):
            return {**numeric, "tuning.cache": str(fp8_cache)}
        return numeric

    if proposed.values != start.values:
        plan = checked_plan(result, start, proposed, guard=guard, measure=again, log=log, goes_with=goes_with)
    result.plan = Setting({k: v for k, v in plan.values.items() if v != start.values.get(k)})
    result.minutes = (time.monotonic() - t0) / 60
    if out is not None and is_main:
        result.out = Path(out)
        write_plan(result.out, result)
    return result



