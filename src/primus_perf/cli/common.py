"""What every CLI shares: user errors as one line and exit code 2, a console."""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer
from rich.console import Console

from primus_perf.errors import UserError

console = Console()
err_console = Console(stderr=True)


def not_yet_available(what: str) -> None:
    """For commands whose implementation has not landed yet."""
    err_console.print(f"[yellow]{what} is not yet available in this version of primus-perf[/]")
    raise typer.Exit(2)


def run_app(app: typer.Typer | Callable[[], object]) -> None:
    """Run a typer app; a UserError becomes ``error: <message>`` and its exit code."""
    try:
        app(standalone_mode=False) if isinstance(app, typer.Typer) else app()
    except UserError as exc:
        err_console.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as exc:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Exit):
            sys.exit(exc.exit_code)
        raise
