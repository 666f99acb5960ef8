"""Compare two analyses: per-step time, category breakdown and per-op deltas, and a verdict.

Ops are matched by op family and shape, never by kernel or exact op name, so the same work
compares across libraries, backends and vendors: a GEMM of one problem is the same work
under cuBLAS and hipBLASLt, an attention of one problem under flash, cuDNN or aiter, a
convolution of one shape under cuDNN and MIOpen. The family of a GEMM or attention row is
its category and its shape the canonical problem key (:mod:`.analyses.hotspots`); an
attention row without a problem (shapes not recorded) is still its category, the pass the
category rules give its op (``flash_attn_3::bwd`` a backward); other rows take their family
from :data:`OP_FAMILIES` (else the op name) and keep their input shapes; a copy or memset is a family of its own ("memset in gemm": a GEMM's workspace);
kernels launched outside any op compare by their category alone. All figures are per step as in the analysis (step time: the temporal breakdown's
span; calls: op calls), so runs with different step counts compare. Runs on different
devices or world sizes are compared too, with a warning in the result and the verdict.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.base.errors import UserError
from primus_perf.tracelens.analyses.breakdown import steps_in_order
from primus_perf.tracelens.analyze import Analysis, analyze
from primus_perf.tracelens.categories import (
    ATTENTION_BWD,
    ATTENTION_FWD,
    GEMM,
    MEMCPY,
    MEMSET,
    op_category,
)
from primus_perf.tracelens.colors import category_colors
from primus_perf.tracelens.inputs import check_traces

COMPARE_SCHEMA = "primus-perf-compare/1"
MAX_OPS = 2000

# categories whose rows carry a canonical problem: the category is the family
PROBLEM_FAMILIES = (GEMM, ATTENTION_FWD, ATTENTION_BWD)
# attention: its pass is the category's (``categories.OP_RULES`` knows every library's
# forward and backward ops: ``flash_attn_3::bwd`` is a backward), whether or not its row has
# a problem
ATTENTION_FAMILIES = (ATTENTION_FWD, ATTENTION_BWD)
# op name -> family for the other rows (first match wins), e.g. aten::cudnn_convolution and
# aten::miopen_convolution are both conv_fwd
OP_FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (family, re.compile(rx)) for family, rx in (
        ("conv_bwd", r"^aten::\w*convolution\w*backward|^aten::\w*conv\w*_backward"),
        ("conv_fwd", r"^aten::(cudnn_|miopen_|mkldnn_|_slow_|_nnpack_|_)?convolution(_relu)?$|^aten::conv\dd$"
                     r"|^aten::(cudnn_|miopen_)?conv_transpose\dd?$|^aten::miopen_depthwise_convolution$"),
        ("gemm", r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)$|^primus_perf::gemm$"),
    )
)
KEY = ["family", "shape"]
NO_OP = "(kernels without an op)"
VERDICT_GROUPS = {"attention_fwd": "attention", "attention_bwd": "attention"}


def _rel(base: float, cand: float) -> float | None:
    return (cand - base) / base if base > 0 else None


def change_head(change: float | None, *, subject: str = "candidate", base: str = "base",
                where: str = " per step", nothing: str = "no comparable steps") -> str:
    """``candidate 6.1% faster per step``, ``candidate as fast as base per step``."""
    if change is None:
        return nothing
    if abs(change) < 0.0005:
        return f"{subject} as fast as {base}{where}"
    return f"{subject} {abs(change) * 100:.1f}% {'faster' if change < 0 else 'slower'}{where}"


def verdict_line(step_change: float | None, breakdown: list[dict[str, Any]], top: int = 3) -> str:
    """E.g. ``candidate 6.1% faster per step; gemm -9.8%, attention +0.4%``."""
    head = change_head(step_change)
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


def op_family(category: str, op: str, has_problem: bool) -> str:
    """The family of a hotspot row (see the module docstring); ``has_problem``: the row has a
    canonical problem key."""
    if category in ATTENTION_FAMILIES or (category in PROBLEM_FAMILIES and has_problem):
        return category
    by_op = op_category(op)
    family = next((f for f, rx in OP_FAMILIES if rx.search(op)), by_op if by_op in ATTENTION_FAMILIES else op)
    # a copy or memset an op launched (a GEMM's workspace memset) is not that op's work
    return f"{category} in {family}" if category in (MEMCPY, MEMSET) else family


def _names(ops: pd.Series, most: int = 3) -> str:
    """The distinct op (or kernel) names of a row, the first ``most`` of them."""
    names = list(dict.fromkeys(ops))
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _ops(a: Analysis) -> pd.DataFrame:
    """Hotspots per (family, shape): category, the ops behind them, ms and calls per step."""
    h = a.hotspots
    if h.empty:
        return pd.DataFrame(columns=["category", "ops", "ms", "calls"], index=pd.MultiIndex.from_tuples([], names=KEY))
    has = [bool(k) for k in h["problem_key"]]
    # a row of kernels launched outside any op is named after its kernel: its category is all
    # that compares across libraries
    no_op = [op in {n for n, _ in top} for op, top in zip(h["op"], h["top_kernels"], strict=True)]
    family = [c if n else op_family(c, o, p) for c, o, p, n in zip(h["category"], h["op"], has, no_op, strict=True)]
    shape = [NO_OP if n else p if k else sh for k, n, p, sh in zip(has, no_op, h["problem"], h["shape"], strict=True)]
    key = [NO_OP if n else k or sh for k, n, sh in zip(h["problem_key"], no_op, h["shape"], strict=True)]
    d = pd.DataFrame({"family": family, "key": key, "label": shape, "category": h["category"], "op": h["op"],
                      "ms": h["time_s"] * 1e3, "calls": h["calls"]})
    g = d.groupby(["family", "key"], sort=False).agg(
        shape=("label", "first"), category=("category", "first"),
        ops=("op", _names), ms=("ms", "sum"), calls=("calls", "sum"))
    return g


def mismatch_warnings(base: Analysis, candidate: Analysis) -> list[str]:
    """Why the two runs may not be comparable: different devices or world sizes."""
    out = []
    bdev, cdev = base.device["name"], candidate.device["name"]
    if bdev != cdev:
        out.append(f"different devices: {bdev} vs {cdev}")
    if base.world_size != candidate.world_size:
        out.append(f"different world sizes: {base.world_size} vs {candidate.world_size}")
    return out


def _median(s: pd.Series) -> float:
    return float(s.median()) * 1e3 if len(s) else 0.0


def compare_analyses(base: Analysis, candidate: Analysis, *, base_label: str = "base",
                     candidate_label: str = "candidate") -> dict[str, Any]:
    """The comparison of two analyses as a JSON-ready dict; ``header.step_change`` is the
    relative change of the median step time (negative: the candidate is faster)."""
    without = [label for label, a in ((base_label, base), (candidate_label, candidate)) if a.temporal.empty]
    if len(without) == 2:
        return compare_cpu_analyses(base, candidate, base_label=base_label, candidate_label=candidate_label)
    if without:
        other = candidate_label if without[0] == base_label else base_label
        raise UserError(f"{without[0]}: the trace has no GPU kernels and {other} has: a GPU run compares with"
                        " a GPU run, a CPU run with a CPU run")
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
    ops = sorted(_op_rows(joined), key=lambda r: -abs(r["delta_ms"]))[:MAX_OPS]
    step_change = _rel(base_step, cand_step)
    warnings = mismatch_warnings(base, candidate)
    figures = {"base_step_ms": base_step, "candidate_step_ms": cand_step, "step_change": step_change,
               "base_kernel_ms": base_kernel, "candidate_kernel_ms": cand_kernel,
               "kernel_change": _rel(base_kernel, cand_kernel)}
    return _diff(base, candidate, base_label, candidate_label, cats, verdict_line(step_change, breakdown), warnings,
                 warnings, figures, (len(sb), len(sc)), steps, breakdown, ops, ops)


def _op_rows(joined: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of ``ops``, one per row of the two runs' tables joined (columns suffixed
    ``_b`` and ``_c``: category, shape, ops, ms, calls; the family first in the index)."""
    ops = []
    for key, r in joined.iterrows():
        in_b, in_c = not np.isnan(r["ms_b"]), not np.isnan(r["ms_c"])
        b, c = (float(r["ms_b"]) if in_b else 0.0), (float(r["ms_c"]) if in_c else 0.0)
        side = "both" if in_b and in_c else ("base only" if in_b else "candidate only")
        ops.append({
            "category": r["category_b"] if in_b else r["category_c"], "family": key[0],
            "shape": r["shape_b"] if in_b else r["shape_c"],
            "base_op": r["ops_b"] if in_b else None, "candidate_op": r["ops_c"] if in_c else None,
            "base_ms": b, "candidate_ms": c, "delta_ms": c - b,
            "rel": _rel(b, c) if side == "both" else None, "side": side,
            "base_calls": float(r["calls_b"]) if in_b else None,
            "candidate_calls": float(r["calls_c"]) if in_c else None,
        })
    return ops


