"""Report data: everything the HTML report shows, as one JSON-ready dict.

``build_report(paths)`` analyzes traces with :func:`primus_perf.tracelens.analyze.analyze`
and aggregates the result; ``report_from_analysis(analysis)`` does the same for an
analysis already in hand. The dict is bounded in size whatever the trace size: tables
are per (category, op, shape) or per problem, the breakdown per (rank, step) and the
timeline merges each stream's kernels into busy segments at a fixed resolution.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.devices import lookup_peaks
from primus_perf.errors import UserError

REPORT_SCHEMA = "primus-perf-report/1"
MAX_HOTSPOTS = 2000
MAX_BREAKDOWN_ROWS = 256
TIMELINE_BINS = 1500  # segments are merged at span / TIMELINE_BINS


@dataclass
class ReportInputs:
    """What the report needs from a trace analysis."""

    kernels: pd.DataFrame  # rank, step, stream, ts_us, dur_us, name, category, op, shape
    gemm: pd.DataFrame = field(default_factory=pd.DataFrame)
    attention: pd.DataFrame = field(default_factory=pd.DataFrame)
    hotspots: pd.DataFrame | None = None
    device: str = "unknown"
    versions: dict[str, str] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    traces: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- inputs


def _as_dict(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "to_dict"):
        return dict(obj.to_dict())
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    return {}


def inputs_from_analysis(analysis: Any, traces: Sequence[str] = ()) -> ReportInputs:
    """Adapt a ``tracelens.analyze.Analysis`` (or anything with the same attributes)."""
    summary: dict[str, Any] = {}
    if hasattr(analysis, "to_json"):
        try:
            summary = analysis.to_json()
        except Exception:  # the summary is optional decoration; the DataFrames are the data
            summary = {}
    dev = summary.get("device", getattr(analysis, "device", None))
    dev_d = _as_dict(dev) if not isinstance(dev, str) else {"name": dev}
    manifest = _as_dict(summary.get("manifest", getattr(analysis, "manifest", None)))
    versions = summary.get("versions") or manifest.get("versions") or dev_d.get("versions") or {}
    return ReportInputs(
        kernels=getattr(analysis, "kernels", pd.DataFrame()),
        gemm=_frame(getattr(analysis, "gemm_problems", None)),
        attention=_frame(getattr(analysis, "attention_problems", None)),
        hotspots=_frame(getattr(analysis, "hotspots", None)),
        device=str(dev_d.get("name") or manifest.get("device") or "unknown"),
        versions={str(k): str(v) for k, v in _as_dict(versions).items()},
        manifest=manifest,
        traces=[str(t) for t in traces],
    )


def _frame(obj: Any) -> pd.DataFrame:
    if obj is None:
        return pd.DataFrame()
    if isinstance(obj, pd.DataFrame):
        return obj
    return pd.DataFrame(obj)


def _col(df: pd.DataFrame, *names: str) -> pd.Series | None:
    for n in names:
        if n in df.columns:
            return df[n]
    return None


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


# --------------------------------------------------------------------------- kernels


def step_kernels(kernels: pd.DataFrame) -> pd.DataFrame:
    """Kernels inside a profiler step (step >= 0), with a numeric rank and step."""
    need = {"rank", "step", "stream", "ts_us", "dur_us", "category", "op", "shape"}
    missing = need - set(kernels.columns)
    if missing:
        raise UserError(f"kernel table lacks column(s): {', '.join(sorted(missing))}")
    k = kernels[kernels["step"].notna()]
    k = k[k["step"].astype(float) >= 0]
    if len(k) == 0:
        k = kernels.assign(step=0)  # a trace without step markers: one pseudo-step
    k = k.copy()
    k["rank"] = k["rank"].fillna(0).astype(int)
    k["step"] = k["step"].astype(int)
    for c in ("category", "op", "shape"):
        k[c] = k[c].astype(str).replace({"nan": "", "None": ""})
    return k


def breakdown(k: pd.DataFrame) -> tuple[list[str], list[dict[str, Any]]]:
    """Categories (by total time) and rows of ms per category: one per (rank, step), or
    one per rank (mean over its steps) when that would exceed ``MAX_BREAKDOWN_ROWS``."""
    cats = list(k.groupby("category", observed=True)["dur_us"].sum().sort_values(ascending=False).index)
    table = k.groupby(["rank", "step", "category"], observed=True)["dur_us"].sum().unstack(fill_value=0.0)
    per_rank = len(table) > MAX_BREAKDOWN_ROWS
    if per_rank:
        counts = table.groupby(level="rank").size()
        table = table.groupby(level="rank").mean()
    rows = []
    for idx, vals in table.iterrows():
        if per_rank:
            rank, step, label = int(idx), None, f"rank {int(idx)} (mean of {int(counts[idx])} steps)"
        else:
            rank, step = int(idx[0]), int(idx[1])
            label = f"rank {rank} step {step}"
        rows.append({
            "rank": rank,
            "step": step,
            "label": label,
            "total_ms": float(vals.sum()) / 1e3,
            "by_cat": {c: round(float(vals.get(c, 0.0)) / 1e3, 6) for c in cats if vals.get(c, 0.0) > 0},
        })
        if len(rows) >= MAX_BREAKDOWN_ROWS:
            break
    return cats, rows


def hotspots(k: pd.DataFrame, extra: pd.DataFrame | None) -> list[dict[str, Any]]:
    """Per (category, op, shape): calls and ms per step, share; TFLOP/s from the analysis."""
    n_steps = max(1, k.groupby(["rank", "step"]).ngroups)
    total = float(k["dur_us"].sum()) or 1.0
    g = k.groupby(["category", "op", "shape"], observed=True)["dur_us"].agg(["sum", "count"])
    g = g.sort_values("sum", ascending=False).head(MAX_HOTSPOTS)
    perf: dict[tuple[str, str, str], tuple[float | None, float | None]] = {}
    if extra is not None and len(extra) and {"op", "shape"} <= set(extra.columns):
        tf = _col(extra, "tflops")
        pr = _col(extra, "pct_roofline", "roofline_frac")
        cat = _col(extra, "category")
        for i in range(len(extra)):
            key = (str(cat.iloc[i]) if cat is not None else "", str(extra["op"].iloc[i]), str(extra["shape"].iloc[i]))
            perf[key] = (
                _num(tf.iloc[i]) if tf is not None else None,
                _pct_frac(pr.iloc[i]) if pr is not None else None,
            )
    rows = []
    for (cat, op, shape), r in g.iterrows():
        tf, pr = perf.get((cat, op, shape)) or perf.get(("", op, shape)) or (None, None)
        rows.append({
            "category": cat, "op": op, "shape": shape,
            "calls": float(r["count"]) / n_steps,
            "time_ms": float(r["sum"]) / n_steps / 1e3,
            "share": float(r["sum"]) / total,
            "tflops": tf, "pct_roofline": pr,
        })
    return rows


def _pct_frac(v: Any) -> float | None:
    """% of roofline as a fraction; analyses may give 0..1 or 0..100."""
    f = _num(v)
    if f is None:
        return None
    return f / 100.0 if f > 1.5 else f


def _busy_per_bin(s: np.ndarray, e: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Kernel time inside each bin [edges[i], edges[i+1]) for intervals (s, e), exactly:
    the busy time before t is sum(clip(t - s, 0, e - s)), evaluated at the edges through
    sorted starts and ends (O((K + B) log K), no K x B matrix)."""
    order_s, order_e = np.sort(s), np.sort(e)
    cs, ce = np.concatenate(([0.0], np.cumsum(order_s))), np.concatenate(([0.0], np.cumsum(order_e)))
    n_started = np.searchsorted(order_s, edges, side="right")
    n_ended = np.searchsorted(order_e, edges, side="right")
    # sum over started kernels of (t - s) minus, over ended ones, (t - e)
    before = (n_started * edges - cs[n_started]) - (n_ended * edges - ce[n_ended])
    return np.diff(before)


