"""How every command starts and ends, a typer app (``cli.common.run_app``) or a plain entry
point (:func:`run_main`: ``python -m primus_perf.launch``): ``--version`` anywhere before ``--``
prints the version; SIGTERM is handled as Ctrl-C, so ``finally`` blocks run (logs and partial
traces are kept); a UserError or an Interrupted is one line on stderr and its exit code."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from primus_perf.base.errors import Interrupted, UserError

VERSION = "0.1.0"  # primus_perf.__version__; pyproject.toml's version says the same
EXIT_INTERRUPTED = Interrupted.exit_code  # Ctrl-C or SIGTERM
Log = Callable[[str], None]  # where a long job's progress goes, a line at a time (a command prints it)


def version_line() -> str:
    """``primus-perf 0.1.0 (torch 2.13.0, Python 3.11.9)``, without importing torch."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"primus-perf {VERSION} (torch {torch_version}, Python {platform.python_version()})"


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def start(argv: Sequence[str]) -> None:
    """What every command does first: ``--version`` before ``--`` (a program's own arguments
    follow it) prints the version and exits; SIGTERM becomes Ctrl-C (in the main thread)."""
    if "--version" in (argv[:argv.index("--")] if "--" in argv else argv):
        print(version_line())
        sys.exit(0)
    with contextlib.suppress(ValueError):  # not the main thread: leave SIGTERM alone
        signal.signal(signal.SIGTERM, _terminate)


def error_text(exc: UserError | Interrupted) -> str:
    """The one line a UserError (``error: ...``) or an Interrupted (``interrupted: ...``) prints."""
    if isinstance(exc, Interrupted):
        return f"interrupted: {' '.join(exc.kept.split())}"
    return f"error: {' '.join(str(exc).split())}"


def run_main(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> NoReturn:
    """Run a plain entry point taking its arguments as every command runs (module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    start(args)
    try:
        code = main(args)
    except (UserError, Interrupted) as exc:
        print(error_text(exc), file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)
