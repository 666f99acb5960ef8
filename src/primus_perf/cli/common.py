"""What every CLI shares: user errors as one line and exit code 2, Ctrl-C and SIGTERM as
exit code 130 with a line saying what was kept, a console, and the shared option checks."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer
from rich.markup import escape

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import ClickException, NoArgsIsHelpError

from primus_perf.base.entry import EXIT_INTERRUPTED, error_text, start
from primus_perf.base.errors import Interrupted, UserError
from primus_perf.cli.render import CONSOLE, ERR_CONSOLE, plain_help_off_tty

console = CONSOLE
err_console = ERR_CONSOLE

# Options that print rows: at least one (a typer min, so that `--top -5` is a usage error).
TOP_MIN = 1
JSON_HELP = "Write the result as JSON to this file (- for stdout)."


def log_line(message: str) -> None:
    """A line of a run's log to the console as it is: no markup, no highlighting, not wrapped."""
    console.print(message, highlight=False, soft_wrap=True, markup=False)


def error_line(exc: BaseException) -> str:
    """The one line (rich markup) a UserError or an Interrupted prints: :func:`..base.entry.error_text`."""
    text = escape(error_text(exc))
    return "[red]error:[/]" + text[len("error:"):] if text.startswith("error:") else text


VERSION_HELP = "--version (anywhere before --) prints the version of primus-perf, torch and Python."


def command_app(name: str, help: str) -> typer.Typer:
    """A ``primus-*`` command's app: the help when run without arguments, no shell
    completion, and :data:`VERSION_HELP` under every help."""
    return typer.Typer(name=name, help=help, no_args_is_help=True, add_completion=False, epilog=VERSION_HELP)


def run_app(app: typer.Typer, args: Sequence[str] | None = None) -> None:
    """Run a typer app. Every error a user can cause is one line on stderr: a usage error
    (``error: Invalid value for '--top': ...``, exit 2), a UserError (``error: <message>``,
    its exit code). SIGTERM is handled as Ctrl-C (``finally`` blocks run: logs and partial
    traces are kept); a command that caught it raises :class:`Interrupted` to say what it
    kept (exit 130). ``--help`` and a command without arguments print the help; ``--version``
    anywhere before ``--`` (a program's own arguments follow it) prints the version, for
    every command."""
    start(sys.argv[1:] if args is None else list(args))
    plain_help_off_tty(sys.stdout)
    try:
        code = app(None if args is None else list(args), standalone_mode=False)
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

