"""How tests run the commands: a CLI in a subprocess, in one process or under torchrun on a free
port (:func:`_run`; the trainer's by default), its JSON log's losses (:func:`_losses`), and a
kind's routing held for a block (:func:`routing`)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from primus_perf.runtime import dispatch

CLI = [sys.executable, "-m", "primus_perf.cli.train"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], nproc: int = 1, timeout: int = 240, module: str = "primus_perf.cli.train"
         ) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` (the trainer's CLI by default), under torchrun for ``nproc`` > 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}",
            "-m",
            module,
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@contextlib.contextmanager
def routing(kind: str, router: Any = None, device_type: str = "cpu", backend: str | None = None
            ) -> Iterator[dispatch.Dispatch]:
    """``router`` (None: none) in ``kind``'s dispatch, its aten overrides held (the only routing
    path), for the block; ``backend``: the grouped dispatch's backend meanwhile (what a call
    without a route runs, as the trainer sets it). The previous router and backend after it."""
    d = dispatch.of(kind)
    previous, holder = d.router, object()
    if backend is not None:
        d.set_backend(backend, owner=holder)  # the last set runs; released with the hold
    d.install(router)
    d.keep_overrides(holder, device_type)
    try:
        yield d
    finally:
        d.release(holder)
        d.install(previous)


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]
