"""The CI performance regression gate: does a candidate run regress against a baseline?

Decision rule (both must hold for a regression):

1. **Statistical evidence**: a one-sided Mann-Whitney U test (normal approximation with
   tie and continuity correction) rejects "candidate is not slower" at ``alpha``
   (default 0.01). Mann-Whitney compares ranks, so the occasional very slow step (a
   clock drop, a host hiccup, a collective waiting on a straggler) does not dominate it
   the way it dominates a t-test on means; it assumes nothing about the noise's shape.
2. **Minimum effect**: the ratio of medians (candidate / baseline for lower-is-better
   metrics) exceeds ``1 + max_regression`` (default 3%). With enough samples any shift,
   however small, becomes significant; run-to-run drift on GPUs is a few percent, so a
   gate without a minimum effect would fail CI on noise that nobody can act on.

This is the rule asv uses (Mann-Whitney U plus a minimum effect); pytest-benchmark and
nvbench gate on a relative threshold of a robust statistic in the same spirit. The
error rates of this rule are measured by a seeded simulation in the tests: with 2% CV
noise and 20 samples per side, a true 5% regression is caught in >= 95% of trials and a
no-change pair fails in <= 2%.

Exit codes of ``primus-profile gate``: 0 pass, 1 regression, 2 bad input (unreadable or
malformed samples, a missing metric, too few samples, different devices).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from primus_perf.errors import UserError
from primus_perf.gate.stats import bootstrap_ratio_ci, mann_whitney_greater

SAMPLES_SCHEMA = "primus-perf-bench/1"
MIN_SAMPLES = 5

# Metrics where a larger value is better; every other metric (times) is lower-is-better.
HIGHER_IS_BETTER = frozenset({"tokens_per_s", "mfu", "tflops"})


class GateInputError(UserError):
    """Samples that cannot be gated (exit code 2)."""


@dataclass(frozen=True)
class MetricVerdict:
    """The gate's finding for one metric."""

    metric: str
    n_baseline: int
    n_candidate: int
    baseline_median: float
    candidate_median: float
    ratio: float  # candidate / baseline median
    change: float  # signed relative change in the "worse" direction (+0.05 = 5% worse)
    ci_low: float  # 95% bootstrap CI of ``change``
    ci_high: float
    p_value: float  # one-sided Mann-Whitney U: candidate worse than baseline
    regression: bool
    improvement: bool
    higher_is_better: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GateResult:
    """All verdicts plus the settings that produced them."""

    verdicts: list[MetricVerdict]
    max_regression: float
    alpha: float
    device: str
    baseline_path: str = ""
    candidate_path: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(v.regression for v in self.verdicts)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "exit_code": self.exit_code,
            "max_regression": self.max_regression,
            "alpha": self.alpha,
            "device": self.device,
            "baseline": self.baseline_path,
            "candidate": self.candidate_path,
            "test": "one-sided Mann-Whitney U + minimum effect on the ratio of medians",
            "verdicts": [v.to_dict() for v in self.verdicts],
            "notes": list(self.notes),
        }


def compare_metric(
    metric: str,
    baseline: list[float] | np.ndarray,
    candidate: list[float] | np.ndarray,
    *,
    max_regression: float = 0.03,
    alpha: float = 0.01,
    bootstrap: bool = True,
) -> MetricVerdict:
    """Apply the gate's rule to one metric's samples."""
    b = np.asarray(baseline, dtype=np.float64)
    c = np.asarray(candidate, dtype=np.float64)
    for side, arr in (("baseline", b), ("candidate", c)):
        if len(arr) < MIN_SAMPLES:
            raise GateInputError(
                f"metric {metric!r}: {side} has {len(arr)} samples, need at least {MIN_SAMPLES}"
            )
        if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
            raise GateInputError(f"metric {metric!r}: {side} has non-finite or non-positive samples")
    higher = metric in HIGHER_IS_BETTER
    mb, mc = float(np.median(b)), float(np.median(c))
    ratio = mc / mb
    # "worse" direction: slower time, or lower throughput.
    change = (ratio - 1.0) if not higher else (1.0 / ratio - 1.0)
    if higher:
        p_worse = mann_whitney_greater(b, c)
        p_better = mann_whitney_greater(c, b)
    else:
        p_worse = mann_whitney_greater(c, b)
        p_better = mann_whitney_greater(b, c)
    if bootstrap:
        lo, hi = bootstrap_ratio_ci(b, c)
        ci = (lo - 1.0, hi - 1.0) if not higher else (1.0 / hi - 1.0, 1.0 / lo - 1.0)
    else:
        ci = (float("nan"), float("nan"))
    return MetricVerdict(
        metric=metric,
        n_baseline=len(b),
        n_candidate=len(c),
        baseline_median=mb,
        candidate_median=mc,
        ratio=ratio,
        change=change,
        ci_low=ci[0],
        ci_high=ci[1],
        p_value=p_worse,
        regression=bool(p_worse < alpha and change > max_regression),
        improvement=bool(p_better < alpha and -change > max_regression),
        higher_is_better=higher,
    )


