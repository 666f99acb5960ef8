"""Capture any training script: ``primus-profile run -- script.py args`` (or
:func:`capture_program`) runs the script in this process under the schedule of
:func:`~primus_perf.profiler.capture.profile_steps` and writes the same run folder as
``run --config``: one gzipped trace per traced rank and ``manifest.json``.

Where a step ends is found, not configured (``programs.StepMarks``): each ``optimizer.step()``
of the first optimizer that steps ends one, unless the script marks its steps itself with
``primus_perf.profile_step()`` at the end of each (gradient accumulation, several optimizers, a
loop without an optimizer): from its first call on, only its calls count. Outside such a
command it does nothing.

The baseline steps run without the profiler; the profiler starts after them and stops once
the window's active steps are recorded, so steps after it run unprofiled again. A script that
stops before its window is recorded keeps the active steps recorded so far; one that stops
before any is recorded is a one-line error saying how many steps it marked.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from primus_perf.base import environment
from primus_perf.base.errors import Interrupted, UserError
from primus_perf.base.programs import StepMarks, StopProgram, run_target
from primus_perf.base.programs import exit_code as code_of
from primus_perf.profiler.capture import (
    CaptureResult,
    Schedule,
    base_manifest,
    meet_ranks,
    parse_ranks,
    prepare_out_dir,
    profile_window,
    trace_name,
    write_manifest,
)


class _Steps:
    """The schedule driven by the script's step marks (``programs.StepMarks``)."""

    def __init__(self, out: Path, schedule: Schedule, rank: int, traced: bool,
                 on_step: Callable[[dict[str, Any]], None] | None, stop: bool = False) -> None:
        self.out, self.schedule, self.rank, self.traced, self.on_step = out, schedule, rank, traced, on_step
        self.stop = stop  # end the program once the schedule's last step is marked
        self.phases = schedule.phases()
        self.records: list[dict[str, Any]] = []
        self._open = contextlib.ExitStack()  # the open profile_window context
        self.window: Any = None
        self.trace: Path | None = None
        self.marks = StepMarks(self.mark)

    def mark(self, i: int, seconds: float, _loss: Any = None) -> None:
        if i >= len(self.phases):
            return  # past the schedule: the script runs on, unrecorded
        rec = {"index": i, "phase": self.phases[i], "time_s": seconds}
        self.records.append(rec)
        if self.on_step is not None:
            self.on_step(rec)
        if self.window is not None:
            self.window.step()
        s = self.schedule
        if i + 1 == s.baseline:
            self.open()
        elif i + 1 == s.baseline + s.wait + s.warmup + s.active:
            try:
                self.close()
            finally:
                meet_ranks()  # every rank, traced or not: an untraced rank that went on alone left the others waiting
        if self.stop and i + 1 == len(self.phases):
            raise StopProgram

    def open(self) -> None:
        if self.traced:
            s = self.schedule
            window = profile_window(self.out / trace_name(self.rank), active=s.active, warmup=s.warmup, wait=s.wait)
            self.window = self._open.enter_context(window)

    def close(self) -> None:
        if self.window is not None:
            self.window = None
            self._open.close()
            self.trace = self.out / trace_name(self.rank) if (self.out / trace_name(self.rank)).is_file() else None


def check_target(target: Sequence[str]) -> None:
    """UserError unless ``target`` names a program: a script file, or ``-m module``."""
    if not target or not (target[0] == "-m" or Path(target[0]).is_file()):
        raise UserError(f"no script to run: {target[0] if target else 'nothing'} after -- is not a file"
                        " (script.py args, or -m module args)")


def capture_program(target: Sequence[str], out_dir: str | Path, schedule: Schedule, *, ranks: str | None = None,
                    on_step: Callable[[dict[str, Any]], None] | None = None, overwrite: bool = False,
                    stop: bool = False) -> CaptureResult:
    """Run ``script.py args`` (or ``-m module args``) in this process, profiling a window of
    its steps (see the module docstring) into a run folder (an empty one, or ``overwrite``);
    every rank under torchrun; ``stop``: end the program once the schedule's steps are marked
    (its remaining steps not run). The script's exit code other than 0 is raised as SystemExit
    after the run folder is written; Ctrl-C keeps what was recorded (``Interrupted``)."""
    check_target(target)
    rank, world = environment.get("RANK"), environment.get("WORLD_SIZE")
    traced = parse_ranks(ranks, world)
    out = prepare_out_dir(out_dir, overwrite=overwrite)
    steps = _Steps(out, schedule, rank, rank in traced, on_step if rank == 0 else None, stop)
    if schedule.baseline == 0:
        steps.open()
    exit_code: int | None = None
    try:
        with steps.marks:
            run_target(target)
    except StopProgram:  # the schedule's steps are in (stop)
        pass
    except SystemExit as exc:
        exit_code = code_of(exc)
    except UserError:
        raise
    except Exception:  # the script's own error: its traceback, as Python prints it; the folder is written
        traceback.print_exc()
        exit_code = 1
    except KeyboardInterrupt:
        steps.close()
        _write(steps, world, traced, target, interrupted=True)
        raise Interrupted(f"after {len(steps.records)} steps; wrote {out}") from None
    finally:
        with contextlib.suppress(Exception):
            steps.close()
    recorded = sum(r["phase"] == "active" for r in steps.records)
    if not recorded and rank in traced:
        how = "primus_perf.profile_step() calls" if steps.marks.explicit else "optimizer.step() calls"
        if exit_code:
            raise UserError(f"the program exited with code {exit_code} after {len(steps.records)} steps ({how});"
                            " no step was recorded")
        raise UserError(f"the program marked {len(steps.records)} steps ({how}), and the window needs"
                        f" {schedule.baseline + schedule.wait + schedule.warmup + 1} to record one: run more steps,"
                        " or lower --baseline, --wait or --warmup" + ("" if steps.records else
                        "; mark each step with primus_perf.profile_step() when the program has no optimizer"))
    result = CaptureResult(out_dir=out, trace=steps.trace, steps=steps.records, manifest=_write(steps, world, traced,
                                                                                                 target))
    if exit_code:
        raise SystemExit(exit_code)
    return result


def _write(steps: _Steps, world: int, traced: list[int], target: Sequence[str], interrupted: bool = False
           ) -> dict[str, Any]:
    if steps.rank != 0:
        return {}
    extra: dict[str, Any] = {"program": list(target), "step_marks": "profile_step" if steps.marks.explicit else
                             "optimizer.step"}
    if interrupted:
        extra["interrupted"] = True
    manifest = base_manifest(steps.schedule, steps.records, world_size=world, traced_ranks=traced, extra=extra)
    write_manifest(steps.out, manifest)
    return manifest

