"""The FP8 plan in the loop, per config: tune the plan (layer groups timed in the step,
``train.compile=true``), check its loss against bf16 from the same seed at step
``--loss-steps`` (the plan tuner's own A/B, run that long), then the tokens/s of one trainer
switched in place between three sides in interleaved blocks (``--blocks`` blocks of
``--block-steps`` steps a side, one settling step after each switch):

- ``bf16_eager``: no FP8, the non-GEMM parts eager (``train.compile=false``);
- ``bf16_compile``: no FP8, the non-GEMM parts compiled;
- ``fp8_compile``: the plan's FP8 layers (their quantization compiled) and the non-GEMM
  parts compiled.

The bars: ``fp8_compile`` >= 1.15x the tokens/s of ``bf16_eager``; the plan's loss within
1.5% relative of bf16's at step 200; the layers where FP8 loses kept bf16 (``plan``, per
layer, and ``groups``, every candidate's measured saving). JSON to ``--out``::

    python benchmarks/fp8/fp8_loop.py --out benchmarks/results/fp8_loop/h100.json

``--smoke``: the tiny preset on the CPU, a few steps, compile off (a test runs it).

``--moe``: also qwen3-30b-a3b (2 layers, seq 4096, micro-batch 1): the MoE expert GEMMs on
``grouped_mm`` (bf16) and on the FP8 grouped backend ``fp8_rowwise``
(``kernels.grouped.fp8``), switched in place per block in one trainer, the dense
layers bf16; step times and the losses of both sides over the same steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json
from primus_perf.kernels.fp8.plan import library_versions as fp8_versions
from primus_perf.trainer.config import load_config
from primus_perf.trainer.fp8 import group_of
from primus_perf.trainer.loop import Trainer
from primus_perf.tuner.fp8 import trainer_problem, trainer_sessions, tune_plan

SHAPE = ["model.n_layers=4", "train.seq_len=4096", "train.micro_batch=2"]
# qwen3-30b-a3b: the held-out config with small linear layers (attention of a 2048-wide
# model; its experts are grouped GEMMs, not linear layers), where FP8 may not pay
CONFIGS = {"llama3-8b": ("llama3-8b", SHAPE), "qwen2.5-7b": ("qwen2.5-7b", SHAPE),
           "qwen3-30b-a3b": ("qwen3-30b-a3b", ["model.n_layers=2", "train.seq_len=4096", "train.micro_batch=1",
                                               "model.moe.grouped_gemm_backend=grouped_mm"])}
SMOKE = {"tiny": ("tiny", ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
                           "train.seq_len=32", "train.micro_batch=2"]),
         "tiny-moe": ("tiny-moe", ["train.seq_len=32", "train.micro_batch=1"])}
SIDES = ("bf16_eager", "fp8_compile", "bf16_compile")


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(xs) * 1e3, "min_ms": min(xs) * 1e3, "max_ms": max(xs) * 1e3, "n": len(xs)}


def throughput(preset: str, overrides: list[str], plan: dict[str, str], *, compile: bool, blocks: int,
               block_steps: int, log: Any) -> dict[str, Any]:
    """Tokens/s of the three sides, one trainer switched in place, interleaved blocks."""
    trainer = Trainer(load_config(preset, [*overrides, "train.compile=false", "train.fp8=off"]))
    times: dict[str, list[float]] = {s: [] for s in SIDES}

    def use(side: str) -> None:
        compiled = side.endswith("compile")
        if compile:  # the model's pointwise scope, its compiled callables kept between switches
            trainer.model.set_compile("pointwise" if compiled else "off")
        trainer.set_fp8(plan if side.startswith("fp8") else {}, compile=compiled and compile)

    try:
        for side in SIDES:  # warm-up: compile, allocate
            use(side)
            for _ in range(2):
                trainer.train_step()
        for b in range(blocks):
            for side in SIDES:
                use(side)
                trainer.train_step()
                times[side] += [trainer.train_step().step_time_s for _ in range(block_steps)]
            log(f"  block {b + 1}/{blocks}: " + ", ".join(
                f"{s} {statistics.median(times[s][-block_steps:]) * 1e3:.1f} ms" for s in SIDES))
        tokens = trainer.tokens_per_step
    finally:
        trainer.close()
    out = {s: {**_stats(t), "tokens_per_s": tokens / statistics.median(t)} for s, t in times.items()}
    return out


def run_config(name: str, preset: str, overrides: list[str], args: argparse.Namespace, log: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    cache = args.out.parent / f"{args.out.stem}_{name}_cache.json"
    cache.unlink(missing_ok=True)
    comp = [f"train.compile={'true' if args.compile else 'false'}"]
    log(f"{name}: tuning the FP8 plan")
    res = tune_plan(trainer_sessions(preset, [*overrides, *comp]), trainer_problem, group_of,
                    cache=cache, blocks=args.tune_blocks, block_steps=args.block_steps, settle=1,
                    plan_blocks=args.tune_blocks, check_steps=args.loss_steps, log=lambda m: log(f"  {m}"))
    for line in res.lines():
        log(f"  {line}")
    if res.refused:
        log(f"  {res.refused}")
    tuned_s = time.perf_counter() - t0
    log(f"{name}: tokens/s, interleaved")
    tps = throughput(preset, overrides, res.plan.layers, compile=args.compile, blocks=args.blocks,
                     block_steps=args.block_steps, log=log)
    loss: dict[str, Any] = {"steps": args.loss_steps}
    if res.losses:
        a, b = res.losses["bf16"][-1], res.losses["fp8"][-1]
        loss.update(bf16_at_step=a, fp8_at_step=b, rel_diff_at_step=abs(b - a) / abs(a),
                    within_1_5pct=abs(b - a) <= 0.015 * abs(a), check=res.loss.to_dict() if res.loss else None,
                    bf16=res.losses["bf16"], fp8=res.losses["fp8"])
    base = tps["bf16_eager"]["tokens_per_s"]
    row = {
        "name": name, "preset": preset, "overrides": overrides,
        "plan": res.plan.layers, "groups": res.plan.groups,
        "plan_step_speedup": res.timing.speedup if res.timing else None,
        "plan_step_times": res.timing.times() if res.timing else None,
        "refused": res.refused, "written": str(res.written) if res.written else None,
        "tokens_per_s": tps,
        "speedup": {"fp8_compile_vs_bf16_eager": tps["fp8_compile"]["tokens_per_s"] / base,
                    "bf16_compile_vs_bf16_eager": tps["bf16_compile"]["tokens_per_s"] / base,
                    "fp8_compile_vs_bf16_compile": tps["fp8_compile"]["tokens_per_s"]
                    / tps["bf16_compile"]["tokens_per_s"]},
        "loss": loss, "tune_s": tuned_s, "elapsed_s": time.perf_counter() - t0,
    }
    s = row["speedup"]
    log(f"{name}: fp8+compile {s['fp8_compile_vs_bf16_eager']:.3f}x of bf16 eager "
        f"(compile alone {s['bf16_compile_vs_bf16_eager']:.3f}x); loss at step {args.loss_steps}: "
        + (f"bf16 {loss['bf16_at_step']:.4f}, FP8 {loss['fp8_at_step']:.4f} ({loss['rel_diff_at_step']:.2%})"
           if res.losses else "no FP8 layer") + f"; {row['elapsed_s']:.0f} s")
    return row


MOE = ("qwen3-30b-a3b", ["model.n_layers=2", "train.seq_len=4096", "train.micro_batch=1",
                          "model.moe.grouped_gemm_backend=grouped_mm"])


def moe_grouped(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Step times with the MoE expert GEMMs on grouped_mm and on fp8_rowwise, interleaved."""
    from primus_perf.kernels.grouped.backends import BACKENDS
    from primus_perf.kernels.grouped.fp8 import FP8_BACKENDS

    BACKENDS.update(FP8_BACKENDS)  # this benchmark only: the trainer resolves backends by name
    preset, overrides = MOE
    trainer = Trainer(load_config(preset, [*overrides, "train.compile=false"]))
    moes = [m for m in trainer.model.modules() if hasattr(m, "backend") and hasattr(m, "backend_checked")]
    times: dict[str, list[float]] = {"grouped_mm": [], "fp8_rowwise": []}
    losses: dict[str, list[float]] = {"grouped_mm": [], "fp8_rowwise": []}
    why = None
    try:
        for side in ("grouped_mm", "fp8_rowwise"):
            for m in moes:
                m.backend, m.backend_checked = side, False
            try:
                trainer.train_step()
            except Exception as exc:  # the reason FP8 grouped GEMMs do not run is the result
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                log(f"moe: {side} failed: {why}")
                return {"preset": preset, "overrides": overrides, "error": why}
        for b in range(args.blocks):
            for side in times:
                for m in moes:
                    m.backend = side
                trainer.train_step()
                for _ in range(args.block_steps):
                    r = trainer.train_step()
                    times[side].append(r.step_time_s)
                    losses[side].append(r.loss)
            log(f"  moe block {b + 1}/{args.blocks}: " + ", ".join(
                f"{s} {statistics.median(t[-args.block_steps:]) * 1e3:.1f} ms" for s, t in times.items()))
        kernels = {}
        for side in times:  # where each side's GPU time goes: the measured reason for the ratio
            for m in moes:
                m.backend = side
            trainer.train_step()
            kernels[side] = kernel_breakdown(trainer, steps=2)
            log(f"  moe {side} kernels per step: " + ", ".join(
                f"{c} {ms:.1f} ms" for c, ms in kernels[side]["by_category_ms"].items()))
    finally:
        trainer.close()
    g, f = statistics.median(times["grouped_mm"]), statistics.median(times["fp8_rowwise"])
    log(f"moe: fp8_rowwise {g / f:.3f}x of grouped_mm ({f * 1e3:.1f} vs {g * 1e3:.1f} ms/step)")
    delta = {c: kernels["fp8_rowwise"]["by_category_ms"].get(c, 0.0) - kernels["grouped_mm"]["by_category_ms"].get(c, 0.0)
             for c in CATEGORIES}
    log("moe: fp8_rowwise minus grouped_mm, GPU ms per step: " + ", ".join(f"{c} {d:+.1f}" for c, d in delta.items()))
    return {"preset": preset, "overrides": overrides, "step_ms": {k: _stats(v) for k, v in times.items()},
            "speedup_fp8_vs_grouped_mm": g / f, "losses": losses, "kernels": kernels,
            "fp8_minus_bf16_ms_per_step": delta,
            "note": "dense layers bf16; blocks alternate, so each side's losses are of different steps"}


