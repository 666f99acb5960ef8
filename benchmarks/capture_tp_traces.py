"""Capture one trace per rank of the trainer under tensor parallelism (run with torchrun).

    torchrun --nproc-per-node 2 benchmarks/capture_tp_traces.py OUT_DIR [override ...]

Writes ``OUT_DIR/trace_rank{R}.json.gz``: 2 profiled steps after 3 warm-up steps, with
shapes, on every rank. The multi-rank fixture of the trace analysis tests comes from here.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer


def main(out_dir: str, overrides: list[str]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(load_config("llama3-8b", overrides))
    rank = trainer.groups.rank
    for _ in range(3):
        trainer.train_step()
    raw = out / f"trace_rank{rank}.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(raw))) as prof:
        for _ in range(3):
            trainer.train_step()
            prof.step()
    torch.cuda.synchronize()
    trainer.close()
    with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.unlink(raw)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
