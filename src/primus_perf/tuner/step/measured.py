"""One run of a user's script measured by its own steps: the unit the script step tuner compares.

The child side (:func:`measure_program`, what ``python -m primus_perf.launch --plan P --measure
OUT`` runs): the plan applied from outside (``own_flags.install``: a known program's own flags,
the rest through ``hooks``), the script run as ``__main__``;
its steps end where ``programs.StepMarks`` says (each ``optimizer.step()`` of its first
optimizer, or ``primus_perf.profile_step()``); the first ``warmup`` steps (allocation,
compilation) are left out, the next ``steps`` are timed, each with its loss: the scalars the
script called ``.backward()`` on in that step (their sum and their mean: a script that scales
its loss by its accumulation steps sums to the step's loss, one that does not averages to it),
what a known program's loss method returned (torchtitan's), or what it gave
``profile_step(loss=...)``. Then the run stops (the script's remaining steps
are not run) and writes :class:`RunResult` as JSON. Running out of memory, the script's own
error, or too few steps are a result too (``status``), never a traceback.

The parent side (:func:`run_script`): the child started with the plan in a file, on the GPUs
given, under torchrun's variables when the tuner itself runs under torchrun (a port of its own
for the child's process group); its result read back.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from primus_perf.base import environment

OK, OUT_OF_MEMORY, CANNOT_RUN, TOO_FEW = "ok", "out of memory", "cannot run", "too few steps"
_RUNS = [0]  # children started (under torchrun every rank starts the same ones, in the same order)


@dataclass
class RunResult:
    """A measured run: ``step_s`` the timed steps' seconds, ``loss_sum``/``loss_mean`` per
    timed step (None where the step had no loss), what the plan applied (``applied``), the peak
    GPU memory (GiB), the steps the script marked."""

    status: str
    step_s: list[float] = field(default_factory=list)
    loss_sum: list[float | None] = field(default_factory=list)
    loss_mean: list[float | None] = field(default_factory=list)
    reason: str = ""
    applied: dict[str, Any] = field(default_factory=dict)
    peak_gib: float | None = None
    marked: int = 0
    seconds: float = 0.0  # the run's wall time, start-up included (the parent's clock)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunResult:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


# ---- the child --------------------------------------------------------------------------------


class _Losses:
    """The 0-d tensors the script calls ``.backward()`` on, kept (not read: no sync) until the
    step's mark reads them; or, for a program whose profile names where its loss is
    (``own_flags.ProgramProfile.loss``: torchtitan's forward-backward step, whose backward a
    CUDA graph replays without Python), what that method returns, copied (a graph's output is
    overwritten by its next replay)."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def install(self, source: str = "") -> None:
        """``source``: "module:Class.method" returning a part of the step's loss; "" (or a
        module that does not import: the program says why itself) the backward scalars."""
        import importlib

        import torch

        pending = self.pending
        if source:
            module, _, attr = source.partition(":")
            owner_name, name = attr.rsplit(".", 1)
            try:
                owner = getattr(importlib.import_module(module), owner_name)
            except (ImportError, AttributeError):
                owner = None
            if owner is not None:
                method = getattr(owner, name)

                def part(*args: Any, **kwargs: Any) -> Any:
                    out = method(*args, **kwargs)
                    if isinstance(out, torch.Tensor) and out.numel() == 1:
                        pending.append(out.detach().reshape(()).clone())
                    return out

                setattr(owner, name, part)
                return
        original = torch.Tensor.backward

        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if tensor.dim() == 0:
                pending.append(tensor.detach())
            return original(tensor, *args, **kwargs)

        torch.Tensor.backward = backward

    def take(self, given: Any) -> tuple[float | None, float | None]:
        """The step's loss (sum, mean) and forget it; ``given``: profile_step's loss."""
        values = [float(t) for t in self.pending]
        self.pending.clear()
        if given is not None:
            value = float(given)
            return value, value
        if not values:
            return None, None
        return math.fsum(values), math.fsum(values) / len(values)


def _found_device(applied: Any) -> None:
    """What the parent reads of the device without starting CUDA itself."""
    import importlib.util

    import torch

    applied.found["torchao"] = importlib.util.find_spec("torchao") is not None
    gpu = torch.cuda.is_available()
    applied.found["device"] = torch.cuda.get_device_name() if gpu else "cpu"
    applied.found["fp8_formats"] = gpu and torch.cuda.get_device_capability() >= (8, 9)


