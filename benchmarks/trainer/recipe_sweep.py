"""The trainer's speed knobs at a fixed recipe (one global batch): tokens/s per optimizer step,
MFU, peak memory, the optimizer's share of the step and the memory estimate, per config.

    python benchmarks/trainer/recipe_sweep.py --preset llama3-8b --out benchmarks/results/recipe_sweep/h100.json
    python benchmarks/trainer/recipe_sweep.py --preset qwen3-30b-a3b --configs default mb2 mb4 ...
    python benchmarks/trainer/recipe_sweep.py --equality --out ...      # one global batch split 4 ways
    python benchmarks/trainer/recipe_sweep.py --smoke --out /tmp/s.json  # the CPU: checks the script

Each config is a set of overrides over the preset's shape (``SHAPES``: llama3-8b 4 layers,
qwen3-30b-a3b 2 layers, seq 4096, the preset's global batch): one trainer, ``--warmup``
untimed optimizer steps, then ``--steps`` timed ones (medians, with the quartiles). A config
the memory estimate refuses, or that runs out of memory, is recorded as such and the sweep
goes on.
Rows are merged into ``--out`` by (preset, config) after each one, so what finished survives
a time limit (``--budget-s`` stops starting configs). ``--equality``: llama3-8b with 2 layers,
seq 1024, a global batch of 8 as 1x8, 2x4, 4x2 and 8x1 over 20 steps, the losses against 8x1.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.errors import ConfigError, OutOfMemory
from primus_perf.base.files import write_json
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer
from primus_perf.trainer.resources import estimate_memory

SHAPES = {
    "llama3-8b": ["model.n_layers=4", "train.seq_len=4096", "train.global_batch=16"],
    "qwen3-30b-a3b": ["model.n_layers=2", "model.vocab_size=32000", "train.seq_len=4096", "train.global_batch=32"],
    "tiny": ["train.global_batch=8", "train.micro_batch=8"],
}
CONFIGS = {
    "default": [],
    "mb2": ["train.micro_batch=2"],
    "mb4": ["train.micro_batch=4"],
    "mb4-selective": ["train.micro_batch=4", "train.recompute=selective"],
    "mb4-full": ["train.micro_batch=4", "train.recompute=full"],
    "mb1-selective": ["train.recompute=selective"],
    "mb1-full": ["train.recompute=full"],
    "pointwise": ["train.compile=pointwise"],
    "block": ["train.compile=block"],
    "mb4-block": ["train.micro_batch=4", "train.compile=block"],
    "foreach": ["train.optimizer=foreach"],
    "bf16-moments": ["train.optimizer=bf16"],
    "mb8": ["train.micro_batch=8"],
    "mb8-selective": ["train.micro_batch=8", "train.recompute=selective"],
    "mb8-full": ["train.micro_batch=8", "train.recompute=full"],
    "mb8-block": ["train.micro_batch=8", "train.compile=block"],
    "mb4-full-block": ["train.micro_batch=4", "train.recompute=full", "train.compile=block"],
}


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def run_config(preset: str, name: str, overrides: list[str], warmup: int, steps: int) -> dict:
    cfg = load_config(preset, [*SHAPES[preset], *overrides])
    row = {"preset": preset, "config": name, "overrides": overrides, "micro_batch": cfg.train.micro_batch,
           "global_batch": cfg.train.global_batch, "recompute": cfg.train.recompute, "compile": cfg.train.compile,
           "optimizer": cfg.train.optimizer}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    row["estimate_gib"] = estimate_memory(cfg, device).total / 2**30
    trainer = None
    try:
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup):
            trainer.train_step()
        ms = [trainer.train_step() for _ in range(steps)]
        row["setup_and_warmup_s"] = time.perf_counter() - t0
    except OutOfMemory as exc:
        row["out_of_memory"] = str(exc)
        return row
    except ConfigError as exc:  # the memory estimate says it cannot fit: not built
        row["does_not_fit"] = str(exc)
        return row
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
        gc.collect()
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    q1, med, q3 = _quartiles([m.tokens_per_s for m in ms])
    row.update(tokens_per_s=med, tokens_per_s_q1=q1, tokens_per_s_q3=q3,
               step_s=statistics.median(m.step_time_s for m in ms),
               mfu=statistics.median(m.mfu for m in ms) if ms[0].mfu is not None else None,
               peak_gib=max(m.peak_mem_bytes for m in ms) / 2**30,
               optimizer_share=statistics.median(m.optimizer_s / m.step_time_s for m in ms),
               micro_batches=ms[0].micro_batches, losses=[m.loss for m in ms])
    row["estimate_vs_peak"] = row["estimate_gib"] / row["peak_gib"]
    return row


def equality(steps: int, smoke: bool) -> dict:
    preset, shape = ("tiny", []) if smoke else ("llama3-8b", ["model.n_layers=2", "train.seq_len=1024"])
    losses = {}
    for micro in (8, 4, 2, 1):
        cfg = load_config(preset, [*shape, "train.global_batch=8", f"train.micro_batch={micro}", f"train.steps={steps}"])
        trainer = Trainer(cfg)
        try:
            losses[f"{micro}x{8 // micro}"] = [trainer.train_step().loss for _ in range(steps)]
        finally:
            trainer.close()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    ref = losses["8x1"]
    worst = {k: max(abs(a - b) / abs(b) for a, b in zip(v, ref)) for k, v in losses.items() if k != "8x1"}
    return {"preset": preset, "shape": shape, "steps": steps, "losses": losses, "max_rel_diff_vs_8x1": worst}


def _merge(out: Path, key: str, rows: list[dict] | dict, args: argparse.Namespace) -> None:
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc.update(benchmark="recipe_sweep", device=current_device().to_dict(), versions=library_versions(),
               smoke=args.smoke)
    if key == "rows":
        done = {(r["preset"], r["config"]) for r in rows}
        doc["rows"] = [r for r in doc.get("rows", []) if (r["preset"], r["config"]) not in done] + rows
    else:
        doc[key] = rows
    write_json(out, doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=sorted(CONFIGS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=1e9, help="no config starts after this many seconds")
    ap.add_argument("--equality", action="store_true", help="the loss-equality run instead of the sweep")
    ap.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU, two configs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.configs, args.warmup, args.steps = "tiny", ["default", "mb2"], 1, 2
    elif not torch.cuda.is_available():
        ap.error("needs a GPU (or --smoke)")
    if args.equality:
        res = equality(3 if args.smoke else 20, args.smoke)
        _merge(args.out, "equality", res, args)
        print(json.dumps(res["max_rel_diff_vs_8x1"]), flush=True)
        return
    start = time.perf_counter()
    for name in args.configs:
        if time.perf_counter() - start > args.budget_s:
            print(f"{name}: not started (budget)", flush=True)
            continue
        row = run_config(args.preset, name, CONFIGS[name], args.warmup, args.steps)
        _merge(args.out, "rows", [row], args)
        brief = {k: row.get(k) for k in ("tokens_per_s", "mfu", "peak_gib", "estimate_gib", "optimizer_share")}
        failed = row.get("out_of_memory") or row.get("does_not_fit")
        print(f"{args.preset} {name}: {failed or json.dumps(brief)}", flush=True)


if __name__ == "__main__":
    main()