def timeline(k: pd.DataFrame, cats: list[str], bins: int = TIMELINE_BINS) -> dict[str, Any] | None:
    """One representative step (median GPU time, lowest rank), per stream: the step cut into
    ``bins`` bins, each labelled with the category that has most kernel time in it; runs of
    bins with the same label become one segment [start_us, length_us, category, busy_us]."""
    if len(k) == 0:
        return None
    rank = int(k["rank"].min())
    kr = k[k["rank"] == rank]
    per_step = kr.groupby("step")["dur_us"].sum().sort_values()
    step = int(per_step.index[len(per_step) // 2])
    ks = kr[kr["step"] == step]
    ts = ks["ts_us"].to_numpy(dtype=np.float64)
    dur = ks["dur_us"].to_numpy(dtype=np.float64)
    t0 = float(ts.min())
    span = float((ts + dur).max() - t0) or 1.0
    res = span / bins
    edges = np.linspace(0.0, span, bins + 1)
    edges[-1] = np.nextafter(span, np.inf)  # the last kernel's end lies inside the last bin
    cat_index = {c: i for i, c in enumerate(cats)}
    streams = []
    for stream, grp in ks.groupby("stream", sort=True):
        s = grp["ts_us"].to_numpy(dtype=np.float64) - t0
        e = s + grp["dur_us"].to_numpy(dtype=np.float64)
        c = grp["category"].to_numpy()
        names = sorted(set(c), key=lambda x: cat_index.get(x, 0))
        busy = np.stack([_busy_per_bin(s[c == n], e[c == n], edges) for n in names])  # categories x bins
        total = busy.sum(axis=0)
        label = np.where(total > 0, busy.argmax(axis=0), -1)
        change = np.flatnonzero(np.diff(label)) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [bins]))
        segments = [
            [round(float(edges[a]), 3), round(float(min(edges[b], span) - edges[a]), 3),
             cat_index.get(names[label[a]], 0), round(float(total[a:b].sum()), 3)]
            for a, b in zip(starts, ends) if label[a] >= 0
        ]
        streams.append({"stream": str(stream), "segments": segments})
    return {"rank": rank, "step": step, "t0_us": t0, "dur_us": span, "resolution_us": res,
            "categories": cats, "streams": streams}


