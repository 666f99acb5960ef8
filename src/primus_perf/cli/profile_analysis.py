"""``primus-profile analyze`` and ``shapes``: explain a trace."""

from __future__ import annotations

import typer

from primus_perf.cli.common import not_yet_available


def register(app: typer.Typer) -> None:
    @app.command("analyze")
    def analyze_cmd() -> None:
        """Breakdown, hotspots and GEMM/attention problems of one or more traces."""
        not_yet_available("primus-profile analyze")

    @app.command("shapes")
    def shapes_cmd() -> None:
        """Write the unique GEMM and attention problems of traces for the tuners."""
        not_yet_available("primus-profile shapes")
