"""Preflight figures and their verdicts: the one place that decides pass or fail.

A :class:`Measurement` is one figure of one subject (the host, a GPU, a link between two
ranks, the job's collectives), with what it is expected to be: a bound from a datasheet
or a documented fraction of one (``expected``; a floor when higher is better, a ceiling
otherwise), and whether it is compared with its peers (the same figure of the other GPUs
or links). :func:`evaluate` turns measurements into :class:`Check` rows:

- ``fail``: outside its expected bound (or a hard error, e.g. uncorrected ECC errors);
- ``slow``: below ``threshold`` x the median of its peers (default 90%; only figures
  marked ``peers`` and only with at least two peers);
- ``ok``: checked and within both; ``info``: reported, nothing to compare;
- ``skipped``: could not be measured here (the reason says why).

The exit code is 1 when any check is ``fail`` or ``slow``, else 0.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_THRESHOLD = 0.9
FAILING = ("fail", "slow")


@dataclass
class Measurement:
    group: str  # "host", "gpu", "telemetry", "collective", "p2p"
    name: str  # what was measured, e.g. "bf16 GEMM 8192", "HBM copy", "all_reduce 64 MiB"
    subject: str  # "host node0", "gpu 3 (node0:3)", "link 0->1", "job (8 ranks)"
    value: float | None
    unit: str = ""
    expected: float | None = None  # a floor (higher_is_better) or a ceiling
    expected_note: str = ""  # where the bound comes from
    higher_is_better: bool = True
    peers: bool = False  # compare with the same figure of the other subjects
    peer_key: str = ""  # subjects compared together share (group, name, peer_key)
    reason: str = ""  # why it was skipped, or what it means

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        return cls(**data)


@dataclass
class Check:
    measurement: Measurement
    status: str  # ok, fail, slow, info, skipped
    peer_median: float | None = None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        m = self.measurement
        return {
            "group": m.group, "name": m.name, "subject": m.subject, "value": m.value, "unit": m.unit,
            "value_text": format_value(m.value, m.unit), "expected": m.expected,
            "expected_text": _bound_text(m), "expected_note": m.expected_note,
            "peer_median": self.peer_median, "peer_text": format_value(self.peer_median, m.unit),
            "status": self.status, "reason": self.reason,
        }


@dataclass
class PreflightReport:
    checks: list[Check]
    threshold: float
    facts: dict[str, Any] = field(default_factory=dict)  # host facts, ranks, devices, versions
    skipped: list[str] = field(default_factory=list)  # whole groups not run, with the reason

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status in FAILING]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for c in self.checks:
            counts[c.status] = counts.get(c.status, 0) + 1
        return {
            "kind": "preflight", "title": "primus-perf preflight", "threshold": self.threshold,
            "passed": not self.failed, "exit_code": self.exit_code, "counts": counts,
            "facts": self.facts, "skipped": self.skipped, "checks": [c.to_dict() for c in self.checks],
        }


def format_value(value: float | None, unit: str = "") -> str:
    """A figure for people: 3 significant digits, grouped thousands, its unit; "-" when
    missing. The one formatting of preflight numbers (terminal, JSON text, HTML)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    a = abs(value)
    if a == 0 or a >= 100:
        text = f"{value:,.0f}"
    else:
        decimals = min(4, 2 - math.floor(math.log10(a)))
        text = f"{value:,.{decimals}f}"
    return f"{text} {unit}".strip()


def _bound_text(m: Measurement) -> str:
    if m.expected is None:
        return ""
    return ("≥ " if m.higher_is_better else "≤ ") + format_value(m.expected, m.unit)


def _peer_medians(measurements: list[Measurement]) -> dict[tuple[str, str, str], float]:
    groups: dict[tuple[str, str, str], list[float]] = {}
    for m in measurements:
        if m.peers and m.value is not None:
            groups.setdefault((m.group, m.name, m.peer_key), []).append(m.value)
    return {k: statistics.median(v) for k, v in groups.items() if len(v) >= 2}


def evaluate(measurements: list[Measurement], threshold: float = DEFAULT_THRESHOLD) -> list[Check]:
    """A verdict for every measurement (see the module docstring)."""
    medians = _peer_medians(measurements)
    checks = []
    for m in measurements:
        if m.value is None:
            checks.append(Check(m, "skipped", reason=m.reason or "not measured"))
            continue
        median = medians.get((m.group, m.name, m.peer_key)) if m.peers else None
        status, reasons = "info", []
        if m.expected is not None:
            inside = m.value >= m.expected if m.higher_is_better else m.value <= m.expected
            status = "ok" if inside else "fail"
            if not inside:
                reasons.append(f"{'below' if m.higher_is_better else 'above'} expected {_bound_text(m)}"
                               + (f" ({m.expected_note})" if m.expected_note else ""))
        if median is not None and median > 0:
            ratio = m.value / median if m.higher_is_better else median / max(m.value, 1e-30)
            if ratio < threshold:
                status = "fail" if status == "fail" else "slow"
                reasons.append(f"{ratio:.0%} of the median of its peers ({format_value(median, m.unit)});"
                               f" threshold {threshold:.0%}")
            elif status == "info":
                status = "ok"
        checks.append(Check(m, status, median, "; ".join(reasons) or m.reason))
    return checks