# --------------------------------------------------------------------------- problems


def _problem_label(row: pd.Series, kind: str) -> tuple[str, str]:
    """(cache key, readable shape) of a problem row."""
    prob = row.get("problem")
    if prob is not None and hasattr(prob, "key"):
        return prob.key(), str(prob)
    if isinstance(prob, Mapping):
        from primus_perf.problems import AttentionProblem, GemmProblem

        try:
            p = (GemmProblem if kind == "gemm" else AttentionProblem).from_dict(dict(prob))
            return p.key(), str(p)
        except (TypeError, ValueError):
            pass
    key = str(row.get("key", "") or "")
    shape = str(row.get("label", "") or row.get("shape", "") or key)
    return key, shape


def problems(df: pd.DataFrame, kind: str, n_steps: int, total_us: float,
             marks: Mapping[str, float | None] | None) -> list[dict[str, Any]]:
    """One row per GEMM/attention problem with roofline figures and cache marks."""
    rows = []
    if df is None or len(df) == 0:
        return rows
    for _, r in df.iterrows():
        key, shape = _problem_label(r, kind)
        time_s = _num(r.get("time_s"))
        if time_s is None and _num(r.get("time_us")) is not None:
            time_s = float(r["time_us"]) / 1e6
        ai = _num(r.get("arithmetic_intensity", r.get("ai")))
        flops, nbytes = _num(r.get("flops")), _num(r.get("bytes", r.get("bytes_moved")))
        if ai is None and flops and nbytes:
            ai = flops / nbytes
        tflops = _num(r.get("tflops"))
        calls = _num(r.get("calls", r.get("count")))
        row = {
            "key": key, "shape": shape, "kind": kind,
            "dtype": str(r.get("dtype", "") or ""),
            "calls": calls / n_steps if calls is not None else None,
            "time_ms": time_s * 1e3 / n_steps if time_s is not None else None,
            "share": (time_s * 1e6 / total_us) if time_s is not None and total_us else None,
            "ai": ai, "tflops": tflops,
            "pct_roofline": _pct_frac(r.get("pct_roofline")),
            "tuned": None, "speedup": None,
        }
        if kind == "attention":
            row["direction"] = str(r.get("direction", "") or "")
        if marks is not None:
            row["tuned"] = key in marks
            row["speedup"] = marks.get(key)
        rows.append(row)
    rows.sort(key=lambda x: -(x["time_ms"] or 0.0))
    return rows


def _dominant_dtype(rows: list[dict[str, Any]]) -> str:
    weights: dict[str, float] = {}
    for r in rows:
        d = r["dtype"] or (r["key"].split("|")[4].split(".")[0] if r["key"].startswith("gemm:") else "")
        if r["key"].startswith("attn|"):
            d = r["key"].split("|")[7]
        if d:
            weights[d] = weights.get(d, 0.0) + (r["time_ms"] or 0.0)
    return max(weights, key=lambda d: weights[d]) if weights else "bf16"


