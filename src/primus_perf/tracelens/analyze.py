"""The trace analysis facade: ``analyze(paths) -> Analysis`` of pandas DataFrames.

One or more Kineto traces (one per rank, or a run directory written by
``primus-profile run``) are loaded (:mod:`.load`), linked (:mod:`.link`), categorized
(:mod:`.categories`), modeled (:mod:`.perf_models`) and accounted (:mod:`.breakdown`).

``Analysis`` holds:

- ``kernels``: one row per GPU event: rank, step, stream, ts_us, dur_us, name, kind,
  category, op (the op it is attributed to: the nearest op with a perf model, else the op
  that launched it, else the kernel name), shape, leaf_op, fwd_op (backward events).
- ``hotspots``: per (category, op, shape): calls, time, share, FLOPs, TFLOP/s, % roofline.
- ``gemm_problems`` / ``attention_problems``: the unique problems with call counts,
  total time, FLOPs and bytes per call, TFLOP/s and % of the roofline.
- ``breakdown``: seconds per (rank, step, category); ``temporal``: compute, exposed
  communication, exposed memcpy and idle per (rank, step).
- ``op_times``: per op name, GPU time of the kernels it launched itself (self) and of all
  kernels launched inside it (inclusive), e.g. ``aten::linear`` includes its ``aten::mm``.
- ``ranks`` and ``collectives``: per-rank step times and collective start skew.

Times are in the trace's microseconds in ``kernels`` and in seconds elsewhere. A trace
recorded without shapes still gives categories (from kernel names) with FLOPs unknown; a
CPU-only trace (no GPU events) gives its problems with the ops' CPU time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.devices import lookup_peaks
from primus_perf.errors import TraceError
from primus_perf.tracelens import breakdown as B
from primus_perf.tracelens import load as L
from primus_perf.tracelens.categories import (
    ATTENTION_BWD,
    ATTENTION_FWD,
    COMPUTE,
    GEMM,
    classify,
)
from primus_perf.tracelens.link import Linked, link
from primus_perf.tracelens.perf_models import OpModel, model_op

_KIND_NAMES = {L.KIND_KERNEL: "kernel", L.KIND_MEMCPY: "memcpy", L.KIND_MEMSET: "memset"}
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.I)
_STEP_NAME = re.compile(r"^ProfilerStep#\d+$")
TRACE_SUFFIXES = (".json", ".json.gz")


@dataclass
class Analysis:
    """The result of :func:`analyze` (see the module docstring)."""

    traces: list[str]
    device: dict[str, Any]
    ranks: list[int]
    steps: list[int]
    kernels: pd.DataFrame
    hotspots: pd.DataFrame
    gemm_problems: pd.DataFrame
    attention_problems: pd.DataFrame
    breakdown: pd.DataFrame
    temporal: pd.DataFrame
    op_times: pd.DataFrame
    rank_summary: pd.DataFrame
    collectives: pd.DataFrame
    totals: dict[str, Any]
    manifest: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def n_steps(self) -> int:
        """Profiled steps per rank (1 for a trace without step markers)."""
        return max(1, len(self.steps))

    def to_json(self, top: int = 50) -> dict[str, Any]:
        """A JSON-ready summary: device, steps, breakdown (category -> seconds per step),
        the problems, totals, and the temporal, per-rank, hotspot and collective tables."""
        per_step = self.n_steps * max(1, len(self.ranks))
        by_cat = self.breakdown.groupby("category", observed=True)["seconds"].sum() / per_step
        return {
            "schema": "primus-perf-analysis/1",
            "traces": self.traces,
            "device": self.device,
            "versions": self.manifest.get("versions", {}),
            "manifest": self.manifest,
            "ranks": self.ranks,
            "steps": self.steps,
            "breakdown": {str(k): float(v) for k, v in by_cat.sort_values(ascending=False).items()},
            "temporal": _records(self.temporal.drop(columns=[], errors="ignore")),
            "gemm_problems": _problem_records(self.gemm_problems),
            "attention_problems": _problem_records(self.attention_problems),
            "hotspots": _records(self.hotspots.head(top)),
            "op_times": _records(self.op_times.head(top)),
            "ranks_summary": _records(self.rank_summary),
            "collectives": _records(self.collectives),
            "totals": self.totals,
            "notes": self.notes,
        }


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for rec in df.to_dict(orient="records"):
        out.append({str(k): _plain(v) for k, v in rec.items()})
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if np.isfinite(f) else None
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if hasattr(v, "to_dict"):
        return v.to_dict()
    return v


def _problem_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    recs = _records(df.drop(columns=["problem"], errors="ignore"))
    for rec, prob in zip(recs, df["problem"] if "problem" in df else [None] * len(recs), strict=True):
        if prob is not None:
            rec["problem"] = prob.to_dict()
    return recs


# ---------------------------------------------------------------------------- inputs


def trace_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Expand run directories to their trace files (sorted); files pass through."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.name.endswith(TRACE_SUFFIXES) and f.name != "manifest.json")
            if not found:
                raise TraceError(f"no trace files (*.json, *.json.gz) in {p}")
            out += found
        elif not p.exists():
            raise TraceError(f"trace not found: {p}")
        else:
            out.append(p)
    if not out:
        raise TraceError("no trace given")
    return out


def find_manifest(paths: Sequence[Path]) -> dict[str, Any]:
    """The ``manifest.json`` of ``primus-profile run`` next to the traces, if any."""
    for d in dict.fromkeys(p.parent for p in paths):
        m = d / "manifest.json"
        if m.is_file():
            try:
                data = json.loads(m.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                return data
    return {}


def _rank_of(rt: L.RawTrace, path: Path, index: int, taken: set[int]) -> int:
    r = rt.rank
    if r is None:
        m = _RANK_IN_NAME.search(path.name)
        r = int(m.group(1)) if m else index
    while r in taken:
        r += 1
    return r


# ---------------------------------------------------------------------------- one trace


@dataclass
class _TraceFrames:
    kernels: pd.DataFrame
    instances: pd.DataFrame  # modeled op calls: rank, step, row, kind, key, direction, flops, bytes, time_us
    op_times: pd.DataFrame
    device_name: str | None
    steps: list[int]
    has_shapes: bool
    has_cpu_ops: bool


def _shape_label(args: L.ShapeArgs | None) -> str:
    """``1024x4096, 4096x14336 bf16``: the tensor inputs' dims and the first tensor dtype."""
    if args is None:
        return ""
    dims = [d for d in args.dims if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    text = ", ".join("x".join(map(str, d)) for d in dims)
    dtype = next((t for t in args.types if t and t != "Scalar"), "")
    short = {"c10::BFloat16": "bf16", "c10::Half": "f16", "float": "f32", "double": "f64",
             "long int": "i64", "int": "i32", "bool": "bool"}.get(dtype, dtype)
    return f"{text} {short}".strip()


def _device_name(rt: L.RawTrace, devices: np.ndarray) -> str | None:
    props = rt.device_properties
    if not props:
        return None
    used = int(np.bincount(devices[devices >= 0]).argmax()) if (devices >= 0).any() else 0
    for p in props:
        if p.get("id") == used:
            return str(p.get("name"))
    return str(props[0].get("name"))


def _frames(rt: L.RawTrace, lk: Linked, rank: int) -> _TraceFrames:
    names = rt.names
    gpu = lk.gpu
    # the row each GPU event is attributed to: its modeled op, else its launching op
    attr = np.where(lk.model_op >= 0, lk.model_op, lk.leaf_op)
    model_cache: dict[tuple[int, int], OpModel | None] = {}

    def model_of(row: int) -> OpModel | None:
        key = (int(rt.name[row]), int(rt.shape[row]))
        if key not in model_cache:
            model_cache[key] = model_op(names[key[0]], rt.shape_args(key[1]))
        return model_cache[key]

    shape_labels: dict[int, str] = {}

    def shape_label(code: int) -> str:
        if code not in shape_labels:
            shape_labels[code] = _shape_label(rt.shape_args(code))
        return shape_labels[code]

    # categories and labels per unique combination, mapped back to events
    kind = rt.kind[gpu]
    name = rt.name[gpu]
    nonames = len(names)
    model_name = np.where(lk.model_op >= 0, rt.name[np.clip(lk.model_op, 0, None)], nonames)
    leaf_name = np.where(lk.leaf_op >= 0, rt.name[np.clip(lk.leaf_op, 0, None)], nonames)
    combo = np.stack([kind.astype(np.int64), name, model_name, leaf_name, lk.in_optimizer.astype(np.int64)])
    uniq, inverse = (np.unique(combo, axis=1, return_inverse=True) if len(gpu)
                     else (np.zeros((5, 0), dtype=np.int64), np.zeros(0, dtype=np.int64)))
    nm = [*names, ""]
    cats = [classify(_KIND_NAMES[int(k)], nm[int(n)], nm[int(m)] or None, nm[int(lf)] or None, bool(o))
            for k, n, m, lf, o in uniq.T]
    category = np.array(cats, dtype=object)[inverse.ravel()] if len(gpu) else np.zeros(0, dtype=object)

    attr_name = np.where(attr >= 0, rt.name[np.clip(attr, 0, None)], -1)
    attr_shape = np.where(attr >= 0, rt.shape[np.clip(attr, 0, None)], -1)
    op_label = np.array(
        [_STEP_NAME.sub("ProfilerStep", names[a]) if a >= 0 else names[n] for a, n in zip(attr_name.tolist(), name.tolist(), strict=True)],
        dtype=object,
    )
    shape_col = np.array([shape_label(c) if c >= 0 else "" for c in attr_shape.tolist()], dtype=object)
    leaf_col = np.array([names[rt.name[r]] if r >= 0 else "" for r in lk.leaf_op.tolist()], dtype=object)
    fwd_col = np.array([names[rt.name[r]] if r >= 0 else "" for r in lk.fwd_op.tolist()], dtype=object)
    kernels = pd.DataFrame({
        "rank": np.full(len(gpu), rank, dtype=np.int64),
        "step": lk.step,
        "device": rt.device[gpu],
        "stream": rt.stream[gpu],
        "ts_us": rt.ts[gpu],
        "dur_us": rt.dur[gpu],
        "name": pd.Categorical.from_codes(name, categories=pd.Index(names)) if len(names) else pd.Categorical([]),
        "kind": pd.Categorical([_KIND_NAMES[int(k)] for k in kind]),
        "category": pd.Categorical(category),
        "op": pd.Categorical(op_label),
        "shape": pd.Categorical(shape_col),
        "leaf_op": pd.Categorical(leaf_col),
        "fwd_op": pd.Categorical(fwd_col),
        "call": attr,  # internal: the op row of this event's call (-1: none)
    })

    instances = _instances(rt, lk, kernels, model_of, rank)
    return _TraceFrames(
        kernels=kernels,
        instances=instances,
        op_times=_op_times(rt, lk),
        device_name=_device_name(rt, rt.device[gpu]),
        steps=lk.steps,
        has_shapes=rt.has_shapes,
        has_cpu_ops=bool((rt.kind == L.KIND_CPU_OP).any()),
    )


def _instances(rt: L.RawTrace, lk: Linked, kernels: pd.DataFrame,
               model_of: Callable[[int], OpModel | None], rank: int) -> pd.DataFrame:
    """Every call of a modeled op that has no modeled op inside it, in a step (or all calls
    when the trace has no step markers), with its model and time."""
    modeled = np.flatnonzero(lk.op_model == np.arange(len(lk.op_model)))
    modeled = modeled[~lk.shadowed[modeled]]
    if lk.steps:
        modeled = modeled[lk.op_step[modeled] >= 0]
    gpu_time = kernels[kernels["call"] >= 0].groupby("call")["dur_us"].sum()
    cpu_only = len(kernels) == 0
    rows = []
    for r in modeled.tolist():
        m = model_of(r)
        if m is None:
            continue
        t = float(rt.dur[r]) if cpu_only else float(gpu_time.get(r, 0.0))
        rows.append((rank, int(lk.op_step[r]), r, m.kind, m.problem.key(), m.problem, m.direction,
                     m.flops, m.bytes, t))
    return pd.DataFrame(rows, columns=["rank", "step", "row", "kind", "key", "problem", "direction", "flops",
                                       "bytes", "time_us"])


def _op_times(rt: L.RawTrace, lk: Linked) -> pd.DataFrame:
    """Per op name: self and inclusive GPU time (us) and calls with GPU work."""
    leaf = lk.leaf_op
    dur = rt.dur[lk.gpu]
    ok = leaf >= 0
    n = len(rt)
    self_t = np.zeros(n)
    np.add.at(self_t, leaf[ok], dur[ok])
    incl = np.zeros(n)
    cur, d = leaf[ok].copy(), dur[ok].copy()
    while len(cur):
        np.add.at(incl, cur, d)
        up = lk.op_parent[cur]
        keep = up >= 0
        cur, d = up[keep], d[keep]
    rows = np.flatnonzero(incl > 0)
    names = [_STEP_NAME.sub("ProfilerStep", rt.names[c]) for c in rt.name[rows].tolist()]
    df = pd.DataFrame({"op": names, "self_us": self_t[rows], "inclusive_us": incl[rows]})
    out = df.groupby("op").agg(calls=("op", "size"), self_us=("self_us", "sum"), inclusive_us=("inclusive_us", "sum"))
    return out.reset_index()


# ---------------------------------------------------------------------------- assembly


def _roofline(flops: np.ndarray, nbytes: np.ndarray, time_s: np.ndarray, dtypes: Sequence[str],
              peaks: Any) -> tuple[np.ndarray, np.ndarray]:
    """Achieved TFLOP/s and the fraction of the roofline (min(peak, intensity * bandwidth))."""
    with np.errstate(divide="ignore", invalid="ignore"):
        tflops = np.where(time_s > 0, flops / time_s / 1e12, np.nan)
        pct = np.full(len(flops), np.nan)
        if peaks is not None:
            for i, dt in enumerate(dtypes):
                peak = peaks.peak_tflops(dt)
                if peak and nbytes[i] > 0 and np.isfinite(tflops[i]):
                    roof = min(peak, flops[i] / nbytes[i] * peaks.hbm_tb_s)
                    pct[i] = tflops[i] / roof
    return tflops, pct


def _problem_table(inst: pd.DataFrame, kind: str, peaks: Any) -> pd.DataFrame:
    sub = inst[inst["kind"] == kind]
    cols = ["key", "label", "direction", "count", "time_s", "flops", "bytes", "intensity", "tflops", "tb_s",
            "pct_roofline", "share_of_kind", "dtype", "problem"]
    if sub.empty:
        return pd.DataFrame(columns=cols + (["m", "n", "k"] if kind == "gemm" else []))
    g = sub.groupby(["key", "direction"], sort=False).agg(
        problem=("problem", "first"), count=("row", "size"), time_us=("time_us", "sum"),
        flops=("flops", "first"), bytes=("bytes", "first"))
    g = g.reset_index()
    g["time_s"] = g.pop("time_us") / 1e6
    g["label"] = [str(p) for p in g["problem"]]
    g["dtype"] = [getattr(p, "dtype_a", getattr(p, "dtype", "")) for p in g["problem"]]
    g["intensity"] = g["flops"] / g["bytes"].where(g["bytes"] > 0)
    total_flops = (g["flops"] * g["count"]).to_numpy(dtype=np.float64)
    g["tb_s"] = (g["bytes"] * g["count"]) / g["time_s"].where(g["time_s"] > 0) / 1e12
    g["tflops"], g["pct_roofline"] = _roofline(total_flops, (g["bytes"] * g["count"]).to_numpy(dtype=np.float64),
                                               g["time_s"].to_numpy(dtype=np.float64), list(g["dtype"]), peaks)
    tot = g["time_s"].sum()
    g["share_of_kind"] = g["time_s"] / tot if tot > 0 else np.nan
    if kind == "gemm":
        g["m"] = [p.m for p in g["problem"]]
        g["n"] = [p.n for p in g["problem"]]
        g["k"] = [p.k for p in g["problem"]]
        cols = [*cols[:2], "m", "n", "k", *cols[2:]]
    return g.sort_values("time_s", ascending=False, ignore_index=True)[cols]


def _hotspots(kernels: pd.DataFrame, inst: pd.DataFrame, peaks: Any, per_step: int) -> pd.DataFrame:
    cols = ["category", "op", "shape", "calls", "time_s", "share", "flops", "tflops", "tb_s", "pct_roofline",
            "calls_per_step", "time_s_per_step"]
    k = kernels[kernels["step"] >= 0] if (kernels["step"] >= 0).any() else kernels
    if k.empty:
        return pd.DataFrame(columns=cols)
    keys = ["category", "op", "shape"]
    g = k.groupby(keys, observed=True).agg(time_us=("dur_us", "sum"), kernels=("dur_us", "size"))
    # calls: distinct op calls (an op launching several kernels is one call)
    with_call = k[k["call"] >= 0]
    u = with_call.drop_duplicates(["rank", "call", *keys])
    calls = u.groupby(keys, observed=True).size()
    no_call = k[k["call"] < 0].groupby(keys, observed=True).size()
    g["calls"] = calls.reindex(g.index, fill_value=0) + no_call.reindex(g.index, fill_value=0)
    # FLOPs: of the distinct modeled calls in each group
    flops_of = dict(zip(zip(inst["rank"], inst["row"], strict=True), inst["flops"], strict=True)) if len(inst) else {}
    dtype_of = dict(zip(zip(inst["rank"], inst["row"], strict=True),
                        [getattr(p, "dtype_a", getattr(p, "dtype", "")) for p in inst["problem"]], strict=True)) if len(inst) else {}
    bytes_of = dict(zip(zip(inst["rank"], inst["row"], strict=True), inst["bytes"], strict=True)) if len(inst) else {}
    # FLOPs go to the group of the modeled work, not to a memset the same call launched
    u = u[u["category"].isin((GEMM, ATTENTION_FWD, ATTENTION_BWD))]
    fl = np.array([flops_of.get(kv, 0) for kv in zip(u["rank"], u["call"], strict=True)], dtype=np.float64)
    by = np.array([bytes_of.get(kv, 0) for kv in zip(u["rank"], u["call"], strict=True)], dtype=np.float64)
    dt = [dtype_of.get(kv, "") for kv in zip(u["rank"], u["call"], strict=True)]
    u = u.assign(flops=fl, bytes=by, dtype=dt)
    agg = u.groupby(keys, observed=True).agg(flops=("flops", "sum"), bytes=("bytes", "sum"),
                                             dtype=("dtype", "first"))
    g = g.join(agg, how="left")
    g = g.reset_index()
    g["time_s"] = g.pop("time_us") / 1e6
    total = g["time_s"].sum()
    g["share"] = g["time_s"] / total if total > 0 else np.nan
    g["flops"] = g["flops"].fillna(0.0)
    g["bytes"] = g["bytes"].fillna(0.0)
    modeled = g["flops"] > 0
    tfl, pct = _roofline(g["flops"].to_numpy(), g["bytes"].to_numpy(), g["time_s"].to_numpy(),
                         [str(d) if isinstance(d, str) else "" for d in g["dtype"]], peaks)
    g["tflops"] = np.where(modeled, tfl, np.nan)
    g["pct_roofline"] = np.where(modeled, pct, np.nan)
    g["tb_s"] = np.where(modeled, g["bytes"] / g["time_s"].where(g["time_s"] > 0) / 1e12, np.nan)
    g.loc[~modeled, "flops"] = np.nan
    g["calls_per_step"] = g["calls"] / per_step
    g["time_s_per_step"] = g["time_s"] / per_step
    for c in ("category", "op", "shape"):
        g[c] = g[c].astype(str)
    return g.sort_values("time_s", ascending=False, ignore_index=True)[cols]


def _rank_summary(temporal: pd.DataFrame, kernels: pd.DataFrame) -> pd.DataFrame:
    cols = ["rank", "steps", "step_span_s", "compute_s", "exposed_comm_s", "exposed_memcpy_s", "idle_s",
            "slowest"]
    if temporal.empty:
        return pd.DataFrame(columns=cols)
    g = temporal.groupby("rank").agg(steps=("step", "size"), step_span_s=("span_s", "median"),
                                     compute_s=("compute_s", "median"), exposed_comm_s=("exposed_comm_s", "median"),
                                     exposed_memcpy_s=("exposed_memcpy_s", "median"), idle_s=("idle_s", "median"))
    g = g.reset_index()
    # the slowest rank computes longest: the others wait for it in the collectives
    g["slowest"] = g["compute_s"] == g["compute_s"].max()
    return g[cols]


def analyze(paths: Sequence[str | Path] | str | Path, *, progress: Callable[[str], None] | None = None) -> Analysis:
    """Analyze one or more traces (files or run directories); see the module docstring."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = trace_paths(paths)
    manifest = find_manifest(files)
    frames: list[_TraceFrames] = []
    ranks: list[int] = []
    for i, path in enumerate(files):
        if progress is not None:
            progress(f"loading {path}")
        rt = L.load(path)
        rank = _rank_of(rt, path, i, set(ranks))
        ranks.append(rank)
        if progress is not None:
            progress(f"analyzing {path} ({len(rt):,} events)")
        frames.append(_frames(rt, link(rt), rank))
        del rt
    if not any(f.has_cpu_ops or len(f.kernels) for f in frames):
        raise TraceError(f"nothing to analyze: no operators or GPU events in {', '.join(map(str, files))}")
    notes: list[str] = []
    kernels = pd.concat([f.kernels for f in frames], ignore_index=True)
    for c in ("name", "kind", "category", "op", "shape", "leaf_op", "fwd_op"):
        kernels[c] = kernels[c].astype("category")
    inst = pd.concat([f.instances for f in frames], ignore_index=True)
    steps = sorted({s for f in frames for s in f.steps})
    if not any(f.has_cpu_ops for f in frames):
        notes.append("no CPU ops in the trace: categories come from kernel names; FLOPs and problems unknown")
    elif not any(f.has_shapes for f in frames):
        notes.append("the trace has no recorded shapes (record_shapes=False): FLOPs and problems unknown")
    if kernels.empty:
        notes.append("no GPU events in the trace: problem times are the ops' CPU times")
    if not steps:
        notes.append("no ProfilerStep markers: the whole trace is treated as one step")
        kernels["step"] = 0
        inst["step"] = 0
    device_name = next((f.device_name for f in frames if f.device_name), None)
    if device_name is None:
        device_name = str(manifest.get("device", {}).get("name", "") if isinstance(manifest.get("device"), dict)
                          else manifest.get("device", "")) or ("cpu" if kernels.empty else "unknown")
    peaks = lookup_peaks(device_name)
    per_step = max(1, len(steps)) * max(1, len(ranks))
    gemm = _problem_table(inst, "gemm", peaks)
    attn = _problem_table(inst, "attention", peaks)
    temporal = B.temporal(kernels)
    cat = B.categories(kernels)
    op_times = pd.concat([f.op_times for f in frames], ignore_index=True)
    if not op_times.empty:
        op_times = op_times.groupby("op", as_index=False).sum()
        op_times = op_times.sort_values("inclusive_us", ascending=False, ignore_index=True)
    gemm_flops = int(inst.loc[inst["kind"] == "gemm", "flops"].sum()) if len(inst) else 0
    attn_flops = int(inst.loc[inst["kind"] == "attention", "flops"].sum()) if len(inst) else 0
    in_steps = kernels[kernels["step"] >= 0]
    busy = float(temporal["busy_s"].sum()) if len(temporal) else float(in_steps["dur_us"].sum()) / 1e6
    compute_s = float(in_steps.loc[in_steps["category"].isin(COMPUTE), "dur_us"].sum()) / 1e6
    # FLOPs are unknown (None), not zero, when no op could be modeled for lack of shapes
    flops_known = any(f.has_cpu_ops and f.has_shapes for f in frames)
    totals = {
        "gemm_flops_per_step": gemm_flops / per_step if flops_known else None,
        "attention_flops_per_step": attn_flops / per_step if flops_known else None,
        "gpu_busy_s_per_step": busy / per_step,
        "gpu_kernel_s_per_step": float(in_steps["dur_us"].sum()) / 1e6 / per_step,
        "compute_kernel_s_per_step": compute_s / per_step,
        "gemm_s_per_step": float(in_steps.loc[in_steps["category"] == GEMM, "dur_us"].sum()) / 1e6 / per_step,
        "attention_s_per_step": float(in_steps.loc[in_steps["category"].isin((ATTENTION_FWD, ATTENTION_BWD)),
                                                   "dur_us"].sum()) / 1e6 / per_step,
        "step_span_s": float(temporal["span_s"].median()) if len(temporal) else None,
        "events": len(kernels),
    }
    dev = {"name": device_name, "peaks": peaks.key if peaks else None,
           "vendor": peaks.vendor if peaks else None}
    return Analysis(
        traces=[str(f) for f in files],
        device=dev,
        ranks=sorted(ranks),
        steps=steps,
        kernels=kernels,
        hotspots=_hotspots(kernels, inst, peaks, per_step),
        gemm_problems=gemm,
        attention_problems=attn,
        breakdown=cat,
        temporal=temporal,
        op_times=op_times,
        rank_summary=_rank_summary(temporal, kernels),
        collectives=B.collective_skew(kernels),
        totals=totals,
        manifest=manifest,
        notes=notes,
    )
