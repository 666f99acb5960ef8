"""HTML report of a >= 1 GB trace: size of the page, time and peak memory, one run.

Builds the big trace like ``trace_analysis.py`` (steps of a real H100 trace replicated,
``trace_replicate.py``) unless ``--trace`` names one, then, in a fresh subprocess (so
peak RSS is its own), analyzes it, builds the report data and writes the HTML and JSON.

    python benchmarks/analyzer/report_size.py --out benchmarks/results/report_size/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks import ROOT
from benchmarks.analyzer.trace_replicate import replicate

DEFAULT_SRC = ROOT / "tests" / "data" / "traces" / "h100_llama3-8b_l2_s1024_cudnn.json.gz"
LIMIT_BYTES = 15 * 10**6

REPORT = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from primus_perf.tracelens.analyze import analyze
from primus_perf.tracelens.report import report_from_analysis
from primus_perf.tracelens.report_html import write_html
a = analyze([sys.argv[1]])
t1 = time.perf_counter()
data = report_from_analysis(a)
html = write_html(data, Path(sys.argv[2]) / "report.html")
(Path(sys.argv[2]) / "report.json").write_text(json.dumps(data, default=str))
t2 = time.perf_counter()
print(json.dumps({
    "analysis_s": t1 - t0, "report_s": t2 - t1, "events": a.totals["events"], "steps": len(a.steps),
    "html_bytes": html.stat().st_size, "json_bytes": (Path(sys.argv[2]) / "report.json").stat().st_size,
    "hotspots": len(data["hotspots"]), "breakdown_rows": len(data["breakdown"]["rows"]),
    "timeline_segments": sum(len(s["segments"]) for s in data["timeline"]["streams"]),
}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, help="an existing big trace (default: build one)")
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC)
    ap.add_argument("--size-gb", type=float, default=1.05)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="primus-report-size-") as tmp:
        trace = args.trace
        if trace is None:
            trace = Path(tmp) / "big.json"
            replicate(args.src, trace, int(args.size_gb * 1e9))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", REPORT, str(trace), tmp], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(f"report failed:\n{proc.stderr[-3000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        result = {
            "benchmark": "report_size",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "trace": {"path": str(trace) if args.trace else f"replicated from {args.src.name}",
                      "bytes": trace.stat().st_size},
            **res,
            "wall_s": wall,
            "peak_rss_gb": usage.ru_maxrss / 1e6,  # Linux: KiB
            "html_limit_bytes": LIMIT_BYTES,
            "html_under_limit": res["html_bytes"] < LIMIT_BYTES,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
