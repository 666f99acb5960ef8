"""Attention tuning benchmark (GPU): the issue's bars, measured in one run per problem.

For each problem:
1. ``grid`` search of the Triton tile space (every config validated against fp32 on fresh
   random inputs; slow configs pruned after a short measurement);
2. ``tpe`` search with a fresh measurement record and at most 40% of the grid's
   measurements (distinct forward + backward configs timed);
3. race 1 (the tuner core: validation, isolated timing, medians, the one selection policy):
   torch default SDPA, each SDPA backend, Triton with the grid config -> the selected
   backend; race 2 (independent, same process): the same candidates plus Triton with the
   tpe config -> the bars are read from race 2:
   Triton fwd vs flash fwd (>= 1.2x), Triton bwd vs flash bwd (>= 1.1x), the selected
   backend within 2% of the fastest, tpe total within 3% of grid total.

Then, if ``--e2e`` is given: the trainer (llama3-8b, 4 layers, seq 4096) with and without
the tuned attention router, same seed: tokens/s ratio and losses.

The JSON result is rewritten after every problem (resumable with ``--resume FILE``).

    python benchmarks/attention/attention_tuning.py --out benchmarks/results/attention_tuning/h100.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from primus_perf.base.devices import require_gpu
from primus_perf.kernels.attention.backends import TRITON
from primus_perf.kernels.attention.router import AttentionChoice, library_versions
from primus_perf.problems import AttentionProblem
from primus_perf.tuner.attention.plugin import AttentionTuner, triton_candidate
from primus_perf.tuner.attention.search import Evaluator, grid_search, tpe_search
from primus_perf.tuner.attention.space import default_space, known_good
from primus_perf.tuner.core import TuneResult, tune_problem

PROBLEMS = {
    "b4_h32_s4096_d128_causal": AttentionProblem(4, 32, 32, 4096, 4096, 128, "bf16", True),
    "b1_h32_s16384_d128_causal": AttentionProblem(1, 32, 32, 16384, 16384, 128, "bf16", True),
    "b4_h32_s4096_d128_full": AttentionProblem(4, 32, 32, 4096, 4096, 128, "bf16", False),
    "b16_h16_s1024_d64_causal": AttentionProblem(16, 16, 16, 1024, 1024, 64, "bf16", True),
}
BARS = {"fwd_vs_flash": 1.2, "bwd_vs_flash": 1.1, "selected_within": 0.02, "tpe_within": 0.03, "tpe_budget": 0.40}


def write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    os.replace(tmp, path)


def race(p: AttentionProblem, extra: list) -> TuneResult:
    """torch's default SDPA, every raced SDPA backend and the ``extra`` Triton candidates,
    through the tuner core."""
    return tune_problem(AttentionTuner(strategy=None, extra=extra), p)


def race_rows(p: AttentionProblem, res: TuneResult) -> dict:
    """Per candidate: status, fwd/bwd medians (ms) and TFLOP/s."""
    rows = {}
    for c in res.candidates:
        fwd, bwd = (c.parts.get(part, {}).get("median_s", math.inf) for part in ("fwd", "bwd"))
        rows[c.name] = {"status": c.status, "reason": c.reason, "error": c.error,
                        "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3, "total_ms": c.total_s * 1e3,
                        "fwd_tflops": p.forward_flops / fwd / 1e12, "bwd_tflops": p.backward_flops / bwd / 1e12}
    return rows


def fastest(rows: dict) -> str | None:
    timed = {n: r["total_ms"] for n, r in rows.items() if r["status"] != "rejected"}
    return min(timed, key=lambda n: timed[n]) if timed else None


def bench_problem(name: str, p: AttentionProblem, arch: str, vendor: str, log) -> dict:
    space = default_space(vendor, p.head_dim)
    t0 = time.time()
    ev = Evaluator(p, arch=arch, reps=20, validate=True, seed=1)
    grid = grid_search(ev, space)
    rejected = [m for m in grid.measurements if m.status in ("numerics", "failed")]
    log(f"{name}: grid {grid.config.label() if grid.config else None} fwd {grid.fwd_ms:.3f} bwd {grid.bwd_ms:.3f} ms, measured {grid.measured}, {time.time() - t0:.0f}s")
    t1 = time.time()
    budget = int(BARS["tpe_budget"] * grid.measured)
    ev2 = Evaluator(p, arch=arch, reps=20, validate=True, seed=101)
    tpe = tpe_search(ev2, space, trials=10 * budget, seeds=known_good(vendor, p.head_dim), seed=0, max_measured=budget)
    log(f"{name}: tpe {tpe.config.label() if tpe.config else None} fwd {tpe.fwd_ms:.3f} bwd {tpe.bwd_ms:.3f} ms, measured {tpe.measured}/{budget}, trials {tpe.trials}, {time.time() - t1:.0f}s")
    extra = [triton_candidate(grid.config)] if grid.config else []
    race1 = race(p, extra)
    selected = race1.chosen
    if tpe.config and tpe.config != grid.config:
        extra.append(triton_candidate(tpe.config, "triton:tpe"))
    race2 = race_rows(p, race(p, extra))
    fastest2 = fastest(race2)
    ok = {n: r for n, r in race2.items() if r["status"] != "rejected"}
    tri, fl = ok.get(TRITON), ok.get("sdpa:flash")

    def ratio(a: float, b: float) -> float:
        return b / a if a and math.isfinite(a) and math.isfinite(b) else float("nan")

    out = {
        "problem": p.to_dict(),
        "label": str(p),
        "forward_flops": p.forward_flops,
        "grid": {"config": grid.config.to_dict() if grid.config else None, "fwd_ms": grid.fwd_ms, "bwd_ms": grid.bwd_ms, "measured": grid.measured, "pairs_covered": grid.trials, "rejected": [{"part": m.part, "config": m.config.label(), "status": m.status, "reason": m.reason} for m in rejected], "seconds": round(t1 - t0, 1)},
        "tpe": {"config": tpe.config.to_dict() if tpe.config else None, "fwd_ms": tpe.fwd_ms, "bwd_ms": tpe.bwd_ms, "measured": tpe.measured, "budget": budget, "trials": tpe.trials},
        "race1": race_rows(p, race1),
        "race2": race2,
        "selected": selected,
        "fastest_in_race2": fastest2,
        "bars": {
            "triton_fwd_vs_flash": ratio(tri["fwd_ms"], fl["fwd_ms"]) if tri and fl else None,
            "triton_bwd_vs_flash": ratio(tri["bwd_ms"], fl["bwd_ms"]) if tri and fl else None,
            "selected_over_fastest": ok[selected]["total_ms"] / ok[fastest2]["total_ms"] - 1 if selected in ok and fastest2 else None,
            # the same config as the grid's: equal by construction (not raced twice)
            "tpe_same_config_as_grid": tpe.config == grid.config,
            "tpe_over_grid_race2": 0.0 if tpe.config == grid.config else (ok["triton:tpe"]["total_ms"] / ok[TRITON]["total_ms"] - 1 if "triton:tpe" in ok and TRITON in ok else None),
            "tpe_over_grid_search": (tpe.fwd_ms + tpe.bwd_ms) / (grid.fwd_ms + grid.bwd_ms) - 1,
            "tpe_measured_fraction": tpe.measured / grid.measured if grid.measured else None,
        },
    }
    b = out["bars"]
    out["pass"] = {
        "fwd": b["triton_fwd_vs_flash"] is not None and b["triton_fwd_vs_flash"] >= BARS["fwd_vs_flash"],
        "bwd": b["triton_bwd_vs_flash"] is not None and b["triton_bwd_vs_flash"] >= BARS["bwd_vs_flash"],
        "selected": b["selected_over_fastest"] is not None and b["selected_over_fastest"] <= BARS["selected_within"],
        "tpe": b["tpe_over_grid_race2"] is not None and b["tpe_over_grid_race2"] <= BARS["tpe_within"] and b["tpe_measured_fraction"] <= BARS["tpe_budget"],
    }
    log(f"{name}: bars {json.dumps(b)} pass {out['pass']} ({time.time() - t0:.0f}s)")
    return out


def bench_e2e(steps: int, layers: int, log) -> dict:
    from primus_perf.kernels.attention.router import AttentionRouter
    from primus_perf.runtime import dispatch
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import train

    cfg = load_config("llama3-8b", [f"model.n_layers={layers}", f"train.steps={steps}"])
    m, t = cfg.model, cfg.train
    p = AttentionProblem(t.micro_batch, m.n_heads, m.n_kv_heads, t.seq_len, t.seq_len, m.dim // m.n_heads, "bf16", True)
    t0 = time.time()
    res = tune_problem(AttentionTuner(strategy="tpe", trials=12), p)
    choice = AttentionChoice.from_solution(res.config)
    log(f"e2e: tuned {p} -> {choice.label()} ({time.time() - t0:.0f}s); race {json.dumps({c.name: round(c.total_s * 1e3, 3) for c in res.candidates})}")
    runs = {}
    for mode in ("default", "tuned", "default2"):
        router = AttentionRouter({p.key(): choice}) if mode == "tuned" else None
        attention = dispatch.of("attention")
        attention.reset()
        with dispatch.routing({"attention": router} if router else {}, "cuda"):
            hist = train(cfg)
        tps = [h.tokens_per_s for h in hist[2:]]
        runs[mode] = {"tokens_per_s_median": statistics.median(tps), "tokens_per_s": tps, "losses": [h.loss for h in hist], "router": attention.summary() if router else None}
        log(f"e2e {mode}: {statistics.median(tps):.0f} tok/s, last loss {hist[-1].loss:.4f}")
    base = (runs["default"]["tokens_per_s_median"] + runs["default2"]["tokens_per_s_median"]) / 2
    return {
        "config": "llama3-8b", "layers": layers, "seq_len": t.seq_len, "steps": steps,
        "attention_problem": p.to_dict(), "choice": choice.to_solution(), "tune": res.to_dict(),
        "runs": runs, "tokens_per_s_ratio_tuned_over_default": runs["tuned"]["tokens_per_s_median"] / base,
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(runs["tuned"]["losses"], runs["default"]["losses"], strict=True)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", type=Path, help="an earlier partial result: its problems are kept")
    ap.add_argument("--problems", default=",".join(PROBLEMS), help="comma-separated names")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--e2e-steps", type=int, default=12)
    ap.add_argument("--e2e-first", action="store_true", help="run the end-to-end part before the problems")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; skip work that would start after")
    args = ap.parse_args()
    start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)

    ident = require_gpu()
    data = json.loads(args.resume.read_text()) if args.resume and args.resume.exists() else {}
    data.update({"device": ident.to_dict(), "versions": library_versions(), "bars": BARS})
    data.setdefault("problems", {})

    def e2e() -> None:
        try:
            data["e2e"] = bench_e2e(args.e2e_steps, 4, log)
        except Exception as exc:
            log(f"e2e failed {exc!r}")
            data["e2e"] = {"error": repr(exc)[:500]}

    if args.e2e and args.e2e_first and "e2e" not in data:
        e2e()
        write(args.out, data)
    for name in args.problems.split(","):
        if name in data["problems"]:
            continue
        if time.time() - start > args.deadline:
            log(f"{name}: skipped (deadline)")
            continue
        try:
            data["problems"][name] = bench_problem(name, PROBLEMS[name], ident.arch, ident.vendor, log)
        except Exception as exc:
            log(f"{name}: failed {exc!r}")
            data["problems"][name] = {"error": repr(exc)[:500]}
        write(args.out, data)
        torch.cuda.empty_cache()
    if args.e2e and "e2e" not in data:
        e2e()
    write(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
