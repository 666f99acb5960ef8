"""``primus-profile``: capture traces, analyze them, report, compare and gate.

Each group of commands lives in its own module with a ``register(app)`` function.
"""

from __future__ import annotations

import typer

from primus_perf.cli import (
    profile_analysis,
    profile_capture,
    profile_gate,
    profile_preflight,
    profile_report,
)
from primus_perf.cli.common import VERSION_HELP, run_app

app = typer.Typer(
    name="primus-profile",
    help="Profile training runs and explain their traces.",
    no_args_is_help=True,
    add_completion=False,
    epilog=VERSION_HELP,
)
for module in (profile_capture, profile_analysis, profile_report, profile_gate, profile_preflight):
    module.register(app)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
