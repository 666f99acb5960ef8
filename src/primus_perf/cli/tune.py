"""``primus-tune``: GEMM, grouped-GEMM and attention tuners and the tuning cache.

Each group of commands lives in its own module with a ``register(app)`` function.
"""

from __future__ import annotations

import typer

from primus_perf.cli import (
    tune_attention,
    tune_cache,
    tune_confirm,
    tune_gemm,
    tune_grouped,
    tune_loop,
    tune_step,
)
from primus_perf.cli.common import VERSION_HELP, run_app

app = typer.Typer(
    name="primus-tune",
    help="Tune GEMM, grouped-GEMM (MoE) and attention kernels for your exact problems, and the whole step.",
    no_args_is_help=True,
    add_completion=False,
    epilog=VERSION_HELP,
)
tune_loop.register(app)
tune_gemm.register(app)
tune_attention.register(app)
tune_grouped.register(app)
tune_confirm.register(app)
tune_step.register(app)
cache_app = typer.Typer(help="Inspect, merge and export tuning caches.", no_args_is_help=True)
tune_cache.register(cache_app)
app.add_typer(cache_app, name="cache")


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