def measure_program(target: Sequence[str], plan: Mapping[str, str], out: str | os.PathLike, *, warmup: int,
                    steps: int) -> RunResult:
    """Run ``target`` with ``plan`` in this process, timed by its own steps (module docstring);
    the result is written to ``out`` (by every rank: ``out`` on rank 0, ``out.rankN`` on the
    others) and returned."""
    from primus_perf.base.errors import one_line
    from primus_perf.base.programs import StepMarks, StopProgram, exit_code, run_target
    from primus_perf.tuner.step import own_flags

    target, applied, program = own_flags.install(target, plan)
    losses = _Losses()
    losses.install(program.loss if program is not None else "")
    result = RunResult(OK)

    def on_mark(i: int, seconds: float, loss: Any) -> None:
        result.marked = i + 1
        loss_sum, loss_mean = losses.take(loss)
        if i < warmup:
            return
        result.step_s.append(seconds)
        result.loss_sum.append(loss_sum)
        result.loss_mean.append(loss_mean)
        if len(result.step_s) >= steps:
            raise StopProgram

    try:
        with StepMarks(on_mark):
            run_target(target)
    except StopProgram:  # the timed steps are in
        pass
    except SystemExit as exc:
        if exit_code(exc) != 0:
            result.status, result.reason = CANNOT_RUN, f"the script exited with {exc.code}"
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the script's own error, out of memory: a result, the next candidate goes on
        root, seen = exc, {id(exc)}  # the error under a wrapper's ("Could not import ..."); a chain may loop
        while (under := root.__cause__ or (None if root.__suppress_context__ else root.__context__)) is not None \
                and id(under) not in seen:
            root = under
            seen.add(id(under))
        oom = any(type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower() for e in (exc, root))
        result.status = OUT_OF_MEMORY if oom else CANNOT_RUN
        result.reason = one_line(exc) + (f" (from {one_line(root)})" if root is not exc else "")
        if not oom:  # the whole traceback into the run's log, where the one line points
            traceback.print_exception(exc, file=sys.stderr)
    if result.status == OK and len(result.step_s) < steps:
        result.status = TOO_FEW
        result.reason = (f"the script marked {result.marked} steps and a run needs {warmup + steps}"
                         " (warm-up and timed): give it more steps")
    _found_device(applied)
    result.applied = applied.to_dict()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        result.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    rank = environment.get("RANK")
    path = Path(out) if rank == 0 else Path(f"{out}.rank{rank}")
    from primus_perf.base.files import write_json

    write_json(path, result.to_dict())
    return result


# ---- the parent -------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(devices: str | None, port: int | None, target: Sequence[str] = ()) -> dict[str, str]:
    """The child's environment: ``devices`` its CUDA_VISIBLE_DEVICES (None: as this process's);
    ``port`` a port of its own for its process group (under torchrun: every rank's child meets
    there, as torchrun's agent store is this process's, not the child's); a ``target`` that runs
    only as a torchrun worker (torchtitan) gets one rank's variables where none are set, and a
    port of its own (``own_flags.launcher_env``)."""
    from primus_perf.tuner.step.own_flags import launcher_env

    env = environment.copy({"PYTHONUNBUFFERED": "1"} if devices is None else
                           {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": devices})
    if port is not None:
        env["MASTER_PORT"] = str(port)
        env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    return launcher_env(target, env, port if port is not None else _free_port())


def run_logged(cmd: Sequence[str], env: Mapping[str, str], log_file: Path | None, timeout_s: float) -> int | None:
    """``cmd`` in a child process, its output appended to ``log_file`` (None: dropped); its exit
    code, or None where it did not end within ``timeout_s``. Under torchrun every rank runs its
    child of the same run (in lockstep): a child that fails is said in the job's store, the other
    ranks' children (waiting for it in a collective) are stopped at once, and every rank returns
    the same code (a rank's timeout, else the first failure)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() and dist.get_world_size() > 1 else None
    _RUNS[0] += 1
    key, deadline = f"primus_perf/run/{_RUNS[0]}/failed", time.monotonic() + timeout_s
    sink = open(log_file, "a") if log_file is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        code: int | None = None
        while code is None and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=max(0.0, min(deadline - time.monotonic(), 1.0 if store else timeout_s)))
            if code is None and store is not None and store.check([key]):
                code = int(store.get(key))  # a peer's child failed: this one waits for it in vain
        if code not in (0, None) and store is not None and not store.check([key]):
            store.set(key, str(code))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if log_file is not None:
            sink.close()
    if store is None:
        return code
    codes: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(codes, code)
    return None if None in codes else next((c for c in codes if c != 0), 0)


def run_script(target: Sequence[str], plan: Mapping[str, str], *, warmup: int, steps: int,
               devices: str | None = None, port: int | None = None, timeout_s: float = 1800.0,
               log_file: Path | None = None) -> RunResult:
    """One measured run of ``target`` with ``plan`` in a child process (module docstring);
    ``log_file``: where its output goes (the last lines of it are the reason of a failed run)."""
    with tempfile.TemporaryDirectory(prefix="primus-step-") as tmp:
        plan_file, out = Path(tmp) / "plan.json", Path(tmp) / "run.json"
        plan_file.write_text(json.dumps({"levers": dict(plan)}))
        cmd = [sys.executable, "-m", "primus_perf.launch", "--plan", str(plan_file), "--measure", str(out),
               "--warmup", str(warmup), "--steps", str(steps), "--", *target]
        t0 = time.monotonic()
        code = run_logged(cmd, child_env(devices, port, target), log_file, timeout_s)
        seconds = time.monotonic() - t0
        if out.is_file():
            result = RunResult.from_dict(json.loads(out.read_text()))
        elif code is None:
            result = RunResult(CANNOT_RUN, reason=f"the run did not end within {timeout_s:.0f} s")
        else:
            last = tail(log_file)
            result = RunResult(CANNOT_RUN, reason=f"the run exited with {code} before its result" +
                               (f": {last}" if last else ""))
    result.seconds = seconds
    return result


def tail(log_file: Path | None) -> str:
    """The last line of a child's output (``log_file``; None: none kept)."""
    if log_file is None:
        return ""
    try:
        lines = [ln for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""
