"""Capture: run a step function (the trainer's, or any) under torch.profiler.

:func:`profile_window` is the one place torch.profiler is started: a window inside any
step loop (the caller runs ``window.steps`` steps and calls ``window.step()`` after each;
the recorded steps become one gzipped Kineto trace). :func:`profile_steps` drives a step
function through a whole schedule with it, and :func:`capture_trainer` drives the trainer
and writes a run folder. The schedule of :func:`profile_steps`::

    baseline (no profiler) | wait (profiler on, not recording) | warmup | active | after (no profiler)

- ``active`` steps are recorded with shapes (``record_shapes=True``) and written as one
  gzipped Kineto trace per rank, ``rank{R}.pt.trace.json.gz``: the analyzer reads it,
  Perfetto opens it, and TensorBoard's profiler plugin finds it by its ``.pt.trace.json.gz``
  suffix (the run directory is the TensorBoard run).
- ``baseline`` and ``after`` steps run without the profiler; ``wait`` steps run with the
  profiler started but not recording. Their times give the profiler's overhead on steps
  outside the recorded window, kept in the manifest next to the per-step times.
- ``manifest.json`` (rank 0): config, device, library versions, world size, traced ranks,
  every step's phase and time (the trainer's: loss, tokens/s, MFU, and for an MoE model
  the tokens per expert of each MoE layer), medians, tokens/s and MFU of the unprofiled
  steps, overhead.

Files are written under a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primus_perf.base import environment
from primus_perf.base.errors import Interrupted, UserError, interrupts_held
from primus_perf.base.files import atomic_open, write_json
from primus_perf.base.programs import sync_gpu
from primus_perf.profiler.kineto_marks import kineto_marks_dropped
from primus_perf.tracelens.inputs import MANIFEST

SCHEMA = "primus-perf-run/1"
PHASES = ("baseline", "wait", "warmup", "active", "after")


@dataclass
class Schedule:
    """Steps of each phase (see the module docstring)."""

    active: int = 3
    warmup: int = 1
    wait: int = 2
    baseline: int = 3
    after: int = 3

    def __post_init__(self) -> None:
        if self.active < 1:
            raise UserError("--steps (profiled steps) must be at least 1")
        for name in ("warmup", "wait", "baseline", "after"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} steps must be >= 0")

    def phases(self) -> list[str]:
        return [p for p in PHASES for _ in range(getattr(self, p))]


@dataclass
class CaptureResult:
    """What one rank captured."""

    out_dir: Path
    trace: Path | None  # this rank's trace (None when this rank is not traced)
    steps: list[dict[str, Any]]  # {"index", "phase", "time_s", ...step info}
    manifest: dict[str, Any] = field(default_factory=dict)


def trace_name(rank: int) -> str:
    return f"rank{rank}.pt.trace.json.gz"


_TRACE_NAME = re.compile(r"rank\d+\.pt\.trace\.json\.gz")


class CaptureInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`profile_steps`, with what was captured until then (the trace
    of the active steps already recorded, when there are any)."""

    def __init__(self, result: CaptureResult) -> None:
        super().__init__("interrupted")
        self.result = result


def _activities() -> list[Any]:
    import torch
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    return acts


