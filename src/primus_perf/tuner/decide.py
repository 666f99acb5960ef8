"""The one decision rule of everything that chooses: the offline race, the in-step
confirmation, the online race, the FP8 plan and the step tuner.

Every comparison is paired: a candidate and the baseline measured side by side (two calls of
a shuffled round, an ABBA pair of a program's calls, two blocks of steps), each pair giving
one ratio ``baseline time / candidate time``. The estimate is the median ratio; the noise is
:func:`spread` of the ratios. A candidate is kept only when its median beats 1 by more than
``max(margin, noise)`` and it saves at least ``min_saving_s`` a call (:func:`judge`); among
kept candidates the best median wins, else the baseline stays (:func:`decide`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MARGIN = 0.01  # the least gain that keeps a candidate when the measured noise is smaller
# the least saving a call of a kernel choice routed at run time must make: a routed call costs
# the host more than torch's own launch (a few us in Python), which device events do not see
MIN_SAVING_S = 5e-6
STEP_MARGIN = 0.002  # the least gain of the whole step that keeps a step-level candidate (an FP8 plan)
DROP_RATIO = 1.25  # a candidate this much slower than the best after its first samples goes early
KEPT, DROPPED, UNCONFIRMED = "kept", "dropped", "unconfirmed"
# a step whose GPU idles this share of it or more is host-bound: a routed call's host time is
# then the step's, and a kernel's saving counts only at the GPU's busy share
HOST_BOUND_IDLE = 0.3
WAITED_SHARE = 0.25  # a choice whose calls waited on the host (unseen by device events) more is dropped


def host_bound(busy_s: float | None, step_s: float | None) -> float | None:
    """The GPU's busy share of a host-bound step (idle at least :data:`HOST_BOUND_IDLE` of
    ``step_s``), else None (not host-bound, or not known)."""
    if not busy_s or not step_s or step_s <= 0:
        return None
    share = min(1.0, busy_s / step_s)
    return share if 1.0 - share >= HOST_BOUND_IDLE else None


@dataclass(frozen=True)
class Rule:
    """``margin``: the least relative gain; ``min_saving_s``: the least saving per call (or per
    step); ``least``: the pairs a verdict needs."""

    margin: float = MARGIN
    min_saving_s: float = 0.0
    least: int = 2

    def __post_init__(self) -> None:
        if self.margin < 0 or self.min_saving_s < 0 or self.least < 1:
            raise ValueError("a decision rule needs margin >= 0, min_saving_s >= 0 and least >= 1")


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of at least one value."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def spread(ratios: Sequence[float]) -> float:
    """The noise model: half the interquartile range of the per-pair ratios from four pairs on,
    half their range below (two or three pairs say less), 0 for one."""
    if len(ratios) < 2:
        return 0.0
    if len(ratios) < 4:
        return (max(ratios) - min(ratios)) / 2
    q1, _, q3 = quartiles(ratios)
    return (q3 - q1) / 2


@dataclass
class Verdict:
    """A candidate judged against the baseline: ``status`` kept, dropped or unconfirmed (too
    few pairs); ``speedup`` the median per-pair ratio with quartiles ``low``-``high``; the
    median times of both sides (ms); ``threshold`` the gain it had to beat."""

    kind: str
    key: str
    choice: str
    baseline: str
    status: str
    speedup: float | None
    low: float | None
    high: float | None
    pairs: int
    choice_ms: float | None
    baseline_ms: float | None
    threshold: float
    method: str
    wanted: int = 0
    reason: str = ""  # why a candidate that won its pairs was dropped

    @property
    def kept(self) -> bool:
        return self.status == KEPT

    @property
    def saving_us(self) -> float | None:
        """What the choice saves a call (median times; negative: it costs)."""
        if self.choice_ms is None or self.baseline_ms is None:
            return None
        return (self.baseline_ms - self.choice_ms) * 1e3

    def figure(self) -> dict[str, Any]:
        """What a cache entry stores of it (``CacheEntry.in_step``)."""
        return {
            "method": self.method, "baseline": self.baseline, "choice": self.choice, "verdict": self.status,
            "speedup": self.speedup, "low": self.low, "high": self.high, "samples": self.pairs,
            "choice_ms": self.choice_ms, "baseline_ms": self.baseline_ms, "threshold": self.threshold,
            "saving_us": self.saving_us, **({"reason": self.reason} if self.reason else {}),
        }

    def spread_text(self) -> str:
        if self.speedup is None:
            return f"{self.pairs} of {self.wanted} pairs"
        return f"{self.speedup:.3f}x [{self.low:.3f}-{self.high:.3f}], {2 * self.pairs} calls"

    def text(self) -> str:
        """One line: ``heur2: 1.030x torch in the step [1.010-1.050], 16 calls, 2.1 us saved a
        call: kept``."""
        if self.status == KEPT:
            return (f"{self.choice}: {self.speedup:.3f}x {self.baseline} in the step [{self.low:.3f}-{self.high:.3f}],"
                    f" {2 * self.pairs} calls, {self.saving_us:.1f} us saved a call: kept")
        if self.status == DROPPED and self.reason:
            return f"{self.choice}: {self.spread_text()} in the step, but {self.reason}: {self.baseline} kept"
        if self.status == DROPPED:
            return (f"{self.choice} not confirmed in the step ({self.spread_text()}; needs >"
                    f" {1 + self.threshold:.3f}x): {self.baseline} kept")
        return f"{self.choice} unconfirmed in the step ({self.spread_text()}): too few samples"


def judge(pairs: Sequence[tuple[float, float]], rule: Rule = Rule(), *, kind: str = "", key: str = "",
          choice: str = "", baseline: str = "", method: str = "") -> Verdict:
    """The verdict on ``(baseline seconds, candidate seconds)`` pairs under ``rule``; a pair
    with a time that is not a positive number is left out."""
    pairs = [(b, c) for b, c in pairs if 0 < b < math.inf and 0 < c < math.inf]
    v = Verdict(kind, key, choice, baseline, UNCONFIRMED, None, None, None, len(pairs), None, None, rule.margin,
                method, rule.least)
    ratios = [b / c for b, c in pairs]
    if len(pairs) < rule.least:
        return v
    q1, med, q3 = quartiles(ratios)
    v.threshold = max(rule.margin, spread(ratios))
    v.speedup, v.low, v.high = med, q1, q3
    v.baseline_ms = statistics.median(b for b, _ in pairs) * 1e3
    v.choice_ms = statistics.median(c for _, c in pairs) * 1e3
    v.status = KEPT if med > 1 + v.threshold else DROPPED
    if v.kept and rule.min_saving_s and (v.saving_us or 0.0) < rule.min_saving_s * 1e6:
        v.status = DROPPED
        v.reason = f"it saves {v.saving_us:.1f} us a call, under the {rule.min_saving_s * 1e6:.0f} us routing costs"
    return v


def decide(baseline: str, verdicts: Mapping[str, Verdict]) -> str:
    """The kept candidate with the best median, else ``baseline``."""
    kept = {name: v for name, v in verdicts.items() if v.kept}
    return max(kept, key=lambda n: kept[n].speedup or 0.0) if kept else baseline


def paired(samples: Mapping[str, Sequence[float]], baseline: str) -> dict[str, list[tuple[float, float]]]:
    """Each candidate's samples paired with the baseline's of the same round (the i-th of each:
    the offline timers run every candidate once a round, in a shuffled order)."""
    base = samples[baseline]
    return {name: list(zip(base, ts)) for name, ts in samples.items() if name != baseline}
