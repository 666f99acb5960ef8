"""``primus-tune``: GEMM, grouped-GEMM and attention tuners and the tuning cache.

Each group of commands lives in its own module with a ``register(app)`` function; the kinds'
commands are built by :mod:`.tune_kind` from their CLI parts.
"""

from __future__ import annotations

import typer

from primus_perf.cli import tune_cache, tune_confirm, tune_kind, tune_loop, tune_step
from primus_perf.cli.common import command_app, run_app

app = command_app("primus-tune", "Tune GEMM, grouped-GEMM (MoE) and attention kernels for your exact problems, and the"
                                 " whole step.")
tune_loop.register(app)
tune_kind.register(app)  # primus-tune gemm, grouped-gemm, attention: each kind's CLI part
tune_confirm.register(app)
tune_step.register(app)
cache_app = typer.Typer(help="Inspect, merge and export tuning caches.", no_args_is_help=True)
tune_cache.register(cache_app)
app.add_typer(cache_app, name="cache")


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
