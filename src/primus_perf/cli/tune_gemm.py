"""``primus-tune gemm``."""

from __future__ import annotations

from typing import Optional

import typer

from primus_perf.cli.common import check_trace_args, console


def register(app: typer.Typer) -> None:
    @app.command("gemm")
    def gemm_cmd(
        problems: Optional[list[str]] = typer.Option(None, "--problems", help="JSON/YAML problems file(s)"),  # noqa: UP045
        from_trace: Optional[list[str]] = typer.Option(None, "--from-trace", "--trace", help="Profiler trace(s) or run directories"),  # noqa: UP045
        budget_s: float = typer.Option(5.0, "--budget-s", min=0.001, help="Time budget per problem"),
        widen: bool = typer.Option(False, "--widen", help="Also try split-K variants of the top heuristics"),
        cache: str = typer.Option("tuning_cache.json", "--cache", help="Cache file to write"),
        dry_run: bool = typer.Option(False, "--dry-run", help="List the problems, tune nothing"),
        gpus: str = typer.Option("1", "--gpus", help="GPUs to tune on: a number or 'all' (one worker process each)"),
    ) -> None:
        """Tune GEMM problems with cuBLASLt/hipBLASLt and write the cache after each problem
        (resumes: problems already in the cache for this GPU and library are skipped).

        This is offline tuning, before a run. To tune inside the run instead (the first
        steps time each new problem's candidates, then write the cache), use
        tuning.online=true in primus-train, or primus_perf.enable(cache, online=True) /
        python -m primus_perf.launch --cache PATH --online -- script.py in any program."""
        from functools import partial

        from primus_perf.cli.tune_run import list_problems, run_tuning
        from primus_perf.tuner.gemm.plugin import GemmTuner
        from primus_perf.tuner.multi_gpu import resolve_gpus
        from primus_perf.tuner.problems_input import gather_problems

        check_trace_args(from_trace or ())
        n_gpus = resolve_gpus(gpus)
        with console.status("reading the problems"):
            probs = gather_problems("gemm", traces=from_trace or (), files=problems or ())
        if dry_run:
            list_problems(probs, "GEMM")
            return
        run_tuning(probs, partial(GemmTuner, widen=widen), cache, budget_s=budget_s, gpus=n_gpus)
