"""The whole loop on one GPU: profile the trainer, extract its GEMM problems from the trace,
tune them, and profile again with the cache; then time both, interleaved, in one process.

    python benchmarks/runtime/closed_loop.py --out-dir runs/loop            # on the GPU
    python benchmarks/runtime/closed_loop.py --out-dir runs/loop --reports  # anywhere: compare + HTML

Writes the run folders ``OUT/base`` and ``OUT/tuned`` (``rank0.pt.trace.json.gz`` and a
``manifest.json`` each; the committed results predate that name: ``trace_rank0.json.gz``),
``OUT/tuning_cache.json`` and ``OUT/closed_loop.json`` (tuning results
and the interleaved step-time ratio: the router is switched off and on between blocks of
steps of the same trainer, so both sides see the same clocks, memory and data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def capture(trainer, out_dir: Path, steps: int, extra: dict) -> None:
    """A run folder of ``steps`` recorded steps (after one profiler warm-up step): the trace
    and a manifest that lists it, through the one capture function."""
    from primus_perf.profiler.capture import Schedule, base_manifest, profile_steps, write_manifest

    sched = Schedule(active=steps, warmup=1, wait=0, baseline=0, after=0)
    res = profile_steps(trainer.train_step, out_dir, sched)
    write_manifest(res.out_dir, base_manifest(sched, res.steps, extra=extra))


def run_gpu(args: argparse.Namespace) -> None:
    import torch

    from primus_perf.base.devices import library_versions
    from primus_perf.runtime.activate import activate
    from primus_perf.runtime.handle import Handle
    from primus_perf.tracelens.shapes import problems_from_traces
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer
    from primus_perf.tuner.core import Progress, tune
    from primus_perf.tuner.gemm.plugin import GemmTuner

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [f"model.n_layers={args.layers}", f"train.seq_len={args.seq}", f"train.micro_batch={args.micro_batch}"]
    cfg = load_config(args.config, overrides)
    trainer = Trainer(cfg)
    manifest = {"config": args.config, "overrides": overrides}
    for _ in range(3):
        trainer.train_step()
    capture(trainer, out / "base", args.profile_steps, {**manifest, "tuning_cache": None})
    t0 = time.perf_counter()
    gemm = problems_from_traces([out / "base"])["gemm"]
    cache = out / "tuning_cache.json"
    tuned = []

    class Log(Progress):
        def done(self, r) -> None:
            tuned.append({"problem": str(r.problem), "key": r.problem.key(), "chosen": r.chosen,
                          "tuned_ms": r.entry.times.get("tuned_ms"), "default_ms": r.entry.times.get("default_ms")})
            print(json.dumps(tuned[-1]), flush=True)

    tune([p for p, _ in gemm], cache=cache, tuners=[GemmTuner()], budget_s=args.budget_s, progress=Log())
    tuning_s = time.perf_counter() - t0
    act = activate(cache)
    handle = Handle(tuple(act.routers), act, act.routers, device_type="cuda")
    handle.resume()
    capture(trainer, out / "tuned", args.profile_steps, {**manifest, "tuning_cache": str(cache.name)})
    # interleaved blocks: router off / on, same trainer
    blocks: dict[str, list[float]] = {"default": [], "tuned": []}
    losses: dict[str, list[float]] = {"default": [], "tuned": []}
    for i in range(2 * args.pairs):
        side = "default" if i % 2 == 0 else "tuned"
        if side == "default":
            handle.suspend()
        else:
            handle.resume()
        trainer.train_step()  # one step to settle after the switch
        for _ in range(args.block_steps):
            m = trainer.train_step()
            blocks[side].append(m.step_time_s)
            losses[side].append(m.loss)
    summary = handle.summary()
    handle.suspend()
    act.close()
    trainer.close()
    med = {k: statistics.median(v) for k, v in blocks.items()}
    result = {
        "device": torch.cuda.get_device_name(), "versions": library_versions(), "config": args.config,
        "overrides": overrides, "gemm_problems": len(gemm), "tuning_s": tuning_s, "tuned": tuned,
        "step_time_s": {k: {"median": med[k], "min": min(v), "max": max(v), "n": len(v)} for k, v in blocks.items()},
        "speedup": med["default"] / med["tuned"],
        "router_summary": summary,
        "losses_last": {k: v[-1] for k, v in losses.items()},
    }
    (out / "closed_loop.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result[k] for k in ("gemm_problems", "tuning_s", "speedup")}), flush=True)


def reports(args: argparse.Namespace) -> None:
    from primus_perf.tracelens.compare import compare
    from primus_perf.tracelens.report import build_report
    from primus_perf.tracelens.report_html import write_html

    out = Path(args.out_dir)
    diff = compare(str(out / "base"), str(out / "tuned"))
    (out / "diff.json").write_text(json.dumps(diff, indent=1, default=str))
    write_html(diff, out / "diff.html")
    write_html(build_report([str(out / "tuned")], cache=out / "tuning_cache.json"), out / "report_tuned.html")
    print(diff["verdict"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="runs/loop")
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=2.0)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--block-steps", type=int, default=5)
    ap.add_argument("--reports", action="store_true", help="only build the comparison and HTML (CPU is fine)")
    args = ap.parse_args()
    if args.reports:
        reports(args)
    else:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        run_gpu(args)


if __name__ == "__main__":
    main()
