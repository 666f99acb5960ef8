"""``primus-tune attention``."""

from __future__ import annotations

import typer

from primus_perf.cli.common import not_yet_available


def register(app: typer.Typer) -> None:
    @app.command("attention")
    def attention_cmd() -> None:
        """Tune attention: Triton tile configs against torch SDPA backends."""
        not_yet_available("primus-tune attention")
