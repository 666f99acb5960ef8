"""``primus-profile report``, ``compare``, ``bench`` and ``gate``."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import typer
from rich.progress import Progress
from rich.table import Table

from primus_perf.cli.common import console, err_console
from primus_perf.gate.gate import gate, parse_fraction
from primus_perf.tracelens.compare import compare
from primus_perf.tracelens.report import build_report
from primus_perf.tracelens.report_html import write_html, write_report_json


def _fmt_pct(v: float) -> str:
    return f"{v * 100:+.2f}%"


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd(
        traces: list[Path] = typer.Argument(..., help="Trace files (one per rank) or a run directory."),
        output: Path = typer.Option(Path("report.html"), "-o", "--output", help="HTML file to write."),
        json_out: Path | None = typer.Option(None, "--json", help="Also write the report data as JSON here."),
        cache: Path | None = typer.Option(None, "--cache", help="Tuning cache: mark problems tuned/untuned."),
        title: str | None = typer.Option(None, "--title", help="Report title."),
    ) -> None:
        """Self-contained HTML report of one or more traces."""
        data = build_report([str(t) for t in traces], cache=cache, title=title)
        path = write_html(data, output)
        if json_out is not None:
            write_report_json(data, json_out)
        h = data["header"]
        console.print(
            f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB): {h['device']}, "
            f"{len(h['ranks'])} rank(s), {h['steps']} step(s), {len(data['hotspots'])} hotspots, "
            f"{len(data['gemm'])} GEMM and {len(data['attention'])} attention problems"
        )
        for note in data["notes"]:
            err_console.print(f"[yellow]note:[/] {note}")

    @app.command("compare")
    def compare_cmd(
        base: Path = typer.Argument(..., help="Base trace file or run directory."),
        candidate: Path = typer.Argument(..., help="Candidate trace file or run directory."),
        output: Path | None = typer.Option(None, "-o", "--output", help="Write an HTML diff here."),
        json_out: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
        top: int = typer.Option(15, "--top", help="Op deltas to print."),
    ) -> None:
        """Compare two traces or two runs."""
        data = compare(str(base), str(candidate))
        if output is not None:
            write_html(data, output)
        if json_out:
            console.print_json(json.dumps(data))
            return
        console.print(f"[bold]{data['verdict']}[/]")
        table = Table(title="breakdown (ms per step)")
        for col in ("category", "base", "candidate", "delta", "change"):
            table.add_column(col, justify="left" if col == "category" else "right")
        for r in data["breakdown"]:
            table.add_row(r["category"], f"{r['base_ms']:.3f}", f"{r['candidate_ms']:.3f}",
                          f"{r['delta_ms']:+.3f}", "–" if r["rel"] is None else _fmt_pct(r["rel"]))
        console.print(table)
        ops = Table(title=f"largest op deltas (top {top}, ms per step)")
        for col in ("family", "shape", "ops", "base", "candidate", "delta", "present in"):
            ops.add_column(col, justify="right" if col in ("base", "candidate", "delta") else "left")
        for r in sorted(data["ops"], key=lambda r: -abs(r["delta_ms"]))[:top]:
            names = dict.fromkeys(n for n in (r["base_op"], r["candidate_op"]) if n)
            ops.add_row(r["family"], r["shape"], " → ".join(names), f"{r['base_ms']:.3f}",
                        f"{r['candidate_ms']:.3f}", f"{r['delta_ms']:+.3f}", r["side"])
        console.print(ops)
        if output is not None:
            console.print(f"wrote {output}")

    @app.command("bench")
    def bench_cmd(
        config: str = typer.Option(..., "--config", help="Trainer preset name or YAML path."),
        repeat: int = typer.Option(20, "--repeat", help="Measured steps after warm-up."),
        warmup: int = typer.Option(3, "--warmup", help="Steps run before measuring."),
        profile_steps: int = typer.Option(5, "--profile-steps", help="Profiled steps for per-category GPU times (0: none)."),
        output: Path = typer.Option(Path("samples.json"), "-o", "--output", help="Samples file to write."),
        overrides: list[str] = typer.Option([], "--set", help="Config override key=value (repeatable)."),
    ) -> None:
        """Measure the trainer repeatedly for the regression gate."""
        from primus_perf.gate.bench import (  # loads torch: only for this command
            bench,
            write_samples,
        )

        with Progress(console=err_console, transient=True) as bar:
            task = bar.add_task("bench", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            data = bench(config, overrides=overrides, repeat=repeat, warmup=warmup,
                         profile_steps=profile_steps, progress=progress)
        write_samples(data, output)
        st = data["metrics"]["step_time"]
        console.print(
            f"wrote {output}: {data['device']['name']}, {len(st)} steps, median step "
            f"{statistics.median(st) * 1e3:.2f} ms, metrics: {', '.join(data['metrics'])}"
        )
        for note in data["notes"]:
            err_console.print(f"[yellow]note:[/] {note}")

    @app.command("gate")
    def gate_cmd(
        baseline: Path = typer.Option(..., "--baseline", help="Baseline samples (primus-profile bench)."),
        candidate: Path = typer.Option(..., "--candidate", help="Candidate samples."),
        max_regression: str = typer.Option("3%", "--max-regression", help="Allowed slowdown, e.g. 3% or 0.03."),
        metric: list[str] = typer.Option(["step_time"], "--metric", help="Metric(s) to gate on (repeatable)."),
        alpha: float = typer.Option(0.01, "--alpha", help="Significance level of the one-sided test."),
        json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ) -> None:
        """Pass or fail a candidate against a baseline (exit 0 pass, 1 regression, 2 bad input).

        A metric regresses when a one-sided Mann-Whitney U test is significant at --alpha
        AND the ratio of medians is worse than --max-regression.
        """
        result = gate(baseline, candidate, metrics=metric, max_regression=parse_fraction(max_regression),
                      alpha=alpha)
        if json_out:
            print(json.dumps(result.to_dict(), indent=1))
            sys.exit(result.exit_code)
        table = Table(title=f"gate on {result.device}: max regression {result.max_regression:.1%}, alpha {alpha}")
        for col in ("metric", "n", "baseline median", "candidate median", "change (worse +)",
                    "95% CI", "p (worse)", "verdict"):
            table.add_column(col, justify="left" if col in ("metric", "verdict") else "right")
        for v in result.verdicts:
            verdict = ("[red]REGRESSION[/]" if v.regression else
                       "[green]improved[/]" if v.improvement else "ok")
            table.add_row(v.metric, f"{v.n_baseline}/{v.n_candidate}", f"{v.baseline_median:.6g}",
                          f"{v.candidate_median:.6g}", _fmt_pct(v.change),
                          f"[{_fmt_pct(v.ci_low)}, {_fmt_pct(v.ci_high)}]", f"{v.p_value:.3g}", verdict)
        console.print(table)
        for note in result.notes:
            console.print(f"[yellow]note:[/] {note}")
        console.print("[bold green]PASS[/]" if result.passed else "[bold red]FAIL: REGRESSION[/]")
        sys.exit(result.exit_code)
