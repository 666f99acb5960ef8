"""``primus-tune attention``: search Triton tiles, race SDPA backends, write the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from primus_perf.cli.common import console
from primus_perf.files import write_json


def register(app: typer.Typer) -> None:
    @app.command("attention")
    def attention_cmd(
        problem: Optional[list[str]] = typer.Option(  # noqa: UP045 (typer needs Optional)
            None, "--problem", "-p", help="b,hq,hkv,s,d,causal|full (repeatable)"
        ),
        from_trace: Optional[list[Path]] = typer.Option(  # noqa: UP045
            None, "--from-trace", help="Kineto trace(s): tune their SDPA problems (repeatable)"
        ),
        problems_file: Optional[Path] = typer.Option(  # noqa: UP045
            None, "--problems", help="Problems file of `primus-profile shapes` (its attention problems)"
        ),
        dtype: str = typer.Option("bf16", "--dtype", help="bf16 or f16 (for --problem)"),
        strategy: str = typer.Option("grid", "--strategy", help="grid (exhaustive) or tpe (optuna)"),
        trials: Optional[int] = typer.Option(None, "--trials", help="tpe trials (default: 20% of the grid)"),  # noqa: UP045
        cache: Optional[Path] = typer.Option(None, "--cache", help="Tuning cache to write the choices to"),  # noqa: UP045
        study_db: Optional[Path] = typer.Option(  # noqa: UP045
            None, "--study-db", help="SQLite file for tpe studies (resume an interrupted search)"
        ),
        json_out: Optional[Path] = typer.Option(None, "--json", help="Write all results as JSON"),  # noqa: UP045
    ) -> None:
        """Tune attention: Triton tile configs (forward + backward) against every torch SDPA
        backend; the fastest per problem goes to the cache."""
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        from primus_perf.devices import require_gpu
        from primus_perf.errors import UserError
        from primus_perf.tuner.attention.spec import STRATEGIES, check_tunable, parse_problem_spec

        if strategy not in STRATEGIES:
            raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if trials is not None and trials <= 0:
            raise UserError("--trials must be positive")
        problems = [parse_problem_spec(s, dtype) for s in problem or []]
        if from_trace:
            from primus_perf.tracelens.shapes import problems_from_traces

            with console.status("analyzing the trace(s)"):
                problems += [p for p, _ in problems_from_traces([str(t) for t in from_trace])[1]]
        if problems_file is not None:
            from primus_perf.tracelens.shapes import load_problems

            problems += [p for p, _ in load_problems(problems_file)[1]]
        problems = list(dict.fromkeys(problems))
        if not problems:
            raise UserError("nothing to tune: give --problem, --problems or --from-trace")
        for p in problems:
            check_tunable(p)
        ident = require_gpu()
        from primus_perf.tuner.attention.configs import default_space
        from primus_perf.tuner.attention.search import grid_size
        from primus_perf.tuner.attention.tune import tune_problem

        results = []
        for p in problems:
            space = default_space(ident.vendor, p.head_dim)
            n_f, n_b = grid_size(space, p, ident.arch)
            total = n_f + n_b if strategy == "grid" else (trials or max(4, int(0.2 * (n_f + n_b))))
            with Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("{task.fields[last]}"), console=console,
            ) as bar:
                task = bar.add_task(str(p), total=total, last="")
                res = tune_problem(
                    p, strategy=strategy, trials=trials, space=space, storage=study_db,
                    progress=lambda label, t=task: bar.update(t, advance=1, last=label),
                )
            results.append(res)
            render(res)
        if cache is not None:
            from primus_perf.tuner.attention.cache_io import save_results

            n = save_results(results, cache)
            console.print(f"wrote {n} attention entr{'y' if n == 1 else 'ies'} to {cache}")
        if json_out is not None:
            write_json(json_out, [r.to_dict() for r in results], indent=1, default=float)


def render(res) -> None:
    from rich.table import Table

    table = Table(title=f"{res.problem}  ({res.search.strategy}: {res.search.measured} configs measured)")
    for col in ("backend", "config", "fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd ms", "vs default"):
        table.add_column(col, justify="left" if col in ("backend", "config") else "right")
    for row in res.rows():
        mark = "[bold green]* " if row["selected"] else "  "
        if row["status"] != "ok":
            table.add_row(mark + row["backend"], "unavailable", "", "", "", "")
            continue
        table.add_row(
            mark + row["backend"], row["config"], f"{row['fwd_tflops']:.0f}", f"{row['bwd_tflops']:.0f}",
            f"{row['total_ms']:.3f}", f"{row['speedup']:.2f}x",
        )
    console.print(table)
    console.print(f"selected: [bold]{res.selected}[/]  speedup over torch default: {res.speedup:.2f}x")