# --------------------------------------------------------------------------- cache marks


def cache_marks(cache_path: str | Path, device: str | None = None) -> tuple[dict[str, float | None], int]:
    """Problem key -> cached speedup (default / tuned time) of the cache's entries for
    ``device`` (all devices when None); the newest entry wins when several match."""
    from primus_perf.cache.store import TuningCache

    p = Path(cache_path)
    if not p.exists():
        raise UserError(f"tuning cache not found: {p}")
    entries = TuningCache(p).entries()
    marks: dict[str, float | None] = {}
    for e in sorted(entries, key=lambda e: e.created):
        if device is not None and e.device.get("name") not in (None, "", device):
            continue
        marks[e.problem_key] = e.speedup
    return marks, len(entries)


# --------------------------------------------------------------------------- assembly


def report_from_inputs(inp: ReportInputs, *, marks: Mapping[str, float | None] | None = None,
                       cache_info: dict[str, Any] | None = None, title: str | None = None) -> dict[str, Any]:
    """The report dict (JSON-ready) for analysis inputs."""
    if inp.kernels is None or len(inp.kernels) == 0:
        raise UserError("the trace has no GPU kernels to report on")
    k = step_kernels(inp.kernels)
    cats, rows = breakdown(k)
    n_steps = max(1, k.groupby(["rank", "step"]).ngroups)
    total_us = float(k["dur_us"].sum())
    per_step_ms = k.groupby(["rank", "step"])["dur_us"].sum().to_numpy() / 1e3
    gemm = problems(inp.gemm, "gemm", n_steps, total_us, marks)
    attn = problems(inp.attention, "attention", n_steps, total_us, marks)
    peaks = lookup_peaks(inp.device)
    dtype = _dominant_dtype(gemm + attn)
    roof = {
        "dtype": dtype,
        "peak_tflops": peaks.peak_tflops(dtype) if peaks else None,
        "hbm_tb_s": peaks.hbm_tb_s if peaks else None,
        "points": [
            {"kind": r["kind"], "label": r["shape"], "ai": r["ai"], "tflops": r["tflops"], "share": r["share"]}
            for r in gemm + attn if r["ai"] and r["tflops"]
        ],
    }
    m = inp.manifest
    header = {
        "device": inp.device,
        "versions": inp.versions,
        "traces": inp.traces,
        "ranks": sorted(int(r) for r in k["rank"].unique()),
        "steps": int(k["step"].nunique()),
        "step_time_ms": float(np.median(per_step_ms)) if len(per_step_ms) else None,
        "wall_step_time_ms": _num(m.get("step_time_s")) * 1e3 if _num(m.get("step_time_s")) else None,
        "tokens_per_s": _num(m.get("tokens_per_s")),
        "mfu": _num(m.get("mfu")),
    }
    return {
        "schema": REPORT_SCHEMA,
        "kind": "report",
        "title": title or f"primus-perf report: {inp.device}",
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "header": header,
        "categories": cats,
        "breakdown": {"rows": rows, "per_rank_means": bool(rows) and rows[0]["step"] is None},
        "hotspots": hotspots(k, inp.hotspots),
        "roofline": roof,
        "gemm": gemm,
        "attention": attn,
        "cache": cache_info,
        "timeline": timeline(k, cats),
    }


def report_from_analysis(analysis: Any, *, traces: Sequence[str] = (), cache: str | Path | None = None,
                         title: str | None = None) -> dict[str, Any]:
    inp = inputs_from_analysis(analysis, traces)
    marks, info = None, None
    if cache is not None:
        marks, n = cache_marks(cache, inp.device if inp.device != "unknown" else None)
        info = {"path": str(cache), "entries": n}
    return report_from_inputs(inp, marks=marks, cache_info=info, title=title)


def build_report(paths: Sequence[str | Path], *, cache: str | Path | None = None,
                 title: str | None = None) -> dict[str, Any]:
    """Analyze traces (files or run directories) and return the report dict."""
    from primus_perf.tracelens.compare import trace_files

    files = [f for p in paths for f in trace_files(p)]  # UserError for a missing path
    if cache is not None and not Path(cache).exists():
        raise UserError(f"tuning cache not found: {cache}")
    from primus_perf.tracelens import analyzer

    analyze = analyzer()

    return report_from_analysis(analyze(files), traces=files, cache=cache, title=title)
