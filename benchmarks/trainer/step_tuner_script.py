"""The step tuner for users' scripts, as a user runs it: ``primus-tune step --out DIR -- SCRIPT
ARGS`` (under torchrun for a multi-GPU case), then the plan reproduced by ``python -m
primus_perf.launch --plan DIR/plan.yaml``: measured runs of the script as written and with the
plan, alternated (``--reproduce`` runs of the plan between runs of the default), their ratio
against the tuner's own figure.

    python benchmarks/trainer/step_tuner_script.py --cases hf-qwen2-7b-4l-1gpu --budget-min 10 \\
        --out benchmarks/results/step_tuner_script/h200.json
    python benchmarks/trainer/step_tuner_script.py --smoke --out /tmp/script.json   # the CPU: small sizes

Rows: ``{"case", "gpus", "speedup", "default_step_s", "tuned_step_s", "search_min", "plan", ...}``
with the verdict's spread, the loss guard, the reproduction (``launch_speedup``, its runs and
its distance from the tuner's figure) and each trial.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from primus_perf.base.devices import library_versions
from primus_perf.base.files import write_json

REPO = Path(__file__).resolve().parents[2]
CASES: dict[str, dict[str, Any]] = {
    # the hand-measured script of the issue: Qwen2 7B dims, 4 layers, seq 2048, 2 x 4 accumulation, AdamW
    "hf-qwen2-7b-4l-1gpu": {"gpus": 1, "target": ["examples/hf_train.py", "--layers", "4", "--steps", "100000"]},
    "hf-qwen2-7b-4l-fsdp2-2gpu": {"gpus": 2, "target": ["examples/hf_train.py", "--layers", "4", "--fsdp",
                                                        "--steps", "100000"]},
    "hf-trainer-qwen2-7b-4l-1gpu": {"gpus": 1, "target": ["examples/hf_trainer.py", "--layers", "4",
                                                          "--max-steps", "100000"]},
    # the same Trainer script with gradient checkpointing on, as many are written (the tuner may turn it off)
    "hf-trainer-qwen2-7b-4l-gc-1gpu": {"gpus": 1, "target": ["examples/hf_trainer.py", "--layers", "4",
                                                             "--gradient-checkpointing", "--max-steps", "100000"]},
    # torchtitan's llama3 8B dims, 4 layers, seq 2048, 1 sequence a micro-batch and 8 a step
    # (benchmarks/trainer/torchtitan_case.py: its target and environment, for the torchtitan installed)
    "torchtitan-llama3-8b-4l-1gpu": {"gpus": 1, "torchtitan": {"flavor": "8B", "layers": 4, "seq": 2048,
                                                               "local_batch": 1, "global_batch": 8}},
}
SMOKE = {"hf-small-cpu": {"gpus": 1, "levers": "micro_batch,recompute",
                          "target": ["examples/hf_train.py", "--size", "small", "--steps", "100000"],
                          "args": ["--warmup-steps", "1", "--run-steps", "3", "--final-blocks", "2"]}}


def resolve(name: str, case: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The case with its target and the environment its runs add (a torchtitan case's are
    written for the torchtitan installed, its tokenizer and data under ``workdir``)."""
    if "torchtitan" not in case:
        return {**case, "env": {}}
    from benchmarks.trainer.torchtitan_case import torchtitan_case

    target, env = torchtitan_case(workdir / f"{name}.assets", **case["torchtitan"])
    return {**case, "target": target, "env": env}


def tune_command(case: dict[str, Any], out: Path, budget_min: float, levers: str | None,
                 tune_args: list[str] = ()) -> list[str]:
    tune = ["-m", "primus_perf.cli.tune", "step", "--out", str(out), "--overwrite", "--budget-min", str(budget_min),
            *case.get("args", []), *tune_args]
    levers = case.get("levers", levers)
    if levers:
        tune += ["--levers", levers]
    tune += ["--", *case["target"]]
    if case["gpus"] > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(case["gpus"]), *tune]
    return [sys.executable, *tune]


