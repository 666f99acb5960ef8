"""Capture one trace per rank of the trainer under tensor parallelism (run with torchrun).

    torchrun --nproc-per-node 2 benchmarks/profiler/capture_tp_traces.py OUT_DIR [override ...]

Writes ``OUT_DIR/rank{R}.pt.trace.json.gz`` through ``profiler.capture.profile_steps``: 3
unprofiled steps, then 1 profiler warm-up step and 2 recorded steps, with shapes, on every
rank. The multi-rank fixtures of the trace analysis tests come from here (committed under
their earlier names, ``trace_rank{R}.json.gz``).
"""

from __future__ import annotations

import sys

from primus_perf.profiler.capture import Schedule, profile_steps
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer


def main(out_dir: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config("llama3-8b", overrides))
    try:
        profile_steps(trainer.train_step, out_dir, Schedule(active=2, warmup=1, wait=0, baseline=3, after=0),
                      rank=trainer.groups.rank)
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
