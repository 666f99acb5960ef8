"""GPU tests of the GEMM tuner: tuned choices match the fp32 reference; wrong candidates lose."""

from __future__ import annotations

import pytest

from primus_perf.problems import GemmProblem

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("shape", [(512, 768, 1024, False, True), (1000, 384, 256, True, False)])
def test_tuned_result_matches_reference(dtype: str, shape: tuple) -> None:
    import torch

    from primus_perf.kernels.gemm import GemmRouter
    from primus_perf.runtime.gemm import GemmDispatch
    from primus_perf.tuner.core import tune_problem
    from primus_perf.tuner.gemm.plugin import TOLERANCE, GemmTuner

    M, N, K, at, bt = shape
    p = GemmProblem.from_row_major(M, N, K, a_transposed=at, b_transposed=bt, dtype=dtype)
    entry = tune_problem(GemmTuner(), p, budget_s=1.0).entry
    assert entry.error is not None and entry.error <= TOLERANCE[dtype]
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
    a = torch.randn(K, M, device="cuda", dtype=dt).T if at else torch.randn(M, K, device="cuda", dtype=dt)
    b = torch.randn(N, K, device="cuda", dtype=dt).T if bt else torch.randn(K, N, device="cuda", dtype=dt)
    router = GemmRouter([entry])
    d = GemmDispatch("gemm")  # a dispatch of its own: the router's choice runs on the call
    d.install(router)
    got = d.gemm(a, b)
    ref = a.float() @ b.float()
    assert ((got.float() - ref).norm() / ref.norm()).item() <= TOLERANCE[dtype]
    summary = d.summary()
    assert sum(summary["routed"].values()) == 1 and not summary["fallback"] and not summary["failed"]
    router.close()


def test_planted_wrong_candidate_is_rejected() -> None:
    import torch

    from primus_perf.tuner.core import tune_problem
    from primus_perf.tuner.gemm.plugin import GemmTuner, python_candidate

    p = GemmProblem.from_row_major(1024, 1024, 1024, b_transposed=True)

    def half_k(a, b, out):  # twice as fast as the real product, and wrong
        k = a.shape[1] // 2
        torch.mm(a[:, :k], b[:k], out=out)

    res = tune_problem(GemmTuner(extra=[python_candidate("planted", half_k)]), p, budget_s=1.0)
    assert res.chosen != "planted"
    assert {c.name: c.status for c in res.candidates}["planted"] == "rejected"


def test_routed_gemm_is_traced_and_modeled_like_aten_mm(tmp_path) -> None:
    """Under torch.profiler a tuned cuBLASLt call shows as ``primus_perf::gemm`` with its
    operands' shapes; the analyzer gives it the same problem and FLOPs as torch.mm."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from primus_perf.base.devices import current_device
    from primus_perf.cache.store import CacheEntry
    from primus_perf.kernels.blaslt.binding import load
    from primus_perf.kernels.gemm import WORKSPACE_BYTES, GemmRouter
    from primus_perf.runtime.gemm import GemmDispatch
    from primus_perf.tracelens.analyze import analyze

    M, N, K = 1024, 768, 512
    p = GemmProblem.from_row_major(M, N, K, b_transposed=True)
    with load().plan(p) as plan:
        h = plan.heuristics(1, WORKSPACE_BYTES)[0]
    entry = CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(), device=current_device().to_dict(),
                       versions={}, solution={"config": {"source": "cublaslt"}, "blob": h.algo},
                       times={"tuned_ms": 1.0, "default_ms": 1.0})
    router = GemmRouter([entry])
    d = GemmDispatch("gemm")
    d.install(router)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    plain = d.gemm(a, w.T)  # outside the profiler: the direct launch
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        traced = d.gemm(a, w.T)
        torch.cuda.synchronize()
    assert d.summary() == {"routed": {p.key(): 2}, "fallback": {}, "failed": []}
    torch.testing.assert_close(traced, plain, rtol=0, atol=0)
    ref = a.float() @ w.float().T
    assert ((traced.float() - ref).norm() / ref.norm()).item() < 1e-2
    path = tmp_path / "routed.json"
    prof.export_chrome_trace(str(path))
    an = analyze([path])
    rows = an.gemm_problems
    assert list(rows["key"]) == [p.key()] and rows["calls"].iloc[0] == 1
    assert rows["flops"].iloc[0] == p.flops
    router.close()


def test_interrupted_offline_tuning_resumes_without_retuning(tmp_path) -> None:
    """SIGINT mid-run keeps every finished problem in the cache; the rerun skips them."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from primus_perf.cache.store import TuningCache

    probs = [{"M": 256 * (i + 1), "N": 1024, "K": 2048, "b_transposed": True, "dtype": "bf16"} for i in range(12)]
    pfile, cache = tmp_path / "problems.json", tmp_path / "cache.json"
    pfile.write_text(json.dumps(probs))
    cmd = [sys.executable, "-m", "primus_perf.cli.tune", "gemm", "--problems", str(pfile),
           "--cache", str(cache), "--budget-s", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if cache.exists() and len(TuningCache(cache).entries()) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "Resume with the same command" in " ".join(out.split()) and "Traceback" not in out + err, out + err
    first = {e.problem_key: e.created for e in TuningCache(cache).entries()}
    assert 2 <= len(first) < len(probs)

    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(probs) - len(first)} tuned, {len(first)} already in the cache" in " ".join(r.stdout.split())
    after = {e.problem_key: e.created for e in TuningCache(cache).entries()}
    assert len(after) == len(probs)
    assert all(after[k] == t for k, t in first.items()), "resumed run re-tuned a finished problem"
