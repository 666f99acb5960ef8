"""Tuning on every GPU of a machine: one worker process per GPU, one cache, one progress.

:func:`tune_on_gpus` first starts one process per GPU, at most one per problem (``spawn``;
each sees only its GPU through the vendor's visible-devices variable, so it runs on device
0 and its cache entries carry that GPU's identity); while they start (interpreter, torch,
the GPU, the BLAS library: seconds) the parent dedupes and checks the problems. A worker
builds its tuner and a :class:`~primus_perf.tuner.core.Runner`, says it is ready, and is
handed one problem at a time over its own pipe: the costliest left (:func:`flops_of`, the
only estimate there is), then the next when it reports the last one done. A problem's time
follows its budget, candidate count and library far more than its FLOPs, so a split made
before the start would leave one GPU idle while another works through a longer share;
pulling keeps every GPU busy until the queue is empty, whatever each problem costs. The
runner skips problems the cache holds for its GPU and library (resume) and writes the
cache after each problem; the cache store serializes the writes with its file lock and
re-reads the file before writing, so every worker's entries end up in the one file.

A worker sends ``("ready", (launch s, start-up s))``, ``("step", label)``, ``("done",
result)`` and, when it fails, ``("error", one line)``; the parent answers ``ready`` and
``done`` with a problem, or with ``None``: stop. It feeds one
:class:`~primus_perf.tuner.core.Progress` and returns a :class:`MultiGpuRun` whose
``workers`` say, per GPU, the start-up (spawn to ready), the problems finished and the
time spent on them (:class:`WorkerStats`).

Ctrl-C (or SIGTERM, to the parent or its whole process group as a batch system sends it):
the workers start with SIGINT and SIGTERM blocked, so only the parent sees them (a worker
interrupted inside a message would leave a torn one in its pipe);
the parent hands out nothing more, stops the workers still starting, and lets each busy
worker finish its current problem (its entry is kept). Ctrl-C again, or
:data:`STOP_GRACE_S` later, stops them where they are (SIGKILL: they block SIGTERM). The run is ``interrupted``,
``remaining`` holds what was not done, and the same call resumes.

A worker that dies (killed, crashed) is reported in ``failures``. The problem it held may
be what killed it (a library fault on that shape) or not (the OOM killer, a stray kill):
it goes back to the end of the queue once, so it is retried by a surviving worker after
every other problem was handed out; a problem that kills workers costs at most one more of
them, and only at the end. If the retry dies too, the problem stays in ``remaining``. A
worker that reports an error (an exception in its tuner or runner, which would recur)
stops; its problem is not retried. No worker is started in a dead one's place.

The worker is injectable (``worker=``): a picklable function ``(job, conn)``; the default,
:func:`run_worker`, builds the tuner with ``job.make_tuner()`` in the worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any

from primus_perf.base import environment
from primus_perf.base.errors import UserError, interrupts_caught, one_line
from primus_perf.tuner import core
from primus_perf.tuner.measure import Timer

# the variable that restricts a process to some GPUs, per vendor ("cpu": tests, no effect)
VISIBLE_DEVICES_ENV = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES", "cpu": "CUDA_VISIBLE_DEVICES"}
STOP_GRACE_S = 60.0  # after Ctrl-C, how long workers get to finish their problem
JOIN_S = 10.0  # how long an exited or killed worker is waited for
WORKER_BLOCKED = {signal.SIGINT, signal.SIGTERM}  # the parent's to act on (see the module docstring)
POLL_S = 0.2  # how often the parent looks for Ctrl-C while it waits for the workers


def flops_of(problem: Any) -> int:
    """FLOPs of one timed call of a problem's candidates (attention: forward + backward):
    the order problems are handed out in, and the TFLOP/s of result tables."""
    if hasattr(problem, "forward_flops"):
        return problem.forward_flops + problem.backward_flops
    return problem.flops


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
    """What one worker needs: its GPU (its only visible one), the cache, how to build its
    tuner, the budget per problem, an injected timer, and when the parent spawned it
    (``time.time()``: the clock every process of the machine shares)."""

    gpu: int
    cache: str
    make_tuner: Callable[[], core.Tuner]
    budget_s: float
    timer: Timer | None = None
    spawned_at: float = 0.0


@dataclass
class WorkerStats:
    """One worker's part of a run, in seconds: ``startup_s`` from its spawn to its first
    request for a problem (None when it never got there), of which ``launch_s`` to the
    worker function (interpreter, imports: torch, the tuner's modules) and the rest its
    tuner's set-up (the GPU, the BLAS library); ``problems`` it finished; ``busy_s`` from
    each hand-out to the result (the cache look-up and write included)."""

    gpu: int
    launch_s: float | None = None
    startup_s: float | None = None
    problems: int = 0
    busy_s: float = 0.0

    def summary(self) -> str:
        if self.startup_s is None:
            return f"gpu {self.gpu}: never ready"
        return (f"gpu {self.gpu}: start-up {self.startup_s:.1f} s ({self.launch_s:.1f} s to launch),"
                f" {self.problems} problems in {self.busy_s:.1f} s")


@dataclass
class MultiGpuRun(core.TuneRun):
    """A :class:`~primus_perf.tuner.core.TuneRun` with what each GPU's worker did."""

    workers: list[WorkerStats] = field(default_factory=list)


def run_worker(job: WorkerJob, conn: Connection) -> None:
    """The default worker: its tuner and runner (its start-up), then each problem the
    parent hands it, until it is handed ``None``; ``("error", message)`` when it fails.
    Handed ``None``, it leaves at once: every entry is in the cache, and the interpreter's
    teardown (torch, the GPU context) would hold up the parent's join for about a second."""
    launch_s = time.time() - job.spawned_at
    try:
        tuner = job.make_tuner()
        runner = core.Runner(job.cache, [tuner], timer=job.timer, budget_s=job.budget_s)
        conn.send(("ready", (launch_s, time.time() - job.spawned_at)))
        while (problem := conn.recv()) is not None:
            conn.send(("done", runner.handle(problem, lambda label: conn.send(("step", label)))))
    except Exception as exc:  # reported by the parent as this GPU's failure
        with contextlib.suppress(OSError):  # the parent may be gone
            conn.send(("error", one_line(exc)))
        return
    finally:
        conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _key(problem: Any) -> tuple[str, str]:
    return type(problem).__name__, problem.key()


@dataclass
class _Worker:
    """The parent's view of one worker."""

    stats: WorkerStats
    proc: Any
    conn: Connection
    held: Any = None  # the problem it works on
    handed_at: float = 0.0
    stopped: bool = False  # told to stop, or terminated by the parent: its exit is no failure
    error: str = ""  # what it reported before it exited

    @property
    def name(self) -> str:
        return f"gpu {self.stats.gpu}"


def _start(job: WorkerJob, worker: Callable[[WorkerJob, Connection], None], env_name: str, ctx: Any) -> _Worker:
    """Start one worker process that sees only GPU ``job.gpu`` (of the parent's visible ones)
    and never sees Ctrl-C or SIGTERM (blocked from its first instruction: the mask outlives exec)."""
    mine, theirs = ctx.Pipe()
    resource_tracker.ensure_running()  # its first start unblocks SIGINT, a worker's start would run it
    ids = [s for s in environment.get(env_name).split(",") if s.strip()]
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_BLOCKED)
    try:  # a spawned process takes the environment and the signal mask at its start
        job.spawned_at = time.time()
        proc = ctx.Process(target=worker, args=(job, theirs), name=f"primus-tune-gpu{job.gpu}", daemon=True)
        with environment.changed({env_name: ids[job.gpu] if ids else str(job.gpu)}):
            proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    theirs.close()  # the worker holds the only other end: EOF when it exits
    return _Worker(WorkerStats(job.gpu), proc, mine)


