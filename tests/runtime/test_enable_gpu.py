"""GPU tests of primus_perf.enable: an offline-tuned cuBLASLt/hipBLASLt entry routes an
unmodified nn.Linear's forward, input-gradient and weight-gradient GEMMs (results within
the tuner's tolerance); online tuning locks every problem and the restart does no tuning."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _linear_problems(lin, x, g):
    from primus_perf.kernels.gemm import problem_of

    return [problem_of(x, lin.weight.t()), problem_of(g, lin.weight), problem_of(g.t(), x)]


def test_offline_cache_routes_linear_fwd_dgrad_wgrad(tmp_path) -> None:
    import torch

    import primus_perf
    from primus_perf.cache.store import TuningCache
    from primus_perf.kernels.gemm import TORCH_SOURCE, solution_source
    from primus_perf.runtime import dispatch
    from primus_perf.tuner.core import tune
    from primus_perf.tuner.gemm.plugin import TOLERANCE, GemmTuner

    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 3072, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2048, 3072, device="cuda", dtype=torch.bfloat16)
    cache = tmp_path / "cache.json"
    problems = _linear_problems(lin, x.detach(), g)
    tune(problems, cache=cache, tuners=[GemmTuner()], budget_s=1.0)
    with primus_perf.enable(cache, kinds=("gemm",), log=None) as tuned:
        y = lin(x)
        y.backward(g)
        torch.cuda.synchronize()
        s = tuned.summary()["gemm"]
    entries = TuningCache(cache).entries("gemm")
    assert len(entries) == 3
    library = [e for e in entries if solution_source(e.solution) != TORCH_SOURCE]
    if library:  # a mixed cache: every call goes through the router (torch's choices counted)
        assert s["routed"] == 3 and s["fallback"] == 0 and not s["failed"]
    else:  # every choice is torch's: nothing is routed, no override is installed
        assert s["routed"] == 0 and s["fallback"] == 0 and not dispatch.of("gemm").intercepting
    ref = x.float() @ lin.weight.float().t()
    assert ((y.float() - ref).norm() / ref.norm()).item() <= TOLERANCE["bf16"]


def test_online_tuning_locks_and_restart_does_no_tuning(tmp_path) -> None:
    import torch

    import primus_perf

    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cache = tmp_path / "online.json"
    lines: list[str] = []
    with primus_perf.enable(cache, online=True, kinds=("gemm",), log=lines.append) as tuned:
        for _ in range(60):
            lin(x).square().mean().backward()
        torch.cuda.synchronize()
        s = tuned.summary()["gemm"]
    assert len(s["online"]) == 3 and all(calls <= 64 for calls in s["tuning"].values())
    # each lock is final after its confirmation in the step: a choice kept, or torch's
    assert len(lines) == 3 and all(("locked" in line and "in the step" in line) or "torch kept" in line
                                   or "locked torch" in line for line in lines), lines
    with primus_perf.enable(cache, online=True, kinds=("gemm",), log=None) as again:
        lin(x).square().mean().backward()
        s2 = again.summary()["gemm"]
    assert s2["tuning"] == {} and s2["routed"] == 3


def _triton_attention_setup(tmp_path):
    """A cache whose one entry runs the Triton kernel (default tile config) for a bf16 GQA
    causal problem, and leaf q, k, v for it in torch's layout."""
    import torch

    from primus_perf.base.devices import current_device
    from primus_perf.cache.store import CacheEntry, TuningCache
    from primus_perf.kernels.attention.configs import AttnConfig
    from primus_perf.kernels.attention.router import AttentionChoice, library_versions
    from primus_perf.problems import AttentionProblem

    p = AttentionProblem(2, 8, 2, 512, 512, 64, "bf16", True, "bshd")
    entry = CacheEntry(kind="attention", problem_key=p.key(), problem=p.to_dict(),
                       device=current_device().to_dict(), versions=library_versions(),
                       solution={"config": AttentionChoice("triton", AttnConfig()).to_solution(), "blob": b""})
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(entry)
    torch.manual_seed(0)
    qkv = [torch.randn(2, h, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2)]
    return cache, qkv


def test_cached_triton_attention_is_routed_from_plain_sdpa(tmp_path) -> None:
    import torch.nn.functional as F

    import primus_perf

    cache, (q, k, v) = _triton_attention_setup(tmp_path)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with primus_perf.enable(cache, kinds=("attention",), log=None) as tuned:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()
        s = tuned.summary()["attention"]
    assert s["routed"] == 1 and s["fallback"] == 0
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    assert q.grad is not None and k.grad.shape == k.shape


def test_compiled_sdpa_runs_the_cached_triton_attention_forward_and_backward(tmp_path) -> None:
    """Under torch.compile (Inductor) the SDPA call of a compiled function is routed to the
    cached Triton kernel (one graph; the router counts the call, none failed) and its
    backward runs the Triton backward: output and gradients match eager SDPA within the
    tuner's bf16 tolerance."""
    import torch
    import torch.nn.functional as F

    import primus_perf
    from primus_perf.kernels.attention.reference import TOLERANCE

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def rel(got, want):
        return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

    cache, qkv = _triton_attention_setup(tmp_path)
    do = torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16)
    ref = attend(*qkv)
    ref_grads = torch.autograd.grad(ref, qkv, do)
    graphs = []

    def inductor(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    with primus_perf.enable(cache, kinds=("attention",), log=None) as tuned:
        out = torch.compile(attend, backend=inductor, fullgraph=True)(*qkv)
        grads = torch.autograd.grad(out, qkv, do)
        torch.cuda.synchronize()
        s = tuned.summary()["attention"]
    torch._dynamo.reset()
    assert len(graphs) == 1
    assert s["routed"] == 1 and s["fallback"] == 0 and not s["failed"]
    assert rel(out, ref) <= TOLERANCE[torch.bfloat16]
    assert all(rel(g, r) <= TOLERANCE[torch.bfloat16] for g, r in zip(grads, ref_grads))
