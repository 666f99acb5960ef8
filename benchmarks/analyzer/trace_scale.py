"""Trace analysis at scale on this machine: a 1 GB and a 10 GB trace, and 8 rank traces.

Big traces are replicated from a real H100 trace of the trainer (``trace_replicate.py``)
under ``--workdir`` and deleted afterwards. Each measurement runs ``analyze`` in a fresh
subprocess (so its peak RSS is its own, ``trace_analysis.run_measured``):

- ``1gb``: one ~1.05 GB trace (bar: 10 s);
- ``10gb``: one ~10 GB trace (bars: 100 s, 4 GB peak RSS): the loader streams it;

each as ``primus-profile analyze`` does it (the analysis and its JSON with the details: kernel
efficiency and the memory view, from the same pass over the file), saying whether torch was
imported (it should not be);
- ``ranks``: 8 rank traces of ~``--rank-mb`` MB each, analyzed one after another
  (``jobs=1``) and in parallel processes (default ``jobs``: one per CPU), three times each,
  alternated; medians; the two results are checked equal.

The load average is recorded before and after each measurement: other work on a shared
machine slows it down.

    python benchmarks/analyzer/trace_scale.py --workdir /tmp/trace-scale
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks import RESULTS
from benchmarks.analyzer.trace_analysis import DEFAULT_SRC, run_measured
from benchmarks.analyzer.trace_replicate import replicate

ONE = """
import json, sys, time
t0 = time.perf_counter()
from primus_perf.tracelens.analyze import analyze
a = analyze([sys.argv[1]])
summary = a.to_json(details=True)
import resource
cpu = sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime
          for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))  # helper processes' too
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu, "events": a.totals["events"],
                  "steps": len(a.steps), "gemm_flops_per_step": a.totals["gemm_flops_per_step"], "notes": a.notes,
                  "torch_imported": "torch" in sys.modules}))
"""

RANKS = """
import json, resource, statistics, sys, time
import pandas as pd
from primus_perf.tracelens.analyze import analyze
paths = sys.argv[1].split(",")

def cpu_s():
    return sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime
               for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))

times = {1: [], None: []}
cpu = {1: [], None: []}  # CPU seconds (this process and its workers) per wall second: the CPUs it got
results = {}
for jobs in (1, None, None, 1, 1, None):  # alternated: load from other work hits both alike
    t0, c0 = time.perf_counter(), cpu_s()
    results[jobs] = analyze(paths, jobs=jobs)
    times[jobs].append(time.perf_counter() - t0)
    cpu[jobs].append((cpu_s() - c0) / times[jobs][-1])
serial, parallel = results[1], results[None]
pd.testing.assert_frame_equal(serial.kernels, parallel.kernels)
pd.testing.assert_frame_equal(serial.hotspots, parallel.hotspots)
assert serial.totals == parallel.totals and serial.ranks == parallel.ranks
s, p = statistics.median(times[1]), statistics.median(times[None])
print(json.dumps({"serial_s": s, "parallel_s": p, "speedup": s / p, "serial_runs_s": times[1],
                  "parallel_runs_s": times[None], "serial_cpus_used": cpu[1], "parallel_cpus_used": cpu[None],
                  "ranks": serial.ranks, "events": serial.totals["events"],
                  "identical": True}))
"""


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measured(code: str, arg: str) -> dict:
    before = load_average()
    r = run_measured(sys.executable, code, arg, dict(os.environ, OMP_NUM_THREADS="1"))
    r["load_average_before"], r["load_average_after"] = before, load_average()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=str(DEFAULT_SRC))
    ap.add_argument("--workdir", default="/tmp/primus-trace-scale")
    ap.add_argument("--only", choices=["1gb", "10gb", "ranks"], action="append")
    ap.add_argument("--rank-mb", type=float, default=120.0)
    ap.add_argument("--out", default=str(RESULTS / "trace_scale" / "cpu.json"))
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {}
    result.update(benchmark="trace_scale", source=Path(args.src).name,
                  machine={"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()},
                  bars={"1gb_max_s": 10, "10gb_max_s": 100, "10gb_max_rss_gb": 4.0,
                        "ranks": "parallel faster than serial"})
    for case in args.only or ["1gb", "ranks", "10gb"]:
        if case == "ranks":
            one = work / "rank0.json"
            built = replicate(args.src, one, int(args.rank_mb * 1e6))
            paths = [one] + [work / f"rank{i}.json" for i in range(1, 8)]
            for p in paths[1:]:
                shutil.copyfile(one, p)
            r = measured(RANKS, ",".join(map(str, paths)))
            r["trace"] = {**built, "ranks": len(paths)}
            for p in paths:
                p.unlink()
        else:
            big = work / f"{case}.json"
            t0 = time.perf_counter()
            built = replicate(args.src, big, int((1.05 if case == "1gb" else 10.0) * 1e9))
            print(f"built {big}: {built['bytes'] / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
            r = measured(ONE, str(big))
            r["trace"] = built
            big.unlink()
        print(case, json.dumps(r), flush=True)
        result[case] = r
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
