"""Profiler overhead and capture of the trainer, on one GPU.

    python benchmarks/profiler/profiler_overhead.py --config llama3-8b --layers 4 \
        --out-dir runs/overhead --result benchmarks/results/profiler_overhead/h100.json \
        train.seq_len=4096 train.micro_batch=2

One ``capture_trainer`` run with many unprofiled steps before the profiler (``baseline``),
the profiler's wait/warm-up/active steps, and unprofiled steps after it stopped. The
manifest's overhead block compares the medians of each group with the unprofiled steps
(the first is dropped: it pays one-time costs). The captured trace is then analyzed, and
its GEMM FLOPs per step are checked against the analytic count of the config.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from primus_perf.profiler.capture import Schedule, capture_trainer, trace_name
from primus_perf.trainer.config import load_config
from primus_perf.trainer.flops import gemm_flops_per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--baseline", type=int, default=12)
    ap.add_argument("--wait", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--active", type=int, default=3)
    ap.add_argument("--after", type=int, default=12)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    overrides = [*args.overrides, f"model.n_layers={args.layers}"]
    sched = Schedule(active=args.active, warmup=args.warmup, wait=args.wait, baseline=args.baseline,
                     after=args.after)
    res = capture_trainer(args.config, overrides, args.out_dir, sched)
    m = res.manifest
    trace = args.out_dir / trace_name(0)

    from primus_perf.tracelens.analyze import analyze

    t0 = time.perf_counter()
    a = analyze([args.out_dir])
    analysis_s = time.perf_counter() - t0
    cfg = load_config(args.config, overrides)
    expected = gemm_flops_per_step(cfg.model, cfg.train.micro_batch, cfg.train.seq_len)
    result = {
        "benchmark": "profiler_overhead",
        "config": args.config,
        "overrides": overrides,
        "schedule": sched.__dict__,
        "device": m["device"],
        "versions": m["versions"],
        "overhead": m["overhead"],
        "step_times_s": {ph: [s["time_s"] for s in m["steps"] if s["phase"] == ph]
                         for ph in ("baseline", "wait", "warmup", "active", "after")},
        "tokens_per_s": m["tokens_per_s"],
        "mfu": m["mfu"],
        "trace_bytes_gz": trace.stat().st_size,
        "analysis_s": analysis_s,
        "analysis_gemm_flops_per_step": a.totals["gemm_flops_per_step"],
        "analytic_gemm_flops_per_step": expected,
        "gemm_flops_exact": a.totals["gemm_flops_per_step"] == expected,
        "unique_gemm_problems": len(a.gemm_problems),
        "attention_problems": len(a.attention_problems),
        "breakdown_s_per_step": a.to_json()["breakdown"],
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=1, default=str) + "\n")
    o = m["overhead"]
    print(f"outside window {o['outside_window_vs_unprofiled']:.4f}x (wait {o['wait_vs_unprofiled']:.4f}x, "
          f"after {o['after_vs_unprofiled']:.4f}x), active {o['active_vs_unprofiled']:.4f}x; "
          f"GEMM FLOPs exact: {result['gemm_flops_exact']}")


if __name__ == "__main__":
    main()
