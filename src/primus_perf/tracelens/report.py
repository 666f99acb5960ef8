"""Report data: everything the HTML report shows, as one JSON-ready dict, from an ``Analysis``.

``report_from_analysis(analysis)`` builds it; ``build_report(paths)`` analyzes traces first.
The dict is bounded in size whatever the trace size: tables are per (category, op, shape)
or per problem, the breakdown per (rank, step) and the timeline merges each stream's
kernels into busy segments at a fixed resolution. Figures are per step (``calls`` are op
calls), as in the analysis. Every category has one colour (:func:`category_colors`), the
same in every report and comparison (:mod:`.colors`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from primus_perf import kinds
from primus_perf.base.devices import lookup_peaks
from primus_perf.base.errors import UserError
from primus_perf.cache.store import CacheEntry, TuningCache, check_cache_file
from primus_perf.tracelens.analyses.expert_load import summary_line
from primus_perf.tracelens.analyses.hotspots import in_steps
from primus_perf.tracelens.analyses.recommendations import (
    MIN_SAVING_MS,
    lever_parts,
    measured_rows,
    trainer_config,
)
from primus_perf.tracelens.analyses.tune_next import tune_next
from primus_perf.tracelens.analyses.workload import summary as workload_summary
from primus_perf.tracelens.analyze import Analysis, analyze
from primus_perf.tracelens.colors import TEMPORAL_PARTS, category_colors
from primus_perf.tracelens.inputs import check_traces

REPORT_SCHEMA = "primus-perf-report/1"
GROUPED = kinds.GROUPED.name
MAX_HOTSPOTS = 2000
MAX_BREAKDOWN_ROWS = 256
TIMELINE_BINS = 1500  # segments are merged at span / TIMELINE_BINS
MAX_KERNEL_DETAILS = 100  # hotspot rows (the largest) that list their kernels
MAX_KERNEL_NAME = 200  # characters of a kernel name shown (templated names run to thousands)
MAX_COLLECTIVES = 200
MAX_COLLECTIVE_RANKS = 1024  # rows of the per-rank collectives table
TUNE_NEXT = 20
# the critical path's parts (analyses.host), drawn like the temporal breakdown's: host work
# grey-blue, launch delay amber, GPU kernels the compute colour, stream waits idle grey
PATH_COLORS = {"cpu": "#5b6f95", "launch": "#e0a030", "gpu": "#3a9d8f", "wait": "#b8bec9"}
MAX_HOST_OPS = 50  # rows of the CPU-against-GPU table
MAX_EFFICIENCY = 100  # rows of the kernel-efficiency table


def _num(v: Any) -> float | None:
    """A finite number as a float, else None (NaN in the tables; a manifest field that is
    missing or not a number)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _ms(v: Any) -> float | None:
    f = _num(v)
    return None if f is None else f * 1e3


# --------------------------------------------------------------------------- sections


def breakdown(a: Analysis) -> tuple[list[str], list[dict[str, Any]]]:
    """Categories (by total time) and rows of ms per category: one per (rank, step), or
    one per rank (mean over its steps) when that would exceed ``MAX_BREAKDOWN_ROWS``."""
    cats = [str(c) for c in a.category_seconds().index]
    table = a.breakdown.pivot_table(index=["rank", "step"], columns="category", values="seconds",
                                    aggfunc="sum", fill_value=0.0)
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
            "rank": rank, "step": step, "label": label,
            "total_ms": float(vals.sum()) * 1e3,
            "by_cat": {c: round(float(vals[c]) * 1e3, 6) for c in cats if vals[c] > 0},
        })
        if len(rows) >= MAX_BREAKDOWN_ROWS:
            break
    return cats, rows


def temporal(a: Analysis) -> list[dict[str, Any]]:
    """Per (rank, step), ms: the GPU step span, its compute, exposed communication, exposed
    memcpy and idle, and the host (wall-clock) step time; per-rank means when there would be
    more than ``MAX_BREAKDOWN_ROWS`` rows."""
    t = a.temporal.merge(a.wall_steps, on=["rank", "step"], how="left")
    cols = ["span_s", *(f"{p}_s" for p in TEMPORAL_PARTS), "wall_s"]
    per_rank = len(t) > MAX_BREAKDOWN_ROWS
    if per_rank:
        counts = t.groupby("rank").size()
        t = t.groupby("rank", as_index=False)[cols].mean()
    rows = []
    for r in t.head(MAX_BREAKDOWN_ROWS).to_dict(orient="records"):
        rank = int(r["rank"])
        label = f"rank {rank} (mean of {int(counts[rank])} steps)" if per_rank else f"rank {rank} step {int(r['step'])}"
        rows.append({"rank": rank, "step": None if per_rank else int(r["step"]), "label": label,
                     "span_ms": _ms(r["span_s"]), "wall_ms": _ms(r["wall_s"]),
                     "parts": {p: _ms(r[f"{p}_s"]) or 0.0 for p in TEMPORAL_PARTS}})
    return rows


