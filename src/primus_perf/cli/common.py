"""What every CLI shares: user errors as one line and exit code 2, Ctrl-C and SIGTERM as
exit code 130 with a line saying what was kept, a console, and the shared option checks."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Sequence

import typer
from rich.markup import escape

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import ClickException, NoArgsIsHelpError

from primus_perf.cli.render import CONSOLE, ERR_CONSOLE, plain_help_off_tty
from primus_perf.errors import Interrupted, UserError

console = CONSOLE
err_console = ERR_CONSOLE

EXIT_INTERRUPTED = 130
# Options that print rows: at least one (a typer min, so that `--top -5` is a usage error).
TOP_MIN = 1
JSON_HELP = "Write the result as JSON to this file (- for stdout)."


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def error_line(exc: BaseException) -> str:
    """The one line (rich markup) a UserError or an Interrupted prints."""
    if isinstance(exc, Interrupted):
        return f"interrupted: {escape(' '.join(exc.kept.split()))}"
    return f"[red]error:[/] {escape(' '.join(str(exc).split()))}"


VERSION_HELP = "--version (anywhere before --) prints the version of primus-perf, torch and Python."


def version_line() -> str:
    """``primus-perf 0.1.0 (torch 2.13.0, Python 3.11.9)``, without importing torch."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from primus_perf import __version__

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"primus-perf {__version__} (torch {torch_version}, Python {platform.python_version()})"


def run_app(app: typer.Typer | Callable[..., object], args: Sequence[str] | None = None) -> None:
    """Run a typer app. Every error a user can cause is one line on stderr: a usage error
    (``error: Invalid value for '--top': ...``, exit 2), a UserError (``error: <message>``,
    its exit code). SIGTERM is handled as Ctrl-C (``finally`` blocks run: logs and partial
    traces are kept); a command that caught it raises :class:`Interrupted` to say what it
    kept (exit 130). ``--help`` and a command without arguments print the help; ``--version``
    anywhere before ``--`` (a program's own arguments follow it) prints the version, for
    every command."""
    argv = sys.argv[1:] if args is None else list(args)
    if "--version" in (argv[:argv.index("--")] if "--" in argv else argv):
        print(version_line())
        sys.exit(0)
    with contextlib.suppress(ValueError):  # not the main thread: leave SIGTERM alone
        signal.signal(signal.SIGTERM, _terminate)
    plain_help_off_tty(sys.stdout)
    try:
        if isinstance(app, typer.Typer):
            code = app(None if args is None else list(args), standalone_mode=False)
        else:  # a plain entry point taking argv (a launcher such as ``python -m primus_perf.launch``)
            code = app(None if args is None else list(args))
    except NoArgsIsHelpError as exc:  # no_args_is_help: the help, as the framework prints it
        exc.show()
        sys.exit(exc.exit_code)
    except ClickException as exc:
        hint = f" (see {exc.ctx.command_path} --help)" if getattr(exc, "ctx", None) is not None else ""
        err_console.print(f"[red]error:[/] {escape(' '.join(exc.format_message().split()) + hint)}",
                          highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Abort:  # end of input at a prompt
        sys.exit(1)
    except (UserError, Interrupted) as exc:
        err_console.print(error_line(exc), highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted: nothing was written")
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)

