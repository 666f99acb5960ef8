"""MoE expert GEMMs: every grouped-GEMM backend on five layer shapes, forward, input
gradient (dgrad) and weight gradient (wgrad), timed as inside a training step.

Cases (experts, routed token rows, K, N of the forward ``x[T, K] @ W_e[K, N]``):

- DeepSeek-V3 with 8-way expert parallelism, gate/up (32, 8192, 7168, 4096) and down
  (32, 8192, 2048, 7168)
- Mixtral 8x7B gate/up (8, 16384, 4096, 28672) and down (8, 16384, 14336, 4096)
- Qwen3-30B-A3B gate/up (128, 16384, 2048, 1536)

Routing is skewed with a fixed seed: expert popularity ``exp(0.8 z)``, ``z ~ N(0, 1)``,
tokens drawn from it (the counts, their skew and the problem key are in the output).
On a GPU every call is timed two ways, the backends of one operation interleaved in
shuffled rounds within one run: ``median_s`` as a training step pays it
(``primus_perf.tuner.measure.time_launch_bound``: L2 flushed, GPU idle, events around the
call's launches, so the per-expert loop's 3 x G launches count where they outlast the
GPU work; what the tuner uses) and ``isolated_median_s`` (``time_isolated``: the call
queued during 1 ms of GPU sleep, its GPU time only; what earlier results reported).
Medians with quartiles, TFLOP/s on the median, and each backend's largest error relative
to the per-expert loop. ``--tune`` also runs the grouped-GEMM tuner on each problem (no
cache) and times its choice in the same rounds as ``tuned``; the summary gives the tuned
choice's time against the fastest backend measured.
``--triton-space`` also times every config of the Triton search space (the best one is
reported as ``triton_best``).

    python benchmarks/moe/moe_grouped_gemm.py --tune --out benchmarks/results/moe_grouped_gemm/h100.json

``--smoke`` runs the same cases shrunk to a few experts and 32-64 features on any device
(on the CPU with wall-clock timing, and the Triton backend only under TRITON_INTERPRET=1):
it checks the script, not the hardware.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json
from primus_perf.kernels.grouped import BACKENDS, Backend, triton_backend
from primus_perf.problems import GroupedGemmProblem
from primus_perf.tuner import core
from primus_perf.tuner.grouped.plugin import GroupedGemmTuner
from primus_perf.tuner.grouped.space import default_space
from primus_perf.tuner.measure import summarize, time_cpu, time_isolated, time_launch_bound


@dataclass(frozen=True)
class Case:
    name: str
    groups: int
    tokens: int
    k: int
    n: int


CASES = (
    Case("deepseek-v3-ep8-up", 32, 8192, 7168, 4096),
    Case("deepseek-v3-ep8-down", 32, 8192, 2048, 7168),
    Case("mixtral-8x7b-up", 8, 16384, 4096, 28672),
    Case("mixtral-8x7b-down", 8, 16384, 14336, 4096),
    Case("qwen3-30b-a3b-up", 128, 16384, 2048, 1536),
)


def smoke_case(case: Case) -> Case:
    """The case shrunk to run in seconds anywhere (same name, same expert-count order)."""
    return Case(case.name, min(case.groups, 8), 256, 32 if case.k < case.n else 64, 48)


def skewed_counts(groups: int, tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    popularity = torch.exp(0.8 * torch.randn(groups, generator=g))
    picks = torch.multinomial(popularity, tokens, replacement=True, generator=g)
    return torch.bincount(picks, minlength=groups).tolist()


def operation(
    backend: Backend, phase: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, counts
) -> Callable[[], torch.Tensor]:
    if phase == "fwd":
        return lambda: backend.mm(x, w, counts)
    if phase == "dgrad":
        wt = w.transpose(1, 2)
        return lambda: backend.mm(dy, wt, counts)
    return lambda: backend.wgrad(x, dy, counts)


def candidates(
    device: torch.device, dtype: torch.dtype, case: Case, triton_space: bool
) -> tuple[dict[str, Backend], dict[str, str]]:
    """Runnable backends (name -> backend) and the reasons the others cannot run."""
    runnable, skipped = {}, {}
    for name, backend in BACKENDS.items():
        # dgrad swaps K and N: a backend must run both orientations
        why = backend.unsupported(device, dtype, case.k, case.n)
        if why is None:
            runnable[name] = backend
        else:
            skipped[name] = why
    if triton_space and "triton" in runnable:
        ident = current_device()
        vendor, arch = ident.vendor, ident.arch
        problem = GroupedGemmProblem(
            groups=case.groups, k=case.k, n=case.n, tokens=1 << (case.tokens - 1).bit_length()
        )
        configs = set()
        for phase in ("fwd", "dgrad", "wgrad"):
            configs |= set(default_space(vendor).configs(problem.with_phase(phase), arch))
        for cfg in sorted(configs, key=lambda c: c.label()):
            runnable[f"triton[{cfg.label()}]"] = triton_backend(cfg)
    return runnable, skipped


def run_case(
    case: Case, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> list[dict]:
    counts = skewed_counts(case.groups, case.tokens, args.seed)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    x = (torch.randn(case.tokens, case.k, generator=g) * 0.1).to(device, dtype)
    w = (torch.randn(case.groups, case.k, case.n, generator=g) * case.k**-0.5).to(device, dtype)
    dy = (torch.randn(case.tokens, case.n, generator=g) * 0.1).to(device, dtype)
    runnable, skipped = candidates(device, dtype, case, args.triton_space)
    rows = []
    for phase in ("fwd", "dgrad", "wgrad"):
        problem = GroupedGemmProblem.from_counts(
            counts, case.k, case.n, dtype="bf16" if dtype == torch.bfloat16 else "f32", phase=phase
        )
        ops = {name: operation(b, phase, x, w, dy, counts) for name, b in runnable.items()}
        reference = ops["loop"]().float()
        errors = {}
        for name, op in ops.items():
            out = op().float()
            errors[name] = float(
                (out - reference).abs().max() / reference.abs().max().clamp_min(1e-30)
            )
        chosen = None
        if args.tune:
            tuner = GroupedGemmTuner(device=device.type, max_configs=args.max_configs)
            res = core.tune_problem(tuner, problem, budget_s=args.tune_budget_s)
            chosen = res.chosen
            winner = next(c for c in res.candidates if c.name == chosen)
            ops["tuned"] = operation(tuner_backend(res), phase, x, w, dy, counts)
            errors["tuned"] = errors.get(winner.name, float("nan"))
        fns = {name: (lambda _i, op=op: op()) for name, op in ops.items()}
        if device.type == "cuda":
            samples = time_launch_bound(fns, n_sets=1, reps=args.reps, seed=args.seed)
            isolated = time_isolated(fns, n_sets=1, reps=args.reps, seed=args.seed)
        else:
            samples, isolated = time_cpu(fns, 1, args.reps, args.seed), None
        flops = 2 * sum(counts) * case.k * case.n
        for name in ops:
            stats = summarize(samples[name])
            stats["samples"] = stats.pop("n")
            extra = {}
            if isolated is not None:
                iso = statistics.median(isolated[name])
                extra = {"isolated_median_s": iso, "isolated_tflops": flops / iso / 1e12}
            rows.append({
                "case": case.name, "phase": phase, "backend": name, "problem": problem.key(),
                "groups": case.groups, "tokens": sum(counts), "k": case.k, "n": case.n,
                "max_count": max(counts), "empty_groups": counts.count(0),
                "tflops": flops / stats["median_s"] / 1e12, **stats, **extra,
                "max_rel_err_vs_loop": errors.get(name, float("nan")),
                **({"tuned_choice": chosen} if name == "tuned" else {}),
            })  # fmt: skip
        for name, why in skipped.items():
            rows.append({"case": case.name, "phase": phase, "backend": name, "skipped": why})
    return rows


def tuner_backend(res: core.TuneResult) -> Backend:
    """The backend of a tuning result's choice."""
    from primus_perf.kernels.grouped.router import GroupedChoice

    return GroupedChoice.from_solution(res.config).implementation()


