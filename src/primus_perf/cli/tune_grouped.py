"""``primus-tune grouped-gemm``: race the grouped-GEMM backends and Triton configs per
pass of the MoE expert GEMMs, write the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from primus_perf.cli.common import console
from primus_perf.cli.tune_online import ONLINE, STEPS_HELP, run_online
from primus_perf.kinds import GROUPED
from primus_perf.tracelens.inputs import check_traces

DEVICES = ("cuda", "cpu")
HELP = f"""Tune MoE grouped GEMMs: the per-expert loop (default), torch._grouped_mm, padded
        bmm and the Triton grouped GEMM's configs, each pass (fwd, dgrad, wgrad) its own
        problem, timed with the launches a step pays; the fastest per problem goes to the
        cache (written after each problem; a rerun resumes). Problems come from profiler
        traces (--trace: the grouped GEMMs a run profiled, `primus-profile run`), problems
        files (items {{"kind": "{GROUPED.name}", "problem": {{...}}}}, `primus-profile shapes`) or
        a short run of a config (--config PRESET [overrides]: --steps steps are trained and
        the grouped GEMMs they ran are tuned); that is --offline, the default. --online tunes
        during the run instead (--config PRESET [overrides], or a program after --), on a
        GPU. primus-train and primus_perf.enable() route them from the cache."""


def register(app: typer.Typer) -> None:
    @app.command("grouped-gemm", help=HELP)
    def grouped_cmd(
        overrides: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional)
            None, help="With --config: config overrides key=value, e.g. model.n_layers=2; with --online and no"
                       " --config: the program to run after --"
        ),
        online: bool = ONLINE,
        problems_file: Optional[list[Path]] = typer.Option(  # noqa: UP045
            None, "--problems", help=f"Problems file(s) with {GROUPED.name} items (repeatable)"
        ),
        from_trace: Optional[list[Path]] = typer.Option(  # noqa: UP045
            None, "--trace", "--from-trace",
            help="Profiler trace(s) or run directories: tune their grouped GEMM problems (repeatable)",
        ),
        config: Optional[str] = typer.Option(  # noqa: UP045
            None, "--config", "-c", help="Preset or YAML: run a few steps, tune the grouped GEMMs they ran"
        ),
        steps: int = typer.Option(3, "--steps", min=1, help=STEPS_HELP),
        triton: bool = typer.Option(True, "--triton/--no-triton", help="Also search the Triton grouped GEMM"),
        max_configs: int = typer.Option(16, "--max-configs", min=0, help="Triton configs raced per problem"),
        budget_s: float = typer.Option(5.0, "--budget-s", min=0.001, help="Time budget per problem for the final race"),
        device: str = typer.Option(
            "cuda", "--device", help="cuda: tune on the GPU (CUDA or ROCm); cpu: for runs on the CPU (Triton interpreted)"
        ),
        cache: str = typer.Option("tuning_cache.json", "--cache", help="Cache file to write"),
        gpus: str = typer.Option("1", "--gpus", help="GPUs to tune on: a number or 'all' (one worker process each)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="List the problems, tune nothing"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="Write all results as JSON"),  # noqa: UP045
    ) -> None:
        """Tune MoE grouped GEMMs (the command's help: ``HELP``)."""
        from functools import partial

        from primus_perf.cli.tune_run import list_problems, run_tuning
        from primus_perf.errors import UserError
        from primus_perf.tuner.grouped.plugin import GroupedGemmTuner
        from primus_perf.tuner.multi_gpu import resolve_gpus
        from primus_perf.tuner.problems_input import gather_problems

        if online:
            run_online(GROUPED.name, cache, config, steps, overrides or ())
        if overrides and config is None:
            raise UserError("config overrides need --config")
        if not (problems_file or from_trace) and config is None:
            raise UserError("nothing to tune: give --trace TRACE, --problems FILE or --config PRESET")
        if device not in DEVICES:
            raise UserError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
        if device == "cpu" and gpus.strip() != "1":
            raise UserError(f"--gpus {gpus} tunes on GPUs; --device cpu tunes in this process")
        n_gpus = resolve_gpus(gpus)
        check_traces(from_trace or ())
        problems, calls = [], {}
        if problems_file or from_trace:
            with console.status("reading the problems"):
                problems += gather_problems(GROUPED.name, traces=from_trace or (), files=problems_file or ())
        if config is not None:
            calls = recorded(config, list(overrides or []), steps)
            problems += [p for p, _ in calls]
        problems = list({p.key(): p for p in problems}.values())
        if dry_run or calls:  # the problems once, with the calls the run made
            list_problems(problems, "grouped GEMM", {p.key(): n for p, n in calls})
        if dry_run:
            return
        make_tuner = partial(GroupedGemmTuner, triton=triton, max_configs=max_configs, device=device)
        results = []
        try:
            run_tuning(problems, make_tuner, cache, budget_s=budget_s, gpus=n_gpus, on_done=results.append)
        finally:
            if json_out is not None:
                from primus_perf.files import write_json

                write_json(json_out, [r.to_dict() for r in results], indent=1, default=float)


def recorded(config: str, overrides: list[str], steps: int) -> list:
    """The grouped problems ``steps`` training steps of the config ran, each with its calls."""
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.grouped_problems import record_grouped_problems

    cfg = load_config(config, [*overrides, f"train.steps={max(steps, 1)}"])
    with console.status(f"recording the grouped GEMMs of {steps} steps of {config}"):
        return record_grouped_problems(cfg, steps)
