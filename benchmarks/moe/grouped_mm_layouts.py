"""``torch._grouped_mm`` by operand layout and group alignment, against the grouped backends.

The same expert GEMMs ran 386-403 TFLOP/s through ``torch._grouped_mm`` in HF transformers'
Qwen3-MoE (``hf_moe_e2e``: its kernels' GPU time over the step's FLOPs) and 111-142 TFLOP/s
through the ``grouped_mm`` backend in ``moe_grouped_gemm`` (isolated). The backend differs
from HF's calls in two ways, each timed here on its own, with the correctness of each call
against the fp32 per-expert product:

- group starts: the backend copies the tokens into a zero-padded buffer whose group starts
  are multiples of 8 rows when the counts leave one unaligned (``raw`` passes the counts'
  own offsets to torch; ``backend`` pads);
- the weight's layout: ``[E, K, N]`` contiguous (``wN``, the trainer's) or ``[E, N, K]``
  storage passed transposed (``wT``, nn.Linear's and HF's), for the forward and the input
  gradient (dgrad: ``dy @ W^T``, so the layouts swap roles).

Plus the Triton backend at its default config and the first online seed config. Every
operation of a pass is timed in the same shuffled rounds (``tuner.measure.time_isolated``:
GPU time of the call alone, L2 flushed), medians with quartiles and TFLOP/s.

    python benchmarks/moe/grouped_mm_layouts.py --out benchmarks/results/grouped_mm_layouts/h100.json
    python benchmarks/moe/grouped_mm_layouts.py --out /tmp/smoke.json --smoke    # CPU: the script
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks.moe.moe_grouped_gemm import Case, skewed_counts, smoke_case
from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json
from primus_perf.kernels.grouped import BACKENDS, triton_backend
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.tuner.grouped.space import ONLINE_SEEDS
from primus_perf.tuner.measure import summarize, time_cpu, time_isolated

CASES = (
    Case("qwen3-30b-a3b-up", 128, 32768, 2048, 1536),
    Case("qwen3-30b-a3b-down", 128, 32768, 768, 2048),
    Case("deepseek-v3-ep8-up", 32, 8192, 7168, 4096),
    Case("mixtral-8x7b-up", 8, 8192, 4096, 28672),
)


def reference(phase: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The pass in fp32, expert by expert."""
    return BACKENDS["loop"].wgrad(x.float(), dy.float(), counts) if phase == "wgrad" else \
        BACKENDS["loop"].mm((x if phase == "fwd" else dy).float(), (w if phase == "fwd" else w.transpose(1, 2)).float(),
                            counts)


def operations(phase: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
               counts: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> one call of the pass (``w``: ``[E, K, N]`` contiguous)."""
    ends = torch.tensor(torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=x.device)
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, [E, N, K] storage
    backends = {"backend grouped_mm": BACKENDS["grouped_mm"], "triton default": BACKENDS["triton"]}
    seeds = ONLINE_SEEDS.get(current_device().vendor, ())
    if seeds:
        backends[f"triton {seeds[0].label()}"] = triton_backend(seeds[0])
    elif x.device.type == "cpu":
        backends["triton 16x16x16"] = triton_backend(GroupedGemmConfig(16, 16, 16, 4, 1, 1))
    if phase == "wgrad":
        ops = {"raw": lambda: torch._grouped_mm(x.t(), dy, offs=ends)}
        ops.update({name: (lambda b=b: b.wgrad(x, dy, counts)) for name, b in backends.items()})
        return ops
    a = x if phase == "fwd" else dy
    b_n, b_t = (w, w_t) if phase == "fwd" else (w.transpose(1, 2), w_t.transpose(1, 2))
    ops = {"raw wN": lambda: torch._grouped_mm(a, b_n, offs=ends),
           "raw wT": lambda: torch._grouped_mm(a, b_t, offs=ends)}
    ops.update({f"{name} wN": (lambda b=b: b.mm(a, b_n, counts)) for name, b in backends.items()})
    ops["backend grouped_mm wT"] = lambda: BACKENDS["grouped_mm"].mm(a, b_t, counts)
    return ops


def run_case(case: Case, args: argparse.Namespace, device: torch.device) -> list[dict]:
    counts = skewed_counts(case.groups, case.tokens, args.seed)
    unaligned = sum(1 for s in torch.tensor(counts).cumsum(0).tolist()[:-1] if s % 8)
    g = torch.Generator().manual_seed(args.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # (the CPU interpreter's bf16 is not Triton's)
    x = (torch.randn(case.tokens, case.k, generator=g) * 0.1).to(device, dtype)
    w = (torch.randn(case.groups, case.k, case.n, generator=g) * case.k**-0.5).to(device, dtype)
    dy = (torch.randn(case.tokens, case.n, generator=g) * 0.1).to(device, dtype)
    rows = []
    for phase in ("fwd", "dgrad", "wgrad"):
        ops = operations(phase, x, w, dy, counts)
        ref = reference(phase, x, w, dy, counts)
        errors = {}
        for name, op in ops.items():
            try:
                out = op().float()
                errors[name] = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            except Exception as exc:  # a layout torch refuses: said, not timed
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        runnable = {name: (lambda _i, op=op: op()) for name, op in ops.items() if isinstance(errors[name], float)}
        if device.type == "cuda":
            samples = time_isolated(runnable, 1, args.reps, args.seed)
        else:
            samples = time_cpu(runnable, 1, args.reps, args.seed)
        flops = 2 * sum(counts) * case.k * case.n
        for name in ops:
            row = {"case": case.name, "phase": phase, "op": name, "groups": case.groups, "tokens": sum(counts),
                   "k": case.k, "n": case.n, "unaligned_group_starts": unaligned}
            if isinstance(errors[name], float):
                stats = summarize(samples[name])
                row.update(stats, error=errors[name], tflops=flops / stats["median_s"] / 1e12)
            else:
                row["refused"] = errors[name]
            rows.append(row)
            print(f"{case.name} {phase:5s} {name:48s} " + (f"{row['median_s'] * 1e3:8.3f} ms {row['tflops']:6.0f} TF/s"
                  f" err {row['error']:.1e}" if "median_s" in row else f"refused: {row['refused']}"), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="small cases on any device: checks the script")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = [smoke_case(c) for c in CASES[:2]] if args.smoke else list(CASES)
    if args.smoke:
        args.reps = min(args.reps, 3)
    rows = [r for case in cases for r in run_case(case, args, device)]
    write_json(args.out, {"benchmark": "grouped_mm_layouts", "device": current_device().to_dict(),
                          "versions": library_versions(), "smoke": args.smoke, "rows": rows}, default=float)
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
