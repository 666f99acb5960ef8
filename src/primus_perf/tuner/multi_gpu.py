"""Tuning on every GPU of a machine: one worker process per GPU, one cache, one progress.

:func:`tune_on_gpus` dedupes the problems, splits them over ``gpus`` workers so that each
gets about the same estimated cost (:func:`split_by_cost`: FLOPs, largest first to the
least loaded worker), and starts one process per GPU (``spawn``; the worker sees only its
GPU through the vendor's visible-devices variable, so it runs on device 0 and its cache
entries carry that GPU's identity). Each worker runs the core loop (:func:`core.tune`) on
its share, so it skips problems the cache already holds (resume) and writes the cache
after each problem; the cache store serializes the workers' writes with its file lock and
re-reads the file before writing, so every worker's entries end up in the one file.

Each worker reports over its own pipe (a worker killed mid-message tears only its own
pipe, never a lock the others need): the problem it starts, its steps, each finished
:class:`~primus_perf.tuner.core.TuneResult`, and at the end whether it was interrupted.
The parent feeds them to one :class:`~primus_perf.tuner.core.Progress`. Ctrl-C reaches
every process of the terminal's group: the workers stop after their current problem as
the core loop does; the run returned says what remains, and the same call resumes. A
worker that dies (killed, crashed) is reported in ``failures``; its unfinished problems
are in ``remaining``.

The worker is injectable (``worker=``): a picklable function ``(job, conn)``; the
default, :func:`run_worker`, builds the tuner with ``job.make_tuner()`` in the worker.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from primus_perf.errors import UserError, one_line
from primus_perf.tuner import core
from primus_perf.tuner.timing import Timer

# the variable that restricts a process to some GPUs, per vendor ("cpu": tests, no effect)
VISIBLE_DEVICES_ENV = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES", "cpu": "CUDA_VISIBLE_DEVICES"}
STOP_GRACE_S = 60.0  # after Ctrl-C, how long workers get to finish their problem


def flops_of(problem: Any) -> int:
    """FLOPs of one timed call of a problem's candidates (attention: forward + backward):
    the cost estimate the split balances, and the TFLOP/s of result tables."""
    if hasattr(problem, "forward_flops"):
        return problem.forward_flops + problem.backward_flops
    return problem.flops


def split_by_cost(
    problems: Sequence[Any], n: int, cost: Callable[[Any], float] = flops_of
) -> list[list[Any]]:
    """``n`` shares of about equal total cost (longest-processing-time first: each problem,
    costliest first, to the share with the least cost so far); each share keeps the input
    order. Shares may be empty when there are fewer problems than ``n``."""
    loads = [0.0] * n
    owner: dict[int, int] = {}
    for i in sorted(range(len(problems)), key=lambda i: -cost(problems[i])):
        w = min(range(n), key=lambda w: (loads[w], w))
        owner[i] = w
        loads[w] += cost(problems[i])
    return [[p for i, p in enumerate(problems) if owner[i] == w] for w in range(n)]


def resolve_gpus(spec: str | int) -> int:
    """``--gpus`` value -> number of GPUs: a positive count, or ``all`` (every visible GPU).
    UserError for anything else, or for more GPUs than are visible."""
    import torch

    visible = torch.cuda.device_count()
    text = str(spec).strip().lower()
    if text == "all":
        if visible == 0:
            raise UserError("--gpus all: no CUDA or ROCm GPU is visible to torch")
        return visible
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"--gpus must be a positive number or 'all', got {spec!r}")
    n = int(text)
    if n > 1 and n > visible:
        raise UserError(f"--gpus {n}: only {visible} GPU(s) visible to torch")
    return n


@dataclass
class WorkerJob:
    """What one worker tunes: its share of the problems, on GPU ``gpu`` (its only visible one)."""

    gpu: int
    problems: list[Any]
    cache: str
    make_tuner: Callable[[], core.Tuner]
    budget_s: float
    timer: Timer | None = None


class PipeProgress(core.Progress):
    """A worker's progress, sent to the parent as ``(event, payload)`` messages."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def problem(self, problem: Any, index: int) -> None:
        self.conn.send(("problem", problem))

    def step(self, label: str) -> None:
        self.conn.send(("step", label))

    def done(self, result: core.TuneResult) -> None:
        self.conn.send(("done", result))