# --------------------------------------------------------------------------- samples files


def load_samples(path: str | Path) -> dict[str, Any]:
    """Read a ``primus-profile bench`` samples file; GateInputError if it is not one."""
    p = Path(path)
    if not p.is_file():
        raise GateInputError(f"samples file not found: {p}")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GateInputError(f"{p}: not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(data, dict) or data.get("schema") != SAMPLES_SCHEMA:
        raise GateInputError(f"{p}: not a primus-profile bench samples file (schema {SAMPLES_SCHEMA})")
    metrics = data.get("metrics")
    if not isinstance(metrics, dict) or not metrics:
        raise GateInputError(f"{p}: has no metrics")
    for name, values in metrics.items():
        if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            raise GateInputError(f"{p}: metric {name!r} is not a list of numbers")
    if not isinstance(data.get("device"), dict) or "name" not in data["device"]:
        raise GateInputError(f"{p}: has no device record")
    return data


def _device_label(device: dict[str, Any]) -> str:
    return str(device.get("name", "?"))


def check_same_device(baseline: dict[str, Any], candidate: dict[str, Any]) -> None:
    """Samples from different GPU models (or counts) cannot be compared."""
    keys = ("name", "arch", "compute_units", "world_size")
    b = {k: baseline["device"].get(k) for k in keys}
    c = {k: candidate["device"].get(k) for k in keys}
    if b != c:
        diff = ", ".join(f"{k}: {b[k]!r} vs {c[k]!r}" for k in keys if b[k] != c[k])
        raise GateInputError(f"baseline and candidate ran on different devices ({diff})")


def gate(
    baseline: str | Path | dict[str, Any],
    candidate: str | Path | dict[str, Any],
    *,
    metrics: list[str] | None = None,
    max_regression: float = 0.03,
    alpha: float = 0.01,
) -> GateResult:
    """Gate a candidate samples file against a baseline one (paths or loaded dicts)."""
    if not 0 <= max_regression < 1:
        raise GateInputError(f"max regression must be in [0, 1), got {max_regression}")
    if not 0 < alpha < 0.5:
        raise GateInputError(f"alpha must be in (0, 0.5), got {alpha}")
    bpath = "" if isinstance(baseline, dict) else str(baseline)
    cpath = "" if isinstance(candidate, dict) else str(candidate)
    b = baseline if isinstance(baseline, dict) else load_samples(baseline)
    c = candidate if isinstance(candidate, dict) else load_samples(candidate)
    check_same_device(b, c)
    wanted = metrics or ["step_time"]
    notes: list[str] = []
    bconf, cconf = b.get("config"), c.get("config")
    if bconf != cconf:
        notes.append(f"configs differ: {bconf!r} vs {cconf!r}")
    if b.get("versions") != c.get("versions"):
        notes.append("library versions differ")
    verdicts = []
    for m in wanted:
        if m not in b["metrics"] or m not in c["metrics"]:
            have = sorted(set(b["metrics"]) & set(c["metrics"]))
            raise GateInputError(f"metric {m!r} is not in both samples files (common: {', '.join(have)})")
        verdicts.append(
            compare_metric(m, b["metrics"][m], c["metrics"][m], max_regression=max_regression, alpha=alpha)
        )
    return GateResult(
        verdicts=verdicts,
        max_regression=max_regression,
        alpha=alpha,
        device=_device_label(b["device"]),
        baseline_path=bpath,
        candidate_path=cpath,
        notes=notes,
    )


def parse_fraction(text: str) -> float:
    """'3%' -> 0.03, '0.03' -> 0.03; GateInputError on anything else."""
    t = text.strip()
    try:
        return float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        raise GateInputError(f"not a percentage or fraction: {text!r}") from None
