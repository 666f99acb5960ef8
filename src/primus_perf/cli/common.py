"""What every CLI shares: user errors as one line and exit code 2, a console."""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer
from rich.console import Console

from primus_perf.errors import UserError

console = Console()
err_console = Console(stderr=True)


def run_app(app: typer.Typer | Callable[[], object]) -> None:
    """Run a typer app (standalone: usage errors and --help as click does them); a
    UserError becomes ``error: <message>`` on one line and its exit code."""
    try:
        app()
    except UserError as exc:
        message = " ".join(str(exc).split())
        err_console.print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