def run_worker(job: WorkerJob, conn: Connection) -> None:
    """The default worker: the core loop over ``job.problems`` with ``job.make_tuner()``;
    ends with ``("end", interrupted)`` or ``("error", message)``."""
    try:
        tuner = job.make_tuner()
        run = core.tune(job.problems, cache=job.cache, tuners=[tuner], timer=job.timer,
                        progress=PipeProgress(conn), budget_s=job.budget_s)
        conn.send(("end", run.interrupted))
    except KeyboardInterrupt:
        conn.send(("end", True))
    except Exception as exc:  # reported by the parent as this GPU's failure
        conn.send(("error", one_line(exc)))
    finally:
        conn.close()


def _start(job: WorkerJob, worker: Callable[[WorkerJob, Connection], None], env_name: str,
           ctx: Any) -> tuple[Any, Connection]:
    """Start one worker process that sees only GPU ``job.gpu`` (of the parent's visible ones)."""
    receive, send = ctx.Pipe(duplex=False)
    parent_list = os.environ.get(env_name)
    ids = [s for s in parent_list.split(",") if s.strip()] if parent_list else None
    saved = parent_list
    os.environ[env_name] = ids[job.gpu] if ids else str(job.gpu)
    try:  # a spawned process takes the environment at its start
        proc = ctx.Process(target=worker, args=(job, send), name=f"primus-tune-gpu{job.gpu}", daemon=True)
        proc.start()
    finally:
        if saved is None:
            os.environ.pop(env_name, None)
        else:
            os.environ[env_name] = saved
    send.close()  # the worker holds the only write end: EOF when it exits
    return proc, receive


def tune_on_gpus(
    problems: Sequence[Any],
    *,
    cache: str | os.PathLike,
    make_tuner: Callable[[], core.Tuner],
    gpus: int,
    budget_s: float = 5.0,
    progress: core.Progress | None = None,
    worker: Callable[[WorkerJob, Connection], None] = run_worker,
    timer: Timer | None = None,
) -> core.TuneRun:
    """Tune ``problems`` on ``gpus`` GPUs, one worker process each, into one ``cache``
    (see the module docstring). ``make_tuner`` and ``worker`` must be picklable (a class,
    a ``functools.partial`` of one, a module-level function)."""
    from primus_perf.devices import gpu_vendor

    unique = list({(type(p).__name__, p.key()): p for p in problems}.values())
    checker = make_tuner()  # option and problem errors once, here, not in every worker
    for p in unique:
        checker.check(p)
    progress = progress or core.Progress()
    progress.start(len(unique))
    shares = [s for s in split_by_cost(unique, max(1, gpus)) if s]
    ctx = multiprocessing.get_context("spawn")
    env_name = VISIBLE_DEVICES_ENV[gpu_vendor()]
    live: dict[Connection, tuple[Any, WorkerJob]] = {}
    for gpu, share in enumerate(shares):
        job = WorkerJob(gpu, share, str(cache), make_tuner, budget_s, timer)
        proc, conn = _start(job, worker, env_name, ctx)
        live[conn] = (proc, job)
    done: dict[tuple[str, str], core.TuneResult] = {}
    interrupted, failures, started = False, [], 0
    ended: set[int] = set()
    deadline: float | None = None
    while live:
        try:
            ready = wait(list(live), timeout=1.0 if deadline is None else max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            interrupted, deadline = True, time.monotonic() + STOP_GRACE_S
            continue
        if deadline is not None and not ready and time.monotonic() >= deadline:
            for proc, job in live.values():
                proc.terminate()
                failures.append(f"gpu {job.gpu}: stopped after Ctrl-C (did not finish its problem in time)")
            break
        for conn in ready:
            proc, job = live[conn]
            try:
                event, payload = conn.recv()
            except (EOFError, OSError):  # the worker exited
                proc.join()
                if job.gpu not in ended:
                    failures.append(f"gpu {job.gpu}: worker exited with code {proc.exitcode} before finishing")
                del live[conn]
                continue
            if event == "problem":
                progress.problem(payload, started)
                started += 1
            elif event == "step":
                progress.step(f"gpu {job.gpu}: {payload}")
            elif event == "done":
                done[(type(payload.problem).__name__, payload.problem.key())] = payload
                progress.done(payload)
            elif event == "end":
                ended.add(job.gpu)
                interrupted = interrupted or bool(payload)
            elif event == "error":
                ended.add(job.gpu)
                failures.append(f"gpu {job.gpu}: {payload}")
    results = [done[k] for k in ((type(p).__name__, p.key()) for p in unique) if k in done]
    remaining = [p for p in unique if (type(p).__name__, p.key()) not in done]
    return core.TuneRun(results, remaining, interrupted, str(cache), failures=failures)
