"""What every CLI shares: user errors as one line and exit code 2, Ctrl-C and SIGTERM as
exit code 130 with a line saying what was kept, a console, and the shared option checks."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import typer
from rich.console import Console

from primus_perf.errors import Interrupted, UserError
from primus_perf.files import check_input_file

console = Console()
err_console = Console(stderr=True)

EXIT_INTERRUPTED = 130
# Options that print rows: at least one (a typer min, so that `--top -5` is a usage error).
TOP_MIN = 1
JSON_HELP = "Write the result as JSON to this file (- for stdout)."


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def error_line(exc: BaseException) -> str:
    """The one line a UserError or an Interrupted prints."""
    if isinstance(exc, Interrupted):
        return f"interrupted: {' '.join(exc.kept.split())}"
    return f"[red]error:[/] {' '.join(str(exc).split())}"


def run_app(app: typer.Typer | Callable[..., object], args: Sequence[str] | None = None) -> None:
    """Run a typer app (standalone: usage errors and --help as click does them); a
    UserError becomes ``error: <message>`` on one line and its exit code; SIGTERM is
    handled as Ctrl-C (``finally`` blocks run: logs and partial traces are kept), and a
    command that caught it raises :class:`Interrupted` to say what it kept (exit 130)."""
    with contextlib.suppress(ValueError):  # not the main thread: leave SIGTERM alone
        signal.signal(signal.SIGTERM, _terminate)
    try:
        if args is None:
            app()
        else:
            app(list(args))
    except (UserError, Interrupted) as exc:
        err_console.print(error_line(exc), highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted: nothing was written")
        sys.exit(EXIT_INTERRUPTED)


def check_trace_args(paths: Sequence[str | Path]) -> None:
    """Each trace argument is a run directory or a trace file that can be one (a regular,
    non-empty file starting like JSON or gzip): one clear error before the analyzer runs."""
    for path in paths:
        if Path(path).is_dir():
            continue
        check_input_file(path, what="trace file", starts_with=(b"{", b"[", b"\x1f\x8b"))
