"""Compare two runs: per-step time, category breakdown and per-op deltas, and a verdict.

Kernels are matched by (category, op, shape), never by kernel name: a library upgrade
renames kernels (a new cuBLASLt/hipBLASLt heuristic, another flash-attention build) while
the operator and its shapes stay, and that is what a user wants compared. All times are
per step (averaged over steps and ranks), so runs with different step counts compare.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.errors import UserError
from primus_perf.tracelens.report import inputs_from_analysis, step_kernels

COMPARE_SCHEMA = "primus-perf-compare/1"
TRACE_SUFFIXES = (".json", ".json.gz")
MAX_OPS = 2000


def trace_files(path: str | Path) -> list[str]:
    """A trace file as is; a run directory as the trace files inside it (one per rank)."""
    p = Path(path)
    if p.is_file():
        return [str(p)]
    if not p.is_dir():
        raise UserError(f"trace or run directory not found: {p}")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(TRACE_SUFFIXES))
    traces = [f for f in files if "trace" in f.name]
    if not traces:
        traces = [f for f in files if not f.name.startswith(("manifest", "samples", "report"))]
    if not traces:
        raise UserError(f"no trace files (*.json, *.json.gz) in {p}")
    return [str(f) for f in traces]


def _step_table(k: pd.DataFrame) -> pd.DataFrame:
    """Per step index (0..n-1 in time order): GPU kernel ms and span ms, averaged over ranks."""
    g = k.assign(end=k["ts_us"] + k["dur_us"]).groupby(["rank", "step"])
    t = pd.DataFrame({"kernel_us": g["dur_us"].sum(), "span_us": g["end"].max() - g["ts_us"].min()}).reset_index()
    t["idx"] = t.groupby("rank")["step"].rank(method="first").astype(int) - 1
    return t.groupby("idx")[["kernel_us", "span_us"]].mean() / 1e3


def _rel(base: float, cand: float) -> float | None:
    return (cand - base) / base if base > 0 else None


def _per_step(k: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    n = max(1, k.groupby(["rank", "step"]).ngroups)
    g = k.groupby(keys, observed=True)["dur_us"].agg(["sum", "count"])
    return pd.DataFrame({"ms": g["sum"] / n / 1e3, "calls": g["count"] / n})


# Ops that stand for another op of the same shapes: a GEMM that the trainer's router sent to
# a tuned cuBLASLt/hipBLASLt algorithm is the aten::mm it replaced.
SAME_OP_AS = {"primus_perf::gemm": "aten::mm"}


def _canonical_ops(k: pd.DataFrame) -> pd.DataFrame:
    return k.assign(op=k["op"].replace(SAME_OP_AS))


VERDICT_GROUPS = {"attention_fwd": "attention", "attention_bwd": "attention"}


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


def compare_kernels(base: pd.DataFrame, candidate: pd.DataFrame) -> dict[str, Any]:
    """The comparison of two kernel tables (columns as ``Analysis.kernels``)."""
    kb, kc = (_canonical_ops(step_kernels(k)) for k in (base, candidate))
    sb, sc = _step_table(kb), _step_table(kc)
    steps = []
    for i in range(max(len(sb), len(sc))):
        b = float(sb["span_us"].iloc[i]) if i < len(sb) else None
        c = float(sc["span_us"].iloc[i]) if i < len(sc) else None
        steps.append({"step": i, "base_ms": b, "candidate_ms": c,
                      "rel": _rel(b, c) if b is not None and c is not None else None})
    base_step = float(sb["span_us"].median()) if len(sb) else 0.0
    cand_step = float(sc["span_us"].median()) if len(sc) else 0.0
    base_kernel = float(sb["kernel_us"].median()) if len(sb) else 0.0
    cand_kernel = float(sc["kernel_us"].median()) if len(sc) else 0.0

    cb, cc = _per_step(kb, ["category"]), _per_step(kc, ["category"])
    cats = sorted(set(cb.index) | set(cc.index), key=lambda c: -(cb["ms"].get(c, 0.0) + cc["ms"].get(c, 0.0)))
    breakdown = []
    for cat in cats:
        b, c = float(cb["ms"].get(cat, 0.0)), float(cc["ms"].get(cat, 0.0))
        breakdown.append({"category": cat, "base_ms": b, "candidate_ms": c, "delta_ms": c - b, "rel": _rel(b, c)})

    keys = ["category", "op", "shape"]
    ob, oc = _per_step(kb, keys), _per_step(kc, keys)
    joined = ob.merge(oc, how="outer", left_index=True, right_index=True, suffixes=("_b", "_c"))
    ops = []
    for (cat, op, shape), r in joined.iterrows():
        b = 0.0 if np.isnan(r["ms_b"]) else float(r["ms_b"])
        c = 0.0 if np.isnan(r["ms_c"]) else float(r["ms_c"])
        side = "both" if not np.isnan(r["ms_b"]) and not np.isnan(r["ms_c"]) else (
            "base only" if not np.isnan(r["ms_b"]) else "candidate only")
        ops.append({
            "category": cat, "op": op, "shape": shape, "base_ms": b, "candidate_ms": c, "delta_ms": c - b,
            "rel": _rel(b, c) if side == "both" else None, "side": side,
            "base_calls": None if np.isnan(r["calls_b"]) else float(r["calls_b"]),
            "candidate_calls": None if np.isnan(r["calls_c"]) else float(r["calls_c"]),
        })
    ops.sort(key=lambda r: -abs(r["delta_ms"]))
    ops = ops[:MAX_OPS]
    step_change = _rel(base_step, cand_step) if len(sb) and len(sc) else None
    return {
        "schema": COMPARE_SCHEMA,
        "kind": "diff",
        "verdict": verdict_line(step_change, breakdown),
        "header": {
            "base_step_ms": base_step, "candidate_step_ms": cand_step, "step_change": step_change,
            "base_kernel_ms": base_kernel, "candidate_kernel_ms": cand_kernel,
            "kernel_change": _rel(base_kernel, cand_kernel),
            "base_steps": len(sb), "candidate_steps": len(sc),
        },
        "steps": steps,
        "breakdown": breakdown,
        "ops": ops,
        "only_in_base": [r for r in ops if r["side"] == "base only"],
        "only_in_candidate": [r for r in ops if r["side"] == "candidate only"],
    }


def compare_analyses(base: Any, candidate: Any, *, base_label: str = "base",
                     candidate_label: str = "candidate") -> dict[str, Any]:
    """Compare two ``Analysis`` objects (see :func:`compare`)."""
    ib, ic = inputs_from_analysis(base), inputs_from_analysis(candidate)
    for label, inp in ((base_label, ib), (candidate_label, ic)):
        if inp.kernels is None or len(inp.kernels) == 0:
            raise UserError(f"{label}: the trace has no GPU kernels to compare")
    out = compare_kernels(ib.kernels, ic.kernels)
    out["header"].update({
        "base": base_label, "candidate": candidate_label,
        "device": ib.device if ib.device == ic.device else f"{ib.device} vs {ic.device}",
        "same_device": ib.device == ic.device,
        "base_versions": ib.versions, "candidate_versions": ic.versions,
    })
    out["title"] = f"primus-perf diff: {Path(candidate_label).name} vs {Path(base_label).name}"
    out["generated"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return out


def compare(base: str | Path, candidate: str | Path) -> dict[str, Any]:
    """Analyze two traces (or run directories) and compare them; returns a JSON-ready dict.

    ``header.step_change`` is the relative change of the median step time (first kernel
    start to last kernel end of each step); negative means the candidate is faster.
    """
    fb, fc = trace_files(base), trace_files(candidate)
    from primus_perf.tracelens import analyzer

    analyze = analyzer()

    return compare_analyses(analyze(fb), analyze(fc),
                            base_label=str(base), candidate_label=str(candidate))
