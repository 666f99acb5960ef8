"""Check the analyzer's advice against the measured effect of applying it.

For one trainer config: (1) a profiled run (a run folder the analyzer reads: its
``recommendations`` estimate a saving per step for each action); (2) the measured saving of
the actions the trainer can apply in place, in one process, sides switched per block of
``--block-steps`` steps (one settling step after each switch), ``--blocks`` blocks a side:

- ``compile``: ``train.compile=true``'s effect (``Transformer.set_compile``: RoPE, SwiGLU and
  RMSNorm compiled, GEMMs still dispatched) against the eager step.

The JSON holds each side's step times (median, spread) and the saving in ms per step; the
analysis of ``<out>/run`` is compared with it afterwards (on any machine)::

    python benchmarks/analyzer/advice_check.py --config llama3-8b --out runs/advice_dense \
        model.n_layers=4 train.seq_len=4096 train.micro_batch=2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json
from primus_perf.profiler.capture import Schedule, capture_trainer
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median_ms": statistics.median(s) * 1e3, "p10_ms": s[len(s) // 10] * 1e3,
            "p90_ms": s[(9 * len(s)) // 10] * 1e3, "n": len(s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    run = args.out / "run"
    capture_trainer(args.config, args.overrides, run, Schedule(active=args.profile_steps), overwrite=True)
    log(f"trace written to {run}")

    trainer = Trainer(load_config(args.config, args.overrides))
    times: dict[str, list[float]] = {"eager": [], "compile": []}
    try:
        for side in ("compile", "eager", "compile"):  # warm-up: compile, allocate
            trainer.model.set_compile("pointwise" if side == "compile" else "off")
            trainer.train_step()
        for i in range(2 * args.blocks):
            side = ("eager", "compile")[i % 2]
            trainer.model.set_compile("pointwise" if side == "compile" else "off")
            trainer.train_step()
            for _ in range(args.block_steps):
                times[side].append(trainer.train_step().step_time_s)
            log(f"block {i + 1}/{2 * args.blocks} ({side}): median "
                f"{statistics.median(times[side][-args.block_steps:]) * 1e3:.2f} ms/step")
    finally:
        trainer.close()
    eager, comp = _stats(times["eager"]), _stats(times["compile"])
    result = {
        "config": args.config, "overrides": args.overrides, "device": current_device().name,
        "versions": library_versions(), "blocks": args.blocks, "block_steps": args.block_steps,
        "eager": eager, "compile": comp,
        "measured_saving_ms": {"compile": eager["median_ms"] - comp["median_ms"]},
        "times_s": times, "run": str(run),
    }
    write_json(args.out / "advice_check.json", result)
    log(f"eager {eager['median_ms']:.2f} ms, compile {comp['median_ms']:.2f} ms: "
        f"saving {result['measured_saving_ms']['compile']:.2f} ms/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
