"""``primus-tune attention``: search Triton tiles, race the SDPA backends, write the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from primus_perf.cli.render import print_table
from primus_perf.cli.tune_online import (
    CONFIG_HELP,
    ONLINE,
    STEPS_HELP,
    refuse_offline_extras,
    run_online,
)
from primus_perf.tracelens.inputs import check_traces
from primus_perf.tuner.attention.space import STRATEGIES


def register(app: typer.Typer) -> None:
    @app.command("attention")
    def attention_cmd(
        args: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional)
            None, help="With --online: config overrides key=value (with --config), or the program to run after --"),
        online: bool = ONLINE,
        config: Optional[str] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),  # noqa: UP045
        steps: int = typer.Option(3, "--steps", min=1, help=STEPS_HELP),
        problem: Optional[list[str]] = typer.Option(  # noqa: UP045 (typer needs Optional)
            None, "--problem", "-p", help="b,hq,hkv,s,d,causal|full (repeatable)"
        ),
        from_trace: Optional[list[Path]] = typer.Option(  # noqa: UP045
            None, "--from-trace", "--trace", help="Profiler trace(s) or run directories: tune their SDPA problems (repeatable)"
        ),
        problems_file: Optional[list[Path]] = typer.Option(  # noqa: UP045
            None, "--problems", help="Problems file(s) (`primus-profile shapes`): their attention problems"
        ),
        dtype: str = typer.Option("bf16", "--dtype", help="bf16 or f16 (fp16, float16 accepted) for --problem"),
        strategy: str = typer.Option("grid", "--strategy", help=f"{' or '.join(STRATEGIES)}: exhaustive, or optuna's TPE"),
        trials: Optional[int] = typer.Option(None, "--trials", min=1, help="tpe trials (default: 20% of the grid)"),  # noqa: UP045
        budget_s: float = typer.Option(5.0, "--budget-s", min=0.001, help="Time budget per problem for the final race"),
        cache: str = typer.Option("tuning_cache.json", "--cache", help="Cache file to write"),
        study_db: Optional[Path] = typer.Option(  # noqa: UP045
            None, "--study-db", help="SQLite file for tpe studies (resume an interrupted search)"
        ),
        json_out: Optional[Path] = typer.Option(None, "--json", help="Write all results as JSON"),  # noqa: UP045
        dry_run: bool = typer.Option(False, "--dry-run", help="List the problems, tune nothing"),
        gpus: str = typer.Option("1", "--gpus", help="GPUs to tune on: a number or 'all' (one worker process each)"),
    ) -> None:
        """Tune attention: Triton tile configs (forward + backward) against every torch SDPA
        backend; the fastest per problem goes to the cache, written after each problem.
        --offline (the default) tunes the listed problems now; --online tunes during a run
        (--config PRESET [overrides], or a program after --)."""
        from functools import partial

        from primus_perf.cli.tune_run import list_problems, run_tuning
        from primus_perf.errors import UserError
        from primus_perf.problems import canonical_dtype
        from primus_perf.tuner.attention.plugin import AttentionTuner
        from primus_perf.tuner.multi_gpu import resolve_gpus
        from primus_perf.tuner.problems_input import gather_problems

        if strategy not in STRATEGIES:
            raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if online:
            run_online("attention", cache, config, steps, args or ())
        refuse_offline_extras(config, args or ())
        check_traces(from_trace or ())
        try:
            dtype = canonical_dtype(dtype)
        except ValueError as exc:
            raise UserError(f"--dtype: {exc}") from None
        n_gpus = resolve_gpus(gpus)
        make_tuner = partial(AttentionTuner, strategy=strategy, trials=trials, storage=study_db)
        problems = gather_problems("attention", traces=from_trace or (), files=problems_file or (),
                                   specs=problem or (), dtype=dtype)
        if dry_run:
            list_problems(problems, "attention")
            return
        results = []

        def done(res) -> None:
            results.append(res)
            if not res.cached:
                render(res)

        try:
            run_tuning(problems, make_tuner, cache, budget_s=budget_s, gpus=n_gpus, on_done=done)
        finally:
            if json_out is not None:
                from primus_perf.files import write_json

                write_json(json_out, [r.to_dict() for r in results], indent=1, default=float)


def render(res) -> None:
    """The candidates of one tuned attention problem: forward and backward rates, status."""
    from rich.table import Table

    from primus_perf.cli.tune_run import tflops
    from primus_perf.kernels.attention.configs import AttnConfig

    search = res.details.get("search")
    title = str(res.problem) + (f"  ({search['strategy']}: {search['measured']} configs measured)" if search else "")
    table = Table(title=title)
    for col in ("backend", "config", "fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd ms", "vs default"):
        table.add_column(col, justify="left" if col in ("backend", "config") else "right")
    p = res.problem
    for c in res.candidates:
        mark = "[bold green]* " if c.status == "chosen" else "  "
        if c.status == "rejected":
            table.add_row(mark + c.name, f"rejected: {c.reason}", "", "", "", "")
            continue
        fwd, bwd = (c.parts.get(part, {}).get("median_s") for part in ("fwd", "bwd"))
        table.add_row(
            mark + c.name + (" (dropped)" if c.status == "dropped" else ""),
            AttnConfig.from_dict(c.config).label() if "fwd" in c.config else "",
            tflops(p.forward_flops, fwd), tflops(p.backward_flops, bwd),
            f"{c.total_s * 1e3:.3f}", f"{res.default_s / c.total_s:.2f}x",
        )
    print_table(table)
