"""Trace loading, op->kernel linking, perf models, breakdowns, reports, compare, gate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from primus_perf.errors import UserError


def analyzer() -> Callable[..., Any]:
    """``tracelens.analyze.analyze``, or one clear UserError where this version lacks it."""
    try:
        from primus_perf.tracelens.analyze import analyze
    except ModuleNotFoundError as exc:
        if exc.name != "primus_perf.tracelens.analyze":
            raise
        raise UserError(
            "trace analysis (primus_perf.tracelens.analyze) is not available in this version"
            " of primus-perf"
        ) from None
    return analyze
