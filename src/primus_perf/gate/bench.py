"""``primus-profile bench``: repeated measurements of the trainer for the regression gate.

A samples file holds, for one config on one device:

- ``step_time`` (s) and ``tokens_per_s``: one sample per optimizer step after warm-up;
- ``gpu_time.<category>`` (s per step): one sample per step of a short profiled window
  that follows, split by the trace analysis's kernel categories (GEMM, attention, ...);
- the device identity and library versions, so that the gate can refuse to compare
  runs from different hardware.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.errors import UserError
from primus_perf.base.files import write_json
from primus_perf.gate.gate import SAMPLES_SCHEMA
from primus_perf.profiler.capture import Schedule, profile_steps
from primus_perf.tracelens.analyze import Analysis, analyze
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer


def device_record(world_size: int = 1) -> dict[str, Any]:
    rec = current_device().to_dict()
    rec["world_size"] = world_size
    return rec


def category_times_per_step(analysis: Analysis) -> dict[str, list[float]]:
    """``gpu_time.<category>`` and ``gpu_time.total``: GPU event seconds of each (rank, step)."""
    table = analysis.breakdown.pivot_table(index=["rank", "step"], columns="category", values="seconds",
                                           aggfunc="sum", fill_value=0.0)
    out = {f"gpu_time.{cat}": [float(v) for v in table[cat]] for cat in table.columns}
    if len(table):
        out["gpu_time.total"] = [float(v) for v in table.sum(axis=1)]
    return out


def bench(
    config: str,
    *,
    overrides: Sequence[str] = (),
    repeat: int = 20,
    warmup: int = 3,
    profile_steps: int = 5,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the trainer and return a samples dict (``SAMPLES_SCHEMA``)."""
    if repeat < 1 or warmup < 0 or profile_steps < 0:
        raise UserError("repeat must be >= 1, warmup and profile steps >= 0")
    cfg = load_config(config, list(overrides))
    trainer = Trainer(cfg)
    notes: list[str] = []
    world = 0  # set when every step ran
    try:
        total = warmup + repeat + profile_steps
        step_time, tokens, mfu, loss = [], [], [], []
        for done in range(1, warmup + repeat + 1):
            m = trainer.train_step()
            if done > warmup:  # the warm-up steps' metrics are not samples
                step_time.append(m.step_time_s)
                tokens.append(m.tokens_per_s)
                loss.append(m.loss)
                if m.mfu is not None:
                    mfu.append(m.mfu)
            if progress:
                progress(done, total)
        metrics: dict[str, list[float]] = {"step_time": step_time, "tokens_per_s": tokens}
        if len(mfu) == len(step_time):
            metrics["mfu"] = mfu
        if profile_steps:
            metrics.update(_profiled_window(trainer, profile_steps, notes))
            if progress:
                progress(total, total)
        world = trainer.groups.world_size
    finally:
        trainer.close(finished=world > 0)
    return {
        "schema": SAMPLES_SCHEMA,
        "config": config,
        "overrides": list(overrides),
        "device": device_record(world),
        "versions": library_versions(),
        "warmup": warmup,
        "repeat": repeat,
        "profile_steps": profile_steps,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "metrics": metrics,
        "final_loss": loss[-1] if loss else None,
        "notes": notes,
    }


def _profiled_window(trainer: Trainer, steps: int, notes: list[str]) -> dict[str, list[float]]:
    """Per-category GPU times of ``steps`` profiled steps (after one profiler warm-up step)."""
    with tempfile.TemporaryDirectory(prefix="primus-bench-") as tmp:
        res = profile_steps(trainer.train_step, tmp, Schedule(active=steps, warmup=1, wait=0, baseline=0, after=0))
        assert res.trace is not None  # profile_steps raises when the profiler wrote nothing
        analysis = analyze([res.trace])
    if analysis.kernels.empty:
        notes.append("no GPU events in the profiled steps: no per-category GPU times")
    return category_times_per_step(analysis)


def write_samples(data: dict[str, Any], path: str | Path) -> Path:
    """Write atomically (temp file + rename)."""
    return write_json(path, data, indent=1)
