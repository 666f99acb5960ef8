"""What ``primus-tune gemm`` and ``primus-tune attention`` share: the progress bars, the
result table, and the end of a run (summary line; on Ctrl-C the table so far, how to
resume, exit 130)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from primus_perf.base.devices import require_gpu
from primus_perf.base.entry import EXIT_INTERRUPTED
from primus_perf.cli.common import console
from primus_perf.cli.render import print_table
from primus_perf.tuner import core
from primus_perf.tuner.multi_gpu import MultiGpuRun, flops_of, tune_on_gpus

EXIT_WORKER_FAILED = 1


def tflops(flops: int, seconds: float | None) -> str:
    """TFLOP/s: whole numbers, three significant digits below 10 (small or CPU problems)."""
    if not seconds:
        return "-"
    rate = flops / seconds / 1e12
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.3g}"


class RichProgress(core.Progress):
    """One bar over the problems; the current step beside it."""

    def __init__(self, bar: Progress, on_done: Callable[[core.TuneResult], None]) -> None:
        self.bar = bar
        self.task = bar.add_task("tuning", total=None, last="")
        self.on_done = on_done

    def start(self, total: int) -> None:
        self.bar.update(self.task, total=total)

    def problem(self, problem: Any, index: int) -> None:
        self.bar.update(self.task, description=str(problem), last="")

    def step(self, label: str) -> None:
        self.bar.update(self.task, last=label)

    def done(self, result: core.TuneResult) -> None:
        self.bar.advance(self.task)
        self.on_done(result)


def tuning_bar(transient: bool = False) -> Progress:
    """The bar over the problems a tuning run shows (:class:`RichProgress` drives it)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[last]}"), console=console, transient=transient)


def results_table(results: Sequence[core.TuneResult]) -> Table:
    table = Table(Column("problem", no_wrap=True), *(Column(col, justify="right") for col in (
        "default ms", "tuned ms", "default TFLOP/s", "tuned TFLOP/s", "speedup (how measured)")), "choice")
    for r in results:
        flops = flops_of(r.problem)
        table.add_row(
            str(r.problem),
            f"{r.default_s * 1e3:.3f}" if r.default_s else "-",
            f"{r.tuned_s * 1e3:.3f}" if r.tuned_s else "-",
            tflops(flops, r.default_s),
            tflops(flops, r.tuned_s),
            escape(r.entry.claim()) if r.cached else (f"{r.speedup:.3f}x {r.entry.measured_by}" if r.speedup else "-"),
            f"{r.chosen} (cached)" if r.cached else r.chosen,
        )
    return table


def list_problems(problems: Sequence[Any], noun: str, calls: dict[str, int] | None = None) -> None:
    """``--dry-run``: each problem once (its label, as every command prints it, two spaces,
    its cache key; ``calls``: per key, the calls a recorded run made), then how many."""
    for p in problems:
        n = (calls or {}).get(p.key())
        console.print(f"{p}  {p.key()}" + (f"  ({n} calls)" if n else ""), highlight=False, soft_wrap=True)
    console.print(f"{len(problems)} unique {noun} problems")


def run_tuning(
    problems: Sequence[Any],
    make_tuner: Callable[[], core.Tuner],
    cache: str,
    *,
    budget_s: float = 5.0,
    gpus: int = 1,
    on_done: Callable[[core.TuneResult], None] = lambda _r: None,
) -> core.TuneRun:
    """Tune (on ``gpus`` GPUs, one worker each, when more than one) with progress bars,
    print the table, each GPU's start-up and share (several GPUs) and the summary; on
    Ctrl-C print the table so far and the resume hint, and exit 130; when a GPU's worker
    failed, say which and exit 1."""
    tuner = make_tuner()
    if gpus == 1 and getattr(tuner, "device", "cuda") != "cpu":
        require_gpu()  # said before a progress bar is drawn
    with tuning_bar() as bar:
        progress = RichProgress(bar, on_done)
        if gpus > 1:
            run = tune_on_gpus(problems, cache=cache, make_tuner=make_tuner, gpus=gpus,
                               budget_s=budget_s, progress=progress)
        else:
            run = core.tune(problems, cache=cache, tuners=[tuner], budget_s=budget_s,
                            progress=progress)
    print_table(results_table(run.results))
    if isinstance(run, MultiGpuRun):
        for worker in run.workers:
            console.print(worker.summary(), highlight=False, soft_wrap=True)
    for failure in run.failures:
        console.print(f"[red]failed:[/] {failure}", highlight=False, soft_wrap=True)
    if run.failures or run.interrupted:
        kept = (f"{run.tuned} tuned and {run.cached} already cached are in {cache};"
                f" {len(run.remaining)} left. Resume with the same command.")
        console.print(kept if run.failures else f"interrupted: {kept}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_WORKER_FAILED if run.failures else EXIT_INTERRUPTED)
    console.print(f"{run.tuned} tuned, {run.cached} already in the cache; written to {cache}",
                  highlight=False, soft_wrap=True)
    return run
