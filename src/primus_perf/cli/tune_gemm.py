"""``primus-tune gemm``."""

from __future__ import annotations

from typing import Optional

import typer

from primus_perf.cli.common import console


def register(app: typer.Typer) -> None:
    @app.command("gemm")
    def gemm_cmd(
        problems: Optional[str] = typer.Option(None, "--problems", help="JSON/YAML problems file"),  # noqa: UP045
        from_trace: Optional[list[str]] = typer.Option(None, "--from-trace", help="Profiler trace(s)"),  # noqa: UP045
        offline: bool = typer.Option(True, "--offline/--no-offline", help="Tune ahead of training"),
        budget_s: float = typer.Option(5.0, "--budget-s", help="Time budget per problem"),
        cache: str = typer.Option("tuning_cache.json", "--cache", help="Cache file to write"),
        dry_run: bool = typer.Option(False, "--dry-run", help="List the problems, tune nothing"),
    ) -> None:
        """Tune GEMM problems with cuBLASLt/hipBLASLt and write the cache (resumes: problems
        already in the cache for this GPU and library are skipped)."""
        from rich.progress import Progress
        from rich.table import Table

        from primus_perf.errors import UserError
        from primus_perf.tuner.gemm_problems import load_problems

        if not problems and not from_trace:
            raise UserError("give --problems FILE or --from-trace TRACE")
        found = []
        if from_trace:  # ranked by their time in the trace, most expensive first
            from primus_perf.tracelens.shapes import problems_from_traces

            with console.status("analyzing the trace(s)"):
                found += [p for p, _ in problems_from_traces(from_trace)[0]]
        if problems:
            found += load_problems(problems)
        probs = list({p.key(): p for p in found}.values())
        if not probs:
            raise UserError("no GEMM problems found (a trace needs record_shapes=True)")
        if dry_run:
            for p in probs:
                console.print(str(p), highlight=False)
            console.print(f"{len(probs)} unique GEMM problems")
            return
        from primus_perf.tuner.gemm import tune_problems

        table = Table("problem", "default TFLOP/s", "tuned TFLOP/s", "speedup", "choice")
        counts = {"tuned": 0, "cached": 0}
        with Progress(console=console) as progress:
            task = progress.add_task("tuning GEMMs", total=len(probs))

            def done(p, entry, report):
                t, d = entry.times.get("tuned_ms"), entry.times.get("default_ms")
                table.add_row(str(p), f"{p.flops / d / 1e9:.0f}" if d else "-", f"{p.flops / t / 1e9:.0f}" if t else "-",
                              f"{d / t:.3f}x" if t and d else "-",
                              "cached" if report.get("skipped") else str(entry.solution["config"].get("name")))
                counts["cached" if report.get("skipped") else "tuned"] += 1
                progress.advance(task)

            try:
                tune_problems(probs, cache, budget_s, on_done=done)
            except KeyboardInterrupt:
                progress.stop()
                console.print(table)
                left = len(probs) - counts["tuned"] - counts["cached"]
                console.print(f"interrupted: {counts['tuned']} tuned and {counts['cached']} already cached are in "
                              f"{cache}; {left} left, rerun the same command to resume")
                raise typer.Exit(130) from None
        console.print(table)
        console.print(f"{counts['tuned']} tuned, {counts['cached']} already in the cache; written to {cache}")