def _short(name: str) -> str:
    return name if len(name) <= MAX_KERNEL_NAME else name[:MAX_KERNEL_NAME - 1] + "…"


def hotspots(a: Analysis) -> tuple[list[dict[str, Any]], list[str]]:
    """Per (category, op, shape, problem): op calls and ms per step, share, TFLOP/s, % roofline;
    the largest ``MAX_KERNEL_DETAILS`` rows list their top kernels as [index into the
    returned kernel names, share of the row's time]."""
    top = a.hotspots.head(MAX_HOTSPOTS)
    names: dict[str, int] = {}
    rows = []
    for i, r in enumerate(top.itertuples(index=False)):
        under = [[names.setdefault(_short(n), len(names)), round(share, 4)] for n, share in r.top_kernels] \
            if i < MAX_KERNEL_DETAILS else []
        rows.append({"category": r.category, "op": r.op, "shape": r.shape, "problem": r.problem,
                     "calls": float(r.calls), "time_ms": float(r.time_s) * 1e3, "share": _num(r.share),
                     "tflops": _num(r.tflops), "pct_roofline": _num(r.pct_roofline), "kernels": under})
    return rows, list(names)


def collectives(a: Analysis) -> list[dict[str, Any]]:
    """Per (collective, message size, group size): calls and ms per step, algorithm and bus
    bandwidth (GB/s; median rank, min and max over ranks) and the start skew across ranks."""
    return [{"collective": r.collective, "bytes": _num(r.bytes) if r.bytes >= 0 else None,
             "group_size": int(r.group_size) if r.group_size > 0 else None, "ranks": int(r.ranks),
             "calls": float(r.calls), "time_ms": float(r.time_s) * 1e3, "mean_us": _num(r.mean_us),
             "algbw_gbs": _num(r.algbw_gbs), "busbw_gbs": _num(r.busbw_gbs), "min_busbw_gbs": _num(r.min_busbw_gbs),
             "max_busbw_gbs": _num(r.max_busbw_gbs), "slowest_rank": int(r.slowest_rank),
             "mean_skew_us": _num(r.mean_skew_us), "max_skew_us": _num(r.max_skew_us),
             "last_rank": None if _num(r.last_rank) is None else int(r.last_rank), "sizes": int(r.sizes)}
            for r in a.collective_bandwidth.head(MAX_COLLECTIVES).itertuples(index=False)]


def collective_ranks(a: Analysis) -> list[dict[str, Any]]:
    """Per (collective, group size, rank), every message size together: calls and ms per
    step, bytes per step (message, and the rank's input and output: what an all-to-all
    sends and receives), algorithm and bus bandwidth (GB/s)."""
    return [{"collective": r.collective, "group_size": int(r.group_size) if r.group_size > 0 else None,
             "rank": int(r.rank), "calls": float(r.calls), "time_ms": float(r.time_s) * 1e3, "bytes": _num(r.bytes),
             "in_bytes": _num(r.in_bytes), "out_bytes": _num(r.out_bytes), "algbw_gbs": _num(r.algbw_gbs),
             "busbw_gbs": _num(r.busbw_gbs)}
            for r in a.collective_ranks.head(MAX_COLLECTIVE_RANKS).itertuples(index=False)]


def expert_load_rows(a: Analysis) -> dict[str, Any] | None:
    """Per MoE layer, the tokens per expert over the profiled steps (:mod:`.analyses.expert_load`),
    each expert's mean tokens per step under ``load``; None when the run recorded none."""
    t = a.expert_load
    if t.empty:
        return None
    return {"summary": summary_line(t), "layers": [
        {"layer": int(r.layer), "experts": int(r.experts), "steps": int(r.steps), "tokens": float(r.tokens),
         "min": float(r.min), "median": float(r.median), "max": float(r.max), "imbalance": _num(r.imbalance),
         "worst_step_imbalance": _num(r.worst_step_imbalance), "idle": int(r.idle), "load": list(r.load)}
        for r in t.itertuples(index=False)]}