def measured_run(case: dict[str, Any], plan: Path | None, warmup: int, steps: int, log: Path) -> dict[str, Any]:
    """One run of the case's script through ``python -m primus_perf.launch`` (with ``--plan``, or
    as written), timed by its own steps."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        launch = ["-m", "primus_perf.launch", *(["--plan", str(plan)] if plan else []), "--measure", str(out),
                  "--warmup", str(warmup), "--steps", str(steps), "--", *case["target"]]
        # torchtitan wants torchrun's variables on one GPU too
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(case["gpus"]), *launch]
               if case["gpus"] > 1 or "torchtitan" in case else [sys.executable, *launch])
        with open(log, "a") as sink:
            subprocess.run(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, timeout=1800, check=False,
                           env={**os.environ, **case["env"]})
        return json.loads(out.read_text()) if out.is_file() else {"status": "no result"}


def reproduce(case: dict[str, Any], plan: Path, runs: int, warmup: int, steps: int, log: Path) -> dict[str, Any]:
    """``runs`` runs with the plan between runs without it: per plan run, its ratio to the
    default runs on both sides."""
    medians: dict[str, list[float]] = {"default": [], "plan": []}
    sequence = ["default"] + ["plan", "default"] * runs
    for side in sequence:
        res = measured_run(case, plan if side == "plan" else None, warmup, steps, log)
        if res.get("status") != "ok":
            return {"error": f"{side}: {res.get('status')} {res.get('reason', '')}".strip()}
        medians[side].append(statistics.median(res["step_s"]))
    d, p = medians["default"], medians["plan"]
    ratios = [d[i] / p[i] for i in range(runs)] + [d[i + 1] / p[i] for i in range(runs)]
    return {"launch_speedup": statistics.median(ratios), "ratios": ratios, "default_s": d, "plan_s": p}


def run_case(name: str, case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out = args.workdir / name
    log = args.workdir / f"{name}.log"
    t0 = time.monotonic()
    case = resolve(name, case, args.workdir)
    cmd = tune_command(case, out, args.budget_min, args.levers, shlex.split(args.tune_args))
    print(f"{name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    with open(log, "w") as sink:
        proc = subprocess.run(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, check=False,
                              timeout=args.budget_min * 60 + 1800, env={**os.environ, **case["env"]})
    row: dict[str, Any] = {"case": name, "gpus": case["gpus"], "target": case["target"], "exit_code": proc.returncode,
                           "wall_min": round((time.monotonic() - t0) / 60, 2)}
    result = out / "step_plan.json"
    if proc.returncode or not result.is_file():
        row["error"] = [ln for ln in log.read_text().splitlines() if ln.strip()][-3:]
        return row
    doc = json.loads(result.read_text())
    row.update(speedup=doc["speedup"], default_step_s=statistics.median(doc["default_ms"]) / 1e3 if doc["default_ms"]
               else None, tuned_step_s=statistics.median(doc["plan_ms"]) / 1e3 if doc["plan_ms"] else None,
               search_min=doc["search_min"], plan=doc["plan"], verdict=doc["verdict"], loss_guard=doc["loss_guard"],
               found=doc.get("found"), trials=doc["measured"], notes=doc["notes"])
    if doc["plan"] and args.reproduce:
        warmup, steps = (1, 3) if args.smoke else (4, 8)
        rep = reproduce(case, out / "plan.yaml", args.reproduce, warmup, steps, args.workdir / f"{name}.launch.log")
        if "launch_speedup" in rep:
            rep["vs_tuner"] = rep["launch_speedup"] / doc["speedup"] - 1
        row["reproduced"] = rep
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", nargs="*", default=None)
    ap.add_argument("--budget-min", type=float, default=18.0)
    ap.add_argument("--levers", default=None, help="comma-separated levers (default: every one that applies)")
    ap.add_argument("--tune-args", default="", help="more options for primus-tune step (e.g. '--final-blocks 2')")
    ap.add_argument("--reproduce", type=int, default=2, help="plan runs between default runs with launch --plan (0: none)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/step_tuner_script"))
    ap.add_argument("--smoke", action="store_true", help="small sizes on the CPU: checks the script")
    args = ap.parse_args(argv)
    cases = SMOKE if args.smoke else CASES
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.cases or list(cases):
        row = run_case(name, cases[name], args)
        doc = json.loads(args.out.read_text()) if args.out.is_file() else {}
        rows = [r for r in doc.get("rows", []) if r["case"] != name] + [row]
        doc.update(benchmark="step_tuner_script", versions=library_versions(), smoke=args.smoke, rows=rows)
        write_json(args.out, doc, default=float)
        print(f"{name}: {row.get('speedup', row.get('error'))}; plan {row.get('plan')};"
              f" reproduced {row.get('reproduced', {}).get('launch_speedup')}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
