"""``primus-profile run``: train under torch.profiler."""

from __future__ import annotations

import typer

from primus_perf.cli.common import not_yet_available


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd() -> None:
        """Train under torch.profiler and write one trace per rank plus a manifest."""
        not_yet_available("primus-profile run")
