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

**Inconclusive** (neither holds, but the noise hides the answer): a metric that is not a
regression whose 95% bootstrap interval of the change reaches past ``max_regression`` (or,
without the interval, whose ratio of medians is past it): a regression beyond the allowed
one cannot be ruled out. A +20.9% slowdown with p 0.125 and a CV of 38-64% is not a pass:
the verdict is INCONCLUSIVE (exit code 3), with what to do (more samples, a quieter machine).

Refusals (exit code 2, before any verdict): sample sizes whose smallest possible p
(every candidate sample worse than every baseline one) is not below ``alpha``, so that no
regression could ever fail (5 samples a side cannot reach 0.005); samples of different
configs, overrides or devices, unless ``allow_mismatch`` (then they are notes). Each
side's noise (coefficient of variation) is reported, with a note above
:data:`NOISY_CV`: on a noisy machine the verdict can flip with the order of the runs.

Exit codes of ``primus-profile gate``: 0 pass, 1 regression, 2 bad input (unreadable or
malformed samples, a missing metric, too few samples, a comparison that cannot reach
significance, different configs, overrides or devices), 3 inconclusive.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from primus_perf.base.errors import UserError
from primus_perf.base.files import load_json, read_input
from primus_perf.gate.stats import (
    bootstrap_ratio_ci,
    coefficient_of_variation,
    mann_whitney_greater,
    median,
    min_p_value,
)

SAMPLES_SCHEMA = "primus-perf-bench/1"
MIN_SAMPLES = 5
DEFAULT_ALPHA = 0.01
DEFAULT_MAX_REGRESSION = 0.03
NOISY_CV = 0.05  # a side noisier than this gets a note
EXIT_INCONCLUSIVE = 3
# The profiled window of ``bench``: the fewest steps whose gpu_time metrics catch a true 5%
# change in >= 99% of trials at 2% noise (gate.simulation.smallest_window; held by a test).
DEFAULT_PROFILE_STEPS = 20

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
    cv_baseline: float  # noise of each side: standard deviation / mean
    cv_candidate: float
    regression: bool
    improvement: bool
    higher_is_better: bool
    inconclusive: bool = False  # not a regression, but one past max_regression is not ruled out

    @property
    def verdict(self) -> str:
        if self.regression:
            return "REGRESSION"
        return "INCONCLUSIVE" if self.inconclusive else "improved" if self.improvement else "ok"

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
    def verdict(self) -> str:
        """FAIL (a regression), INCONCLUSIVE (none found, but the noise hides one past the
        allowed regression) or PASS."""
        if any(v.regression for v in self.verdicts):
            return "FAIL"
        return "INCONCLUSIVE" if any(v.inconclusive for v in self.verdicts) else "PASS"

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @property
    def exit_code(self) -> int:
        return {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": EXIT_INCONCLUSIVE}[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
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
    max_regression: float = DEFAULT_MAX_REGRESSION,
    alpha: float = DEFAULT_ALPHA,
    bootstrap: bool = True,
) -> MetricVerdict:
    """Apply the gate's rule to one metric's samples; GateInputError when the sample sizes
    cannot reach significance at ``alpha``."""
    b = np.asarray(baseline, dtype=np.float64)
    c = np.asarray(candidate, dtype=np.float64)
    for side, arr in (("baseline", b), ("candidate", c)):
        if len(arr) < MIN_SAMPLES:
            raise GateInputError(
                f"metric {metric!r}: {side} has {len(arr)} samples, need at least {MIN_SAMPLES}"
            )
        if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
            raise GateInputError(f"metric {metric!r}: {side} has non-finite or non-positive samples")
    p_min = min_p_value(len(b), len(c))
    if p_min >= alpha:
        raise GateInputError(
            f"metric {metric!r}: with {len(b)} and {len(c)} samples the smallest possible p is {p_min:.3g},"
            f" not below alpha {alpha:g}: no regression could fail; take more samples (bench --repeat)"
            f" or raise --alpha"
        )
    higher = metric in HIGHER_IS_BETTER
    mb, mc = median(b), median(c)
    with np.errstate(all="ignore"):
        ratio = mc / mb
        # "worse" direction: slower time, or lower throughput.
        change = (ratio - 1.0) if not higher else (1.0 / ratio - 1.0)
    if not (math.isfinite(ratio) and ratio > 0 and math.isfinite(change)):
        raise GateInputError(f"metric {metric!r}: the medians {mb:g} and {mc:g} are too far apart to compare"
                             f" (samples of different units?)")
    x, y = (b, c) if higher else (c, b)  # the candidate is worse where x tends to be larger than y
    p_worse, p_better = mann_whitney_greater(x, y), mann_whitney_greater(y, x)
    if bootstrap:
        with np.errstate(all="ignore"):
            lo, hi = bootstrap_ratio_ci(b, c)
            ci = (lo - 1.0, hi - 1.0) if not higher else (1.0 / hi - 1.0, 1.0 / lo - 1.0)
    else:
        ci = (float("nan"), float("nan"))
    regression = bool(p_worse < alpha and change > max_regression)
    reach = ci[1] if math.isfinite(ci[1]) else change  # the worst change the samples allow
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
        cv_baseline=coefficient_of_variation(b),
        cv_candidate=coefficient_of_variation(c),
        regression=regression,
        improvement=bool(p_better < alpha and -change > max_regression),
        higher_is_better=higher,
        inconclusive=not regression and reach > max_regression,
    )


