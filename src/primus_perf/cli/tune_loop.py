"""``primus-tune loop``: the whole loop in one command (``loop.pipeline.run_loop``)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

import typer

from primus_perf import kinds
from primus_perf.cli.common import console, err_console, log_line
from primus_perf.cli.render import print_table
from primus_perf.cli.tune_confirm import print_confirmation, print_final


def register(app: typer.Typer) -> None:
    @app.command("loop")
    def loop_cmd(
        overrides: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional)
            None, help="Config overrides key=value, e.g. train.micro_batch=2"
        ),
        config: str = typer.Option("tiny", "--config", "-c", help="Preset name or YAML path"),
        out: Path = typer.Option(Path("runs/quickstart"), "--output", "-o", "--out",
                                 help="Folder for the run, report and cache"),
        steps: int = typer.Option(3, "--steps", min=1, help="Profiled steps"),
        budget_s: float = typer.Option(2.0, "--budget-s", min=0.001, help="Tuning time budget per problem (GPU)"),
        blocks: int = typer.Option(4, "--blocks", min=1,
                                   help="Blocks of steps per side when measuring the speedup (GPU)"),
        fp8: bool = typer.Option(False, "--fp8", help="Then tune the FP8 plan (per layer group, measured in the step;"
                                 " the loss checked against bf16) into the cache (GPU)"),
        step: bool = typer.Option(False, "--step", help="Then search the step's levers (primus-tune step) into"
                                  " OUT/step, the kernel cache one of them"),
        step_budget_min: float = typer.Option(20.0, "--step-budget-min", min=0.1, max=24 * 60,
                                              help="Minutes for the step search"),
    ) -> None:
        """Train under the profiler, analyze the trace and write the HTML report; on a GPU
        also tune the trace's GEMM and attention problems and train again with the cache,
        printing the measured speedup."""
        from primus_perf.base.entry import EXIT_INTERRUPTED
        from primus_perf.cli.tune_run import RichProgress, results_table, tuning_bar
        from primus_perf.loop.pipeline import run_loop

        with tuning_bar(transient=True) as bar:
            res = run_loop(config, list(overrides or []), out, steps=steps, budget_s=budget_s, blocks=blocks,
                           log=log_line, tune_progress=RichProgress(bar, lambda _r: None), fp8=fp8, step=step,
                           step_budget_min=step_budget_min)
        step = f"{res.step_time_s * 1e3:.2f} ms/step" if res.step_time_s else "step time n/a"
        counts = [f"{n} {kinds.get(kind).title}" for kind, n in res.problems.items()
                  if n or kind in (kinds.GEMM.name, kinds.ATTENTION.name)]
        listed = " and ".join([", ".join(counts[:-1]), counts[-1]] if len(counts) > 1 else counts)
        console.print(f"{res.device}: {step}; {listed} problems; report: {res.report}", highlight=False, soft_wrap=True)
        for note in res.notes:
            err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
        if res.step is not None:
            for line in res.step.lines():
                log_line(line)
        if res.tuning_skipped:
            console.print(f"no tuning: {res.tuning_skipped}", highlight=False, soft_wrap=True)
            return
        run = res.tune_run
        print_table(results_table(run.results))
        if run.interrupted:
            console.print(f"interrupted: {run.tuned} tuned and {run.cached} already cached are in {res.cache};"
                          f" {len(run.remaining)} left. Resume with the same command.", highlight=False)
            raise typer.Exit(EXIT_INTERRUPTED)
        if res.confirmation is not None:
            print_confirmation(res.confirmation)
        print_final(res.final)
        m = res.measurement
        if m is not None:
            console.print(
                f"median step: default {statistics.median(m.default_s) * 1e3:.2f} ms [{m.spread('default')[0] * 1e3:.2f}-"
                f"{m.spread('default')[1] * 1e3:.2f}], with the cache {statistics.median(m.tuned_s) * 1e3:.2f} ms "
                f"[{m.spread('tuned')[0] * 1e3:.2f}-{m.spread('tuned')[1] * 1e3:.2f}]; {m.routed_calls} calls used a"
                f" cached choice, {m.fallback_calls} fell back; cache: {res.cache}", highlight=False, soft_wrap=True)
            if not m.losses_match:
                err_console.print(f"[red]warning:[/] one batch's loss with the cache, {m.loss_tuned:.6g}, is not"
                                  f" within {m.LOSS_TOLERANCE:.0%} of the loss without it, {m.loss_default:.6g}"
                                  " (the same weights and data): a tuned kernel computes something else")
        else:
            console.print(f"cache: {res.cache} (every entry the step routes is its baseline: no override installed)",
                          highlight=False, soft_wrap=True)
        if res.fp8 is not None:
            for line in res.fp8.lines():
                console.print(line, highlight=False, soft_wrap=True)
            if res.fp8.refused:
                err_console.print(res.fp8.refused, highlight=False, soft_wrap=True)