def _diff(base: Analysis, candidate: Analysis, base_label: str, candidate_label: str, cats: list[str], verdict: str,
          warnings: list[str], shown: list[str], figures: dict[str, Any], n_steps: tuple[int, int],
          steps: list[dict[str, Any]], breakdown: list[dict[str, Any]], ops: list[dict[str, Any]],
          all_ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison's dict, as both kinds of comparison give it: ``warnings`` follow the
    verdict, ``shown`` are the ``warnings`` listed; ``figures``: the header's times; ``ops``
    the rows listed, ``all_ops`` those the ``only_in_*`` lists are taken from."""
    bdev, cdev = base.device["name"], candidate.device["name"]
    return {
        "schema": COMPARE_SCHEMA,
        "kind": "diff",
        "colors": category_colors(cats),
        "title": f"primus-perf diff: {Path(candidate_label).name} vs {Path(base_label).name}",
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "verdict": verdict + "".join(f" (warning: {w})" for w in warnings),
        "warnings": shown,
        "header": {
            "base": base_label, "candidate": candidate_label, **figures,
            "base_steps": n_steps[0], "candidate_steps": n_steps[1],
            "device": bdev if bdev == cdev else f"{bdev} vs {cdev}", "same_device": bdev == cdev,
            "world_size": base.world_size if base.world_size == candidate.world_size
            else f"{base.world_size} vs {candidate.world_size}",
            "base_versions": base.versions, "candidate_versions": candidate.versions,
        },
        "steps": steps,
        "breakdown": breakdown,
        "ops": ops,
        "only_in_base": [r for r in all_ops if r["side"] == "base only"],
        "only_in_candidate": [r for r in all_ops if r["side"] == "candidate only"],
    }


CPU_NOTE = ("no GPU events in either run: compared are the CPU times of their GEMM, grouped GEMM and attention"
            " ops (per step), not step or kernel times")


def _cpu_ops(a: Analysis) -> pd.DataFrame:
    """Per (kind, problem key, direction): label, ms and calls per step of a CPU-only run."""
    frames = [df.assign(family=kind)[["family", "key", "direction", "label", "time_s", "calls"]]
              for kind, df in a.problem_tables().items() if len(df)]
    if not frames:
        return pd.DataFrame(columns=["category", "shape", "ops", "ms", "calls"],
                            index=pd.MultiIndex.from_tuples([], names=["family", "key", "direction"]))
    d = pd.concat(frames, ignore_index=True)
    # a kind is its own category and op
    return pd.DataFrame({"category": d["family"].to_numpy(), "ops": d["family"].to_numpy(),
                         "shape": [f"{lb} ({dr})" for lb, dr in zip(d["label"], d["direction"], strict=True)],
                         "ms": d["time_s"].to_numpy() * 1e3, "calls": d["calls"].to_numpy()},
                        index=pd.MultiIndex.from_frame(d[["family", "key", "direction"]]))


def compare_cpu_analyses(base: Analysis, candidate: Analysis, *, base_label: str = "base",
                         candidate_label: str = "candidate") -> dict[str, Any]:
    """Two runs without GPU events (CPU runs): what they have, the CPU time per step of
    their modeled ops (GEMM, grouped GEMM, attention) per problem and per kind, in the shape
    :func:`compare_analyses` gives (no per-step times: ``steps`` is empty)."""
    joined = _cpu_ops(base).merge(_cpu_ops(candidate), how="outer", left_index=True, right_index=True,
                                  suffixes=("_b", "_c"))
    ops, kinds = _op_rows(joined), {}
    for r in ops:
        kb, kc = kinds.get(r["family"], (0.0, 0.0))
        kinds[r["family"]] = (kb + r["base_ms"], kc + r["candidate_ms"])
    ops.sort(key=lambda r: -abs(r["delta_ms"]))
    breakdown = [{"category": k, "base_ms": b, "candidate_ms": c, "delta_ms": c - b, "rel": _rel(b, c)}
                 for k, (b, c) in sorted(kinds.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))]
    total_b, total_c = sum(b for b, _ in kinds.values()), sum(c for _, c in kinds.values())
    change = _rel(total_b, total_c)
    warnings = mismatch_warnings(base, candidate)
    head = change_head(change, subject="candidate's modeled ops", base="base's", where=" on the CPU",
                       nothing="no modeled ops to compare")
    figures = {"base_step_ms": None, "candidate_step_ms": None, "step_change": None, "base_kernel_ms": None,
               "candidate_kernel_ms": None, "kernel_change": None, "base_cpu_op_ms": total_b,
               "candidate_cpu_op_ms": total_c, "cpu_op_change": change}
    return _diff(base, candidate, base_label, candidate_label, list(kinds), head, warnings, [CPU_NOTE, *warnings],
                 figures, (len(base.steps), len(candidate.steps)), [], breakdown, ops[:MAX_OPS], ops)


def compare(base: str | Path, candidate: str | Path) -> dict[str, Any]:
    """Analyze two traces (or run folders) and compare them (see :func:`compare_analyses`);
    both are checked (``inputs.check_traces``) before either is analyzed."""
    check_traces([base, candidate])
    return compare_analyses(analyze(base), analyze(candidate), base_label=str(base), candidate_label=str(candidate))
