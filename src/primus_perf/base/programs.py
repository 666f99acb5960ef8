"""Running a Python program in this process, as ``python script.py args`` (or ``python -m
module args``) would: what ``python -m primus_perf.launch``, ``primus-profile run -- script.py``
and ``primus-tune confirm -- script.py`` share; where its steps end (:class:`StepMarks`,
:func:`profile_step`), and its steps driven from another thread (:class:`DrivenSteps`)."""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def run_target(target: Sequence[str]) -> None:
    """Run ``script.py args`` (or ``-m module args``) in this process as ``__main__``, with
    ``sys.argv`` as the program expects it."""
    target = list(target)
    if target[0] == "-m":
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
        runpy.run_path(target[0], run_name="__main__")


def exit_code(exc: SystemExit) -> int:
    """The exit code a ``SystemExit`` gives the shell; ``sys.exit("message")``: 1, its message
    printed to stderr, as Python prints it."""
    code = exc.code
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


# ---- a running program's steps ----------------------------------------------------------------

_LISTENING: list[StepMarks] = []  # who hears the running program's step marks


def profile_step(loss: Any = None) -> None:
    """Mark the end of one step of the running script (``primus-profile run -- script.py``,
    ``primus-tune confirm -- script.py``, ``primus-tune step -- script.py``); from its first
    call on, ``optimizer.step()`` no longer counts; ``loss``: the step's loss (a number or a
    0-d tensor), for the step tuner's loss guard. Nothing outside those commands."""
    for marks in list(_LISTENING):
        marks.mark(explicit=True, loss=loss)


def sync_gpu() -> None:
    """Wait for the GPU's queued work (a step's end is when its kernels are done)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepMarks:
    """While entered, ``on_mark(index, seconds, loss)`` at the end of each step of the program
    running in this process: each ``optimizer.step()`` of the first optimizer that steps (a post
    hook on every ``torch.optim.Optimizer``), unless the program marks its steps with
    :func:`profile_step` (from its first call on, only those count). ``seconds``: from the end
    of the previous mark's ``on_mark`` (the listener's own time is not the step's), the GPU's
    queued work waited for."""

    def __init__(self, on_mark: Callable[[int, float, Any], None]) -> None:
        self.on_mark = on_mark
        self.count = 0
        self.explicit = False
        self.optimizer: Any = None
        self._hook: Any = None
        self._t0 = 0.0

    def __enter__(self) -> StepMarks:
        import torch.optim.optimizer as optim

        self._hook = optim.register_optimizer_step_post_hook(self._stepped)
        _LISTENING.append(self)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        _LISTENING.remove(self)

    def _stepped(self, optimizer: Any, *_: Any) -> None:
        if self.optimizer is None:
            self.optimizer = optimizer
        if optimizer is self.optimizer and not self.explicit:
            self.mark()

    def mark(self, explicit: bool = False, loss: Any = None) -> None:
        self.explicit = self.explicit or explicit
        sync_gpu()
        seconds = time.perf_counter() - self._t0
        index = self.count
        self.count += 1
        self.on_mark(index, seconds, loss)
        self._t0 = time.perf_counter()


class StopProgram(BaseException):
    """Raised from a step mark to end the running program there (its remaining steps are not
    run): a BaseException, so that the program's own ``except Exception`` does not take it."""


class ProgramEnded(Exception):
    """The program stopped stepping before a driver's steps were done."""


class DrivenSteps:
    """A running program's steps driven from another thread: once :meth:`start` has been called
    at a step mark (the program's thread), the program waits at each mark until :meth:`step`
    (the driver's thread) lets it run one more step, whose seconds it returns. Between two
    steps the driver changes what the program runs through :meth:`call`, which runs a function
    in the program's own thread while it is held (what a program runs is its thread's: torch's
    compiler settings are per thread). :meth:`program_ended` (once the program returns) makes a
    waiting :meth:`step` raise :class:`ProgramEnded`."""

    def __init__(self) -> None:
        import queue

        self._times: queue.Queue[float | None] = queue.Queue()
        self._orders: queue.Queue[Callable[[], Any] | None] = queue.Queue()  # None: run a step
        self._done: queue.Queue[BaseException | None] = queue.Queue()
        self.driving = False
        self.ended = False
        self.steps = 0

    def start(self, drive: Callable[[DrivenSteps], None]) -> Any:
        """In the program's thread, at a mark: run ``drive(self)`` in a thread and hold the
        program until the driver's first :meth:`step` (or its end). Returns the thread."""
        import threading

        self.driving = True

        def run() -> None:
            try:
                drive(self)
            finally:
                self.driving = False
                self._orders.put(None)  # the program runs on

        thread = threading.Thread(target=run, name="primus-perf-driver", daemon=True)
        thread.start()
        self._serve()
        return thread

    def _serve(self) -> None:
        """In the program's thread: run the driver's calls until it lets the program step."""
        while True:
            order = self._orders.get()
            if order is None:
                return
            try:
                order()
            except BaseException as exc:  # the driver gets it
                self._done.put(exc)
            else:
                self._done.put(None)

    def at_mark(self, seconds: float) -> None:
        """In the program's thread, at each mark: hand the step's seconds to the driver and wait."""
        if not self.driving:
            return
        self._times.put(seconds)
        self._serve()

    def call(self, fn: Callable[[], Any]) -> None:
        """In the driver's thread: ``fn()`` run in the program's thread, held at its mark."""
        if self.ended:
            raise ProgramEnded(f"the program ended after {self.steps} driven steps")
        self._orders.put(fn)
        error = self._done.get()
        if error is not None:
            raise error

    def step(self) -> float:
        """In the driver's thread: one step of the program, its seconds."""
        if self.ended:
            raise ProgramEnded(f"the program ended after {self.steps} driven steps")
        self._orders.put(None)
        seconds = self._times.get()
        if seconds is None:
            raise ProgramEnded(f"the program ended after {self.steps} driven steps")
        self.steps += 1
        return seconds

    def program_ended(self) -> None:
        self.ended = True
        self._times.put(None)
