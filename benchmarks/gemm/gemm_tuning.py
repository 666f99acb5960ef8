"""GEMM tuning benchmark: tune the Llama-3 8B (TP=1) and 70B (TP=8) linear GEMMs (forward,
input gradient, weight gradient) at 4k and 16k tokens plus odd sizes, then time tuned
(through the trainer's router) vs ``torch.matmul`` interleaved in one run.

    python benchmarks/gemm/gemm_tuning.py --cache gemm_cache.json --out benchmarks/results/gemm_tuning/h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from primus_perf.base.devices import current_device
from primus_perf.cache.store import TuningCache
from primus_perf.gate.stats import geomean
from primus_perf.kernels.gemm import GemmRouter, library_versions, problem_of
from primus_perf.problems import GemmProblem
from primus_perf.tuner import measure as timing
from primus_perf.tuner.core import TuneResult, tune_problem
from primus_perf.tuner.gemm.plugin import GemmTuner, Operands

# (model, in_features, out_features) of the fused linears, per TP rank
LINEARS = {
    "llama3-8b-tp1": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
    "llama3-70b-tp8": [("qkv", 8192, 1280), ("o", 1024, 8192), ("gate_up", 8192, 7168), ("down", 3584, 8192)],
}


def problems() -> list[tuple[str, GemmProblem]]:
    out = []
    for model, linears in LINEARS.items():
        for tokens in (4096, 16384):
            for name, fin, fout in linears:
                tag = f"{model}/{name}/{tokens // 1024}k"
                # fwd: x[T,in] @ W[out,in].T ; dgrad: dy[T,out] @ W ; wgrad: dy.T @ x
                out.append((tag + "/fwd", GemmProblem.from_row_major(tokens, fout, fin, b_transposed=True)))
                out.append((tag + "/dgrad", GemmProblem.from_row_major(tokens, fin, fout)))
                out.append((tag + "/wgrad", GemmProblem.from_row_major(fout, fin, tokens, a_transposed=True)))
    for m in (1000, 128):
        out.append((f"odd/m{m}/qkv/fwd", GemmProblem.from_row_major(m, 6144, 4096, b_transposed=True)))
        out.append((f"odd/m{m}/down/fwd", GemmProblem.from_row_major(m, 4096, 14336, b_transposed=True)))
    return out


def verify(p: GemmProblem, router: GemmRouter, rounds: int = 30) -> dict:
    """Tuned (router) vs torch.matmul, interleaved, each call timed alone (as the tuner
    times), on fresh rotating operands."""
    ops = Operands(p, seed=7)

    def routed(i: int):
        out = router(ops.a[i], ops.b[i])
        return out if out is not None else torch.matmul(ops.a[i], ops.b[i])

    fns = {"torch": lambda i: torch.matmul(ops.a[i], ops.b[i]), "tuned": routed}
    t = timing.time_isolated(fns, ops.n, rounds, seed=3)
    ratios = [a / b for a, b in zip(t["torch"], t["tuned"], strict=True)]
    return {
        "torch": timing.summarize(t["torch"]),
        "tuned": timing.summarize(t["tuned"]),
        "speedup": statistics.median(t["torch"]) / statistics.median(t["tuned"]),
        "speedup_per_round_q1_q3": [statistics.quantiles(ratios, n=4)[0], statistics.quantiles(ratios, n=4)[2]],
    }


def tuning_report(res: TuneResult) -> dict:
    """The tuning figures of one problem: the choice, the pool, what was rejected and why."""
    return {"chosen": res.chosen, "pool": len(res.candidates),
            "valid": sum(c.status != "rejected" for c in res.candidates),
            "rejected": {c.name: c.reason for c in res.candidates if c.status == "rejected"},
            "tuning_s": res.tuning_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="gemm_cache.json")
    ap.add_argument("--out", default="benchmarks/results/gemm_tuning/h100.json")
    ap.add_argument("--budget-s", type=float, default=2.0)
    ap.add_argument("--max-s", type=float, default=1e9, help="stop tuning new problems after this")
    ap.add_argument("--widen", action="store_true", help="add split-K variants of the top heuristics")
    ap.add_argument("--e2e", action="store_true", help="trainer run without/with the tuned cache")
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=1)
    args = ap.parse_args()
    if args.e2e:
        e2e(args)
        return
    t_start = time.time()
    cache = TuningCache(args.cache)
    dev = current_device()
    result = {"device": dev.to_dict(), "torch": torch.__version__, "cuda": torch.version.cuda, "widen": args.widen,
              "versions": library_versions(), "python": platform.python_version(), "problems": []}
    for tag, p in problems():
        if time.time() - t_start > args.max_s:
            result["problems"].append({"tag": tag, "skipped": "time limit"})
            continue
        try:
            res = tune_problem(GemmTuner(widen=args.widen), p, budget_s=args.budget_s)
            entry = res.entry
            cache.put(entry)
            router = GemmRouter([entry])
            v = verify(p, router)
            router.close()
            M, N, K, _at, _bt = p.row_major_shapes()
            row = {"tag": tag, "key": p.key(), "MNK": [M, N, K], **tuning_report(res),
                   "error": entry.error,
                   "torch_tflops": p.flops / v["torch"]["median_s"] / 1e12,
                   "tuned_tflops": p.flops / v["tuned"]["median_s"] / 1e12, **v}
        except Exception as exc:  # one failing problem does not lose the others
            row = {"tag": tag, "error_text": f"{type(exc).__name__}: {exc}"}
        result["problems"].append(row)
        print(json.dumps({k: row.get(k) for k in ("tag", "chosen", "speedup", "tuning_s", "error_text")}), flush=True)
        done = [r for r in result["problems"] if "speedup" in r]
        if done:
            result["summary"] = {
                "problems": len(done),
                "geomean_speedup": geomean([r["speedup"] for r in done]),
                "min_speedup": min(r["speedup"] for r in done),
                "median_tuning_s": statistics.median(r["tuning_s"] for r in done),
            }
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
    print(json.dumps(result.get("summary")), flush=True)



def trainer_problems(config: str, layers: int) -> list[GemmProblem]:
    """The GEMM problems one training step of the trainer issues (recorded at dispatch)."""
    from primus_perf.runtime import dispatch
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer

    seen: dict[str, GemmProblem] = {}

    class Record:
        def route(self, a, b, bias=None):
            try:
                p = problem_of(a, b)
                seen[p.key()] = p
            except ValueError:
                return "unsupported", None
            return p.key(), None

    trainer = Trainer(load_config(config, [f"model.n_layers={layers}", "train.steps=1"]))
    try:
        with dispatch.routing({"gemm": Record()}, trainer.device.type):
            trainer.train_step()
    finally:
        trainer.close()
    del trainer
    torch.cuda.empty_cache()
    return list(seen.values())


def e2e(args: argparse.Namespace) -> None:
    """Tune the trainer's GEMMs, then run it without/with the cache, alternating."""
    import subprocess
    import sys

    cache = TuningCache(args.cache)
    probs = trainer_problems(args.config, args.layers)
    result: dict = {"config": args.config, "layers": args.layers, "problems": len(probs), "tuning": [], "runs": []}
    for p in probs:
        res = tune_problem(GemmTuner(), p, budget_s=args.budget_s)
        cache.put(res.entry)
        result["tuning"].append({"key": p.key(), "chosen": res.chosen, "tuning_s": res.tuning_s,
                                 "tuned_ms": res.entry.times["tuned_ms"], "default_ms": res.entry.times["default_ms"]})
    for i, use in enumerate([False, True] * args.pairs):
        log = f"{args.out}.run{i}.jsonl"
        cmd = [sys.executable, "-m", "primus_perf.cli.train", "--config", args.config, "--layers", str(args.layers),
               "--steps", str(args.steps), "--json-log", log] + ([f"tuning.cache={args.cache}"] if use else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        steps = []
        if os.path.exists(log):
            with open(log) as f:
                steps = [json.loads(x) for x in f]
        result["runs"].append({"cached": use, "rc": proc.returncode, "tail": proc.stdout[-1500:] + proc.stderr[-1500:],
                               "steps": steps})
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({"e2e_runs": len(result["runs"])}), flush=True)


if __name__ == "__main__":
    main()
