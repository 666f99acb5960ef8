"""Never slower than what the user had: the tuned cache, confirmed in the step, against every
fixed choice the user could have made, in one process, interleaved.

    python benchmarks/runtime/never_slower.py --out benchmarks/results/never_slower/h100.json moe
    python benchmarks/runtime/never_slower.py --out ... example --cache CONFIRMED.json
    python benchmarks/runtime/never_slower.py --out ... loop
    python benchmarks/runtime/never_slower.py --out /tmp/smoke.json --smoke moe   # CPU: the script

Sections (each adds or replaces its rows in ``--out``; the file is a list of rows
``{"case", "tuned_ms", "baselines": {name: ms}, ...}`` with each side's spread):

- ``moe``: primus-train on deepseek-v3, mixtral-8x7b and qwen3-30b-a3b, two override sets
  each. Per case: the grouped problems of a few steps (a recording router; calls per step
  counted), tuned offline (``tuner/grouped``), then confirmed inside the trainer's steps
  (``primus_perf.tuner.confirm``: each finalist against the caller's backend, call by
  call, CUDA events where the call runs); then one trainer switched per block between the
  fixed backends (``loop``, ``grouped_mm``, ``triton`` with its default config) and the
  confirmed cache (``tuned``: its router installed over the trainer's default backend), in
  rotating order, ``--blocks`` blocks of ``--block-steps`` steps a side after one settling
  step. The row also has the step saving the cache's in-step figures predict (per-call
  saving x calls per step, summed) and the measured one, with its spread.
- ``example``: ``examples/llama_train.py`` without enable and under ``enable()`` with a
  confirmed cache (``--cache``), ``--pairs`` blocks of ``--block`` steps each way.
- ``loop``: ``primus-tune loop``'s trainer run on llama3-8b (4 layers, seq 4096,
  micro-batch 2): tuned and confirmed cache against torch, interleaved.
- ``quickstart``: ``primus-tune loop`` as a user runs it (a command of its own, on ``tiny``,
  llama3-8b with 2 layers and qwen3-30b-a3b with 2 layers): the figure it ends with, then the
  cache it left behind against no cache in a fresh trainer, interleaved (``--blocks`` of
  ``--block-steps``); ``--cases`` picks some.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks.moe.moe_e2e import record_calls, rotated_blocks
from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json
from primus_perf.runtime import dispatch
from primus_perf.runtime.activate import activate
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer

# two override sets per model: the first as in benchmarks/moe/moe_e2e.py, the second longer
# sequences or more tokens per step (a held-out token distribution)
MOE_CASES: dict[str, tuple[str, list[str]]] = {
    "deepseek-v3/a": ("deepseek-v3", ["model.n_layers=2", "model.moe.first_k_dense=1", "model.moe.n_experts=32",
                                      "model.vocab_size=32000", "train.seq_len=2048", "train.micro_batch=1"]),
    "deepseek-v3/b": ("deepseek-v3", ["model.n_layers=2", "model.moe.first_k_dense=1", "model.moe.n_experts=48",
                                      "model.vocab_size=32000", "train.seq_len=3072", "train.micro_batch=1"]),
    "mixtral-8x7b/a": ("mixtral-8x7b", ["model.n_layers=1", "train.seq_len=4096", "train.micro_batch=1"]),
    "mixtral-8x7b/b": ("mixtral-8x7b", ["model.n_layers=1", "train.seq_len=4096", "train.micro_batch=2"]),
    "qwen3-30b-a3b/a": ("qwen3-30b-a3b", ["model.n_layers=2", "model.vocab_size=32000", "train.seq_len=4096",
                                          "train.micro_batch=1"]),
    "qwen3-30b-a3b/b": ("qwen3-30b-a3b", ["model.n_layers=3", "model.vocab_size=32000", "train.seq_len=2048",
                                          "train.micro_batch=2"]),
}
SMOKE_CASES = {"tiny-moe/a": ("tiny-moe", ["model.n_layers=2", "train.seq_len=32", "train.micro_batch=2"])}
FIXED = ("loop", "grouped_mm", "triton")
FINE_GRAINED = 64  # experts per rank from which the bar asks 1.05x


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def spread_ms(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else [xs[0]] * 3
    return {"median_ms": statistics.median(xs) * 1e3, "q1_ms": q[0] * 1e3, "q3_ms": q[2] * 1e3, "n": len(xs)}


def tune_grouped(problems: list[Any], cache: Path, args: argparse.Namespace) -> None:
    from primus_perf.tuner import core
    from primus_perf.tuner.grouped.plugin import GroupedGemmTuner

    device = "cuda" if torch.cuda.is_available() else "cpu"
    core.tune(problems, cache=cache, tuners=[GroupedGemmTuner(device=device, max_configs=args.max_configs)],
              budget_s=args.budget_s)


def confirm_in_trainer(preset: str, overrides: list[str], cache: Path, steps: int, log: Any) -> dict[str, Any]:
    """The cache's choices confirmed inside ``steps`` steps of the trainer (the cache is
    rewritten: choices that do not win where they run go back to the default)."""
    from primus_perf.tuner.cache_check import confirm_trainer

    run = confirm_trainer(preset, overrides, cache, steps=steps, log=lambda m: log(f"  {m}"))
    return {"unseen": run.unseen, "rows": [{"problem": r.problem, "entries": r.entries, **r.verdict.figure()}
                                           for r in run.rows]}


def set_side(trainer: Trainer, side: str, router: Any, default: str) -> None:
    """The grouped dispatch runs ``side``'s fixed backend, or the trainer's default under the
    cache's router (``tuned``); its override held for the trainer (released at its close)."""
    grouped = dispatch.of("grouped_gemm")
    grouped.install(None)
    grouped.set_backend(default if side == "tuned" else side, owner=trainer)
    grouped.keep_overrides(trainer, trainer.device.type)
    if side == "tuned" and router is not None:
        grouped.install(router)


