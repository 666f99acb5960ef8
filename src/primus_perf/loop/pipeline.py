"""The main job in one call, ``primus-tune loop``: one pipeline of stages (:func:`run_loop`), each
a function that calls down into the layers and says ``i/N`` and what it does:

1. profile: train a preset under the profiler (``profiler.capture.capture_trainer``): a trace
   and a manifest in ``OUT/profile``;
2. analyze: the trace analyzed (``tracelens.analyze``), the HTML report ``OUT/report.html``;
3. tune: on a GPU, the trace's problems of every kind (``tuner.core.tune``) into
   ``OUT/tuning_cache.json``;
4. confirm: on a GPU, the choices inside real steps (``tuner.cache_check.confirm_trainer``): each
   routed problem's choice (GEMM, grouped GEMM, attention with its backward) against the
   baseline, alternating calls; the cache keeps only the choices that win where they run (in a
   host-bound step, ``decide.host_bound``, with their host time counted);
5. final check: on a GPU (``tuner.cache_check.check_cache``, ``tuner.final_check``): one
   trainer, blocks of steps with the cache's routers on and off in turn (interleaved, so both
   sides see the same clocks, memory and data); a cache that does not win the step past the
   noise loses the kinds that do not win it alone, down to none ("1.00x: torch's own kernels
   kept");
6. with ``fp8``, the FP8 plan into the same cache; with ``step``, the step tuner
   (``tuner.step.tune.tune_config``: a profile, the analyzer's advice, the search), on a CPU too.

Where a kernel stage cannot run (no GPU, no problem to tune) the loop says why and goes on to
the step tuner, if asked. Everything the CLI prints comes from the returned :class:`LoopResult`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primus_perf.base.devices import gpu_vendor
from primus_perf.base.entry import Log
from primus_perf.tuner.decide import host_bound


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
    measurement: Any = None  # tuner.cache_check.SpeedupMeasurement of what the final check kept (None: nothing)
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


@dataclass
class _Run:
    """What the loop's stages share: the request, and the result the stages fill in."""

    config: str
    overrides: tuple[str, ...]
    out: Path
    options: dict[str, Any]
    log: Log
    result: Any = None  # LoopResult, from the analysis stage on
    analysis: Any = None
    tunable: list[Any] = field(default_factory=list)
    tuners: dict[str, Any] = field(default_factory=dict)


def _profile(run: _Run, mark: str) -> None:
    from primus_perf.profiler.capture import Schedule, capture_trainer
    from primus_perf.tuner.online import InStepTuning

    run_dir = run.out / "profile"
    run.log(f"{mark} training {run.config} under the profiler -> {run_dir}")
    # the loop owns OUT/profile: a rerun replaces the run it left there
    capture_trainer(run.config, list(run.overrides), run_dir,
                    Schedule(active=run.options["steps"], warmup=1, wait=1, baseline=2, after=1),
                    overwrite=True, online=InStepTuning())


def _analyze(run: _Run, mark: str) -> str | None:
    """The trace analyzed and reported; why tuning cannot follow (no GPU, no problem), if so."""
    from primus_perf.tracelens.analyze import analyze
    from primus_perf.tracelens.report import report_from_analysis
    from primus_perf.tracelens.report_html import write_html
    from primus_perf.tuner.kinds import default_tuners

    run.log(f"{mark} analyzing the trace")
    run_dir = run.out / "profile"
    run.analysis = a = analyze([run_dir])
    report = write_html(report_from_analysis(a, title=f"{run.config}: profiled run"), run.out / "report.html")
    run.result = r = LoopResult(
        out_dir=run.out, run_dir=run_dir, report=report, device=str(a.device["name"]),
        step_time_s=a.totals.get("step_time_s") or _host_step(a),
        problems={kind: int(df["key"].nunique()) for kind, df in a.problem_tables().items()},
        notes=list(a.notes), host_bound=host_bound(a.totals.get("gpu_busy_s_per_step"), a.totals.get("step_time_s")))
    if r.host_bound is not None:
        run.log(f"the step is host-bound: the GPU is busy {r.host_bound:.0%} of its {r.step_time_s * 1e3:.2f} ms;"
                " a routed call's host time counts in full, its kernel's saving at that share")
    if gpu_vendor() == "cpu":
        return "tuning measures GPU kernels and needs a CUDA or ROCm GPU; on this machine the loop ends with the report"
    problems = trace_problems(a)
    if not problems:
        return "the trace has no problems to tune (was it recorded with shapes?)"
    run.tuners = default_tuners()
    run.tunable, not_tunable = tunable_problems(problems, run.tuners)
    r.notes += not_tunable
    return None if run.tunable else "no problem of the trace can be tuned (see the notes)"