def _write_gz(src: Path, dst: Path) -> None:
    with atomic_open(dst, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as g, \
            open(src, "rb") as f:
        shutil.copyfileobj(f, g, 1 << 20)


_PROBE_PREFIX = ".write-test."  # each process's short-lived check that --out is writable


def prepare_out_dir(out_dir: str | Path, *, overwrite: bool | None = None) -> Path:
    """Create the output directory, or one clear error. ``overwrite=False``: a directory
    with files in it is refused (runs would mix); ``True``: the previous run's traces and
    manifest there are removed (rank 0 only: ``RANK``); None: no check."""
    out = Path(out_dir)
    if overwrite is not None and environment.get("RANK") == 0:
        _check_empty(out, overwrite)
    try:
        out.mkdir(parents=True, exist_ok=True)
        # A probe of its own per process: every rank of a torchrun job checks the same
        # directory at once, and a shared probe name raced (one rank removed the other's).
        fd, probe = tempfile.mkstemp(dir=out, prefix=_PROBE_PREFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"cannot write to --out {out}: {exc.strerror or exc}") from None
    return out


def _check_empty(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    try:
        # Another rank's writability probe may be there for a moment: it is not a run.
        present = sorted(p.name for p in out.iterdir()
                         if not p.name.startswith(_PROBE_PREFIX)) if out.is_dir() else []
    except OSError as exc:
        raise UserError(f"cannot read --out {out}: {exc.strerror}") from None
    if not present:
        return
    if not overwrite:
        shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
        raise UserError(f"--out {out} is not empty ({shown}): runs would mix; choose an empty folder"
                        f" or pass --overwrite to replace the run there")
    for name in present:  # only what a run writes: other files stay
        if name == MANIFEST or _TRACE_NAME.fullmatch(name):
            try:
                (out / name).unlink()
            except OSError as exc:
                raise UserError(f"cannot replace {out / name}: {exc.strerror}") from None


@dataclass
class ProfiledWindow:
    """The window :func:`profile_window` yields: run ``steps`` steps, calling :meth:`step`
    after each; ``trace`` is the written trace once the window has closed (None: nothing
    was recorded)."""

    steps: int
    trace: Path | None = None
    _prof: Any = None

    def step(self) -> None:
        """Mark the end of one step of the caller's loop (Ctrl-C waits for the profiler's
        step to finish: halfway, it leaves the profiler unable to stop)."""
        with interrupts_held(), kineto_marks_dropped():
            self._prof.step()


@contextmanager
def profile_window(trace: str | Path, *, active: int, warmup: int = 1, wait: int = 0) -> Iterator[ProfiledWindow]:
    """Profile a window of the caller's step loop: ``wait`` steps with the profiler started
    but not recording, ``warmup`` steps recorded and dropped (the profiler's own start-up
    cost), then ``active`` steps recorded with shapes and marked ``ProfilerStep#N``. The
    trace is written gzipped to ``trace`` (temporary name, then renamed) when the window
    closes; a loop that stops early, or is interrupted (Ctrl-C), keeps the active steps
    recorded so far (the exception goes on)."""
    import torch.profiler as tp

    if active < 1 or warmup < 0 or wait < 0:
        raise UserError("a profiled window needs at least 1 active step and no negative wait or warm-up")
    out = Path(trace)
    window = ProfiledWindow(steps=wait + warmup + active)
    with tempfile.TemporaryDirectory(prefix="primus-capture-") as tmp:
        raw = Path(tmp) / "trace.json"
        prof = tp.profile(
            activities=_activities(),
            schedule=tp.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(raw)),
            record_shapes=True,
            with_stack=False,
            profile_memory=False,
        )
        # Ctrl-C is held while the profiler starts and stops: interrupted halfway it can
        # neither export nor stop cleanly. The step loop itself stays interruptible.
        started = False
        try:
            with interrupts_held(), kineto_marks_dropped():  # a Ctrl-C held here is raised once started
                prof.__enter__()
                started = True
            window._prof = prof
            yield window
        finally:
            with interrupts_held():
                if started:
                    with kineto_marks_dropped():
                        prof.__exit__(*sys.exc_info())
                if raw.is_file():  # the active steps recorded, also on Ctrl-C
                    _write_gz(raw, out)
                    window.trace = out


def profile_steps(
    step_fn: Callable[[], Any],
    out_dir: str | Path,
    schedule: Schedule | None = None,
    *,
    rank: int = 0,
    traced: bool = True,
    step_info: Callable[[Any], dict[str, Any]] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> CaptureResult:
    """Run ``step_fn`` through the schedule; record the active steps when ``traced``
    (``out_dir/rank{R}.pt.trace.json.gz``).

    Untraced ranks run the same number of steps (collectives stay matched) without a
    profiler. ``step_info(result)`` adds fields (loss, tokens/s, ...) to each step record.
    """
    sched = schedule or Schedule()
    out = prepare_out_dir(out_dir)
    phases = sched.phases()
    records: list[dict[str, Any]] = []

    def run(phase: str) -> None:
        sync_gpu()
        t0 = time.perf_counter()
        result = step_fn()
        sync_gpu()
        rec = {"index": len(records), "phase": phase, "time_s": time.perf_counter() - t0}
        if step_info is not None and result is not None:
            rec.update(step_info(result))
        records.append(rec)
        if on_step is not None:
            on_step(rec)

    window: ProfiledWindow | None = None
    try:
        for phase in phases[:sched.baseline]:
            run(phase)
        profiled = phases[sched.baseline: len(phases) - sched.after]
        if traced:
            with profile_window(out / trace_name(rank), active=sched.active, warmup=sched.warmup,
                                wait=sched.wait) as window:
                for phase in profiled:
                    run(phase)
                    window.step()
            if window.trace is None:
                raise UserError("the profiler wrote no trace")
        else:
            for phase in profiled:
                run(phase)
        for phase in phases[len(phases) - sched.after:]:
            run(phase)
    except KeyboardInterrupt:
        kept = window.trace if window is not None else None
        raise CaptureInterrupted(CaptureResult(out_dir=out, trace=kept, steps=records)) from None
    return CaptureResult(out_dir=out, trace=window.trace if window is not None else None, steps=records)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def overhead(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median step times per phase group and their ratios to the unprofiled steps."""
    def times(*phases: str) -> list[float]:
        return [s["time_s"] for s in steps if s["phase"] in phases]

    # unprofiled: the steps before the profiler starts; the first also pays one-time costs
    # (allocator, autotuning), so it is skipped when there are others. Outside the window:
    # the profiler's wait steps and the steps after it stopped (CUPTI may stay attached).
    base = times("baseline")[1:] or times("baseline")
    wait, after, active = times("wait"), times("after"), times("active")
    outside = wait + after
    ub, uo, ua = _median(base), _median(outside), _median(active)

    def ratio(vals: list[float]) -> float | None:
        m = _median(vals)
        return m / ub if m and ub else None

    return {
        "unprofiled_median_s": ub,
        "outside_window_median_s": uo,
        "active_median_s": ua,
        "outside_window_vs_unprofiled": ratio(outside),
        "wait_vs_unprofiled": ratio(wait),
        "after_vs_unprofiled": ratio(after),
        "active_vs_unprofiled": ratio(active),
        "unprofiled_steps": len(base),
        "outside_window_steps": len(outside),
        "spread_s": {name: [min(v), max(v)] for name, v in
                     (("unprofiled", base), ("wait", wait), ("after", after), ("active", active)) if v},
    }


def meet_ranks() -> None:
    """Every rank waits for the others at the window's end (under torchrun): each traced rank's
    file is written before rank 0's manifest names it. Each rank comes here at the same step,
    traced or not; a window closed by an error does not (a rank that failed never comes)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> Path:
    return write_json(out_dir / MANIFEST, manifest, indent=1, default=str)


def _run_versions() -> dict[str, str]:
    """The run's library versions: ``devices.library_versions()`` and, on a GPU, the BLAS-Lt
    library's (what GEMM cache entries are keyed by, so a report can match them)."""
    from primus_perf.base.devices import current_device, library_versions
    from primus_perf.base.errors import DeviceError

    versions = library_versions()
    if current_device().vendor != "cpu":
        from primus_perf.kernels.gemm import library_versions as blaslt_versions

        with contextlib.suppress(DeviceError):  # no BLAS-Lt library: GEMM entries stay unmatched
            versions.update(blaslt_versions())
    return versions


def base_manifest(schedule: Schedule, steps: Sequence[dict[str, Any]], *, world_size: int = 1,
                  traced_ranks: Sequence[int] = (0,), extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest fields every capture has (the trainer adds config, tokens/s, MFU)."""
    from primus_perf.base.devices import current_device

    active = [s["time_s"] for s in steps if s["phase"] == "active"]
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": sys.argv,
        "device": current_device().to_dict(),
        "versions": _run_versions(),
        "world_size": world_size,
        "traced_ranks": list(traced_ranks),
        "traces": {str(r): trace_name(r) for r in traced_ranks},
        "schedule": vars(schedule),
        "step_time_s": _median(active),
        "steps": list(steps),
        "overhead": overhead(steps),
        **(extra or {}),
    }


def parse_ranks(text: str | None, world_size: int) -> list[int]:
    """``"0,3"`` -> [0, 3]; None -> every rank; one clear error for bad input."""
    if text is None or text.strip() in ("", "all"):
        return list(range(world_size))
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise UserError(f"--ranks must be comma-separated rank numbers, got {text!r}") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise UserError(f"--ranks {text!r}: ranks must be in 0..{world_size - 1}")
    return ranks


def capture_trainer(config: str, overrides: Sequence[str], out_dir: str | Path, schedule: Schedule,
                    ranks: str | None = None, on_step: Callable[[dict[str, Any]], None] | None = None,
                    *, overwrite: bool = False, online: Any = None) -> CaptureResult:
    """Train the reference trainer under the profiler (every rank under torchrun) into a
    run folder (an empty one, or ``overwrite``). Ctrl-C keeps the trace of the active steps
    already recorded (with a manifest of the steps run) and raises
    :class:`~primus_perf.base.errors.Interrupted` saying what was written. ``online``: the
    online tuning a config with ``tuning.online=true`` runs (``Trainer``'s)."""
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer

    cfg = load_config(config, overrides)
    out = prepare_out_dir(out_dir, overwrite=overwrite)
    trainer = Trainer(cfg, online=online)
    try:
        world = trainer.groups.world_size
        rank = trainer.groups.rank
        traced = parse_ranks(ranks, world)

        def info(m: Any) -> dict[str, Any]:
            rec = {"loss": m.loss, "tokens_per_s": m.tokens_per_s, "mfu": m.mfu}
            if m.tokens_per_expert is not None:  # an MoE model: the report's expert load
                rec["tokens_per_expert"] = m.tokens_per_expert
            return rec

        try:
            res = profile_steps(trainer.train_step, out, schedule, rank=rank, traced=rank in traced,
                                step_info=info, on_step=on_step if trainer.is_main else None)
        except CaptureInterrupted as stop:
            part = stop.result
            recorded = sum(s["phase"] == "active" for s in part.steps)
            if part.trace is None:
                raise Interrupted(f"after {len(part.steps)} steps, before a recorded step was written;"
                                  f" nothing was written to {out}") from None
            if trainer.is_main:
                write_manifest(out, base_manifest(schedule, part.steps, world_size=world, traced_ranks=traced,
                                                  extra={"config": cfg.to_dict(), "config_name": config,
                                                         "overrides": list(overrides), "interrupted": True}))
            raise Interrupted(f"after {len(part.steps)} steps; wrote {part.trace} with {recorded} recorded"
                              f" step(s) and {out / MANIFEST}") from None
        # every rank's trace is on disk before rank 0's manifest names it: rank 0
        # may finish first (untraced, or no step after the window) while another exports
        meet_ranks()
        if trainer.is_main:
            plain = [s for s in res.steps if s["phase"] in ("baseline", "after")][1:]
            tok = _median([s["tokens_per_s"] for s in plain])
            mfu_vals = [s["mfu"] for s in plain if s.get("mfu") is not None]
            res.manifest = base_manifest(schedule, res.steps, world_size=world, traced_ranks=traced, extra={
                "config": cfg.to_dict(),
                "config_name": config,
                "overrides": list(overrides),
                "tokens_per_step": trainer.tokens_per_step,
                "tokens_per_s": tok,
                "mfu": _median(mfu_vals),
                "device_name": trainer.device_name,
                "fp8_layers": trainer.fp8,  # layer -> FP8 recipe or bf16 ({} with train.fp8=off)
            })
            write_manifest(out, res.manifest)
        return res
    finally:
        trainer.close()