def predicted_saving_ms(cache: Path, calls: Counter) -> float | None:
    """Step saving the cache's in-step figures predict: (baseline - choice) per call x
    calls per step, over the entries that route."""
    total, found = 0.0, False
    for entry in read_json(cache).get("entries", []):
        ins = entry.get("in_step")
        if not ins or entry.get("problem_key") not in calls:
            continue
        if ins.get("verdict") not in (None, "kept"):
            continue
        found = True
        total += (ins["baseline_ms"] - ins["choice_ms"]) * calls[entry["problem_key"]]
    return total if found else None


def recorded(preset: str, overrides: list[str], steps: int) -> tuple[str, list, Counter]:
    """The trainer's default grouped backend, and the grouped problems ``steps`` steps ran
    with their calls per step; the trainer is gone on return (its model and optimizer
    state would otherwise stay on the device through the tuning and the confirmation: a
    second trainer of deepseek-v3 with 48 experts then ran out of an H100's memory)."""
    trainer = Trainer(load_config(preset, overrides))
    try:
        trainer.train_step()
        default = trainer.grouped
        problems, calls = record_calls(trainer, steps)
    finally:
        trainer.close()
    return default, problems, calls


def release_device_memory() -> None:
    """Hand the cached blocks of trainers and tensors that are gone back to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def moe_case(case: str, preset: str, overrides: list[str], args: argparse.Namespace, tmp: Path, log: Any) -> dict:
    cache = tmp / f"{case.replace('/', '_')}.json"
    default, problems, calls = recorded(preset, overrides, args.record_steps)
    release_device_memory()
    log(f"{case}: {len(problems)} grouped problems; default backend {default}; tuning")
    tune_grouped(problems, cache, args)
    release_device_memory()
    confirmed = confirm_in_trainer(preset, overrides, cache, args.confirm_steps, log)
    release_device_memory()
    sides = (*FIXED, "tuned")
    trainer = Trainer(load_config(preset, overrides))
    act = activate(cache, always=["grouped_gemm"])
    router = act.routers.get("grouped_gemm")
    times: dict[str, list[float]] = {s: [] for s in sides}
    try:
        for side in sides:  # warm-up: compile, allocate, plan on every side
            set_side(trainer, side, router, default)
            trainer.train_step()
        for side in rotated_blocks(tuple(sides), args.blocks):
            set_side(trainer, side, router, default)
            trainer.train_step()
            times[side] += [trainer.train_step().step_time_s for _ in range(args.block_steps)]
        summary = dispatch.of("grouped_gemm").summary() if router is not None else {}
    finally:
        dispatch.of("grouped_gemm").install(None)
        act.close()
        trainer.close()
    med = {s: statistics.median(v) * 1e3 for s, v in times.items()}
    fastest = min(FIXED, key=lambda s: med[s])
    experts = problems[0].groups if problems else 0
    # measured saving against the trainer's default backend, with the spread of block pairs
    n = args.block_steps
    pairs = [statistics.median(times[default][i:i + n]) - statistics.median(times["tuned"][i:i + n])
             for i in range(0, len(times["tuned"]), n)]
    row = {
        "case": case, "preset": preset, "overrides": overrides, "experts": experts, "default_backend": default,
        "tuned_ms": med["tuned"], "baselines": {s: med[s] for s in FIXED},
        "spread": {s: spread_ms(v) for s, v in times.items()},
        "fastest_fixed": fastest, "tuned_vs_fastest_fixed": med[fastest] / med["tuned"],
        "bar": 1.05 if experts >= FINE_GRAINED else 0.995,
        "saving_vs_default_ms": {"measured": med[default] - med["tuned"],
                                 "block_pairs_ms": [p * 1e3 for p in pairs],
                                 "predicted": predicted_saving_ms(cache, calls)},
        "calls_per_step": dict(calls), "confirmation": confirmed, "cache": read_json(cache),
        "routed_calls": sum(summary.get("routed", {}).values()),
        "fallback_calls": sum(summary.get("fallback", {}).values()),
    }
    log(f"{case}: tuned {med['tuned']:.2f} ms; " + ", ".join(f"{s} {med[s]:.2f}" for s in FIXED)
        + f"; tuned {row['tuned_vs_fastest_fixed']:.3f}x of the fastest fixed ({fastest}), bar {row['bar']}")
    return row


def section_moe(args: argparse.Namespace, log: Any) -> list[dict]:
    cases = SMOKE_CASES if args.smoke else MOE_CASES
    chosen = args.cases or list(cases)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in chosen:
            preset, overrides = cases[case]
            rows.append(moe_case(case, preset, overrides, args, Path(tmp), log))
            release_device_memory()
            yield_rows(args, rows)
    return rows


def section_example(args: argparse.Namespace, log: Any) -> list[dict]:
    import primus_perf
    from benchmarks.runtime.enable_overhead import SMOKE, interleaved, load_example

    if args.cache is None:
        raise SystemExit("example: --cache CONFIRMED.json is required")
    example = load_example()
    margs = example.parse(SMOKE if args.smoke else [])
    model, opt = example.build(margs)
    for i in range(2):
        example.step(model, opt, margs, i)
    times = interleaved(lambda i: example.step(model, opt, margs, i),
                        lambda: primus_perf.enable(str(args.cache), log=None), args.pairs, args.block, start=2)
    on, off = spread_ms(times["on"]), spread_ms(times["off"])
    log(f"example: enable+cache {on['median_ms']:.2f} ms, without {off['median_ms']:.2f} ms "
        f"({off['median_ms'] / on['median_ms']:.4f}x)")
    return [{"case": "examples/llama_train.py under enable()", "tuned_ms": on["median_ms"],
             "baselines": {"no enable": off["median_ms"]}, "spread": {"tuned": on, "no enable": off},
             "tuned_vs_fastest_fixed": off["median_ms"] / on["median_ms"], "bar": 1.0,
             "cache": read_json(args.cache), "pairs": args.pairs, "block": args.block}]


def section_loop(args: argparse.Namespace, log: Any) -> list[dict]:
    from primus_perf.loop.pipeline import run_loop

    preset, overrides = ("tiny", []) if args.smoke else (
        "llama3-8b", ["model.n_layers=4", "train.seq_len=4096", "train.micro_batch=2"])
    with tempfile.TemporaryDirectory() as tmp:
        res = run_loop(preset, overrides, tmp, budget_s=args.budget_s, blocks=args.blocks,
                       block_steps=args.block_steps, log=log)
        m = res.measurement
        if m is None:
            log(f"loop: no measurement ({res.tuning_skipped})")
            return []
        cache = read_json(res.cache) if res.cache else None
    t, d = spread_ms(m.tuned_s), spread_ms(m.default_s)
    log(f"loop: tuned {t['median_ms']:.2f} ms, torch {d['median_ms']:.2f} ms ({m.speedup:.4f}x)")
    return [{"case": f"primus-tune loop {preset} " + " ".join(overrides), "tuned_ms": t["median_ms"],
             "baselines": {"torch": d["median_ms"]}, "spread": {"tuned": t, "torch": d},
             "tuned_vs_fastest_fixed": m.speedup, "bar": 0.995, "routed_calls": m.routed_calls,
             "cache": cache}]


QUICKSTART = {  # primus-tune loop as a user runs it: the README's first command, a dense model, an MoE preset
    "tiny": ("tiny", []),
    "llama3-8b-2l": ("llama3-8b", ["model.n_layers=2"]),
    "qwen3-30b-a3b-2l": ("qwen3-30b-a3b", ["model.n_layers=2", "model.vocab_size=32000", "train.seq_len=4096",
                                           "train.micro_batch=1"]),
}
SMOKE_QUICKSTART = {"tiny": ("tiny", ["model.n_layers=1", "train.seq_len=32", "train.micro_batch=2"])}


def loop_figure(log: str) -> dict[str, Any]:
    """The loop's last word: ``speedup with the cache: 1.012x [...]`` or ``1.00x: torch's own
    kernels kept``, and whether it said the step was host-bound."""
    import re

    line = next((ln for ln in reversed(log.splitlines()) if ln.startswith("speedup with the cache")), "")
    found = re.search(r"speedup with the cache: ([0-9.]+)x", line)
    step = re.search(r": ([0-9.]+) ms/step;", log)
    return {"line": line, "speedup": float(found.group(1)) if found else None,
            "step_ms": float(step.group(1)) if step else None,
            "host_bound": "the step is host-bound" in log,
            "dropped": [ln for ln in log.splitlines() if ln.startswith("final check: dropped")]}


def section_quickstart(args: argparse.Namespace, log: Any) -> list[dict]:
    """``primus-tune loop`` run as a command (its own process, its own output), then the cache it
    left behind against no cache in a fresh trainer of the same config, interleaved blocks."""
    import subprocess

    from primus_perf.tuner.cache_check import measure_speedup

    cases = SMOKE_QUICKSTART if args.smoke else QUICKSTART
    rows = []
    for case in args.cases or list(cases):
        preset, overrides = cases[case]
        out = (args.workdir / case).resolve()
        cmd = [sys.executable, "-m", "primus_perf.cli.tune", "loop", "--config", preset, "--out", str(out), *overrides]
        log(f"{case}: {' '.join(cmd[2:])}")
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout_s)
        minutes = (time.monotonic() - t0) / 60
        output = proc.stdout + proc.stderr
        (args.workdir / f"{case}.log").write_text(output)
        row: dict[str, Any] = {"case": f"primus-tune loop --config {preset} " + " ".join(overrides),
                               "exit_code": proc.returncode, "loop_min": round(minutes, 2),
                               "loop": loop_figure(proc.stdout), "bar": 0.99}
        cache = out / "tuning_cache.json"
        if proc.returncode == 0 and cache.is_file():
            release_device_memory()
            # a block lasts --min-block-s at least: a 7 ms host-bound step's blocks of 6 steps gave
            # 0.986x between two identical sides (no call routed)
            step_s = row["loop"]["step_ms"] / 1e3 if row["loop"]["step_ms"] else 0.0
            block_steps = max(args.block_steps, math.ceil(args.min_block_s / step_s) if step_s else 0)
            m = measure_speedup(preset, overrides, cache, blocks=args.blocks, block_steps=block_steps)
            d, t = spread_ms(m.default_s), spread_ms(m.tuned_s)
            row.update(left_behind={"speedup": m.speedup, "default": d, "tuned": t, "routed_calls": m.routed_calls,
                                    "blocks": args.blocks, "block_steps": block_steps,
                                    "losses_match": m.losses_match},
                       cache=read_json(cache))
            log(f"{case}: loop said {row['loop']['line']!r}; the cache it left: {m.speedup:.4f}x of no cache"
                f" ({t['median_ms']:.2f} vs {d['median_ms']:.2f} ms), {m.routed_calls} routed calls")
        else:
            log(f"{case}: no cache left (exit {proc.returncode}): "
                f"{output.strip().splitlines()[-1] if output.strip() else ''}")
        rows.append(row)
        release_device_memory()
        yield_rows(args, rows)
    return rows


def yield_rows(args: argparse.Namespace, rows: list[dict]) -> None:
    """Merge ``rows`` into ``--out`` (rows of the same case replaced): what is done survives."""
    doc = read_json(args.out) if args.out.exists() else {}
    kept = [r for r in doc.get("rows", []) if r["case"] not in {x["case"] for x in rows}]
    doc.update(benchmark="never_slower", device=current_device().to_dict(), versions=library_versions(),
               smoke=args.smoke, rows=kept + rows)
    write_json(args.out, doc, default=float)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny presets on the CPU: checks the script")
    ap.add_argument("--cases", nargs="*", default=None, help=f"moe cases (default all: {', '.join(MOE_CASES)})")
    ap.add_argument("--cache", type=Path, default=None, help="example: the confirmed cache")
    ap.add_argument("--record-steps", type=int, default=2)
    ap.add_argument("--confirm-steps", type=int, default=30, help="at most; it stops when every problem has its verdict")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--block-steps", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--max-configs", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=1.5)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/never_slower"), help="quickstart: run folders, logs")
    ap.add_argument("--case-timeout-s", type=float, default=900.0)
    ap.add_argument("--min-block-s", type=float, default=0.5, help="quickstart: the least time a block of steps lasts")
    ap.add_argument("section", choices=("moe", "example", "loop", "quickstart"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.record_steps, args.confirm_steps, args.blocks, args.block_steps = 1, 2, 1, 1
        args.pairs, args.block, args.max_configs, args.budget_s = 1, 1, 1, 0.05
    elif not torch.cuda.is_available():
        raise SystemExit("never_slower measures a GPU; use --smoke on the CPU")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = {"moe": section_moe, "example": section_example, "loop": section_loop,
            "quickstart": section_quickstart}[args.section](args, log)
    yield_rows(args, rows)
    log(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
