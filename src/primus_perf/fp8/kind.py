"""The ``fp8_plan`` kind's record, for the kinds registry: its problem type, title, the
analyzer-table columns of its shape and its label. :func:`register` is the one call that
adds it (the registry lives in ``primus_perf.kinds`` where that module exists)."""

from __future__ import annotations

from typing import Any

from primus_perf.kernels.fp8.plan import Fp8PlanProblem

RECORD: dict[str, Any] = {
    "problem_type": Fp8PlanProblem,
    "title": "FP8 plan",
    "shape_columns": ("layers", "tokens"),
    "label": Fp8PlanProblem.label,
}


def register() -> Any:
    """Register the kind in ``primus_perf.kinds`` (the registry's ``Kind`` record)."""
    import importlib

    kinds = importlib.import_module("primus_perf.kinds")
    return kinds.register(kinds.Kind(**RECORD))
