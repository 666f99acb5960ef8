"""Shared test setup.

Triton reads ``TRITON_INTERPRET`` when it is first imported, and any test module may be the
first to import it (through the package), so the choice is made here, before any test
module is collected: the interpreter on a machine without a GPU; on a GPU machine the
caller decides (``TRITON_INTERPRET=0 pytest -m gpu``).

A shell starts a background job (``pytest ... &``) with SIGINT ignored, its children inherit
that, and Python then installs no Ctrl-C handler in them: the tests that send Ctrl-C to a
command would see it ignored. So the suite handles SIGINT as Python does by default, and
every command it starts begins with the default disposition.

The native GEMM dispatch (``runtime/native.py``) is built before the first test, once per
machine (its build folder is shared): no test's output then holds the line that says it is
being built, whichever test enables GEMM routing first, in this process or a command it runs.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest


def _has_gpu() -> bool:
    return bool(shutil.which("nvidia-smi") or shutil.which("rocm-smi") or os.path.exists("/dev/kfd"))


if not _has_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def native_gemm_dispatch_built():
    from primus_perf.runtime import native

    return native.load()
