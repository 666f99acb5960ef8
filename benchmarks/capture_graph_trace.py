"""Capture a small trace with CUDA graph replays (and the same work run eagerly).

The trace analyzer must link every kernel a graph replay launches to the graph launch and
the op around it; this script writes the fixture ``tests/data/traces/h100_cuda_graph.json.gz``.

    python benchmarks/capture_graph_trace.py OUT.json.gz
"""

from __future__ import annotations

import gzip
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule


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
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(tmp)) as prof:
        for _ in range(3):
            with record_function("graph_replay"):
                graph.replay()
            with record_function("eager"):
                work()
            torch.cuda.synchronize()
            prof.step()
    with open(tmp, "rb") as f, gzip.open(out, "wb") as g:
        g.write(f.read())
    os.unlink(tmp)


if __name__ == "__main__":
    main(sys.argv[1])
