"""The step tuner's goals: ``primus-tune step`` on each case, its plan against the default at the
same global batch (interleaved, in the tuner's own final measurement), the search's minutes.

Cases (``CASES``): llama3-8b 4 layers seq 4096 global batch 16 on one GPU; llama3-8b 8 layers
under FSDP2 over 2 and 4 GPUs at 16 sequences a GPU, and on one GPU for their scaling (tokens/s
against one GPU's, and that over the GPUs: ``scaling_vs_1gpu``); qwen3-30b-a3b 2 layers and mixtral-8x7b
1 layer at global batch 32. A multi-GPU case runs under torchrun. Each case is a run folder
``<workdir>/<case>`` (the profile, plan.yaml, step_plan.json); its row is merged into ``--out``
as soon as it ends::

    python benchmarks/trainer/step_tuner.py --cases llama3-8b-1gpu --out benchmarks/results/step_tuner/h100.json
    python benchmarks/trainer/step_tuner.py --smoke --out /tmp/step.json   # the CPU: tiny, two levers

Rows: ``{"case", "gpus", "speedup", "default_tokens_s", "tuned_tokens_s", "search_min", "plan", ...}``
with the verdict's spread, the FP8 plan's minutes, the loss guard and the analyzer's top
recommendations against the measurement of the same lever (where the search measured it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json

CASES: dict[str, dict[str, Any]] = {
    "llama3-8b-1gpu": {"config": "llama3-8b", "gpus": 1,
                       "overrides": ["model.n_layers=4", "train.seq_len=4096", "train.global_batch=16",
                                     "train.micro_batch=1"]},
    "llama3-8b-8l-1gpu": {"config": "llama3-8b", "gpus": 1,  # the FSDP2 cases' model on one GPU: their scaling
                          "overrides": ["model.n_layers=8", "train.seq_len=4096", "train.global_batch=16",
                                        "train.micro_batch=1"]},
    "llama3-8b-fsdp2-2gpu": {"config": "llama3-8b", "gpus": 2, "one_gpu": "llama3-8b-8l-1gpu",
                             "overrides": ["model.n_layers=8", "train.seq_len=4096", "train.global_batch=32",
                                           "train.micro_batch=1", "parallel.dp_shard=2"]},
    "llama3-8b-fsdp2-4gpu": {"config": "llama3-8b", "gpus": 4, "one_gpu": "llama3-8b-8l-1gpu",
                             "overrides": ["model.n_layers=8", "train.seq_len=4096", "train.global_batch=64",
                                           "train.micro_batch=1", "parallel.dp_shard=4"]},
    "qwen3-30b-a3b-1gpu": {"config": "qwen3-30b-a3b", "gpus": 1,
                           "overrides": ["model.n_layers=2", "model.vocab_size=32000", "train.seq_len=4096",
                                         "train.global_batch=32", "train.micro_batch=1"]},
    "mixtral-8x7b-1gpu": {"config": "mixtral-8x7b", "gpus": 1,
                          "overrides": ["model.n_layers=1", "model.vocab_size=32000", "train.seq_len=4096",
                                        "train.global_batch=32", "train.micro_batch=1"]},
}
SMOKE = {"tiny-cpu": {"config": "tiny", "gpus": 1, "levers": "micro_batch,optimizer",
                      "overrides": ["train.global_batch=4", "train.micro_batch=1", "model.n_layers=1",
                                    "train.seq_len=32"],
                      "args": ["--blocks", "2", "--block-steps", "1", "--final-blocks", "2", "--check-steps", "3"]}}


def _command(case: dict[str, Any], out: Path, budget_min: float) -> list[str]:
    args = ["step", "--config", case["config"], "--out", str(out), "--overwrite", "--budget-min", str(budget_min),
            *case.get("args", []), *(["--levers", case["levers"]] if "levers" in case else []), *case["overrides"]]
    if case["gpus"] > 1:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={case['gpus']}",
                "-m", "primus_perf.cli.tune", *args]
    return [sys.executable, "-m", "primus_perf.cli.tune", *args]


def _advice_vs_measured(folder: Path) -> list[dict[str, Any]]:
    """The analyzer's top three recommendations of the profiled default, each with the step
    tuner's measurement of its lever where the search measured it."""
    from primus_perf.tracelens.analyze import analyze

    recs = analyze([folder]).recommendations
    keep = ["category", "lever", "estimated_saving_ms", "measured_saving_ms", "measured_against", "method"]
    return json.loads(recs[[c for c in keep if c in recs.columns]].head(3).to_json(orient="records"))