def _tune(run: _Run, mark: str) -> None:
    from primus_perf.tuner import core

    r = run.result
    r.cache = run.out / "tuning_cache.json"
    run.log(f"{mark} tuning {len(run.tunable)} problems -> {r.cache}")
    r.tune_run = core.tune(run.tunable, cache=r.cache, tuners=list(run.tuners.values()),
                           budget_s=run.options["budget_s"], progress=run.options["tune_progress"])


def _confirm(run: _Run, mark: str) -> None:
    from primus_perf.tuner.cache_check import confirm_trainer

    run.log(f"{mark} confirming the choices inside the steps (each against the baseline, alternating calls)")
    run.result.confirmation = confirm_trainer(run.config, run.overrides, run.result.cache, busy=run.result.host_bound,
                                              log=run.log)


def _final_check(run: _Run, mark: str) -> None:
    from primus_perf.tuner.cache_check import check_cache

    r = run.result
    run.log(f"{mark} the final check: training with and without the cache, interleaved (a cache never ships slower)")
    r.final, r.measurement = check_cache(run.config, run.overrides, r.cache, blocks=run.options["blocks"],
                                         block_steps=run.options["block_steps"], host_bound=r.host_bound, log=run.log)


def _fp8_plan(run: _Run, mark: str) -> None:
    from primus_perf.tuner.fp8 import tune_trainer

    run.log(f"{mark} FP8: tuning the plan (layer groups in the step, then the loss check) -> {run.result.cache}")
    run.result.fp8 = tune_trainer(run.config, run.overrides, run.result.cache, log=run.log)


def _step(run: _Run, mark: str) -> None:
    from primus_perf.tuner.step.tune import tune_config

    cache = run.result.cache if run.result.cache is not None and run.result.cache.is_file() else None
    run.log(f"{mark} step: searching the step's levers{' with the kernel cache' if cache else ''}"
            f" -> {run.out / 'step'}")
    run.result.step = tune_config(run.config, run.overrides, run.out / "step", log=run.log,
                                  cache=str(cache) if cache else None, budget_min=run.options["step_budget_min"])


# the kernel stages (after the analysis) stop where one says why; the step tuner runs after them
# on any machine, unless the tuning was interrupted
KERNEL_STAGES = (_tune, _confirm, _final_check)


def run_loop(config: str = "tiny", overrides: Sequence[str] = (), out_dir: str | Path = "runs/quickstart",
             *, steps: int = 3, budget_s: float = 2.0, blocks: int = 4, block_steps: int = 5,
             log: Log = lambda _m: None, tune_progress: Any = None, fp8: bool = False, step: bool = False,
             step_budget_min: float = 20.0) -> LoopResult:
    """The loop's stages in turn (the module docstring), each saying ``i/N`` and what it does;
    ``fp8``: then tune the FP8 plan (``tuner.fp8.tune_trainer``) into the same cache; ``step``:
    then the step tuner (``tuner.step.tune.tune_config`` into ``out_dir/step``, the kernel cache one of its
    levers), on a CPU too."""
    run = _Run(config, tuple(overrides), Path(out_dir), log=log, options=dict(
        steps=steps, budget_s=budget_s, blocks=blocks, block_steps=block_steps, tune_progress=tune_progress,
        step_budget_min=step_budget_min))
    stages = (_profile, _analyze, *KERNEL_STAGES, *((_fp8_plan,) if fp8 else ()), *((_step,) if step else ()))
    for i, stage in enumerate(stages, 1):
        r = run.result
        if r is not None and ((r.tune_run is not None and r.tune_run.interrupted)  # Ctrl-C: nothing more
                              or (r.tuning_skipped is not None and stage is not _step)):
            continue
        why = stage(run, f"{i}/{len(stages)}")
        if why is not None:
            run.result.tuning_skipped = why
    return run.result
