"""GPU tests of the GEMM tuner: tuned choices match the fp32 reference; wrong candidates lose."""

from __future__ import annotations

import pytest

from primus_perf.problems import GemmProblem

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("shape", [(512, 768, 1024, False, True), (1000, 384, 256, True, False)])
def test_tuned_result_matches_reference(dtype: str, shape: tuple) -> None:
    import torch

    from primus_perf.tuner.gemm import TOLERANCE, tune_problem
    from primus_perf.tuner.gemm_runtime import GemmRouter

    M, N, K, at, bt = shape
    p = GemmProblem.from_row_major(M, N, K, a_transposed=at, b_transposed=bt, dtype=dtype)
    entry, _report = tune_problem(p, budget_s=1.0)
    assert entry.error is not None and entry.error <= TOLERANCE[dtype]
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
    a = torch.randn(K, M, device="cuda", dtype=dt).T if at else torch.randn(M, K, device="cuda", dtype=dt)
    b = torch.randn(N, K, device="cuda", dtype=dt).T if bt else torch.randn(K, N, device="cuda", dtype=dt)
    router = GemmRouter([entry])
    out = router(a, b)
    got = out if out is not None else torch.mm(a, b)
    ref = a.float() @ b.float()
    assert ((got.float() - ref).norm() / ref.norm()).item() <= TOLERANCE[dtype]
    assert sum(router.routed.values()) + sum(router.default.values()) == 1


def test_planted_wrong_candidate_is_rejected() -> None:
    import torch

    from primus_perf.tuner.gemm import Candidate, tune_problem

    p = GemmProblem.from_row_major(1024, 1024, 1024, b_transposed=True)

    def half_k(a, b, out):  # twice as fast as the real product, and wrong
        k = a.shape[1] // 2
        torch.mm(a[:, :k], b[:k], out=out)

    _, report = tune_problem(p, budget_s=1.0, planted=Candidate("planted", None, fn=half_k))
    assert report["chosen"] != "planted"
    assert "planted" in report["rejected"]
