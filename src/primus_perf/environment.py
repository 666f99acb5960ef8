"""The one module that reads the process's environment (``tests/test_architecture.py``: no
other module mentions ``os.environ``). Every variable the package reads is declared once in
:data:`VARIABLES` (its type, default and meaning) and read with :func:`get`; a child process
is given :func:`copy`; a process started inside :func:`changed` inherits what it changes.
(``primus_perf_enable.pth`` reads ``PRIMUS_PERF_CACHE`` itself: one line, before any import.)"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from primus_perf.errors import UserError


@dataclass(frozen=True)
class Variable:
    """``kind`` str, int (unset or empty: ``default``) or bool (unset: ``default``; set, a
    False default turns True only at ``1``, a True default False only at ``0``)."""

    name: str
    kind: type
    default: Any
    meaning: str


VARIABLES = {v.name: v for v in (
    Variable("PRIMUS_PERF_CACHE", str, None, "a tuning cache: the start-up hook enables it in every Python "
             "process (primus_perf_enable.pth); launch's --cache default"),
    Variable("PRIMUS_PERF_ONLINE", bool, False, "1: the start-up hook tunes new problems online too"),
    Variable("PRIMUS_PERF_NATIVE", bool, True, "0: the GEMM dispatch's Python overrides only (no native one built)"),
    Variable("RANK", int, 0, "torchrun: this process's rank (rank 0 speaks and writes)"),
    Variable("LOCAL_RANK", int, 0, "torchrun: this process's GPU on its node"),
    Variable("WORLD_SIZE", int, 1, "torchrun: the job's processes (above 1: join a process group)"),
    Variable("CUDA_VISIBLE_DEVICES", str, "", "the GPUs this process sees, comma-separated"),
    Variable("HIP_VISIBLE_DEVICES", str, "", "AMD: the GPUs this process sees, comma-separated"),
    Variable("TRITON_INTERPRET", bool, False, "1: Triton kernels run on the CPU (the grouped GEMM's Triton backend)"),
    Variable("CUDA_HOME", str, "/usr/local/cuda", "where cuBLASLt is looked for after torch's own"),
    Variable("ROCM_PATH", str, "/opt/rocm", "where hipBLASLt is looked for after torch's own"),
    Variable("COLUMNS", str, "", "the console's width where the output is not a terminal"),
    Variable("PYTORCH_CUDA_ALLOC_CONF", str, "", "torch's allocator (the step plan's allocator lever adds to it)"),
)}
_LOCK = threading.RLock()


def get(name: str) -> Any:
    """The value of a declared variable (:data:`VARIABLES`), of its kind."""
    var, value = VARIABLES[name], os.environ.get(name)
    if var.kind is bool:
        return var.default if value is None else (value != "0" if var.default else value == "1")
    if var.kind is int and value:
        try:
            return int(value)
        except ValueError:
            raise UserError(f"{name}={value!r} is not a whole number") from None
    return var.default if value is None or (var.kind is int and not value) else value


def with_prefix(prefixes: tuple[str, ...]) -> dict[str, str]:
    """The variables set in this process whose names start with one of ``prefixes``, sorted."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


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
    """Set ``name`` in this process for good (a library that reads it later: torch's allocator)."""
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
