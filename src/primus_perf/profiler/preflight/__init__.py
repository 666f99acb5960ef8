"""Preflight: is every GPU, link and host of a job healthy before it trains?

A package of small modules: ``checks`` (figures, bounds, peer medians, the verdict),
``host``, ``gpu`` and ``comm`` (what is measured), ``run`` (one process or a torchrun
job), ``render`` (terminal table; JSON and HTML through the report code).
"""

from __future__ import annotations

from primus_perf.profiler.preflight.checks import (
    DEFAULT_THRESHOLD,
    Check,
    Measurement,
    PreflightReport,
    evaluate,
)
from primus_perf.profiler.preflight.run import preflight

__all__ = ["DEFAULT_THRESHOLD", "Check", "Measurement", "PreflightReport", "evaluate", "preflight"]
