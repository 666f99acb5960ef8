"""This analyzer against Holistic Trace Analysis on every trace of the external corpus.

For each trace (``../shared/traces/external``, SOURCES.md): GPU kernel time (the union of
all GPU events: busy time), communication time (the union of communication kernels) and
idle time (from the first GPU event's start to the last one's end, minus busy time), over
the whole trace, side by side. HTA runs in its own virtual environment (``--hta-python``)
on one trace at a time; its figures are ``get_temporal_breakdown`` (``compute_time`` +
``non_compute_time``, ``idle_time``) and ``get_gpu_kernel_breakdown`` (the rows with
COMMUNICATION).

Every difference above 1% is explained in the results, by recomputing the figure from the
raw events the way HTA 0.5 reads them (each reading checked in its source, then reproduced
here; the smallest set that brings the figure within 1% of HTA's is recorded):

- "window": HTA keeps only GPU events launched before the last ProfilerStep starts
  (``include_last_profiler_step=False``), where this analyzer's figures here span the whole
  trace;
- "rounding": HTA rounds float timestamps inward to whole microseconds (start up, end down:
  about 1 us less per kernel);
- "stream": HTA counts every event with an integer ``stream`` argument as a kernel;
- "nccl": HTA's communication kernels are those named "nccl";
- or HTA failed on the trace (its error is recorded).

    python benchmarks/analyzer/trace_corpus_vs_hta.py --hta-python /tmp/venv_hta/bin/python
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks import RESULTS, ROOT

CORPUS = ROOT.parent / "shared" / "traces" / "external"
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
TOLERANCE = 0.01

HTA = """
import json, os, sys, tempfile, logging
logging.disable(logging.WARNING)
import importlib.metadata as m
from hta.trace_analysis import TraceAnalysis
out = {"version": m.version("HolisticTraceAnalysis")}
d = tempfile.mkdtemp()
os.symlink(sys.argv[1], os.path.join(d, "rank0.json.gz"))
try:
    ta = TraceAnalysis(trace_dir=d)
    kt, _ = ta.get_gpu_kernel_breakdown(visualize=False)
    tb = ta.get_temporal_breakdown(visualize=False).iloc[0]
    out.update(ok=True, busy_us=float(tb["compute_time(us)"] + tb["non_compute_time(us)"]),
               idle_us=float(tb["idle_time(us)"]), span_us=float(tb["kernel_time(us)"]),
               comm_us=float(kt.loc[kt["kernel_type"].str.contains("COMMUNICATION"), "sum"].sum()))
except Exception as exc:
    out.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
print(json.dumps(out))
"""


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    from primus_perf.tracelens.analyses.breakdown import union_length as ul

    return ul(np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64))


def figures(start: np.ndarray, dur: np.ndarray, comm: np.ndarray) -> dict[str, float]:
    """Busy (union of all), communication (union of communication) and idle time, in us."""
    if not len(start):
        return {"busy_us": 0.0, "comm_us": 0.0, "idle_us": 0.0}
    end = start + dur
    busy = union_length(start, end)
    return {"busy_us": busy, "comm_us": union_length(start[comm], end[comm]),
            "idle_us": float(end.max() - start.min()) - busy}


def ours(path: Path) -> dict[str, Any]:
    """This analyzer's figures, from its kernel table (every GPU event of the trace)."""
    from primus_perf.tracelens.analyze import analyze

    a = analyze([path])
    k = a.kernels
    names = k["name"].astype(str).to_numpy()
    comm = (k["category"] == "communication").to_numpy()
    return {"device": a.device["name"], "notes": a.notes, "communication": dict(zip(names, comm, strict=True)),
            **figures(k["ts_us"].to_numpy(), k["dur_us"].to_numpy(),
                      (k["category"] == "communication").to_numpy())}


RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "Runtime", "hip_runtime"}
STEP_PREFIX = "ProfilerStep"
READINGS = {  # HTA 0.5's readings of a trace, checked in its source and reproduced here
    "window": "HTA keeps only GPU events launched before the last ProfilerStep starts "
              "(include_last_profiler_step=False; with two or more steps)",
    "rounding": "HTA rounds float timestamps inward to whole microseconds (start up, end down)",
    "stream": "HTA counts every event with a `stream` argument as a kernel (CPU-side events included)",
    "nccl": "HTA's communication kernels are those named 'nccl'",
}
COMBOS = [frozenset(c) for c in (("window",), ("window", "rounding"), ("window", "stream"), ("window", "nccl"),
                                 ("window", "rounding", "stream"), ("window", "rounding", "nccl"),
                                 ("window", "stream", "nccl"), ("window", "rounding", "stream", "nccl"))]


def _int(v: Any) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        try:
            return int(v, 0)
        except ValueError:
            return None
    return None


