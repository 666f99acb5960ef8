"""Trace analysis speed: a >= 1 GB trace through primus-perf and through HTA, in one run.

Builds a big trace by replicating the steps of a real H100 trace of the trainer
(``trace_replicate.py``), then times, each in a fresh subprocess (so peak RSS is that
run's own):

- primus-perf: ``tracelens.analyze.analyze`` (load + linking + categories + perf models +
  breakdowns + hotspots + problems) and the JSON summary;
- Holistic Trace Analysis (``holistictraceanalysis``): ``TraceAnalysis`` load, kernel
  breakdown and temporal breakdown. HTA lives in its own virtual environment
  (``--hta-python``), as its pinned dependencies differ from ours.

    python benchmarks/analyzer/trace_analysis.py --hta-python /tmp/venv_hta/bin/python \\
        --out benchmarks/results/trace_analysis/cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks import RESULTS, ROOT
from benchmarks.analyzer.trace_replicate import replicate

DEFAULT_SRC = ROOT / "tests" / "data" / "traces" / "h100_llama3-8b_l2_s1024_cudnn.json.gz"

OURS = """
import json, sys, time
t0 = time.perf_counter()
from primus_perf.tracelens.analyze import analyze
a = analyze([sys.argv[1]])
summary = a.to_json()
t1 = time.perf_counter()
print(json.dumps({"seconds": t1 - t0, "events": a.totals["events"], "steps": len(a.steps),
                  "gemm_problems": len(a.gemm_problems), "gemm_flops_per_step": a.totals["gemm_flops_per_step"],
                  "breakdown": summary["breakdown"]}))
"""

HTA = """
import json, sys, time, logging
logging.disable(logging.WARNING)
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
ta = TraceAnalysis(trace_dir=sys.argv[1])
t1 = time.perf_counter()
kernel_type, kernels = ta.get_gpu_kernel_breakdown(visualize=False)
temporal = ta.get_temporal_breakdown(visualize=False)
t2 = time.perf_counter()
print(json.dumps({"seconds": t2 - t0, "load_seconds": t1 - t0, "kernel_rows": int(len(kernels)),
                  "temporal_rows": int(len(temporal))}))
"""


def _tree(pid: int) -> list[int]:
    """A process and its descendants (Linux: /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in task.read_text().split()]
    return out


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class _PssPeak(threading.Thread):
    """The peak of a process tree's memory, summed over its processes at each sample: their
    proportional set sizes (pages shared after a fork counted once), every ``every`` s."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.peak_kb, self.done = pid, every, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.peak_kb = max(self.peak_kb, sum(map(_pss_kb, _tree(self.pid))))


def run_measured(python: str, code: str, arg: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; its JSON result plus wall time, its own peak RSS
    and (Linux) the peak of its processes' memory summed (helpers' included, sampled)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([python, "-c", code, arg], stdout=out, stderr=err, env=env)
        sampler = _PssPeak(proc.pid)
        if Path("/proc/self/smaps_rollup").exists():
            sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        sampler.done.set()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        return {"ok": False, "error": (stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    result = json.loads(stdout.strip().splitlines()[-1])
    result.update(ok=True, wall_s=wall, peak_rss_gb=usage.ru_maxrss / 1e6)  # Linux: ru_maxrss in KiB
    if sampler.peak_kb:
        result["peak_pss_sum_gb"] = sampler.peak_kb / 1e6
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=str(DEFAULT_SRC), help="real trace to replicate")
    ap.add_argument("--size-gb", type=float, default=1.05, help="uncompressed size of the big trace")
    ap.add_argument("--hta-python", default=None, help="python of a venv with holistictraceanalysis")
    ap.add_argument("--workdir", default=None, help="where to build the big trace (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "trace_analysis" / "cpu.json"))
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="primus-trace-bench-"))
    trace_dir = work / "big"
    trace_dir.mkdir(parents=True, exist_ok=True)
    big = trace_dir / "rank0.json"
    t0 = time.perf_counter()
    built = replicate(args.src, big, int(args.size_gb * 1e9))
    print(f"built {big}: {built['bytes'] / 1e9:.2f} GB, {built['events']:,} events in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)

    env = dict(os.environ, OMP_NUM_THREADS="2")
    ours = run_measured(sys.executable, OURS, str(big), env)
    print("primus-perf:", json.dumps(ours), flush=True)
    result = {
        "benchmark": "trace_analysis",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "trace": {"source": str(Path(args.src).name), **built},
        "primus_perf": ours,
        "bars": {"max_seconds": 45, "max_rss_gb": 4.0, "goal_speedup_vs_hta": 5.0},
    }
    if args.hta_python:
        hta = run_measured(args.hta_python, HTA, str(trace_dir), env)
        ver = subprocess.run([args.hta_python, "-c", "import importlib.metadata as m;"
                              "print(m.version('HolisticTraceAnalysis'))"], capture_output=True, text=True)
        hta["version"] = ver.stdout.strip()
        print("HTA:", json.dumps(hta), flush=True)
        result["hta"] = hta
        if hta.get("ok") and ours.get("ok"):
            result["speedup_vs_hta"] = hta["wall_s"] / ours["wall_s"]
    else:
        result["hta"] = {"ok": False, "error": "not run (no --hta-python given)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    big.unlink()


if __name__ == "__main__":
    main()