def tune_next_rows(a: Analysis, marks: Mapping[str, float | None] | None) -> list[dict[str, Any]]:
    """The problems to tune next (:mod:`.analyses.tune_next`), with their commands."""
    return [{"kind": r.kind, "key": r.key, "shape": r.label, "calls": float(r.calls), "time_ms": float(r.time_s) * 1e3,
             "pct_roofline": _num(r.pct_roofline), "saving_ms": float(r.score) * 1e3, "command": r.command,
             "tuned": None if marks is None else r.key in marks}
            for r in tune_next(a.problem_tables(), TUNE_NEXT).itertuples(index=False)]


def problems(df: pd.DataFrame, kind: str, kernel_s_per_step: float,
             marks: Mapping[str, float | None] | None) -> list[dict[str, Any]]:
    """One row per GEMM/attention problem (and direction) with roofline figures and cache marks."""
    return [{"key": r.key, "shape": r.label, "kind": kind, "dtype": r.dtype, "direction": r.direction,
             "calls": float(r.calls), "time_ms": float(r.time_s) * 1e3,
             "share": float(r.time_s) / kernel_s_per_step if kernel_s_per_step > 0 else None,
             "ai": _num(r.intensity), "tflops": _num(r.tflops), "pct_roofline": _num(r.pct_roofline),
             "tuned": None if marks is None else r.key in marks,
             "speedup": None if marks is None else marks.get(r.key)}
            for r in df.itertuples(index=False)]


def _dominant_dtype(rows: list[dict[str, Any]]) -> str:
    weights: dict[str, float] = {}
    for r in rows:
        weights[r["dtype"]] = weights.get(r["dtype"], 0.0) + r["time_ms"]
    return max(weights, key=lambda d: weights[d]) if weights else "bf16"


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


def timeline(kernels: pd.DataFrame, cats: list[str], bins: int = TIMELINE_BINS) -> dict[str, Any]:
    """One representative step (median GPU time, lowest rank), per stream: the step cut into
    ``bins`` bins, each labelled with the category that has most kernel time in it; runs of
    bins with the same label become one segment [start_us, length_us, category, busy_us]."""
    rank = int(kernels["rank"].min())
    kr = kernels[kernels["rank"] == rank]
    per_step = kr.groupby("step")["dur_us"].sum().sort_values()
    step = int(per_step.index[len(per_step) // 2])
    ks = kr[kr["step"] == step]
    ts = ks["ts_us"].to_numpy(dtype=np.float64)
    dur = ks["dur_us"].to_numpy(dtype=np.float64)
    t0 = float(ts.min())
    span = float((ts + dur).max() - t0) or 1.0
    edges = np.linspace(0.0, span, bins + 1)
    edges[-1] = np.nextafter(span, np.inf)  # the last kernel's end lies inside the last bin
    cat_index = {c: i for i, c in enumerate(cats)}
    streams = []
    for stream, grp in ks.groupby("stream", sort=True):
        s = grp["ts_us"].to_numpy(dtype=np.float64) - t0
        e = s + grp["dur_us"].to_numpy(dtype=np.float64)
        c = grp["category"].to_numpy().astype(str)
        names = sorted(set(c), key=lambda x: cat_index[x])
        busy = np.stack([_busy_per_bin(s[c == n], e[c == n], edges) for n in names])  # categories x bins
        total = busy.sum(axis=0)
        label = np.where(total > 0, busy.argmax(axis=0), -1)
        change = np.flatnonzero(np.diff(label)) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [bins]))
        segments = [
            [round(float(edges[a]), 3), round(float(min(edges[b], span) - edges[a]), 3),
             cat_index[names[label[a]]], round(float(total[a:b].sum()), 3)]
            for a, b in zip(starts, ends, strict=True) if label[a] >= 0
        ]
        streams.append({"stream": str(stream), "segments": segments})
    return {"rank": rank, "step": step, "t0_us": t0, "dur_us": span, "resolution_us": span / bins,
            "categories": cats, "streams": streams}


