"""Compare two analyses: per-step time, category breakdown and per-op deltas, and a verdict.

Ops are matched by (category, op, shape), never by kernel name: a library upgrade renames
kernels (a new cuBLASLt/hipBLASLt heuristic, another flash-attention build) while the
operator and its shapes stay, and that is what a user wants compared. All figures are per
step as in the analysis (step time: the temporal breakdown's span; calls: op calls), so
runs with different step counts compare.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.errors import UserError
from primus_perf.tracelens.analyses.breakdown import steps_in_order
from primus_perf.tracelens.analyses.hotspots import KEYS
from primus_perf.tracelens.analyze import Analysis, analyze

COMPARE_SCHEMA = "primus-perf-compare/1"
MAX_OPS = 2000

# Ops that stand for another op of the same shapes: a GEMM that the trainer's router sent to
# a tuned cuBLASLt/hipBLASLt algorithm is the aten::mm it replaced.
SAME_OP_AS = {"primus_perf::gemm": "aten::mm"}
VERDICT_GROUPS = {"attention_fwd": "attention", "attention_bwd": "attention"}


def _rel(base: float, cand: float) -> float | None:
    return (cand - base) / base if base > 0 else None


def verdict_line(step_change: float | None, breakdown: list[dict[str, Any]], top: int = 3) -> str:
    """E.g. ``candidate 6.1% faster per step; gemm -9.8%, attention +0.4%``."""
    if step_change is None:
        head = "no comparable steps"
    elif abs(step_change) < 0.0005:
        head = "candidate as fast as base per step"
    else:
        word = "faster" if step_change < 0 else "slower"
        head = f"candidate {abs(step_change) * 100:.1f}% {word} per step"
    # the tuners' targets (GEMM, attention: forward and backward together) always, then
    # the other categories by the size of their change
    groups: dict[str, list[float]] = {}
    for r in breakdown:
        name = VERDICT_GROUPS.get(r["category"], r["category"])
        b, c = groups.setdefault(name, [0.0, 0.0])
        groups[name] = [b + r["base_ms"], c + r["candidate_ms"]]
    first = [g for g in ("gemm", "attention") if g in groups]
    rest = sorted((g for g in groups if g not in first), key=lambda g: -abs(groups[g][1] - groups[g][0]))
    parts = []
    for g in (first + rest)[:top]:
        b, c = groups[g]
        rel = _rel(b, c)
        parts.append(f"{g} new ({c:.3g} ms)" if rel is None else f"{g} {rel * 100:+.1f}%")
    return head + ("; " + ", ".join(parts) if parts else "")


def _ops(a: Analysis) -> pd.DataFrame:
    """Hotspots per (category, op, shape) with equivalent ops merged: ms and calls per step."""
    h = a.hotspots.assign(op=a.hotspots["op"].replace(SAME_OP_AS))
    g = h.groupby(KEYS)[["time_s", "calls"]].sum()
    return pd.DataFrame({"ms": g["time_s"] * 1e3, "calls": g["calls"]})


def _median(s: pd.Series) -> float:
    return float(s.median()) * 1e3 if len(s) else 0.0


def compare_analyses(base: Analysis, candidate: Analysis, *, base_label: str = "base",
                     candidate_label: str = "candidate") -> dict[str, Any]:
    """The comparison of two analyses as a JSON-ready dict; ``header.step_change`` is the
    relative change of the median step time (negative: the candidate is faster)."""
    for label, a in ((base_label, base), (candidate_label, candidate)):
        if a.temporal.empty:
            raise UserError(f"{label}: the trace has no GPU kernels to compare")
    sb = steps_in_order(base.temporal, base.breakdown)
    sc = steps_in_order(candidate.temporal, candidate.breakdown)
    steps = []
    for i in range(max(len(sb), len(sc))):
        b = float(sb["span_s"].iloc[i]) * 1e3 if i < len(sb) else None
        c = float(sc["span_s"].iloc[i]) * 1e3 if i < len(sc) else None
        steps.append({"step": i, "base_ms": b, "candidate_ms": c,
                      "rel": _rel(b, c) if b is not None and c is not None else None})
    base_step, cand_step = _median(sb["span_s"]), _median(sc["span_s"])
    base_kernel, cand_kernel = _median(sb["kernel_s"]), _median(sc["kernel_s"])

    cb, cc = base.category_seconds() * 1e3, candidate.category_seconds() * 1e3
    cats = sorted(set(cb.index) | set(cc.index), key=lambda c: -(cb.get(c, 0.0) + cc.get(c, 0.0)))
    breakdown = []
    for cat in cats:
        b, c = float(cb.get(cat, 0.0)), float(cc.get(cat, 0.0))
        breakdown.append({"category": cat, "base_ms": b, "candidate_ms": c, "delta_ms": c - b, "rel": _rel(b, c)})

    joined = _ops(base).merge(_ops(candidate), how="outer", left_index=True, right_index=True, suffixes=("_b", "_c"))
    ops = []
    for (cat, op, shape), r in joined.iterrows():
        in_b, in_c = not np.isnan(r["ms_b"]), not np.isnan(r["ms_c"])
        b = float(r["ms_b"]) if in_b else 0.0
        c = float(r["ms_c"]) if in_c else 0.0
        side = "both" if in_b and in_c else ("base only" if in_b else "candidate only")
        ops.append({
            "category": cat, "op": op, "shape": shape, "base_ms": b, "candidate_ms": c, "delta_ms": c - b,
            "rel": _rel(b, c) if side == "both" else None, "side": side,
            "base_calls": float(r["calls_b"]) if in_b else None,
            "candidate_calls": float(r["calls_c"]) if in_c else None,
        })
    ops.sort(key=lambda r: -abs(r["delta_ms"]))
    ops = ops[:MAX_OPS]
    step_change = _rel(base_step, cand_step)
    bdev, cdev = base.device["name"], candidate.device["name"]
    return {
        "schema": COMPARE_SCHEMA,
        "kind": "diff",
        "title": f"primus-perf diff: {Path(candidate_label).name} vs {Path(base_label).name}",
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "verdict": verdict_line(step_change, breakdown),
        "header": {
            "base": base_label, "candidate": candidate_label,
            "base_step_ms": base_step, "candidate_step_ms": cand_step, "step_change": step_change,
            "base_kernel_ms": base_kernel, "candidate_kernel_ms": cand_kernel,
            "kernel_change": _rel(base_kernel, cand_kernel),
            "base_steps": len(sb), "candidate_steps": len(sc),
            "device": bdev if bdev == cdev else f"{bdev} vs {cdev}", "same_device": bdev == cdev,
            "base_versions": base.versions, "candidate_versions": candidate.versions,
        },
        "steps": steps,
        "breakdown": breakdown,
        "ops": ops,
        "only_in_base": [r for r in ops if r["side"] == "base only"],
        "only_in_candidate": [r for r in ops if r["side"] == "candidate only"],
    }


def compare(base: str | Path, candidate: str | Path) -> dict[str, Any]:
    """Analyze two traces (or run folders) and compare them (see :func:`compare_analyses`)."""
    return compare_analyses(analyze(base), analyze(candidate), base_label=str(base), candidate_label=str(candidate))
