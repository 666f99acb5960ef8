"""MoE end to end: the tuned grouped-GEMM cache against the per-expert loop (the default)
and against always-``torch._grouped_mm``, on MoE presets shrunk to fit one H100.

Per preset (``PRESETS``: the overrides that make it fit one 80 GB GPU, bf16 autocast,
AdamW: fewer layers, a smaller vocabulary, DeepSeek-V3 with the 32 experts one rank holds
under 8-way expert parallelism):

1. tuning (unless ``--cache`` is given): a recording router in the grouped-GEMM dispatch lists
   the problems (pass, shapes, token bucket) of ``--record-steps`` steps of the trainer,
   and the grouped-GEMM tuner (``tuner/grouped``: backends + Triton configs, timed with
   the launches a step pays) writes them to a cache;
2. losses: three fresh trainers, same seed and data, ``--loss-steps`` steps each: the loop
   default (``model.moe.grouped_gemm_backend=loop``), always-``_grouped_mm``
   (``=grouped_mm``) and the tuned cache (``tuning.cache=PATH``, routed through
   ``primus_perf.enable`` as ``primus-train`` does); the largest relative loss difference to
   the loop's;
3. speed: one trainer, sides switched per block of ``--block-steps`` steps (one settling
   step after each switch) in a rotating order, ``--blocks`` blocks a side: the loop, always
   ``_grouped_mm`` (the grouped dispatch's backend switched), and the tuned cache's grouped
   router installed in the dispatch (over the loop); median tokens/s per side and the ratios.

    python benchmarks/moe/moe_e2e.py --out benchmarks/results/moe_e2e/h100.json

``--smoke`` runs ``tiny-moe`` for a few steps on the CPU (the Triton configs under
``TRITON_INTERPRET=1``): it checks the script, not the hardware.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import torch

from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json
from primus_perf.kernels.grouped import problem_of
from primus_perf.kinds import GROUPED
from primus_perf.runtime import dispatch
from primus_perf.runtime.activate import activate
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer
from primus_perf.tuner import core
from primus_perf.tuner.grouped.plugin import GroupedGemmTuner

PRESETS: dict[str, list[str]] = {
    # 32 local experts as on one rank of 8-way EP; 1 dense + 1 MoE layer; 16k routed rows
    "deepseek-v3": ["model.n_layers=2", "model.moe.first_k_dense=1", "model.moe.n_experts=32",
                    "model.vocab_size=32000", "train.seq_len=2048", "train.micro_batch=1"],
    # all 128 experts, 2 layers; 32k routed rows
    "qwen3-30b-a3b": ["model.n_layers=2", "model.vocab_size=32000", "train.seq_len=4096", "train.micro_batch=1"],
    # one layer of 8 experts of width 14336; 8k routed rows
    "mixtral-8x7b": ["model.n_layers=1", "train.seq_len=4096", "train.micro_batch=1"],
}
SMOKE = {"tiny-moe": ["model.n_layers=2", "train.seq_len=32", "train.micro_batch=2"]}
SIDES = ("loop", "grouped_mm", "tuned")


def rotated_blocks(sides: tuple[str, ...], rounds: int) -> list[str]:
    """The side of each block: ``rounds`` rounds over every side, the order rotating by one
    each round (so no side always runs right after the same other one)."""
    return [sides[(r + i) % len(sides)] for r in range(rounds) for i in range(len(sides))]


def record_calls(trainer: Trainer, steps: int) -> tuple[list, Counter]:
    """The grouped problems ``steps`` steps of ``trainer`` ran (a recording router), and each
    problem's calls per step."""
    seen: dict[str, object] = {}
    calls: Counter = Counter()

    class Record:
        def route(self, phase, a, b, offsets, baseline):
            p = problem_of(phase, a, b, offsets.counts())
            seen.setdefault(p.key(), p)
            calls[p.key()] += 1
            return p.key(), None

    grouped = dispatch.of(GROUPED.name)
    previous, record = grouped.router, Record()
    grouped.install(record)
    grouped.keep_overrides(record, trainer.device.type)
    try:
        for _ in range(steps):
            trainer.train_step()
    finally:
        grouped.release(record)
        grouped.install(previous)
    return list(seen.values()), Counter({k: v / steps for k, v in calls.items()})


def record_problems(trainer: Trainer, steps: int) -> list:
    """The grouped problems ``steps`` steps of ``trainer`` ran."""
    return record_calls(trainer, steps)[0]


def tune_cache(preset: str, overrides: list[str], cache: Path, args: argparse.Namespace) -> list[dict]:
    trainer = Trainer(load_config(preset, overrides))
    try:
        problems = record_problems(trainer, args.record_steps)
    finally:
        trainer.close()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tuner = GroupedGemmTuner(device=device, max_configs=args.max_configs)
    run = core.tune(problems, cache=cache, tuners=[tuner], budget_s=args.budget_s)
    return [{"problem": r.problem.key(), "chosen": r.chosen, "speedup_vs_loop": r.speedup,
             "tuned_ms": (r.tuned_s or 0) * 1e3, "default_ms": (r.default_s or 0) * 1e3} for r in run.results]


