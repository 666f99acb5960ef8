"""TP=2 against TP=1 on GPUs: the same seed gives the same losses within bf16 tolerance.

    python benchmarks/trainer/trainer_tp.py --config llama3-8b --layers 2 --seq 2048 --steps 10 \
        --out benchmarks/results/trainer_tp/2xh200.json

Runs ``primus-train`` once in one process (TP=1) and once under torchrun with two
processes (TP=2, NCCL), each writing a JSON-lines log, and records both loss curves and
their largest relative difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def run(args: list[str], nproc: int, log: Path) -> dict:
    base = [sys.executable]
    if nproc > 1:
        base += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [*base, "-m", "primus_perf.cli.train", *args, "--json-log", str(log)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    out = {"cmd": " ".join(cmd[1:]), "returncode": proc.returncode}
    if proc.returncode != 0:
        out["stderr_tail"] = proc.stderr[-3000:]
        return out
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    out["losses"] = [r["loss"] for r in rows]
    out["step_time_s"] = [r["step_time_s"] for r in rows]
    out["tokens_per_s"] = [r["tokens_per_s"] for r in rows]
    out["mfu"] = [r["mfu"] for r in rows]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("error: needs two GPUs", file=sys.stderr)
        return 2
    common = [
        "--config", a.config, "--layers", str(a.layers), "--steps", str(a.steps),
        f"train.seq_len={a.seq}", "train.micro_batch=1",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        tp1 = run(common, 1, Path(tmp) / "tp1.jsonl")
        tp2 = run([*common, "parallel.tp=2"], 2, Path(tmp) / "tp2.jsonl")
    result = {
        "benchmark": "trainer_tp2_vs_tp1",
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
        "config": {"name": a.config, "layers": a.layers, "seq_len": a.seq, "steps": a.steps, "dtype": "bf16 autocast"},
        "tp1": tp1,
        "tp2": tp2,
    }
    if "losses" in tp1 and "losses" in tp2:
        rel = [abs(x - y) / abs(x) for x, y in zip(tp1["losses"], tp2["losses"])]
        result["max_rel_loss_diff"] = max(rel)
        result["rel_loss_diff_per_step"] = rel
        print("step  tp1 loss   tp2 loss   rel diff")
        for i, (x, y, r) in enumerate(zip(tp1["losses"], tp2["losses"], rel), 1):
            print(f"{i:>4}  {x:9.5f}  {y:9.5f}  {r:.2e}")
    else:
        print(json.dumps({k: v for k, v in result.items() if k in ("tp1", "tp2")}, indent=1)[-4000:])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    return 0 if "max_rel_loss_diff" in result else 1


if __name__ == "__main__":
    sys.exit(main())
