"""Tuning on several GPUs against one: wall-clock speedup and the same choices within noise.

    python benchmarks/gemm/multi_gpu_tuning.py --gpus 2 --out benchmarks/results/multi_gpu_tuning/2xh200.json
    python benchmarks/gemm/multi_gpu_tuning.py --smoke --out /tmp/multi_gpu_smoke.json   # CPU workers

Tunes the Llama-3 8B linear GEMMs of ``benchmarks/gemm/gemm_tuning.py`` (fwd, dgrad, wgrad at
4k and 16k tokens: 24 problems; ``--all-problems``: its 52, for 8 GPUs) into a fresh cache on one GPU, then into another fresh
cache on ``--gpus`` GPUs (one worker each, ``tuner.multi_gpu``). A problem whose choice
differs counts as "same within noise" when the one-GPU run measured the other choice
within ``--noise`` of its own. Each run's ``workers`` say, per GPU, the start-up (spawn to
its first request), of it the launch (interpreter and imports, torch's included; the rest
is the GPU and library set-up), the problems it tuned and the seconds it spent on them;
``*_startup_s`` is the longest start-up of a run, which every run pays before its first
problem. ``--smoke``: 16 small f32 problems tuned on the CPU by
``--gpus`` worker processes (torch's default against a planted ``torch.mm`` candidate), to test
the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

import torch

from primus_perf.problems import GemmProblem
from primus_perf.tuner.core import TuneRun
from primus_perf.tuner.gemm.plugin import GemmTuner, python_candidate
from primus_perf.tuner.multi_gpu import MultiGpuRun, tune_on_gpus


def gpu_problems(every: bool) -> list[GemmProblem]:
    from benchmarks.gemm.gemm_tuning import problems

    return [p for tag, p in problems() if every or tag.startswith("llama3-8b-tp1/")]


def mm_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(a, b, out=out)


def smoke_problems() -> list[GemmProblem]:
    return [GemmProblem.from_row_major(32 * (1 + i % 4), 64 + 16 * i, 64, b_transposed=True, dtype="f32")
            for i in range(16)]


def timed(problems: list[GemmProblem], cache: Path, gpus: int, make_tuner, budget_s: float) -> tuple[MultiGpuRun, float]:
    start = time.perf_counter()
    run = tune_on_gpus(problems, cache=cache, make_tuner=make_tuner, gpus=gpus, budget_s=budget_s)
    return run, time.perf_counter() - start


def startup(run: MultiGpuRun) -> float | None:
    """The longest start-up of a run's workers (None when none got ready)."""
    known = [w.startup_s for w in run.workers if w.startup_s is not None]
    return max(known) if known else None


def compare(one: TuneRun, many: TuneRun, noise: float) -> dict:
    by_key = {r.problem.key(): r for r in many.results}
    rows, same, within = [], 0, 0
    for r in one.results:
        other = by_key[r.problem.key()]
        times = {c.name: c.total_s for c in r.candidates if c.parts}
        if r.chosen == other.chosen:
            same += 1
            gap = 0.0
        else:  # how much slower the other run's choice measured in this run
            gap = times.get(other.chosen, float("inf")) / times[r.chosen] - 1
            within += gap <= noise
        rows.append({"problem": str(r.problem), "one_gpu": r.chosen, "multi_gpu": other.chosen,
                     "gap_in_one_gpu_run": gap, "one_gpu_speedup": r.speedup, "multi_gpu_speedup": other.speedup})
    return {"problems": len(rows), "same_choice": same, "different_within_noise": within,
            "different_beyond_noise": len(rows) - same - within, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU workers on small problems: tests the script")
    ap.add_argument("--gpus", type=int, default=2, help="GPUs (--smoke: CPU workers)")
    ap.add_argument("--all-problems", action="store_true",
                    help="every problem of benchmarks/gemm/gemm_tuning.py (52; Llama-3 70B's too), for many GPUs")
    ap.add_argument("--budget-s", type=float, default=5.0)
    ap.add_argument("--noise", type=float, default=0.02, help="choices this close count as the same")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.smoke:
        problems, make_tuner, device = smoke_problems(), functools.partial(
            GemmTuner, library=None, device="cpu", extra=[python_candidate("mm_out", mm_out)]), "cpu"
        budget, gpus = 0.05, a.gpus
    else:
        if torch.cuda.device_count() < a.gpus:
            print(f"error: needs {a.gpus} GPUs (or --smoke)", file=sys.stderr)
            return 2
        problems, make_tuner, device = gpu_problems(a.all_problems), GemmTuner, torch.cuda.get_device_name(0)
        budget, gpus = a.budget_s, a.gpus
    with tempfile.TemporaryDirectory() as tmp:
        one, one_s = timed(problems, Path(tmp) / "one.json", 1, make_tuner, budget)
        many, many_s = timed(problems, Path(tmp) / "many.json", gpus, make_tuner, budget)
    failures = one.failures + many.failures
    result = {
        "benchmark": "multi_gpu_tuning", "smoke": a.smoke, "device": device, "gpus": gpus,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip},
        "problems": len(problems), "budget_s": budget, "one_gpu_s": one_s, "multi_gpu_s": many_s,
        "speedup": one_s / many_s, "failures": failures,
        "one_gpu_startup_s": startup(one), "multi_gpu_startup_s": startup(many),
        "one_gpu_workers": [asdict(w) for w in one.workers], "multi_gpu_workers": [asdict(w) for w in many.workers],
    }
    if not failures:
        result["choices"] = compare(one, many, a.noise)
        c = result["choices"]
        print(f"{len(problems)} problems: 1 GPU {one_s:.1f} s, {gpus} GPUs {many_s:.1f} s, speedup {one_s / many_s:.2f}x;"
              f" same choice {c['same_choice']}, different within {a.noise:.0%} {c['different_within_noise']},"
              f" beyond {c['different_beyond_noise']}")
        for label, run in (("1 GPU", one), (f"{gpus} GPUs", many)):
            print(f"{label}: " + "; ".join(w.summary() for w in run.workers))
    else:
        print("failures: " + "; ".join(failures), file=sys.stderr)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