class _Dispatcher:
    """The parent's loop: hands problems to the workers that ask, costliest first; records
    results, failures and each worker's time; stops on Ctrl-C (see the module docstring)."""

    def __init__(self, workers: list[_Worker], problems: list[Any], progress: core.Progress,
                 interrupts: list[int]) -> None:
        self.live = {w.conn: w for w in workers}
        self.queue = deque(sorted(problems, key=flops_of, reverse=True))
        self.progress = progress
        self.interrupts = interrupts
        self.idle: list[_Worker] = []  # ready, waiting for a problem a dying worker may leave
        self.retried: set[tuple[str, str]] = set()
        self.done: dict[tuple[str, str], core.TuneResult] = {}
        self.failures: list[str] = []
        self.started = 0

    def run(self) -> None:
        deadline = None
        while self.live:
            if self.interrupts and deadline is None:
                deadline = time.monotonic() + STOP_GRACE_S
                self.progress.step("stopping: each GPU finishes its problem (Ctrl-C again to stop now)")
                self.hand_out()
            if len(self.interrupts) > 1 or (deadline is not None and time.monotonic() > deadline):
                for w in self.live.values():
                    self.terminate(w)
            for conn in wait(list(self.live), timeout=POLL_S):
                self.receive(self.live[conn])

    def receive(self, w: _Worker) -> None:
        try:
            event, payload = w.conn.recv()
        except (EOFError, OSError):  # the worker exited
            self.exited(w)
        else:
            if event == "ready":
                w.stats.launch_s, w.stats.startup_s = payload
                self.progress.step(f"{w.name}: ready after {w.stats.startup_s:.1f} s")
                self.idle.append(w)
            elif event == "step":
                self.progress.step(f"{w.name}: {payload}")
            elif event == "done":
                self.done[_key(payload.problem)] = payload
                w.stats.problems += 1
                w.stats.busy_s += time.monotonic() - w.handed_at
                w.held = None
                self.progress.done(payload)
                self.idle.append(w)
            elif event == "error":
                w.error = payload
        self.hand_out()

    def hand_out(self) -> None:
        """Hand problems to idle workers; once none can come (the queue is empty and no
        worker holds one that may come back, or Ctrl-C), stop the idle workers and those
        still starting."""
        while self.idle and self.queue and not self.interrupts:
            self.hand(self.idle.pop(0), self.queue.popleft())
        if self.interrupts or not (self.queue or any(w.held is not None for w in self.live.values())):
            for w in self.live.values():
                if w in self.idle:
                    self.stop(w)
                elif w.stats.startup_s is None and not w.stopped:
                    self.terminate(w)
            self.idle.clear()

    def hand(self, w: _Worker, problem: Any) -> None:
        w.held, w.handed_at = problem, time.monotonic()
        self.progress.problem(problem, self.started)
        self.started += 1
        with contextlib.suppress(OSError):  # it died: its exit reports the problem it held
            w.conn.send(problem)

    def stop(self, w: _Worker) -> None:
        w.stopped = True
        with contextlib.suppress(OSError):
            w.conn.send(None)

    def terminate(self, w: _Worker) -> None:
        w.stopped = True
        w.proc.kill()  # workers block SIGTERM

    def exited(self, w: _Worker) -> None:
        w.proc.join(JOIN_S)
        del self.live[w.conn]
        w.conn.close()
        if w in self.idle:
            self.idle.remove(w)
        if w.error:  # an exception: it would recur, so its problem is not retried
            self.failures.append(f"{w.name}: {w.error}" + (f" (tuning {w.held})" if w.held is not None else ""))
        elif w.stopped:
            return
        elif w.held is None:
            when = "before it was ready" if w.stats.startup_s is None else "between problems"
            self.failures.append(f"{w.name}: worker exited with code {w.proc.exitcode} {when}")
        else:
            survivors = any(not o.stopped for o in self.live.values())
            again = _key(w.held) not in self.retried and not self.interrupts and survivors
            if again:
                self.retried.add(_key(w.held))
                self.queue.append(w.held)
            self.failures.append(f"{w.name}: worker exited with code {w.proc.exitcode} while tuning {w.held};"
                                 + (" handed to another GPU" if again else " not retried"))


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
) -> MultiGpuRun:
    """Tune ``problems`` on ``gpus`` GPUs, one worker process each, into one ``cache``
    (see the module docstring). ``make_tuner`` and ``worker`` must be picklable (a class,
    a ``functools.partial`` of one, a module-level function)."""
    from primus_perf.base.devices import gpu_vendor

    unique = list({_key(p): p for p in problems}.values())
    progress = progress or core.Progress()
    ctx = multiprocessing.get_context("spawn")
    env_name = VISIBLE_DEVICES_ENV[gpu_vendor()]
    with interrupts_caught() as interrupts:
        # started first: their start-up overlaps the checks below
        workers = [_start(WorkerJob(gpu, str(cache), make_tuner, budget_s, timer), worker, env_name, ctx)
                   for gpu in range(min(max(1, gpus), len(unique)))]
        try:
            checker = make_tuner()  # option and problem errors once, here, not in every worker
            for p in unique:
                checker.check(p)
            progress.start(len(unique))
            dispatcher = _Dispatcher(workers, unique, progress, interrupts)
            dispatcher.run()
        finally:
            for w in workers:
                if w.proc.is_alive():
                    w.proc.kill()  # workers block SIGTERM
                w.proc.join(JOIN_S)  # a process stuck in the driver is not waited for
    done = dispatcher.done
    return MultiGpuRun(
        results=[done[_key(p)] for p in unique if _key(p) in done],
        remaining=[p for p in unique if _key(p) not in done],
        interrupted=bool(interrupts), cache_path=str(cache), failures=dispatcher.failures,
        workers=[w.stats for w in workers],
    )
