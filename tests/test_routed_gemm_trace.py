"""The router's traced operator ``primus_perf::gemm`` records like ``aten::mm``: the trace
analyzer finds the same problem and FLOPs (CPU; the GPU test runs the real cuBLASLt launch)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from primus_perf.problems import GemmProblem
from primus_perf.tracelens.analyze import analyze
from primus_perf.tuner import gemm_runtime


def test_traced_op_is_modeled_like_mm(tmp_path: Path) -> None:
    gemm_runtime._LAUNCHES.append(lambda a, b: torch.mm(a, b))
    slot = len(gemm_runtime._LAUNCHES) - 1
    op = gemm_runtime._traced_gemm_op()
    x, w = torch.randn(48, 32), torch.randn(80, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        y = op(x, w.T, slot)
        ref = torch.mm(x, w.T)
    torch.testing.assert_close(y, ref)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    a = analyze([path])
    p = GemmProblem.from_row_major(48, 80, 32, b_transposed=True, dtype="f32")
    assert set(a.gemm_problems["key"]) == {p.key()}
    assert list(a.gemm_problems["calls"]) == [2]  # the traced op and aten::mm: one problem (no steps: one)
    assert a.gemm_problems["flops"].iloc[0] == p.flops
