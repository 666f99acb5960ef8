"""``primus-tune cache show|merge|export``."""

from __future__ import annotations

import typer

from primus_perf.cli.common import not_yet_available


def register(app: typer.Typer) -> None:
    @app.command("show")
    def show_cmd() -> None:
        """List the entries of a tuning cache."""
        not_yet_available("primus-tune cache show")
