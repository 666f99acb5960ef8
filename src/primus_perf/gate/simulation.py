"""The gate's error rates, measured by a seeded simulation: samples with a given noise (CV)
and a true change, gated as ``primus-profile gate`` gates them. It decides the defaults
(the profiled window of ``bench``) and the tests hold the rates; the table is written by
``benchmarks/gate/gate_simulation.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from primus_perf.gate.gate import (
    DEFAULT_ALPHA,
    DEFAULT_MAX_REGRESSION,
    GateInputError,
    compare_metric,
)
from primus_perf.gate.stats import min_p_value

SIZES = (5, 10, 20, 40)
NOISE_CVS = (0.02, 0.10)
TARGET_CHANGE = 0.05  # the change the profiled window's gpu_time metrics must catch
TARGET_DETECTION = 0.99  # with margin: at 0.95 the choice (10) would sit on the line (0.96)


def regression_rate(n: int, cv: float, true_change: float, *, trials: int = 1000, seed: int = 0,
                    alpha: float = DEFAULT_ALPHA, max_regression: float = DEFAULT_MAX_REGRESSION) -> float:
    """Fraction of trials the gate fails: ``n`` samples a side, normal noise of ``cv``,
    the candidate ``true_change`` slower."""
    rng = np.random.default_rng(seed)
    fails = 0
    for _ in range(trials):
        base = 1.0 + cv * rng.standard_normal(n)
        cand = (1.0 + true_change) * (1.0 + cv * rng.standard_normal(n))
        fails += compare_metric("sim", base, cand, alpha=alpha, max_regression=max_regression,
                                bootstrap=False).regression
    return fails / trials


def refuses(n: int, alpha: float) -> bool:
    """Whether the gate refuses ``n`` samples a side at ``alpha`` (it could never fail)."""
    try:
        compare_metric("sim", np.ones(n), np.ones(n), alpha=alpha, bootstrap=False)
    except GateInputError:
        return True
    return False


def table(sizes: Sequence[int] = SIZES, cvs: Sequence[float] = NOISE_CVS, *, trials: int = 1000,
          seed: int = 0) -> dict[str, Any]:
    """Detection (a true +5%) and false-alarm (no change) rates for each size and noise."""
    rows = []
    for i, n in enumerate(sizes):
        for j, cv in enumerate(cvs):
            rows.append({
                "n": n,
                "cv": cv,
                "detection": regression_rate(n, cv, TARGET_CHANGE, trials=trials, seed=seed + 100 * i + 10 * j),
                "false_alarm": regression_rate(n, cv, 0.0, trials=trials, seed=seed + 100 * i + 10 * j + 1),
                "min_p": min_p_value(n, n),
            })
    return {
        "alpha": DEFAULT_ALPHA,
        "max_regression": DEFAULT_MAX_REGRESSION,
        "true_change": TARGET_CHANGE,
        "trials": trials,
        "seed": seed,
        "rows": rows,
        "refused": {str(alpha): [n for n in sizes if refuses(n, alpha)] for alpha in (0.01, 0.005, 0.001)},
    }


def smallest_window(cv: float = NOISE_CVS[0], *, trials: int = 1000, seed: int = 0) -> int:
    """The fewest samples a side (of :data:`SIZES`) that catch a true +5% in at least 99%
    of trials at noise ``cv``: the default profiled window of ``bench``."""
    for n in SIZES:
        if regression_rate(n, cv, TARGET_CHANGE, trials=trials, seed=seed) >= TARGET_DETECTION:
            return n
    return SIZES[-1]
