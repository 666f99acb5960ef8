"""Does the tuner time GEMMs the way the trainer runs them? One run on the GPU.

For each tuned problem of a tuning cache (entries with a cuBLASLt/hipBLASLt algorithm),
torch's default and the cached algorithm are timed, interleaved, under two conditions:

- ``back_to_back``: the tuner's first harness (``measure.time_interleaved``): calls on rotating
  inputs, one candidate after the other with no gaps: the GPU runs GEMMs for
  milliseconds on end, as a GEMM-only benchmark does.
- ``gapped``: each call is preceded by a memory-bound kernel (zeroing 256 MB, which also
  evicts L2) and timed alone between two events, as in a training step, where GEMMs
  alternate with elementwise, normalization and optimizer kernels.
- ``idle_gapped``: as ``gapped`` with about 1 ms of GPU sleep before each call, so the
  GPU's power draw (and with it the clock the power limit allows) recovers between GEMMs
  (``measure.time_isolated``, what the tuner now uses).

    python benchmarks/gemm/gemm_timing_conditions.py --cache runs/loop/tuning_cache.json \
        --out benchmarks/results/gemm_timing_conditions/h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def torch_and_tuned(ops, plan, algo: bytes, ws, ws_bytes: int) -> dict:
    import torch

    stream = torch.cuda.current_stream().cuda_stream
    launch = plan.launcher(algo, ws_bytes)
    return {
        "torch": lambda i: torch.mm(ops.a[i], ops.b[i], out=ops.d[i]),
        "tuned": lambda i: launch(*ops.pointers(i), ws.data_ptr(), stream),
    }


def main() -> None:
    import torch

    from primus_perf.cache.store import TuningCache
    from primus_perf.kernels.blaslt.binding import load
    from primus_perf.kernels.gemm import WORKSPACE_BYTES
    from primus_perf.problems import GemmProblem
    from primus_perf.tuner import measure as timing
    from primus_perf.tuner.gemm.plugin import Operands

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lt = load()
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for e in TuningCache(args.cache).entries("gemm"):
        if not e.solution.get("blob"):
            continue
        p = GemmProblem.from_dict(e.problem)
        ops, algo = Operands(p), bytes(e.solution["blob"])
        with lt.plan(p) as plan:
            fns = torch_and_tuned(ops, plan, algo, ws, WORKSPACE_BYTES)
            one = timing.time_interleaved({"torch": fns["torch"]}, ops.n, 1, 1)["torch"][0]
            inner = max(1, min(50, int(3e-4 / max(one, 1e-7))))
            b2b = timing.time_interleaved(fns, ops.n, 30, inner, seed=1)
            gap = timing.time_isolated(fns, ops.n, args.reps, idle_cycles=0)
            idle = timing.time_isolated(fns, ops.n, args.reps)
            row = {"problem": str(p), "key": p.key(), "tuner_speedup": e.speedup, "inner": inner}
            for mode, t in (("back_to_back", b2b), ("gapped", gap), ("idle_gapped", idle)):
                med = {n: statistics.median(v) for n, v in t.items()}
                row[mode] = {"torch_ms": med["torch"] * 1e3, "tuned_ms": med["tuned"] * 1e3,
                             "speedup": med["torch"] / med["tuned"],
                             "torch_iqr_ms": [x * 1e3 for x in statistics.quantiles(t["torch"], n=4)[::2]],
                             "tuned_iqr_ms": [x * 1e3 for x in statistics.quantiles(t["tuned"], n=4)[::2]]}
            rows.append(row)
            print(f"{row['problem']:28s} tuner {e.speedup:.3f}  back-to-back {row['back_to_back']['speedup']:.3f} "
                  f"({row['back_to_back']['torch_ms']:.3f} ms torch)  gapped {row['gapped']['speedup']:.3f} "
                  f"({row['gapped']['torch_ms']:.3f} ms torch)  idle-gapped {row['idle_gapped']['speedup']:.3f} "
                  f"({row['idle_gapped']['torch_ms']:.3f} ms torch, {row['idle_gapped']['tuned_ms']:.3f} tuned)",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cublasLt": lt.version(),
                                    "torch": torch.__version__, "problems": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