NO_GPU_ESTIMATES = ("no estimates: each rests on the GPU's kernel times, and this trace has no GPU events (a CPU "
                    "run): profile on a GPU for them")
# a primus-train run the step tuner has not measured
MEASURE_HERE = ", or measure the trainer's levers on this machine with primus-tune step (it runs on a CPU too)"
NOTHING_FOUND = (f"nothing to advise: no change the analyzer estimates would save {MIN_SAVING_MS} ms or more per "
                 "step here")


def next_steps(a: Analysis) -> dict[str, Any]:
    """What to do next, the one source of ``primus-profile analyze``'s section and the HTML
    report's: ``rows``, the recommendations ranked (:mod:`.analyses.recommendations`), each
    with the step tuner's measurement of its lever beside the estimate where the run has one;
    ``measured``, the step tuner's measurements (``step_plan.json`` beside the trace) of levers
    no recommendation names, as it measured them (a CPU run's, where nothing is estimated);
    ``note``, why there is no recommendation, when there is none ("" otherwise)."""
    rows = [{k: (_num(v) if k in ("estimated_saving_ms", "measured_saving_ms") else v) for k, v in r.items()}
            for r in a.recommendations.to_dict(orient="records")]
    advised = {lever_parts(str(r["lever"])) for r in rows}
    measured = [m for m in measured_rows(a.manifest, a.measured) if lever_parts(m["lever"]) not in advised]
    hint = MEASURE_HERE if trainer_config(a.manifest) is not None and not measured else ""
    note = "" if rows else NOTHING_FOUND if len(a.kernels) else NO_GPU_ESTIMATES + hint
    return {"rows": rows, "measured": measured, "note": note}


def measured_line(m: dict[str, Any]) -> str:
    """One step-tuner measurement: ``train.micro_batch=2 against the default: 1.806x, 911.18 ms
    a step saved (kept)``."""
    speedup = f"{m['speedup']:.3f}x, " if m["speedup"] is not None else ""
    status = f" ({m['status']})" if m["status"] else ""
    return f"{m['lever']} against {m['against']}: {speedup}{m['measured_ms']:+.2f} ms a step saved{status}"


def host_side(a: Analysis) -> dict[str, Any] | None:
    """Each step's critical path, launch statistics, the launch-delay histogram, CPU against
    GPU time per op (the largest ``MAX_HOST_OPS`` by CPU time) and the synchronizing calls;
    ms per step."""
    if a.critical_path.empty and a.launches.empty and a.cpu_ops.empty:
        return None
    path = [{"label": f"rank {int(r.rank)} step {int(r.step)}", "path_ms": r.path_s * 1e3,
             "parts": {"cpu": r.cpu_s * 1e3, "launch": r.launch_s * 1e3, "gpu": r.gpu_s * 1e3, "wait": r.wait_s * 1e3},
             "events": int(r.events)} for r in a.critical_path.head(MAX_BREAKDOWN_ROWS).itertuples(index=False)]
    launches = [{"label": f"rank {int(r.rank)} step {int(r.step)}", "launches": int(r.launches),
                 "launch_ms": r.launch_s * 1e3, "call_p50_us": _num(r.launch_p50_us), "delay_p50_us": _num(r.delay_p50_us),
                 "delay_p90_us": _num(r.delay_p90_us), "delay_max_us": _num(r.delay_max_us),
                 "queue_p50": _num(r.queue_p50), "queue_max": _num(r.queue_max)}
                for r in a.launches.head(MAX_BREAKDOWN_ROWS).itertuples(index=False)]
    delays = [{"lo_us": _num(r.lo_us), "hi_us": _num(r.hi_us), "launches": int(r.launches)}
              for r in a.launch_delays.itertuples(index=False)]
    ops = [{"op": r.op, "calls": float(r.calls), "cpu_ms": r.cpu_s * 1e3, "cpu_self_ms": r.cpu_self_s * 1e3,
            "gpu_self_ms": r.gpu_self_s * 1e3, "gpu_ms": r.gpu_s * 1e3}
           for r in a.cpu_ops.head(MAX_HOST_OPS).itertuples(index=False)]
    return {"critical_path": path, "launches": launches, "delays": delays, "ops": ops, "syncs": sync_sites(a)}


