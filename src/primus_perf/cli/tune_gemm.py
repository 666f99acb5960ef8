"""``primus-tune gemm``."""

from __future__ import annotations

from typing import Optional

import typer

from primus_perf.cli.common import console
from primus_perf.cli.tune_online import (
    CONFIG_HELP,
    ONLINE,
    STEPS_HELP,
    refuse_offline_extras,
    run_online,
)
from primus_perf.tracelens.inputs import check_traces


def register(app: typer.Typer) -> None:
    @app.command("gemm")
    def gemm_cmd(
        args: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional)
            None, help="With --online: config overrides key=value (with --config), or the program to run after --"),
        online: bool = ONLINE,
        config: Optional[str] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),  # noqa: UP045
        steps: int = typer.Option(3, "--steps", min=1, help=STEPS_HELP),
        problems: Optional[list[str]] = typer.Option(None, "--problems", help="JSON/YAML problems file(s)"),  # noqa: UP045
        problem: Optional[list[str]] = typer.Option(  # noqa: UP045
            None, "--problem", help="A problem M,N,K[,layout,dtype] (torch's [M,K] @ [K,N]; layout TN, dtype bf16 by"
                                    " default) or its label as analyze prints it, e.g. '8192x4096x14336 bf16 TN'"
                                    " (repeatable)"),
        from_trace: Optional[list[str]] = typer.Option(None, "--from-trace", "--trace", help="Profiler trace(s) or run directories"),  # noqa: UP045
        budget_s: float = typer.Option(5.0, "--budget-s", min=0.001, help="Time budget per problem"),
        widen: bool = typer.Option(False, "--widen", help="Also try split-K variants of the top heuristics"),
        cache: str = typer.Option("tuning_cache.json", "--cache", help="Cache file to write"),
        dry_run: bool = typer.Option(False, "--dry-run", help="List the problems, tune nothing"),
        gpus: str = typer.Option("1", "--gpus", help="GPUs to tune on: a number or 'all' (one worker process each)"),
    ) -> None:
        """Tune GEMM problems with cuBLASLt/hipBLASLt and write the cache after each problem
        (resumes: problems already in the cache for this GPU and library are skipped).

        This is offline tuning (--offline, the default), before a run. To tune inside a run
        instead (the first steps time each new problem's candidates on the GPU, then write
        the cache): --online --config PRESET [overrides] (the trainer, --steps steps) or
        --online -- script.py args (any program, under primus_perf.enable)."""
        from functools import partial

        from primus_perf.cli.tune_run import list_problems, run_tuning
        from primus_perf.tuner.gemm.plugin import GemmTuner
        from primus_perf.tuner.multi_gpu import resolve_gpus
        from primus_perf.tuner.problems_input import gather_problems

        if online:
            run_online("gemm", cache, config, steps, args or ())
        refuse_offline_extras(config, args or ())
        check_traces(from_trace or ())
        n_gpus = resolve_gpus(gpus)
        with console.status("reading the problems"):
            probs = gather_problems("gemm", traces=from_trace or (), files=problems or (), specs=problem or ())
        if dry_run:
            list_problems(probs, "GEMM")
            return
        run_tuning(probs, partial(GemmTuner, widen=widen), cache, budget_s=budget_s, gpus=n_gpus)
