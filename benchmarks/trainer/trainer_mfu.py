"""Trainer throughput and MFU on one GPU, with a GPU-time split that says where the rest goes.

    python benchmarks/trainer/trainer_mfu.py --config llama3-8b --layers 4 --seq 4096 \
        --micro-batch 1 2 --steps 12 --out benchmarks/results/trainer_mfu/h100.json

For each micro-batch size: ``--steps`` training steps, the first ``--warmup`` dropped;
the median step time (with min/max) gives tokens/s and MFU against the datasheet dense
bf16 peak of the device table. Then a few more steps run under the profiler and their
kernel time is split by the trace analysis's categories (GEMM, attention, elementwise,
optimizer, ...), so the note can say what holds MFU below the GEMM rate.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from primus_perf.base.devices import current_device, lookup_peaks
from primus_perf.profiler.capture import Schedule, profile_steps
from primus_perf.tracelens.analyze import analyze
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer


def kernel_split(trainer: Trainer, steps: int) -> dict[str, float]:
    """GPU kernel seconds per step by category of the trace analysis, over ``steps`` steps
    recorded (after one profiler warm-up step) through the one capture function."""
    with tempfile.TemporaryDirectory(prefix="primus-mfu-") as tmp:
        res = profile_steps(trainer.train_step, tmp, Schedule(active=steps, warmup=1, wait=0, baseline=0, after=0))
        by_category = analyze([res.trace]).category_seconds()
    return {str(k): float(v) for k, v in by_category.items()}


def measure(config: str, overrides: list[str], steps: int, warmup: int, split_steps: int) -> dict:
    cfg = load_config(config, overrides)
    trainer = Trainer(cfg)
    try:
        metrics = [trainer.train_step() for _ in range(steps)]
        timed = metrics[warmup:]
        times = [m.step_time_s for m in timed]
        median = statistics.median(times)
        tokens = trainer.tokens_per_step
        peak = trainer.peak_tflops
        achieved_tflops = trainer.flops_per_token * tokens / median / 1e12
        split = kernel_split(trainer, split_steps) if split_steps else {}
        return {
            "overrides": overrides,
            "tokens_per_step": tokens,
            "flops_per_token": trainer.flops_per_token,
            "step_time_s": {"median": median, "min": min(times), "max": max(times), "n": len(times)},
            "tokens_per_s": tokens / median,
            "model_tflops": achieved_tflops,
            "mfu": None if not peak else achieved_tflops / peak,
            "peak_tflops_bf16": peak,
            "peak_mem_gib": max(m.peak_mem_bytes for m in metrics) / 2**30,
            "losses": [m.loss for m in metrics],
            "gpu_seconds_per_step_by_category": split,
        }
    finally:
        trainer.close()
        del trainer
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--split-steps", type=int, default=3)
    ap.add_argument("--extra", nargs="*", default=[], help="more key=value overrides")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: no GPU: this benchmark measures MFU on a GPU", file=sys.stderr)
        return 2

    device = current_device()
    peaks = lookup_peaks(device.name)
    results = {
        "benchmark": "trainer_mfu",
        "device": device.to_dict(),
        "peak_row": None if peaks is None else peaks.key,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "python": platform.python_version(),
        },
        "config": {"name": args.config, "layers": args.layers, "seq_len": args.seq},
        "runs": [],
    }
    for mb in args.micro_batch:
        overrides = [
            f"model.n_layers={args.layers}",
            f"train.seq_len={args.seq}",
            f"train.micro_batch={mb}",
            f"train.steps={args.steps}",
            *args.extra,
        ]
        try:
            run = measure(args.config, overrides, args.steps, args.warmup, args.split_steps)
        except torch.OutOfMemoryError as exc:
            run = {"overrides": overrides, "error": f"out of memory: {str(exc).splitlines()[0]}"}
            torch.cuda.empty_cache()
        results["runs"].append(run)
        if "mfu" in run:
            print(
                f"micro_batch {mb}: {run['tokens_per_s']:,.0f} tok/s, MFU {100 * run['mfu']:.1f}%"
                f" ({run['model_tflops']:.0f} TFLOP/s), step {1e3 * run['step_time_s']['median']:.1f} ms"
                f" [{1e3 * run['step_time_s']['min']:.1f}, {1e3 * run['step_time_s']['max']:.1f}],"
                f" peak mem {run['peak_mem_gib']:.1f} GiB"
            )
            for kind, sec in run["gpu_seconds_per_step_by_category"].items():
                print(f"    {kind:<48} {1e3 * sec:8.1f} ms/step")
        else:
            print(f"micro_batch {mb}: {run['error']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