def sync_sites(a: Analysis) -> list[dict[str, Any]]:
    """Per call site, per step: the synchronizing calls, the host's wait in them and the GPU
    idle after them (ms), most idle first."""
    if a.syncs.empty:
        return []
    g = a.syncs.groupby(["site", "call"], as_index=False)[["calls", "wait_s", "idle_after_s"]].sum()
    g = g.sort_values(["idle_after_s", "calls"], ascending=False).head(MAX_HOST_OPS)
    per = a.rank_steps
    return [{"site": r.site, "call": r.call, "calls": r.calls / per, "wait_ms": r.wait_s * 1e3 / per,
             "idle_after_ms": r.idle_after_s * 1e3 / per} for r in g.itertuples(index=False)]


def kernel_efficiency(a: Analysis) -> list[dict[str, Any]]:
    """Per kernel name, the largest ``MAX_EFFICIENCY`` by time: launch resources, occupancy, flag."""
    return [{"name": _short(str(r.name)), "category": r.category, "launches": float(r.launches),
             "time_ms": r.time_s * 1e3, "share": _num(r.share), "grid": r.grid, "block": r.block,
             "registers": _num(r.registers), "shared_bytes": _num(r.shared_bytes), "blocks_per_sm": _num(r.blocks_per_sm),
             "occupancy_pct": _num(r.occupancy_pct), "flag": r.flag}
            for r in a.kernel_efficiency().head(MAX_EFFICIENCY).itertuples(index=False)]


def memory(a: Analysis) -> dict[str, Any] | None:
    """The memory view of a ``profile_memory`` trace: per device the allocation curve (ms
    from its first event, bytes) and peak, and the ops that allocate most; None otherwise."""
    curve, peaks, by_op = a.memory()
    if peaks.empty:
        return None
    devices = []
    for r in peaks.itertuples(index=False):
        c = curve[(curve["rank"] == r.rank) & (curve["device"] == r.device)]
        t0 = float(c["ts_us"].min())
        devices.append({"label": f"rank {int(r.rank)} {r.device}", "peak_bytes": r.peak_bytes,
                        "peak_ms": (r.peak_ts_us - t0) / 1e3, "allocations": int(r.allocations), "frees": int(r.frees),
                        "relative": not bool(r.recorded_total),
                        "points": [[round((t - t0) / 1e3, 4), float(v)] for t, v in
                                   zip(c["ts_us"].tolist(), c["allocated"].tolist(), strict=True)]})
    return {"devices": devices, "by_op": [{"op": r.op, "allocations": int(r.allocations), "bytes": float(r.bytes),
                                           "largest": float(r.largest)} for r in by_op.itertuples(index=False)]}


# --------------------------------------------------------------------------- cache marks


def cache_marks(cache_path: str | Path, device: str | None = None,
                versions: Mapping[str, str] | None = None) -> tuple[dict[str, float | None], int, int]:
    """Problem key -> cached speedup (default / tuned time) of the cache's entries usable on
    the traced run, as the runtime decides: the same device (all devices when ``device`` is
    None) and the same version of every library the entry names that the run recorded
    (``versions``, from its manifest). Returns the marks, the number of entries, and how many
    marked entries name a library the run did not record (matched without it). When several
    match, the one the cache ranks first wins (:meth:`CacheEntry.rank`: the newest, on a tie
    the fastest)."""
    p = Path(cache_path)
    if not p.exists():
        raise UserError(f"tuning cache not found: {p}")
    entries = TuningCache(p).entries()
    recorded = dict(versions or {})
    marks: dict[str, float | None] = {}
    unchecked: set[str] = set()
    for e in sorted(entries, key=CacheEntry.rank):
        if device is not None and e.device.get("name") not in (None, "", device):
            continue
        if any(lib in recorded and recorded[lib] != v for lib, v in e.versions.items()):
            continue  # tuned with another library version: the runtime would not use it
        marks[e.problem_key] = e.speedup
        if any(lib not in recorded for lib in e.versions):
            unchecked.add(e.problem_key)
        else:
            unchecked.discard(e.problem_key)
    return marks, len(entries), len(unchecked)


# --------------------------------------------------------------------------- assembly


