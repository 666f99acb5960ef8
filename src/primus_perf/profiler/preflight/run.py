"""Run the preflight on this process, or on every rank of a ``torchrun`` job (any number of
nodes): each rank measures its GPU, the first rank of each node its host, all ranks the
collectives and links; rank 0 gathers the figures, judges them (``checks.evaluate``) and
every rank gets the same report, so every rank exits with the same code. Rank 0 publishes
the report (prints and writes it) before any rank returns: torchrun stops a job's other
processes as soon as one exits with an error, and a failed check is such an exit."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from primus_perf.base.devices import current_device, gpu_vendor, library_versions, lookup_peaks
from primus_perf.profiler.preflight import comm, gpu, host
from primus_perf.profiler.preflight.checks import (
    DEFAULT_THRESHOLD,
    Measurement,
    PreflightReport,
    evaluate,
)


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _job() -> comm.Job:
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    hosts = _gather(socket.gethostname())
    order = list(dict.fromkeys(hosts))
    vendor = gpu_vendor()
    peaks = lookup_peaks(current_device().name) if vendor != "cpu" else None
    return comm.Job(rank, world, [order.index(h) for h in hosts], "cpu" if vendor == "cpu" else "gpu",
                    comm.LINKS.get(peaks.key) if peaks else None)


def measure_gpus(job: comm.Job, gemm_sizes: tuple[int, ...]) -> list[Measurement]:
    """This rank's GPU figures ([] without a GPU)."""
    if job.device == "cpu":
        return []
    import torch

    index = torch.cuda.current_device()
    local = job.nodes[: job.rank].count(job.nodes[job.rank])
    return gpu.gpu_measurements(f"gpu {job.rank} (node{job.nodes[job.rank]}:{local})", index, gemm_sizes)


def measure_links(job: comm.Job, sizes: tuple[int, ...] | None) -> list[Measurement]:
    """Collectives and the P2P matrix (every rank calls; rank 0 holds the figures)."""
    if job.world == 1:
        return []
    sizes = sizes or (comm.GPU_SIZES if job.device == "gpu" else comm.CPU_SIZES)
    figures = comm.collective_measurements(job, sizes)
    figures += comm.p2p_measurements(job)
    return figures if job.rank == 0 else []


def preflight(
    *,
    threshold: float = DEFAULT_THRESHOLD,
    gemm_sizes: tuple[int, ...] = gpu.GEMM_SIZES,
    collective_sizes: tuple[int, ...] | None = None,
    disk_path: str | os.PathLike = ".",
    publish: Callable[[PreflightReport], None] = lambda _report: None,
) -> PreflightReport:
    """Measure, gather and judge; ``publish`` the report on rank 0 while the other ranks
    wait (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from primus_perf.trainer.parallel import join_torchrun, leave_torchrun

    owns = join_torchrun(torch.cuda.is_available())
    try:
        job = _job()
        first_of_node = job.nodes.index(job.nodes[job.rank]) == job.rank
        mine = host.host_measurements(f"node{job.nodes[job.rank]}", disk_path) if first_of_node else []
        mine += measure_gpus(job, gemm_sizes)
        mine += measure_links(job, collective_sizes)
        facts = {"host": host.host_facts(), "device": current_device().to_dict()} if first_of_node else {
            "device": current_device().to_dict()}
        everything = _gather(([m.to_dict() for m in mine], facts))
        measurements = [Measurement.from_dict(m) for part, _ in everything for m in part]
        skipped = []
        if job.device == "cpu":
            skipped.append("GPU checks skipped: no CUDA or ROCm GPU is visible to torch")
        if job.world == 1:
            skipped.append("collective and P2P checks skipped: one process (launch with torchrun"
                           " --nproc-per-node N for them)")
        report = PreflightReport(
            evaluate(measurements, threshold), threshold,
            facts={"ranks": job.world, "nodes": len(set(job.nodes)), "versions": library_versions(),
                   "per_rank": [f for _, f in everything]},
            skipped=skipped,
        )
        try:
            if job.rank == 0:
                publish(report)
        finally:
            if dist.is_initialized():
                dist.barrier()
        return report
    finally:
        if owns:
            leave_torchrun(finished=False)  # the ranks met above, after publishing
