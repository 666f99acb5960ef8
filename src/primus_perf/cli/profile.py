"""``primus-profile``: capture traces, analyze them, report, compare and gate.

Each group of commands lives in its own module with a ``register(app)`` function.
"""

from __future__ import annotations

from primus_perf.cli import (
    profile_analysis,
    profile_capture,
    profile_gate,
    profile_preflight,
    profile_report,
)
from primus_perf.cli.common import command_app, run_app

app = command_app("primus-profile", "Profile training runs and explain their traces.")
for module in (profile_capture, profile_analysis, profile_report, profile_gate, profile_preflight):
    module.register(app)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
