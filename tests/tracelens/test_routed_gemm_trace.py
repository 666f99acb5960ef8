"""The router's traced operator ``primus_perf::gemm`` records like ``aten::mm``: the trace
analyzer finds the same problem and FLOPs (CPU; the GPU test runs the real cuBLASLt launch)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from primus_perf.kernels import gemm
from primus_perf.problems import GemmProblem
from primus_perf.tracelens.analyze import analyze


class _MmRouter(gemm.GemmRouter):
    """A GEMM router whose slot 0 is torch.mm (the real launch needs cuBLASLt and a GPU)."""

    def launch(self, slot, a, b):
        return torch.mm(a, b)


def test_traced_op_is_modeled_like_mm(tmp_path: Path) -> None:
    router = _MmRouter([])
    op = gemm.traced_gemm_op()
    x, w = torch.randn(48, 32), torch.randn(80, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        y = op(x, w.T, router.id, 0)
        ref = torch.mm(x, w.T)
    torch.testing.assert_close(y, ref)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    a = analyze([path])
    p = GemmProblem.from_row_major(48, 80, 32, b_transposed=True, dtype="f32")
    assert set(a.gemm_problems["key"]) == {p.key()}
    assert list(a.gemm_problems["calls"]) == [2]  # the traced op and aten::mm: one problem (no steps: one)
    assert a.gemm_problems["flops"].iloc[0] == p.flops


def test_routers_are_held_weakly_by_the_traced_op() -> None:
    """The op finds routers by id without keeping them alive: no registry that grows."""
    gc.collect()  # routers of earlier tests that only a collection frees
    before = len(gemm._live_routers)
    routers = [_MmRouter([]) for _ in range(5)]
    assert len(gemm._live_routers) == before + 5
    routers[0].close()
    assert routers[0].id not in gemm._live_routers
    del routers
    gc.collect()
    assert len(gemm._live_routers) == before
