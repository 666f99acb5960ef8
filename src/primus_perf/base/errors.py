"""Errors a user can cause.

Library code raises :class:`UserError` (or a subclass) for anything the user can fix:
a bad path, bad YAML, a corrupt trace, an unknown device, no GPU. The CLI turns it into
one line on stderr and exit code 2 (see ``cli/common.py``). Any other exception is an
internal bug and may carry a traceback.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """A problem with the user's input or environment, reported as one line."""

    exit_code = 2


class ConfigError(UserError):
    """A trainer config that is malformed, has an unknown key or a wrong type."""


class OutOfMemory(ConfigError):
    """A config that did not fit the device: a result to report (one line: the estimate and
    the peak measured), not a crash."""


class TraceError(UserError):
    """A trace file that cannot be read or is not a Kineto trace."""


class DeviceError(UserError):
    """No GPU, an unsupported device, or a GPU library that cannot be loaded."""


class CacheError(UserError):
    """A tuning cache that cannot be read (corrupt, truncated, wrong schema)."""


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) caught by a command after it kept what it had: the CLI prints
    ``interrupted: <kept>`` on one line and exits with code 130. (Not a KeyboardInterrupt,
    which the CLI framework would turn into a silent exit.)"""

    exit_code = 130

    def __init__(self, kept: str) -> None:
        super().__init__(kept)
        self.kept = kept


class DivergedError(UserError):
    """Training reached a non-finite loss (exit code 3: the run stopped, the input was valid)."""

    exit_code = 3


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters): how a candidate that
    failed (a kernel that would not compile or launch) is reported beside the others."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


@contextmanager
def interrupts_caught() -> Iterator[list[int]]:
    """Catch Ctrl-C and SIGTERM while a block runs: each signal is appended to the list the
    block gets, and nothing is raised (the block decides when to stop, and how). Outside the
    main thread signals cannot be handled: the list stays empty."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def record_signal(signum: int, frame: object) -> None:
        caught.append(signum)

    previous = {sig: signal.signal(sig, record_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a block runs that must not stop halfway (a library's
    state change such as the profiler's step, or writing what was captured), then raise
    the KeyboardInterrupt at its end. Outside the main thread signals cannot be handled:
    the block runs as it is."""
    with interrupts_caught() as caught:
        yield
    if caught:
        raise KeyboardInterrupt(f"signal {caught[0]}")
