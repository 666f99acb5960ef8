"""Kineto's tracepoint marks kept off the user's stderr.

When torch.profiler starts and stops, Kineto prints ``USDT:<date> <time> <pid>:<tid>
SyncActivityProfilerHandler.cpp:52] profiler_start`` (and ``profiler_stop``) on stderr: its
USDT level, above its ERROR level, so ``KINETO_LOG_LEVEL`` can hide the marks only by also
hiding Kineto's errors (CUPTI failures among them). Instead, stderr (file descriptor 2, where
the C++ library writes) goes to a temporary file while the profiler starts, steps and stops,
and everything written there except those marks is written back to stderr.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress

USDT_MARK = re.compile(rb"^USDT:\S+ \S+ \d+:\d+ \S+\] [^\n]*\n?", re.MULTILINE)


def without_marks(data: bytes) -> bytes:
    return USDT_MARK.sub(b"", data)


@contextmanager
def kineto_marks_dropped() -> Iterator[None]:
    """Within the block, what goes to stderr is kept back and written out afterwards, less
    Kineto's USDT marks (in order; the block's own exceptions go on)."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    with tempfile.TemporaryFile() as held:
        _flush()
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            _flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = memoryview(without_marks(held.read()))
            while rest:
                rest = rest[os.write(2, rest):]


def _flush() -> None:
    with suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()
