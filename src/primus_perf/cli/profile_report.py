"""``primus-profile report``, ``compare``, ``bench`` and ``gate``."""

from __future__ import annotations

import typer

from primus_perf.cli.common import not_yet_available


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd() -> None:
        """Self-contained HTML report of one or more traces."""
        not_yet_available("primus-profile report")

    @app.command("compare")
    def compare_cmd() -> None:
        """Compare two traces or two runs."""
        not_yet_available("primus-profile compare")

    @app.command("bench")
    def bench_cmd() -> None:
        """Measure the trainer repeatedly for the regression gate."""
        not_yet_available("primus-profile bench")

    @app.command("gate")
    def gate_cmd() -> None:
        """Pass or fail a candidate against a baseline."""
        not_yet_available("primus-profile gate")
