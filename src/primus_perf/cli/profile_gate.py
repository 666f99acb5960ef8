"""``primus-profile bench`` and ``gate``: repeated measurements and the regression gate."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Optional

import typer

from primus_perf.base.errors import Interrupted
from primus_perf.base.files import check_writable, write_output
from primus_perf.cli.common import JSON_HELP, console, err_console
from primus_perf.cli.render import new_table, print_table, signed_pct, step_progress
from primus_perf.gate.gate import (
    DEFAULT_ALPHA,
    DEFAULT_PROFILE_STEPS,
    gate,
    metric_value,
    parse_fraction,
)


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench_cmd(
        overrides: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional)
            None, help="Config overrides key=value, e.g. train.micro_batch=2 (as in primus-train)"
        ),
        config: str = typer.Option(..., "--config", "-c", help="Trainer preset name or YAML path."),
        repeat: int = typer.Option(20, "--repeat", min=1, help="Measured steps after warm-up."),
        warmup: int = typer.Option(3, "--warmup", min=0, help="Steps run before measuring."),
        profile_steps: int = typer.Option(
            DEFAULT_PROFILE_STEPS, "--profile-steps", min=0,
            help="Profiled steps for per-category GPU times (0: none); the default catches a 5% change"
            " at 2% noise in 99% of cases."),
        output: Path = typer.Option(Path("samples.json"), "-o", "--output", help="Samples file to write."),
    ) -> None:
        """Measure the trainer repeatedly for the regression gate."""
        from primus_perf.gate.bench import (  # loads torch: only for this command
            bench,
            write_samples,
        )

        check_writable(output)  # before minutes of measuring
        done = [0, repeat + warmup + profile_steps]
        with step_progress("bench", err_console) as advance:

            def progress(n: int, total: int) -> None:
                done[:] = [n, total]
                advance(n, total)

            try:
                data = bench(config, overrides=list(overrides or []), repeat=repeat, warmup=warmup,
                             profile_steps=profile_steps, progress=progress)
            except KeyboardInterrupt:
                raise Interrupted(f"after {done[0]} of {done[1]} steps; nothing was written") from None
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
        alpha: float = typer.Option(DEFAULT_ALPHA, "--alpha", help="Significance level of the one-sided test."),
        allow_mismatch: bool = typer.Option(
            False, "--allow-mismatch", help="Gate samples of different configs, overrides or devices (else exit 2)."),
        json_out: Optional[str] = typer.Option(None, "--json", help=JSON_HELP),  # noqa: UP045
    ) -> None:
        """Pass or fail a candidate against a baseline (exit 0 pass, 1 regression, 2 bad input,
        3 inconclusive).

        A metric regresses when a one-sided Mann-Whitney U test is significant at --alpha
        AND the ratio of medians is worse than --max-regression. It is inconclusive when it
        does not regress but its 95% interval reaches past --max-regression: the noise hides
        the answer (take more samples or quiet the machine). Refused (exit 2): sample
        sizes that cannot reach significance at --alpha, and samples of different configs,
        overrides or devices unless --allow-mismatch. Each side's noise (CV) is shown.
        """
        result = gate(baseline, candidate, metrics=metric, max_regression=parse_fraction(max_regression),
                      alpha=alpha, allow_mismatch=allow_mismatch)
        if json_out is not None:
            write_output(json_out, json.dumps(result.to_dict(), indent=1))
            if json_out == "-":
                sys.exit(result.exit_code)
        table = new_table(f"gate on {result.device}: max regression {result.max_regression:.1%}, alpha {alpha}",
                          ("metric", "n", "baseline median", "candidate median", "change (worse +)", "95% CI",
                           "p (worse)", "CV base/cand", "verdict"), {"metric", "verdict"})
        for v in result.verdicts:
            verdict = {"REGRESSION": "[red]REGRESSION[/]", "INCONCLUSIVE": "[yellow]INCONCLUSIVE[/]",
                       "improved": "[green]improved[/]"}.get(v.verdict, v.verdict)
            table.add_row(v.metric, f"{v.n_baseline}/{v.n_candidate}", metric_value(v.metric, v.baseline_median),
                          metric_value(v.metric, v.candidate_median), signed_pct(v.change),
                          f"[{signed_pct(v.ci_low)}, {signed_pct(v.ci_high)}]", f"{v.p_value:.3g}",
                          f"{v.cv_baseline:.1%}/{v.cv_candidate:.1%}", verdict)
        print_table(table)
        for note in result.notes:
            console.print(f"[yellow]note:[/] {note}")
        console.print({"PASS": "[bold green]PASS[/]", "FAIL": "[bold red]FAIL: REGRESSION[/]",
                       "INCONCLUSIVE": "[bold yellow]INCONCLUSIVE: the noise is too large to judge the change[/]"}
                      [result.verdict])
        sys.exit(result.exit_code)
