"""Figures across the job's ranks: collective bus bandwidth over message sizes and the
point-to-point bandwidth matrix (NCCL/RCCL on GPUs, gloo on the CPU).

Bus bandwidth follows the usual convention: algorithm bandwidth (message bytes / time;
the message is the all-reduce buffer, the all-gather output, the reduce-scatter input,
the all-to-all buffer) times 2(n-1)/n for all-reduce and (n-1)/n for the others; the
time of a collective is the slowest rank's. Within one node, the largest message's bus
bandwidth is expected to reach :data:`COLLECTIVE_FLOOR` of the GPU's interconnect figure
(:data:`LINKS`, one direction); across nodes the network is not in the table, so those
figures are reported without a bound.

The P2P matrix: every ordered pair of ranks on the same node, and each rank to the rank
one node further (its counterpart on the next node, the inter-node links), one pair at a time,
``src`` sending to ``dst``. A link below the threshold of the median of its kind
(intra-node or inter-node) is flagged; intra-node links are also held to
:data:`P2P_FLOOR` of the per-pair figure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from primus_perf.profiler.preflight.checks import Measurement

MiB = 1 << 20
GPU_SIZES = (1 * MiB, 16 * MiB, 256 * MiB)
CPU_SIZES = (64 * 1024, 1 * MiB)
P2P_BYTES = {"gpu": 256 * MiB, "cpu": 1 * MiB}
REPS = {"gpu": 20, "cpu": 5}
COLLECTIVE_FLOOR = 0.5  # bus bandwidth of the largest message, of the per-GPU link figure
P2P_FLOOR = 0.6  # of the per-pair link figure

# Interconnect datasheet figures per GPU model (devices.PEAK_TABLE keys), GB/s in one
# direction: (all links of one GPU, between two GPUs). NVLink through NVSwitch gives a
# pair the whole figure; AMD's fully connected xGMI mesh gives a pair one link.
LINKS: dict[str, tuple[float, float]] = {
    "h200": (450.0, 450.0),
    "h100-sxm": (450.0, 450.0),
    "h100-nvl": (300.0, 300.0),
    "h100-pcie": (64.0, 64.0),
    "a100-sxm": (300.0, 300.0),
    "a100-sxm-40gb": (300.0, 300.0),
    "a100-pcie": (32.0, 32.0),
    "mi355x": (537.6, 76.8),
    "mi325x": (448.0, 64.0),
    "mi300x": (448.0, 64.0),
}


@dataclass
class Job:
    """The ranks of the job as preflight sees them."""

    rank: int
    world: int
    nodes: list[int]  # node index of every rank (ranks with the same host name share one)
    device: str  # "gpu" or "cpu"
    links: tuple[float, float] | None  # LINKS row of the GPU model, when known


def _sync(device: str) -> None:
    if device == "gpu":
        import torch

        torch.cuda.synchronize()


def _timed(job: Job, fn: Callable[[], object], reps: int) -> float:
    """Seconds per call of a collective, the slowest rank's (after one warm-up call)."""
    import torch
    import torch.distributed as dist

    fn()
    _sync(job.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(job.device)
    elapsed = torch.tensor([(time.perf_counter() - start) / reps], dtype=torch.float64,
                           device="cuda" if job.device == "gpu" else "cpu")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _collectives(n: int, nbytes: int, device: Any) -> dict[str, tuple[Callable[[], object], float]]:
    """name -> (one call on a message of about ``nbytes``, bus bandwidth factor)."""
    import torch
    import torch.distributed as dist

    count = max(n, nbytes // 4 // n * n)  # float32 elements, a multiple of n
    full = torch.ones(count, device=device)
    part = torch.ones(count // n, device=device)
    out = torch.empty_like(full)
    # newer torch names the tensor forms *_single; older ones only *_into_tensor / *_tensor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {
        "all_reduce": (lambda: dist.all_reduce(full), 2 * (n - 1) / n),
        "all_gather": (lambda: gather(out, part), (n - 1) / n),
        "reduce_scatter": (lambda: scatter(part, full), (n - 1) / n),
        "all_to_all": (lambda: dist.all_to_all_single(out, full), (n - 1) / n),
    }


def collective_measurements(job: Job, sizes: tuple[int, ...]) -> list[Measurement]:
    """Bus bandwidth of each collective at each size (every rank calls; rank 0's list counts)."""
    device = "cuda" if job.device == "gpu" else "cpu"
    subject = f"job ({job.world} ranks, {len(set(job.nodes))} node{'s' if len(set(job.nodes)) > 1 else ''})"
    single_node = len(set(job.nodes)) == 1
    out = []
    for size in sizes:
        for name, (fn, factor) in _collectives(job.world, size, device).items():
            seconds = _timed(job, fn, REPS[job.device])
            busbw = size / seconds * factor / 1e9
            expected, note = None, ""
            if not single_node:
                note = "across nodes: the network is not in the datasheet table"
            elif job.links and size == max(sizes):
                expected = COLLECTIVE_FLOOR * job.links[0]
                note = f"{COLLECTIVE_FLOOR:.0%} of the {job.links[0]:g} GB/s per-GPU link figure"
            elif job.links:
                note = "only the largest message is held to the link figure"
            out.append(Measurement("collective", f"{name} {_size_text(size)}", subject, busbw, "GB/s",
                                   expected, note if expected else "", reason="" if expected else note))
    return out


def _size_text(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"


def link_pairs(nodes: list[int]) -> list[tuple[int, int]]:
    """Ordered pairs measured: every pair on one node, and each rank to the rank one node
    further (its counterpart on the next node) when there are several nodes."""
    world = len(nodes)
    pairs = [(s, d) for s in range(world) for d in range(world) if s != d and nodes[s] == nodes[d]]
    per_node = nodes.count(nodes[0])
    if len(set(nodes)) > 1:
        pairs += [(r, (r + per_node) % world) for r in range(world)]
    return pairs


def p2p_measurements(job: Job) -> list[Measurement]:
    """The P2P matrix (every rank calls; rank 0 returns all links, the others [])."""
    import torch
    import torch.distributed as dist

    device = "cuda" if job.device == "gpu" else "cpu"
    nbytes, reps = P2P_BYTES[job.device], REPS[job.device]
    buf = torch.ones(nbytes // 4, device=device)
    mine: list[tuple[int, int, float]] = []
    for src, dst in link_pairs(job.nodes):
        dist.barrier()
        if job.rank not in (src, dst):
            continue
        peer = dst if job.rank == src else src
        move = dist.send if job.rank == src else dist.recv
        move(buf, peer)  # warm-up: the connection is set up here
        _sync(job.device)
        start = time.perf_counter()
        for _ in range(reps):
            move(buf, peer)
        _sync(job.device)
        if job.rank == dst:
            mine.append((src, dst, nbytes * reps / (time.perf_counter() - start) / 1e9))
    everyone: list[Any] = [None] * job.world
    dist.all_gather_object(everyone, mine)
    if job.rank != 0:
        return []
    out = []
    for src, dst, gb_s in sorted(x for part in everyone for x in part):
        intra = job.nodes[src] == job.nodes[dst]
        kind = "intra-node" if intra else "inter-node"
        expected = P2P_FLOOR * job.links[1] if intra and job.links and job.device == "gpu" else None
        out.append(Measurement(
            "p2p", f"{kind} send/recv {_size_text(nbytes)}", f"link {src}->{dst}", gb_s, "GB/s", expected,
            f"{P2P_FLOOR:.0%} of the {job.links[1]:g} GB/s per-pair link figure" if expected else "",
            peers=True, peer_key=kind))
    return out
