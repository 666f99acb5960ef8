"""Memory safety of the BLAS-Lt path on a GPU, for every layout the GEMM intercept accepts.

For each layout of :data:`LAYOUTS` (what ``aten::mm`` / ``aten::bmm`` receive: transposed
views, sliced views with ld > cols, batched and strided batches, offsets into a storage):

- every candidate the GEMM tuner validates (torch's and each heuristic algorithm) runs on
  operands of the problem's exact layout, with guard regions after each buffer checked
  after the call, and its output is compared with the fp32 product;
- the same on buffers with no guard (each its own allocation): under compute-sanitizer
  with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` any byte read or written past a buffer is an
  error;
- each algorithm as the router runs it (``BlasLtKernel``) on the layout's own torch
  tensors, aligned or not (less aligned pointers run torch's GEMM).

Run under memcheck (small sizes: a few minutes on an H100)::

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python -m pytest -m gpu tests/kernels/test_blaslt_memsafety.py -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=BF16)


# name -> (a, b) of torch.mm / torch.bmm as the intercept receives them (all accepted by problem_of)
LAYOUTS = {
    "mm NN": lambda: (_t(128, 64), _t(64, 96)),
    "mm x @ W.T": lambda: (_t(128, 64), _t(96, 64).t()),
    "mm g.T @ x (wgrad)": lambda: (_t(128, 96).t(), _t(128, 64)),
    "mm TT": lambda: (_t(64, 128).t(), _t(96, 64).t()),
    "mm sliced columns (ld > cols)": lambda: (_t(128, 200)[:, :64], _t(64, 96)),
    "mm sliced weight columns": lambda: (_t(128, 64), _t(64, 160)[:, :96]),
    "mm odd sizes": lambda: (_t(37, 24), _t(24, 40)),
    "mm one row": lambda: (_t(1, 64), _t(64, 96)),
    "bmm packed": lambda: (_t(4, 32, 64), _t(4, 64, 48)),
    "bmm transposed weight": lambda: (_t(4, 32, 64), _t(4, 48, 64).transpose(1, 2)),
    "bmm padded fwd": lambda: (_t(8, 64, 256), _t(8, 256, 512)),
    "bmm padded wgrad": lambda: (_t(8, 64, 256).transpose(1, 2), _t(8, 64, 512)),
    "bmm batch stride beyond the matrix": lambda: (_t(4, 64, 64)[:, :32], _t(4, 64, 48)),
    "bmm sliced ld > cols": lambda: (_t(4, 32, 128)[:, :, :64], _t(4, 64, 48)),
}
# views at an offset into their storage: same problems, pointers less aligned than 256 bytes
UNALIGNED = {
    "mm offset rows": lambda: (_t(129, 64)[1:], _t(64, 96)),
    "mm offset weight": lambda: (_t(128, 64), _t(65, 96)[1:]),
}


def _problem(a, b):
    from primus_perf.kernels.gemm import problem_of

    return problem_of(a, b)


def _library_candidates(session):
    return [c for c in session.candidates() if c.blob]


def _check_candidates(p, guard_bytes: int) -> list[str]:
    """Run every candidate of the tuner on operands of ``p``'s layout; failures as lines."""
    from primus_perf.kernels.blaslt.binding import BlasLtError
    from primus_perf.tuner.gemm.plugin import GemmTuner, Operands

    session = GemmTuner(device="cuda", sets=1).open(p, None, lambda _l: None)
    session.ops = Operands(p, device="cuda", sets=1, guard_bytes=guard_bytes)
    failures = []
    try:
        pool = session.candidates()
        assert len(pool) > 1, f"{p.key()}: no heuristic candidates"
        for c in pool:
            try:
                err = session.error(c)  # GuardError when it wrote outside its output
            except BlasLtError:
                continue  # the library declines this algorithm here: the tuner rejects it
            if not err <= session.tolerance:
                failures.append(f"{p.key()} {c.name}: relative error {err}")
        torch.cuda.synchronize()
    finally:
        session.close()
    return failures


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_candidate_stays_inside_guarded_buffers(name: str) -> None:
    a, b = LAYOUTS[name]()
    assert _check_candidates(_problem(a, b), guard_bytes=4096) == []


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_candidate_on_exact_buffers(name: str) -> None:
    """No guard: under compute-sanitizer memcheck (no caching allocator) any access past a
    buffer's extent is reported."""
    a, b = LAYOUTS[name]()
    assert _check_candidates(_problem(a, b), guard_bytes=0) == []


@pytest.mark.parametrize("name", [*LAYOUTS, *UNALIGNED])
def test_router_kernels_on_the_calls_own_tensors(name: str) -> None:
    from primus_perf.kernels.blaslt.binding import load
    from primus_perf.kernels.gemm import BlasLtKernel
    from primus_perf.tuner.gemm.plugin import library_pool

    a, b = (LAYOUTS | UNALIGNED)[name]()
    p = _problem(a, b)
    ref = torch.matmul(a.float(), b.float())
    unaligned = name in UNALIGNED
    with load().plan(p) as plan:
        pool = library_pool(plan)
    for c in pool:
        kernel = BlasLtKernel(load().plan(p), c.blob)
        try:
            out = kernel(a, b)
            torch.cuda.synchronize()
        finally:
            kernel.close()
        assert out.shape == ref.shape
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err <= 2e-2, f"{name} {c.name}: relative error {err}"
        assert kernel.unaligned == (1 if unaligned else 0)


def test_padded_bmm_wgrad_problem_of_the_online_crash() -> None:
    """The problem online MoE tuning crashed on (padded-bmm's weight gradient, batch 8):
    every heuristic candidate is right and stays in its buffers."""
    from primus_perf.problems import GemmProblem

    p = GemmProblem.from_dict({"m": 512, "n": 256, "k": 64, "trans_a": False, "trans_b": True,
                               "lda": 512, "ldb": 256, "ldc": 512, "ldd": 512, "batch": 8,
                               "stride_a": 32768, "stride_b": 16384, "stride_c": 131072, "stride_d": 131072})
    assert p.key().startswith("gemm:NT|m512|n256|k64|")
    assert _check_candidates(p, guard_bytes=4096) == []
