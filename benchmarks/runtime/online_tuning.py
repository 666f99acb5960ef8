"""Online tuning in the reference trainer, measured in one GPU session (llama3-8b, 4 layers,
seq 4096 by default):

1. ``tuning.online=true`` from an empty cache: every step's time, how many problems are still
   being tuned after each step (the step where the last one locks, of all kinds and per
   kind), the tuning calls, and the step-time overhead while tuning (steps before the last
   lock against the steps after it);
2. a restart with the cache that run wrote: it must do no tuning;
3. the same problems tuned offline (``primus_perf.tune``; an MoE model's grouped GEMMs as
   two recorded steps make them, with their token splits) into a second cache, then
   confirmed in the trainer's steps as ``primus-tune loop`` does (``closed_loop.
   confirm_trainer``: a choice that loses to the trainer's own backend where it runs is
   corrected to it);
4. interleaved in one trainer: no cache (the trainer's defaults), the online cache and the
   offline cache, each cache's routers installed for its blocks, in rotating order
   (``moe_e2e.rotated_blocks``), so online against offline is one run's ratio of medians
   (two separate default-vs-cache runs drifted by 2% between them on an H100).

    python benchmarks/runtime/online_tuning.py --out benchmarks/results/online_tuning/h100.json
    python benchmarks/runtime/online_tuning.py --out ... train.compile=true      # (c) with compile
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks.moe.moe_e2e import rotated_blocks


def interleaved(config: str, overrides: list[str], caches: dict[str, Path], blocks: int,
                block_steps: int = 5) -> dict[str, dict[str, Any]]:
    """Step times of one trainer with no cache (``default``) and with each cache's routers,
    ``blocks`` rotating rounds of ``block_steps`` steps a side after one settling step."""
    from primus_perf.runtime import dispatch
    from primus_perf.runtime.activate import activate
    from primus_perf.runtime.handle import Handle
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer

    trainer = Trainer(load_config(config, overrides))
    acts = {name: activate(path) for name, path in caches.items()}
    handles = {name: Handle(tuple(act.routers), act, act.routers, device_type=trainer.device.type)
               for name, act in acts.items()}
    sides = ("default", *caches)
    times: dict[str, list[float]] = {s: [] for s in sides}
    losses: dict[str, list[float]] = {s: [] for s in sides}
    calls = {name: {"routed": 0, "fallback": 0} for name in caches}
    current = ["default"]

    def use(side: str) -> None:
        if current[0] in handles:  # the side's calls so far, then its routers out
            for kind in acts[current[0]].routers:
                s = dispatch.of(kind).summary()
                for part in ("routed", "fallback"):
                    calls[current[0]][part] += sum(s[part].values())
                dispatch.of(kind).reset()
            handles[current[0]].suspend()
        if side in handles:
            handles[side].resume()
        current[0] = side

    try:
        for side in sides:  # warm-up: compile, allocate, plan on every side
            use(side)
            trainer.train_step()
        use("default")
        for name in caches:
            calls[name] = {"routed": 0, "fallback": 0}
        for side in rotated_blocks(sides, blocks):
            use(side)
            trainer.train_step()
            for _ in range(block_steps):
                m = trainer.train_step()
                times[side].append(m.step_time_s)
                losses[side].append(m.loss)
        use("default")
    finally:
        for h in handles.values():
            h.suspend()
        for act in acts.values():
            act.close()
        trainer.close()
    out = {}
    for side in sides:
        q1, _median, q3 = statistics.quantiles(times[side], n=4, method="inclusive")
        row = {"median_s": statistics.median(times[side]), "q1_s": q1, "q3_s": q3, "step_time_s": times[side],
               "median_loss": statistics.median(losses[side])}
        if side in calls:
            row["routed_calls"], row["fallback_calls"] = calls[side]["routed"], calls[side]["fallback"]
        out[side] = row
    return out


def _run(config: str, overrides: list[str], steps: int) -> dict[str, Any]:
    from primus_perf.enabling import online_tuning
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer

    trainer = Trainer(load_config(config, overrides), online=online_tuning())
    try:
        online = {kind: r for kind, r in trainer.tuning.routers.items() if hasattr(r, "tuning")}
        times, in_tuning = [], []
        by_kind: dict[str, list[int]] = {kind: [] for kind in online}
        for _ in range(steps):
            m = trainer.train_step()
            times.append(m.step_time_s)
            for kind, r in online.items():
                by_kind[kind].append(len(r.tuning))
            in_tuning.append(sum(n[-1] for n in by_kind.values()))
        summary = trainer.tuning.summary()
    finally:
        trainer.close()
    tuning_calls = {k: sum(row.get("tuning", {}).values()) for k, row in summary.items() if row.get("available")}

    def locked_after(counts: list[int]) -> int:
        """The 1-based step after which nothing is tuned (0: nothing ever was)."""
        started = [i for i, n in enumerate(counts) if n > 0]
        return (max(started) + 2) if started else 0

    locked_at = locked_after(in_tuning)
    before, after = times[1:locked_at], times[max(locked_at, 2):]
    return {
        "step_time_s": times, "problems_in_tuning_after_step": in_tuning, "all_locked_after_step": locked_at,
        "locked_after_step_by_kind": {kind: locked_after(n) for kind, n in by_kind.items()},
        "tuning_calls": tuning_calls, "summary": summary,
        "median_while_tuning_s": statistics.median(before) if before else None,
        "median_after_s": statistics.median(after) if after else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--budget-s", type=float, default=2.0, help="offline tuning budget per problem")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--confirm-steps", type=int, default=30, help="at most, confirming the offline cache")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("overrides", nargs="*", default=["model.n_layers=4", "train.seq_len=4096", "train.micro_batch=1"])
    args = ap.parse_args()

    from primus_perf import kinds
    from primus_perf.base.devices import current_device, library_versions
    from primus_perf.cache.store import TuningCache
    from primus_perf.tuner.cache_check import confirm_trainer
    from primus_perf.tuner.kinds import tune

    work = Path(tempfile.mkdtemp(prefix="online_tuning."))
    online_cache, offline_cache = work / "online.json", work / "offline.json"
    tuned = [*args.overrides, f"tuning.cache={online_cache}", "tuning.online=true"]
    first = _run(args.config, tuned, args.steps)
    print(json.dumps({k: first[k] for k in ("all_locked_after_step", "tuning_calls", "median_while_tuning_s",
                                            "median_after_s")}), flush=True)
    restart = _run(args.config, tuned, max(6, args.steps // 4))
    print(json.dumps({"restart_tuning_calls": restart["tuning_calls"]}), flush=True)
    # the GEMMs the online run tuned, and an MoE model's grouped GEMMs as its steps make them
    # (each with its token split: online tuning keys them by shape, at an even split), offline
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.grouped_problems import record_grouped_problems

    problems = [kinds.get(e.kind).problem_type.from_dict(e.problem) for e in TuningCache(online_cache).entries()
                if e.kind == kinds.GEMM.name]
    cfg = load_config(args.config, args.overrides)
    if cfg.model.moe.n_experts > 0:
        problems += [p for p, _calls in record_grouped_problems(cfg, steps=2)]
    run = tune(problems, cache=offline_cache, budget_s=args.budget_s)
    confirmed = confirm_trainer(args.config, args.overrides, offline_cache, steps=args.confirm_steps)
    print(json.dumps({"offline_confirmed": {v: confirmed.count(v) for v in ("kept", "dropped", "unconfirmed")}}),
          flush=True)
    sides = interleaved(args.config, args.overrides, {"online": online_cache, "offline": offline_cache},
                        args.blocks)
    med = {name: row["median_s"] for name, row in sides.items()}

    w, a = first["median_while_tuning_s"], first["median_after_s"]
    result = {
        "benchmark": "online_tuning", "device": current_device().to_dict(), "versions": library_versions(),
        "config": args.config, "overrides": args.overrides,
        "online_first_run": first, "restart": restart,
        "offline": {"problems": len(problems), "tuned": run.tuned, "choices": {r.problem.key(): r.chosen for r in run.results},
                    "confirmed": {v: confirmed.count(v) for v in ("kept", "dropped", "unconfirmed")},
                    "after_confirmation": {e.problem_key: (e.solution.get("config") or {}).get("name")
                                           for e in TuningCache(offline_cache).entries()}},
        "online_choices": {e.problem_key: (e.solution.get("config") or {}).get("name") for e in TuningCache(online_cache).entries()},
        "interleaved": sides,
        "speedup_vs_default": {"online": med["default"] / med["online"], "offline": med["default"] / med["offline"]},
        "bars": {
            "steps_until_all_locked": first["all_locked_after_step"], "goal_steps": 20,
            "steps_until_locked_by_kind": first["locked_after_step_by_kind"],
            "overhead_while_tuning": (w / a - 1) if w and a else None, "goal_overhead": 0.05,
            "online_vs_offline_final": med["offline"] / med["online"], "goal_within": 0.02,
            "restart_tuning_calls": sum(restart["tuning_calls"].values()),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["bars"]), flush=True)


if __name__ == "__main__":
    main()