def report_from_analysis(a: Analysis, *, cache: str | Path | None = None, title: str | None = None) -> dict[str, Any]:
    """The report dict (JSON-ready) of an analysis; ``cache`` marks tuned problems."""
    k = in_steps(a.kernels)
    cpu_only = k.empty
    if cpu_only and a.gemm_problems.empty and a.attention_problems.empty:
        raise UserError("nothing to report: the trace has no GPU kernels and no GEMM or attention ops with shapes")
    device = str(a.device["name"])
    marks, cache_info = None, None
    if cache is not None:
        marks, n, unchecked = cache_marks(cache, device if device != "unknown" else None, a.versions)
        cache_info = {"path": str(cache), "entries": n, "versions_unchecked": unchecked}
    cats, rows = breakdown(a)
    kernel_s = float(a.totals["gpu_kernel_s_per_step"])
    if cpu_only:  # a CPU run: the problems' times are their ops' CPU times
        kernel_s = float(sum(df["time_s"].sum() for df in a.problem_tables().values()))
    gemm = problems(a.gemm_problems, "gemm", kernel_s, marks)
    attn = problems(a.attention_problems, "attention", kernel_s, marks)
    peaks = lookup_peaks(device)
    dtype = _dominant_dtype(gemm + attn)
    roof = {
        "dtype": dtype,
        "peak_tflops": peaks.peak_tflops(dtype) if peaks else None,
        "hbm_tb_s": peaks.hbm_tb_s if peaks else None,
        "points": [{"kind": r["kind"], "label": r["shape"], "ai": r["ai"], "tflops": r["tflops"], "share": r["share"]}
                   for r in gemm + attn if r["ai"] and r["tflops"]],
    }
    m = a.manifest
    wall_s, wall_source = a.wall_step()
    header = {
        "device": device,
        "versions": a.versions,
        "traces": a.traces,
        "ranks": a.ranks,
        "steps": a.n_steps,
        "step_time_ms": _ms(a.totals["step_time_s"]),
        "gpu_kernel_ms": None if cpu_only else kernel_s * 1e3,
        "cpu_only": cpu_only,
        "wall_step_time_ms": _ms(wall_s),  # Analysis.wall_step: the manifest's, else the trace's
        "wall_step_source": wall_source,
        "world_size": a.world_size,
        "tokens_per_s": _num(m.get("tokens_per_s")),
        "mfu": _num(m.get("mfu")),
        # the trainer's FP8 layers (layer -> recipe), from the run's manifest; {} without FP8
        "fp8_layers": {k: v for k, v in m["fp8_layers"].items() if v != "bf16"}
        if isinstance(m.get("fp8_layers"), dict) else {},
        "workload": workload_summary(a.workload),
    }
    hot, kernel_names = hotspots(a)
    nxt = next_steps(a)
    return {
        "schema": REPORT_SCHEMA,
        "kind": "report",
        "title": title or f"primus-perf report: {device}",
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "header": header,
        "categories": cats,
        "colors": {**category_colors([*TEMPORAL_PARTS, *cats]), **PATH_COLORS},
        "breakdown": {"rows": rows, "per_rank_means": bool(rows) and rows[0]["step"] is None},
        "temporal": temporal(a),
        "tune_next": [] if cpu_only else tune_next_rows(a, marks),  # tuning measures GPU kernels
        "hotspots": hot,
        "kernel_names": kernel_names,
        "collectives": collectives(a),
        "collective_ranks": collective_ranks(a),
        "expert_load": expert_load_rows(a),
        # what to do next (next_steps): the recommendations, the step tuner's other measurements, why none
        "recommendations": nxt["rows"],
        "measured_unadvised": nxt["measured"],
        "next_note": nxt["note"],
        "host": None if cpu_only else host_side(a),
        "kernel_efficiency": [] if cpu_only else kernel_efficiency(a),
        "memory": memory(a),
        "roofline": roof,
        "gemm": gemm,
        "attention": attn,
        GROUPED: problems(a.problems_by_kind[GROUPED], GROUPED, kernel_s, marks),
        "cache": cache_info,
        "timeline": None if cpu_only else timeline(k, cats),
        "notes": a.notes,
    }


def build_report(paths: Sequence[str | Path] | str | Path, *, cache: str | Path | None = None,
                 title: str | None = None) -> dict[str, Any]:
    """Analyze traces (files or run folders) and return the report dict. The traces and the
    cache are checked as the command checks them (``inputs.check_traces``, ``check_cache_file``),
    before the analysis."""
    check_traces(paths)
    if cache is not None:
        check_cache_file(cache)
    return report_from_analysis(analyze(paths), cache=cache, title=title)