def hta_view(path: Path, readings: frozenset[str], communication: dict[str, bool]) -> tuple[dict[str, float], dict]:
    """The figures recomputed from the raw events with some of HTA's readings applied;
    ``communication``: this analyzer's category of each kernel name."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X"]

    def on_stream(e: dict) -> bool:  # HTA's stream column: an integer `stream` argument ("0x0" is not)
        v = (e.get("args") or {}).get("stream")
        return isinstance(v, int) and not isinstance(v, bool)

    cpu = [e for e in xs if not on_stream(e)]
    step_names = {str(e.get("name")) for e in xs if STEP_PREFIX in str(e.get("name", ""))}
    starts_of_steps = [float(e["ts"]) for e in cpu if str(e.get("name", "")) in step_names]
    # HTA filters when the trace has two or more distinct ProfilerStep names
    last_start = max(starts_of_steps) if len(step_names) >= 2 and "window" in readings else None
    launch = {}
    for e in cpu:
        c = _int((e.get("args") or {}).get("correlation"))
        if c is not None:
            launch.setdefault(c, float(e["ts"]))
    rounding = "rounding" in readings and any(isinstance(e.get("ts"), float) for e in xs)
    starts, ends, comm = [], [], []
    effect: dict[str, Any] = {"window": last_start is not None, "rounding": rounding, "dropped_by_window": 0,
                              "stream_events": 0, "stream_cats": set()}
    for e in xs:
        args = e.get("args") or {}
        is_gpu = e.get("cat") in GPU_CATS
        if not is_gpu and not ("stream" in readings and on_stream(e)):
            continue
        ts, end = float(e.get("ts", 0)), float(e.get("ts", 0)) + float(e.get("dur", 0))
        if last_start is not None:
            t = launch.get(_int(args.get("correlation"))) if is_gpu else ts
            if t is None or t >= last_start:
                effect["dropped_by_window"] += 1
                continue
        if not is_gpu:
            effect["stream_events"] += 1
            effect["stream_cats"].add(str(e.get("cat")))
        if rounding:
            ts, end = float(np.ceil(ts)), float(np.floor(end))
        name = str(e.get("name", ""))
        starts.append(ts)
        ends.append(max(ts, end))
        comm.append("nccl" in name.lower() if "nccl" in readings else bool(communication.get(name, False)))
    effect["stream_cats"] = sorted(effect["stream_cats"])
    start = np.array(starts, dtype=np.float64)
    return figures(start, np.array(ends, dtype=np.float64) - start, np.array(comm, dtype=bool)), effect


def rel(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def explain(path: Path, mine: dict[str, Any], hta: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    views: dict[frozenset[str], tuple[dict[str, float], dict]] = {}
    for metric in ("busy_us", "comm_us", "idle_us"):
        row: dict[str, Any] = {"ours": mine[metric], "hta": hta.get(metric)}
        if not hta.get("ok"):
            row["explanation"] = f"HTA failed on this trace: {hta.get('error')}"
            rows[metric] = row
            continue
        row["rel_diff"] = rel(mine[metric], hta[metric])
        if row["rel_diff"] > TOLERANCE:
            for combo in COMBOS:
                if combo not in views:
                    views[combo] = hta_view(path, combo, mine["communication"])
                fig, effect = views[combo]
                if rel(fig[metric], hta[metric]) <= TOLERANCE:
                    used = [r for r in READINGS if r in combo and effect.get(r, True)]  # those that applied
                    why = "; ".join(READINGS[r] for r in used)
                    row["explanation"] = (f"{why}. Recomputed from the raw events with these readings: "
                                          f"{fig[metric]:,.0f} us, within {rel(fig[metric], hta[metric]):.2%} of HTA")
                    row["readings"] = used
                    row["effect"] = effect
                    break
            else:
                row["explanation"] = "UNEXPLAINED"
        rows[metric] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hta-python", required=True, help="python of a venv with holistictraceanalysis")
    ap.add_argument("--corpus", default=str(CORPUS))
    ap.add_argument("--out", default=str(RESULTS / "trace_corpus_vs_hta" / "cpu.json"))
    args = ap.parse_args()
    corpus = Path(args.corpus)
    traces = sorted(corpus.rglob("*.json.gz"))
    if not traces:
        sys.exit(f"no traces under {corpus}")
    results = []
    for path in traces:
        name = str(path.relative_to(corpus))
        mine = ours(path)
        proc = subprocess.run([args.hta_python, "-c", HTA, str(path)], capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tempfile.gettempdir())
        try:
            hta = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            hta = {"ok": False, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
        rows = explain(path, mine, hta)
        results.append({"trace": name, "device": mine["device"], "hta_ok": bool(hta.get("ok")),
                        "hta_version": hta.get("version"), "figures": rows})
        print(name, {m: (round(r["ours"]), r.get("hta") and round(r["hta"]), r.get("explanation", "")[:60])
                     for m, r in rows.items()}, flush=True)
    unexplained = [(r["trace"], m) for r in results for m, x in r["figures"].items()
                   if x.get("explanation") == "UNEXPLAINED"]
    doc = {
        "benchmark": "trace_corpus_vs_hta",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "hta_version": next((r["hta_version"] for r in results if r["hta_version"]), None),
        "tolerance": TOLERANCE,
        "definitions": {"busy_us": "union of all GPU events over the whole trace",
                        "comm_us": "union of communication kernels",
                        "idle_us": "first GPU event start to last end, minus busy"},
        "traces": results,
        "within_tolerance": sum(all(x.get("rel_diff", 1) <= TOLERANCE for x in r["figures"].values())
                                for r in results),
        "unexplained": unexplained,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}; {doc['within_tolerance']}/{len(results)} traces within 1% on every figure; "
          f"unexplained: {unexplained}")


if __name__ == "__main__":
    main()