# kernel name -> category, first match wins (the FP8 grouped path's cost centres)
CATEGORIES = {
    "GEMM": r"gemm|cutlass|xmma|nvjet|cublas",
    "fp8 quantize": r"fp8|float8|quant|amax|scale|e4m3|to_mx|clamp|reciprocal",
    "copy/index/pad": r"index|scatter|gather|copy|cat|pad|fill|zero",
    "other": r".",
}


def kernel_breakdown(trainer: Any, *, steps: int) -> dict[str, Any]:
    """GPU kernel time per step of ``steps`` profiled steps: by category (``CATEGORIES``)
    and the 12 largest kernels."""
    import re

    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step()
    per_kernel: dict[str, float] = {}
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", 0.0) / 1e3 / steps
        if ms > 0:
            per_kernel[e.key] = per_kernel.get(e.key, 0.0) + ms
    by_cat = {c: 0.0 for c in CATEGORIES}
    for name, ms in per_kernel.items():
        cat = next(c for c, rx in CATEGORIES.items() if re.search(rx, name, re.IGNORECASE))
        by_cat[cat] += ms
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {"steps": steps, "by_category_ms": by_cat, "total_ms": sum(per_kernel.values()),
            "top_kernels_ms": [{"name": n[:160], "ms": ms} for n, ms in top]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--blocks", type=int, default=3, help="throughput blocks a side")
    ap.add_argument("--tune-blocks", type=int, default=2, help="block pairs per candidate while tuning")
    ap.add_argument("--block-steps", type=int, default=4)
    ap.add_argument("--loss-steps", type=int, default=200)
    ap.add_argument("--moe", action="store_true", help="also the MoE FP8 grouped GEMMs (qwen3-30b-a3b)")
    ap.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, a few steps, compile off")
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    configs = CONFIGS
    args.compile = True
    if args.smoke:
        configs, args.configs, args.compile = SMOKE, list(SMOKE), False
        args.blocks, args.tune_blocks, args.block_steps, args.loss_steps = 1, 1, 1, 3
    unknown = [c for c in args.configs if c not in configs]
    if unknown:
        ap.error(f"unknown config(s) {unknown}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "fp8_loop", "device": current_device().to_dict(),
        "versions": {**library_versions(), **fp8_versions()},
        "settings": {"blocks": args.blocks, "tune_blocks": args.tune_blocks, "block_steps": args.block_steps,
                     "loss_steps": args.loss_steps, "compile": args.compile,
                     "interleaving": "in one process: one trainer switched in place per block"},
        "configs": [],
    }
    for name in args.configs:
        preset, overrides = configs[name]
        doc["configs"].append(run_config(name, preset, list(overrides), args, log))
        write_json(args.out, doc)  # what is done so far survives a later failure
    if args.moe and not args.smoke:
        doc["moe"] = moe_grouped(args, log)
        write_json(args.out, doc)
    log(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
