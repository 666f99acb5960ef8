"""FSDP2 on two GPUs: llama3-8b at full depth, tokens/s and MFU with and without
``train.compile``; FSDP2 and DDP losses of the same seed for 10 steps on a model both fit.

    python benchmarks/trainer/fsdp2_llama3_8b.py --out benchmarks/results/fsdp2_llama3_8b/2xh200.json
    python benchmarks/trainer/fsdp2_llama3_8b.py --smoke --out /tmp/fsdp2_smoke.json   # CPU, gloo, tiny

Every run is ``primus-train`` under torchrun (``benchmarks/trainer/trainer_tp.py``'s runner);
throughput figures are medians over the steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

import torch

from benchmarks.trainer.trainer_tp import run


def summary(res: dict, warmup: int) -> dict:
    if "losses" not in res:
        return res
    steady = slice(warmup, None)
    mfu = [m for m in res["mfu"][steady] if m is not None]
    return {**res, "median_tokens_per_s": statistics.median(res["tokens_per_s"][steady]),
            "median_mfu": statistics.median(mfu) if mfu else None,
            "median_step_time_s": statistics.median(res["step_time_s"][steady])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (gloo): tests the script")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the throughput medians")
    ap.add_argument("--recompute", action="store_true", help="activation recompute in the full-depth runs")
    ap.add_argument("--match-layers", type=int, default=4, help="depth of the FSDP2-vs-DDP loss comparison")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.smoke:
        config, full, match, steps, warmup = "tiny", ["train.device=cpu"], ["train.device=cpu"], 4, 1
        device = "cpu"
    else:
        if torch.cuda.device_count() < a.gpus:
            print(f"error: needs {a.gpus} GPUs (or --smoke)", file=sys.stderr)
            return 2
        config, steps, warmup, device = "llama3-8b", a.steps, a.warmup, torch.cuda.get_device_name(0)
        full = [f"train.seq_len={a.seq}", f"train.micro_batch={a.micro_batch}",
                f"train.recompute={str(a.recompute).lower()}"]
        match = [f"train.seq_len={min(a.seq, 2048)}", "train.micro_batch=1", f"model.n_layers={a.match_layers}"]
    nproc = 2 if a.smoke else a.gpus
    fsdp = [f"parallel.dp_shard={nproc}"]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        runs = {
            "fsdp2_eager": summary(run(["--config", config, "--steps", str(steps), *full, *fsdp], nproc,
                                       t / "eager.jsonl"), warmup),
            "fsdp2_compile": summary(run(["--config", config, "--steps", str(steps), *full, *fsdp,
                                          "train.compile=true"], nproc, t / "compile.jsonl"), warmup),
        }
        match_steps = ["--config", config, "--steps", "10", *match]
        ddp = run(match_steps, nproc, t / "ddp.jsonl")
        fsdp2 = run([*match_steps, *fsdp], nproc, t / "fsdp2.jsonl")
    result: dict = {
        "benchmark": "fsdp2_llama3_8b", "smoke": a.smoke, "device": device, "gpus": nproc,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip},
        "config": {"name": config, "full": full, "match": match, "steps": steps, "warmup": warmup},
        **runs, "match_ddp": ddp, "match_fsdp2": fsdp2,
    }
    ok = all("losses" in r for r in (*runs.values(), ddp, fsdp2))
    if ok:
        rel = [abs(x - y) / abs(x) for x, y in zip(ddp["losses"], fsdp2["losses"])]
        result["match_max_rel_loss_diff"] = max(rel)
        for name, r in runs.items():
            mfu = f"{r['median_mfu']:.1%}" if r["median_mfu"] is not None else "n/a"
            print(f"{name:14s} {r['median_tokens_per_s']:>10,.0f} tok/s  MFU {mfu}")
        print(f"FSDP2 vs DDP, 10 steps: largest relative loss difference {max(rel):.2e}")
    else:
        print(json.dumps(result, indent=1)[-4000:], file=sys.stderr)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
