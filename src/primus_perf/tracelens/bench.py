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

from primus_perf.devices import library_versions
from primus_perf.errors import UserError
from primus_perf.files import write_json
from primus_perf.tracelens.gate import SAMPLES_SCHEMA


def device_record(world_size: int = 1) -> dict[str, Any]:
    from primus_perf.devices import current_device

    rec = current_device().to_dict()
    rec["world_size"] = world_size
    return rec


def category_times_per_step(trace_paths: Sequence[str | Path]) -> dict[str, list[float]]:
    """Per-step GPU kernel time (s) per category, from the trace analysis's kernel table."""
    from primus_perf.tracelens import analyzer

    analyze = analyzer()

    analysis = analyze([str(p) for p in trace_paths])
    kernels = analysis.kernels
    if kernels is None or len(kernels) == 0:
        return {}
    k = kernels[kernels["step"].notna() & (kernels["step"] >= 0)]
    if len(k) == 0:
        return {}
    table = k.groupby(["rank", "step", "category"], observed=True)["dur_us"].sum().unstack(fill_value=0.0)
    out: dict[str, list[float]] = {}
    for cat in table.columns:
        out[f"gpu_time.{cat}"] = [float(v) / 1e6 for v in table[cat].to_list()]
    out["gpu_time.total"] = [float(v) / 1e6 for v in table.sum(axis=1).to_list()]
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
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer

    cfg = load_config(config, list(overrides))
    trainer = Trainer(cfg)
    notes: list[str] = []
    try:
        total = warmup + repeat + profile_steps
        done = 0
        for _ in range(warmup):
            trainer.train_step()
            done += 1
            if progress:
                progress(done, total)
        step_time, tokens, mfu, loss = [], [], [], []
        for _ in range(repeat):
            m = trainer.train_step()
            step_time.append(m.step_time_s)
            tokens.append(m.tokens_per_s)
            loss.append(m.loss)
            if m.mfu is not None:
                mfu.append(m.mfu)
            done += 1
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
        trainer.close()
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


def _profiled_window(trainer: Any, steps: int, notes: list[str]) -> dict[str, list[float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with tempfile.TemporaryDirectory(prefix="primus-bench-") as tmp:
        trace = Path(tmp) / "bench_trace.json"
        # One warm-up step (the profiler's own start-up cost), then `steps` recorded ones;
        # the schedule also marks step boundaries (ProfilerStep#N) in the trace.
        with profile(activities=activities, record_shapes=True,
                     schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(str(trace))) as prof:
            for _ in range(steps + 1):
                trainer.train_step()
                prof.step()
        if not trace.is_file():
            notes.append("the profiler wrote no trace: no per-category GPU times")
            return {}
        try:
            return category_times_per_step([trace])
        except ImportError:
            notes.append("trace analysis not available: no per-category GPU times")
            return {}


def write_samples(data: dict[str, Any], path: str | Path) -> Path:
    """Write atomically (temp file + rename)."""
    return write_json(path, data, indent=1)
