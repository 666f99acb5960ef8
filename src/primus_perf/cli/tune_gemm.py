"""``primus-tune gemm``."""

from __future__ import annotations

import typer

from primus_perf.cli.common import not_yet_available


def register(app: typer.Typer) -> None:
    @app.command("gemm")
    def gemm_cmd() -> None:
        """Tune GEMM problems with cuBLASLt/hipBLASLt and write the cache."""
        not_yet_available("primus-tune gemm")
