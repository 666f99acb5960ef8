"""Capture a small trace with CUDA graph replays (and the same work run eagerly).

The trace analyzer must link every kernel a graph replay launches to the graph launch and
the op around it; this script writes the fixture ``tests/data/traces/h100_cuda_graph.json.gz``
(through ``profiler.capture.profile_window``: 1 warm-up and 2 recorded steps).

    python benchmarks/profiler/capture_graph_trace.py OUT.json.gz
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import record_function

from primus_perf.profiler.capture import profile_window


def main(out: str) -> None:
    dev = "cuda"
    a = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)

    def work() -> torch.Tensor:
        return torch.relu(torch.nn.functional.linear(a, w))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    with profile_window(out, active=2, warmup=1) as window:
        for _ in range(window.steps):
            with record_function("graph_replay"):
                graph.replay()
            with record_function("eager"):
                work()
            torch.cuda.synchronize()
            window.step()


if __name__ == "__main__":
    main(sys.argv[1])
