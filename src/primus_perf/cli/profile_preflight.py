"""``primus-profile preflight``: check GPUs, links and hosts before a job trains."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from primus_perf.cli.common import console
from primus_perf.cli.render import print_table


def register(app: typer.Typer) -> None:
    @app.command("preflight")
    def preflight_cmd(
        json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON"),  # noqa: UP045
        html_out: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the report as HTML"),  # noqa: UP045
        threshold: float = typer.Option(0.9, "--threshold", help="Flag a GPU or link below this fraction of its peers' median"),
        disk: Path = typer.Option(Path("."), "--disk", help="Where free disk space is checked"),
    ) -> None:
        """Per GPU: bf16/FP8 GEMM TFLOP/s, HBM bandwidth, clocks, power, temperature, ECC;
        across ranks (under torchrun, any number of nodes): collective bus bandwidth and the
        P2P matrix; the host: CPU, memory, disk, NCCL/RCCL variables. Each figure against
        its expected value and its peers' median. Exit code 1 when a check fails."""
        from primus_perf.base.errors import UserError
        from primus_perf.profiler.preflight import preflight
        from primus_perf.profiler.preflight.render import preflight_table, write_json, write_page

        if not 0 < threshold <= 1:
            raise UserError(f"--threshold must be in (0, 1], got {threshold}")
        def publish(report) -> None:  # rank 0 speaks for the job; the others wait for it
            print_table(preflight_table(report))
            for note in report.skipped:
                console.print(f"note: {note}", highlight=False, soft_wrap=True)
            if json_out is not None:
                write_json(report, json_out)
            if html_out is not None:
                write_page(report, html_out)
            failed = len(report.failed)
            console.print("preflight passed" if not failed else f"[red]preflight failed:[/] {failed} check(s) flagged",
                          highlight=False)

        report = preflight(threshold=threshold, disk_path=disk, publish=publish)
        raise typer.Exit(report.exit_code)
