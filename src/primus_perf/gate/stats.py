"""The gate's statistics: a one-sided Mann-Whitney U test and a bootstrap interval of the
ratio of medians (numpy only; the same figures as scipy's asymptotic ``mannwhitneyu``)."""

from __future__ import annotations

import math

import numpy as np


def _rankdata(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average ranks (1-based) and the sizes of tie groups."""
    order = np.argsort(values, kind="mergesort")
    sorted_vals = values[order]
    # Boundaries of runs of equal values.
    boundaries = np.flatnonzero(np.diff(sorted_vals)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [len(values)]))
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat((starts + 1 + ends) / 2.0, ends - starts)
    return ranks, (ends - starts)


def mann_whitney_greater(x: np.ndarray, y: np.ndarray) -> float:
    """One-sided p-value of H1 "x tends to be larger than y" (normal approximation).

    Uses the tie-corrected variance and a continuity correction of 0.5, as scipy's
    ``mannwhitneyu(x, y, alternative="greater", method="asymptotic")`` does.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("both samples must be non-empty")
    ranks, ties = _rankdata(np.concatenate((x, y)))
    u1 = float(ranks[:n1].sum()) - n1 * (n1 + 1) / 2.0
    mean = n1 * n2 / 2.0
    n = n1 + n2
    tie_term = float((ties**3 - ties).sum()) / (n * (n - 1)) if n > 1 else 0.0
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term)
    if var <= 0:
        return 0.5 if u1 == mean else (0.0 if u1 > mean else 1.0)
    z = (u1 - mean - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def bootstrap_medians(values: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """The medians of ``n_boot`` bootstrap resamples of ``values`` (each ``len(values)``
    draws with replacement), drawn without making the resamples: the k-th smallest of n
    draws is the sample's value at rank ceil(n U), U the k-th smallest of n uniforms
    (Beta(k, n + 1 - k)); the next one above it is U + (1 - U) Beta(1, n - k). The same
    distribution as resampling, in O(n log n + n_boot) for any n (a million samples a side)."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = len(x)
    k = (n + 1) // 2

    def at(u: np.ndarray) -> np.ndarray:
        return x[np.clip(np.ceil(u * n).astype(np.int64), 1, n) - 1]

    u = rng.beta(k, n + 1 - k, n_boot)
    low = at(u)
    if n % 2:
        return low
    return low / 2.0 + at(u + (1.0 - u) * rng.beta(1, n - k, n_boot)) / 2.0


def median(values: np.ndarray) -> float:
    """np.median without overflow near the end of the float range."""
    x = np.asarray(values, dtype=np.float64)
    scale = float(np.max(np.abs(x))) or 1.0
    return float(np.median(x / scale)) * scale


def bootstrap_ratio_ci(
    baseline: np.ndarray, candidate: np.ndarray, *, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of median(candidate) / median(baseline)."""
    rng = np.random.default_rng(seed)
    ratios = bootstrap_medians(candidate, n_boot, rng) / bootstrap_medians(baseline, n_boot, rng)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def min_p_value(n1: int, n2: int) -> float:
    """The smallest p :func:`mann_whitney_greater` can give for these sample sizes (every
    value of one side above every value of the other): a test whose alpha is not above it
    can never find anything."""
    n = n1 + n2
    z = (n1 * n2 / 2.0 - 0.5) / math.sqrt(n1 * n2 / 12.0 * (n + 1))
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def coefficient_of_variation(values: np.ndarray) -> float:
    """Sample standard deviation over the mean (the noise of one side)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return 0.0
    scaled = values / np.max(np.abs(values))  # no overflow for values near the float range's end
    return float(np.std(scaled, ddof=1) / np.mean(scaled))


def geomean(values: list[float]) -> float:
    """Geometric mean of positive values (speedups); nan for an empty list."""
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))