# --------------------------------------------------------------------------- samples files


MAX_SAMPLES_BYTES = 64 << 20


def load_samples(path: str | Path) -> dict[str, Any]:
    """Read a ``primus-profile bench`` samples file; GateInputError if it is not one."""
    p = Path(path)
    try:
        data = load_json(read_input(p, what="samples file", max_bytes=MAX_SAMPLES_BYTES, starts_with=(b"{",),
                                    expected="JSON"))
    except UserError as exc:
        raise GateInputError(str(exc)) from None
    except ValueError as exc:  # not JSON, or nested too deeply for the parser
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


def metric_value(metric: str, value: float) -> str:
    """A metric's value with its unit: times in ms (samples hold seconds), rates per second,
    MFU in percent."""
    if metric == "step_time" or metric.startswith("gpu_time."):
        return f"{value * 1e3:.3f} ms" if value < 1e6 else f"{value:.4g} s"
    if metric == "tokens_per_s":
        return f"{value:,.0f} tok/s"
    if metric == "mfu":
        return f"{value * 100:.2f}%"
    return f"{value:.6g}"


DEVICE_KEYS = ("name", "arch", "compute_units", "world_size")


def mismatches(baseline: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """What makes two samples files measure different things: devices (model, count),
    configs, overrides. Empty when they can be compared."""
    found = []
    b = {k: baseline["device"].get(k) for k in DEVICE_KEYS}
    c = {k: candidate["device"].get(k) for k in DEVICE_KEYS}
    if b != c:
        diff = ", ".join(f"{k}: {b[k]!r} vs {c[k]!r}" for k in DEVICE_KEYS if b[k] != c[k])
        found.append(f"ran on different devices ({diff})")
    for key, plural in (("config", "configs"), ("overrides", "overrides")):
        if baseline.get(key) != candidate.get(key):
            found.append(f"have different {plural} ({baseline.get(key)!r} vs {candidate.get(key)!r})")
    return found


def check_comparable(baseline: dict[str, Any], candidate: dict[str, Any], *, allow_mismatch: bool = False
                     ) -> list[str]:
    """GateInputError for samples of different devices, configs or overrides, unless
    ``allow_mismatch``: then the differences come back as notes."""
    found = mismatches(baseline, candidate)
    if found and not allow_mismatch:
        raise GateInputError(f"baseline and candidate {'; '.join(found)}; pass --allow-mismatch to gate them anyway")
    return [f"baseline and candidate {m}" for m in found]


def gate(
    baseline: str | Path | dict[str, Any],
    candidate: str | Path | dict[str, Any],
    *,
    metrics: list[str] | None = None,
    max_regression: float = DEFAULT_MAX_REGRESSION,
    alpha: float = DEFAULT_ALPHA,
    allow_mismatch: bool = False,
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
    notes = check_comparable(b, c, allow_mismatch=allow_mismatch)
    wanted = metrics or ["step_time"]
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
    for v in verdicts:
        if v.inconclusive:
            notes.append(f"{v.metric}: inconclusive: {_fmt_change(v.change)} with p {v.p_value:.3g} and CV"
                         f" {v.cv_baseline:.0%}/{v.cv_candidate:.0%}; the samples allow a change up to"
                         f" {_fmt_change(max(v.ci_high, v.change) if math.isfinite(v.ci_high) else v.change)},"
                         f" past the allowed {max_regression:.1%}: take more samples (bench --repeat) or"
                         f" quiet the machine")
        for side, cv in (("baseline", v.cv_baseline), ("candidate", v.cv_candidate)):
            if cv > NOISY_CV:
                notes.append(f"{v.metric}: the {side} is noisy (CV {cv:.1%} > {NOISY_CV:.0%}); the verdict"
                             f" may change with the order of the runs: quiet the machine or take more samples")
    return GateResult(
        verdicts=verdicts,
        max_regression=max_regression,
        alpha=alpha,
        device=str(b["device"].get("name", "?")),
        baseline_path=bpath,
        candidate_path=cpath,
        notes=notes,
    )


def _fmt_change(v: float) -> str:
    return f"{v * 100:+.1f}%"


def parse_fraction(text: str) -> float:
    """'3%' -> 0.03, '0.03' -> 0.03; GateInputError on anything else."""
    t = text.strip()
    try:
        return float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        raise GateInputError(f"not a percentage or fraction: {text!r}") from None
