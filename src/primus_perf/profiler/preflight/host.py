"""Host facts and checks: CPU model and count, memory, free disk, the collective
libraries' environment variables. Linux files where they exist, portable fallbacks else."""

from __future__ import annotations

import os
import platform
import shutil
import socket
from pathlib import Path

from primus_perf.base import environment
from primus_perf.profiler.preflight.checks import Measurement

GiB = 1 << 30
MIN_FREE_DISK_GIB = 20.0  # checkpoints, traces and caches of a run need room
MIN_AVAILABLE_MEMORY_GIB = 8.0  # data loading and pinned buffers
ENV_PREFIXES = ("NCCL_", "RCCL_", "TORCH_NCCL_", "HSA_", "HIP_", "CUDA_", "MIOPEN_", "UCX_", "FI_")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> tuple[int | None, int | None]:
    """(total, available) from /proc/meminfo; (None, None) where it cannot be read."""
    try:
        info = {
            k.strip(): int(v.split()[0]) * 1024
            for k, v in (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        }
    except (OSError, ValueError):
        return None, None
    return info.get("MemTotal"), info.get("MemAvailable")


def collective_env() -> dict[str, str]:
    """NCCL/RCCL and related variables set in this process's environment."""
    return {k: v for k, v in sorted(environment.copy().items()) if k.startswith(ENV_PREFIXES)}


def host_facts() -> dict[str, object]:
    total, available = memory_bytes()
    return {
        "hostname": socket.gethostname(), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
        "memory_total_bytes": total, "memory_available_bytes": available,
        "os": platform.platform(), "python": platform.python_version(), "env": collective_env(),
    }


def free_disk_gib(path: str | os.PathLike) -> tuple[float, Path]:
    """Free space (GiB) where ``path`` is or will be made: the file system of its nearest
    existing folder, and that folder. One UserError when none can be read."""
    from primus_perf.base.errors import UserError

    where = Path(path).resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free / GiB, where
    except OSError as exc:
        raise UserError(f"--disk {path}: cannot read the free space of {where}: {exc.strerror}") from None


def host_measurements(node: str, disk_path: str | os.PathLike = ".") -> list[Measurement]:
    """The host's checked figures: free disk where the run writes (a folder not made yet:
    where it will be), available memory, CPUs."""
    subject = f"host {node}"
    free, where = free_disk_gib(disk_path)
    _, available = memory_bytes()
    made = "" if where == Path(disk_path).resolve() else f" (to be made: {Path(disk_path).resolve()})"
    return [
        Measurement("host", "free disk", subject, free, "GiB", MIN_FREE_DISK_GIB,
                    f"room for checkpoints, traces and caches in {where}{made}"),
        Measurement("host", "available memory", subject, None if available is None else available / GiB, "GiB",
                    MIN_AVAILABLE_MEMORY_GIB, "data loading and pinned buffers",
                    reason="" if available is not None else "/proc/meminfo not readable"),
        Measurement("host", "logical CPUs", subject, float(os.cpu_count() or 0), "", peers=True),
    ]