def run_case(name: str, case: dict[str, Any], workdir: Path, budget_min: float) -> dict[str, Any]:
    folder = workdir / name
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
    log = folder.with_suffix(".log")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(_command(case, folder, budget_min), stdout=f, stderr=subprocess.STDOUT, env=env)
    row: dict[str, Any] = {"case": name, "gpus": case["gpus"], "config": case["config"],
                           "overrides": case["overrides"], "budget_min": budget_min,
                           "tune_args": [*case.get("args", []), *(["--levers", case["levers"]] if "levers" in case else [])],
                           "exit_code": proc.returncode}
    doc_path = folder / "step_plan.json"
    if proc.returncode != 0 or not doc_path.is_file():
        row["error"] = log.read_text()[-2000:]
        return row
    doc = json.loads(doc_path.read_text())
    row.update({k: doc.get(k) for k in ("speedup", "default_tokens_s", "tuned_tokens_s", "search_min", "plan",
                                        "fp8_plan_min", "verdict", "loss_guard", "dropped_by_guard", "levers",
                                        "stopped", "passes")})
    row["trials"] = len(doc.get("measured", []))
    try:
        row["advice_vs_measured"] = _advice_vs_measured(folder)
    except Exception as exc:  # the row stands without it
        row["advice_vs_measured_error"] = str(exc)
    return row


def _scaling(rows: dict[str, dict[str, Any]]) -> None:
    """Each multi-GPU row's tokens/s against its model's one-GPU case (same sequences a GPU),
    default against default and plan against plan, where both rows have them: the ratio and the
    ratio over the GPUs (1.0: linear scaling)."""
    for name, row in rows.items():
        one = rows.get(CASES.get(name, {}).get("one_gpu", ""), {})
        pairs = {k: (row.get(k), one.get(k)) for k in ("default_tokens_s", "tuned_tokens_s")}
        if all(a and b for a, b in pairs.values()):
            row["scaling_vs_1gpu"] = {"one_gpu_case": one["case"], "gpus": row["gpus"],
                                      **{k.removesuffix("_tokens_s"): round(a / b, 3) for k, (a, b) in pairs.items()},
                                      **{k.removesuffix("_tokens_s") + "_per_gpu": round(a / b / row["gpus"], 3)
                                         for k, (a, b) in pairs.items()}}


def _merge(out: Path, row: dict[str, Any], smoke: bool) -> None:
    doc = json.loads(out.read_text()) if out.is_file() else {}
    rows = {r["case"]: r for r in doc.get("rows", [])}
    rows[row["case"]] = row
    _scaling(rows)
    write_json(out, {"benchmark": "step_tuner", "device": current_device().to_dict(), "versions": library_versions(),
                     "smoke": smoke, "rows": list(rows.values())}, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=sorted(CASES))
    ap.add_argument("--budget-min", type=float, default=20.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/step_tuner"))
    ap.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU, two levers")
    ap.add_argument("--levers", help="search only these levers (comma-separated), every case")
    ap.add_argument("--tune-args", default="", help="more primus-tune step options, every case ('--blocks 2')")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cases = SMOKE if args.smoke else {n: CASES[n] for n in args.cases}
    for name, case in cases.items():
        case = {**case, "args": [*case.get("args", []), *args.tune_args.split()],
                **({"levers": args.levers} if args.levers else {})}
        row = run_case(name, case, args.workdir, args.budget_min)
        _merge(args.out, row, args.smoke)
        brief = {k: row.get(k) for k in ("speedup", "default_tokens_s", "tuned_tokens_s", "search_min", "plan")}
        print(f"{name}: {row.get('error', '')[-300:] or json.dumps(brief)}", flush=True)


if __name__ == "__main__":
    main()
