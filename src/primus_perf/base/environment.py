"""The one module that reads the process's environment (the architecture test: no other one
mentions ``os.environ``). :data:`VARIABLES` declares every variable the package reads, once;
:func:`get` reads one; :func:`copy` is what a child process is given; a process started inside
:func:`changed` inherits its changes. (``primus_perf_enable.pth`` reads ``PRIMUS_PERF_CACHE``
itself: one line that runs before any import.)"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from primus_perf.base.errors import UserError

# name -> (type, default, meaning). An int unset or empty is its default; a bool unset is its
# default, and set, a False default turns True only at "1", a True default False only at "0".
VARIABLES: dict[str, tuple[type, Any, str]] = {
    "PRIMUS_PERF_CACHE": (str, None, "a tuning cache enabled in every Python process (primus_perf_enable.pth)"),
    "PRIMUS_PERF_ONLINE": (bool, False, "1: with PRIMUS_PERF_CACHE, new problems are tuned online too"),
    "PRIMUS_PERF_NATIVE": (bool, True, "0: the GEMM dispatch's Python overrides only (no native one built)"),
    "RANK": (int, 0, "torchrun: this process's rank (rank 0 speaks and writes)"),
    "LOCAL_RANK": (int, 0, "torchrun: this process's GPU on its node"),
    "WORLD_SIZE": (int, 1, "torchrun: the job's processes (above 1: join a process group)"),
    "CUDA_VISIBLE_DEVICES": (str, "", "the GPUs this process sees, comma-separated"),
    "HIP_VISIBLE_DEVICES": (str, "", "AMD: the GPUs this process sees, comma-separated"),
    "TRITON_INTERPRET": (bool, False, "1: Triton kernels run on the CPU (the grouped GEMM's Triton backend)"),
    "CUDA_HOME": (str, "/usr/local/cuda", "where cuBLASLt is looked for after torch's own"),
    "ROCM_PATH": (str, "/opt/rocm", "where hipBLASLt is looked for after torch's own"),
    "COLUMNS": (str, "", "the console's width where the output is not a terminal"),
    "PYTORCH_CUDA_ALLOC_CONF": (str, "", "torch's allocator (the step plan's allocator lever adds to it)"),
}
_LOCK = threading.RLock()


def get(name: str) -> Any:
    """The value of a declared variable (:data:`VARIABLES`), of its type."""
    (kind, default, _), value = VARIABLES[name], os.environ.get(name)
    if value is None or (kind is int and not value):
        return default
    if kind is bool:
        return value != "0" if default else value == "1"
    try:
        return kind(value)
    except ValueError:
        raise UserError(f"{name}={value!r} is not a whole number") from None


def copy(changes: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with ``changes`` (None: removed): what a child process is given."""
    env = dict(os.environ)
    _apply(env, changes or {})
    return env


def _apply(env: Any, changes: Mapping[str, str | None]) -> None:
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v


def set_here(name: str, value: str) -> None:
    """Set ``name`` in this process for good (for a library that reads it later: torch's allocator)."""
    os.environ[name] = value


@contextmanager
def changed(changes: Mapping[str, str | None]) -> Iterator[None]:
    """This process's environment with ``changes`` (None: removed) while the block runs, one
    block at a time, then as it was: a process started in the block (spawn) inherits them."""
    with _LOCK:
        saved = {k: os.environ.get(k) for k in changes}
        try:
            _apply(os.environ, changes)
            yield
        finally:
            _apply(os.environ, saved)