def fastest(rows: list[dict]) -> list[dict]:
    """Per (case, phase): the fastest backend, and the best Triton config when searched."""
    out = []
    for case, phase in dict.fromkeys((r["case"], r["phase"]) for r in rows):
        timed = [r for r in rows if (r["case"], r["phase"]) == (case, phase) and "median_s" in r]
        tuned = next((r for r in timed if r["backend"] == "tuned"), None)
        timed = [r for r in timed if r["backend"] != "tuned"]
        tritons = [r for r in timed if r["backend"].startswith("triton[")]
        plain = [r for r in timed if not r["backend"].startswith("triton[")]
        if tritons:
            best = min(tritons, key=lambda r: r["median_s"])
            plain.append({**best, "backend": "triton_best", "config": best["backend"]})
        win = min(plain, key=lambda r: r["median_s"])
        loop_s = next(r["median_s"] for r in plain if r["backend"] == "loop")
        out.append({
            "case": case, "phase": phase, "fastest": win["backend"],
            "triton_best_config": plain[-1]["config"] if tritons else None,
            "tflops": {r["backend"]: round(r["tflops"], 3) for r in plain},
            "speedup_vs_loop": {r["backend"]: round(loop_s / r["median_s"], 3) for r in plain},
            "isolated_tflops": {r["backend"]: round(r["isolated_tflops"], 3) for r in plain if "isolated_tflops" in r},
            **({"tuned_choice": tuned["tuned_choice"], "tuned_vs_fastest": round(win["median_s"] / tuned["median_s"], 3)}
               if tuned else {}),
        })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    ap.add_argument("--triton-space", action="store_true", help="also time every Triton config")
    ap.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    ap.add_argument("--tune", action="store_true", help="also tune each problem and time the choice")
    ap.add_argument("--max-configs", type=int, default=16, help="Triton configs the tuner races")
    ap.add_argument("--tune-budget-s", type=float, default=5.0, help="the tuner's budget per problem")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("the full-size cases need a GPU; use --smoke on the CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = [smoke_case(c) if args.smoke else c for c in CASES]
    if args.cases:
        cases = [c for c in cases if c.name in args.cases]
    rows = []
    for case in cases:
        rows += run_case(case, args, device, dtype)
        print(f"{case.name}: done", flush=True)
    summary = fastest([r for r in rows if "median_s" in r])
    for s in summary:
        print(
            f"{s['case']:<22} {s['phase']:<6} fastest {s['fastest']:<12} "
            + "  ".join(f"{b} {t:.3g}" for b, t in s["tflops"].items())
        )
    write_json(args.out, {
        "benchmark": "moe_grouped_gemm", "device": current_device().to_dict(), "versions": library_versions(),
        "dtype": str(dtype), "seed": args.seed, "reps": args.reps, "smoke": args.smoke,
        "timing": ("median_s: launch-bound (L2 flush, idle GPU, events around the launches);"
                   " isolated_median_s: 1 ms GPU sleep + L2 flush, GPU time only")
                  if device.type == "cuda" else "CPU time (process), CPU",
        "cases": [c.__dict__ for c in cases], "summary": summary, "rows": rows,
    })  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