def side_overrides(side: str, cache: Path) -> list[str]:
    if side == "tuned":
        return [f"tuning.cache={cache}"]
    return [f"model.moe.grouped_gemm_backend={side}"]


def losses(preset: str, overrides: list[str], cache: Path, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for side in SIDES:
        trainer = Trainer(load_config(preset, [*overrides, f"train.steps={steps}", *side_overrides(side, cache)]))
        try:
            out[side] = [trainer.train_step().loss for _ in range(steps)]
        finally:
            trainer.close()
    return out


def set_side(side: str, router: object, holder: object) -> None:
    """The grouped dispatch's backend (the tuned side: the loop, under the cache's router)."""
    grouped = dispatch.of(GROUPED.name)
    grouped.set_backend("grouped_mm" if side == "grouped_mm" else "loop", owner=holder)
    grouped.install(router if side == "tuned" else None)


def speed(preset: str, overrides: list[str], cache: Path, args: argparse.Namespace) -> dict:
    trainer = Trainer(load_config(preset, overrides))
    act = activate(cache, always=["grouped_gemm"])
    router = act.routers.get("grouped_gemm")
    tps: dict[str, list[float]] = {s: [] for s in SIDES}
    grouped = dispatch.of(GROUPED.name)
    holder = object()  # the override held on every side (the trainer holds none for grouped_mm)
    grouped.keep_overrides(holder, trainer.device.type)
    grouped.reset()
    try:
        for side in SIDES:  # warm-up: compile, allocate, plan on every side
            set_side(side, router, holder)
            trainer.train_step()
        for side in rotated_blocks(SIDES, args.blocks):
            set_side(side, router, holder)
            trainer.train_step()
            tps[side] += [trainer.train_step().tokens_per_s for _ in range(args.block_steps)]
        summary = grouped.summary()
    finally:
        grouped.release(holder)
        grouped.install(None)
        act.close()
        trainer.close()
    med = {s: statistics.median(v) for s, v in tps.items()}
    return {
        "tokens_per_s": med, "samples": tps,
        "tuned_vs_loop": med["tuned"] / med["loop"], "tuned_vs_grouped_mm": med["tuned"] / med["grouped_mm"],
        "grouped_mm_vs_loop": med["grouped_mm"] / med["loop"],
        "routed_calls": sum(summary.get("routed", {}).values()),
        "fallback_calls": sum(summary.get("fallback", {}).values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--presets", nargs="*", default=None, help="presets (default: all)")
    ap.add_argument("--cache", type=Path, default=None, help="a tuned cache (default: tune one per preset)")
    ap.add_argument("--record-steps", type=int, default=3)
    ap.add_argument("--loss-steps", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-steps", type=int, default=5)
    ap.add_argument("--max-configs", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=3.0)
    ap.add_argument("--smoke", action="store_true", help="tiny-moe on any device, few steps")
    args = ap.parse_args()
    if args.smoke:
        presets = SMOKE
        args.loss_steps, args.blocks, args.block_steps, args.record_steps = 3, 1, 1, 1
        args.max_configs, args.budget_s = 1, 0.05
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the presets need a GPU; use --smoke on the CPU")
        presets = {p: PRESETS[p] for p in (args.presets or PRESETS)}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset, overrides in presets.items():
            cache = args.cache or Path(tmp) / f"{preset}.json"
            tuned = tune_cache(preset, overrides, cache, args) if args.cache is None else None
            loss = losses(preset, overrides, cache, args.loss_steps)
            worst = max(abs(a - b) / abs(b) for side in ("grouped_mm", "tuned")
                        for a, b in zip(loss[side], loss["loop"]))
            results[preset] = {"overrides": overrides, "tuned": tuned, "losses": loss,
                               "max_rel_loss_diff_vs_loop": worst, **speed(preset, overrides, cache, args)}
            r = results[preset]
            print(f"{preset}: tokens/s loop {r['tokens_per_s']['loop']:.0f}, grouped_mm "
                  f"{r['tokens_per_s']['grouped_mm']:.0f}, tuned {r['tokens_per_s']['tuned']:.0f}"
                  f" (tuned/loop {r['tuned_vs_loop']:.3f}x, tuned/grouped_mm {r['tuned_vs_grouped_mm']:.3f}x);"
                  f" max loss diff {worst:.2e}", flush=True)
    write_json(args.out, {
        "benchmark": "moe_e2e", "device": current_device().to_dict(), "versions": library_versions(),
        "smoke": args.smoke, "blocks": args.blocks, "block_steps": args.block_steps, "results": results,
    }, default=float)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
