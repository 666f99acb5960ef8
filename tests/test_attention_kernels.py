"""Triton flash attention vs an fp32 reference on the CPU interpreter (tiny sizes), and
the router the trainer uses. GPU tests (bf16, real sizes) carry the ``gpu`` mark; run them
with ``TRITON_INTERPRET=0 pytest -m gpu`` (then every test here runs on the GPU).

The interpreter has no bf16 ``tl.dot`` on the CPU, so the CPU tests use fp16."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest

pytest.importorskip("triton")
import torch

from primus_perf.problems import AttentionProblem
from primus_perf.tuner.attention.configs import AttnConfig, BwdConfig, FwdConfig
from primus_perf.tuner.attention.function import triton_attention
from primus_perf.tuner.attention.reference import (
    check_numerics,
    random_qkv,
    reference_attention,
)
from primus_perf.tuner.attention.router import AttentionChoice, AttentionRouter, problem_of

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"

CONFIGS = [
    AttnConfig(FwdConfig(16, 16, 4, 1), BwdConfig(16, 16, 16, 16, 4, 1)),
    AttnConfig(FwdConfig(32, 16, 4, 1), BwdConfig(16, 32, 32, 16, 4, 1)),
    AttnConfig(FwdConfig(16, 32, 4, 1), BwdConfig(32, 16, 16, 32, 4, 1)),
]

# (batch, heads_q, heads_kv, seq, head_dim, causal): MHA, GQA, ragged lengths
CASES = [
    (1, 2, 2, 48, 16, True),
    (2, 4, 2, 37, 32, False),  # GQA, ragged
    (1, 4, 1, 70, 16, True),  # GQA group 4, causal, ragged
    (1, 2, 2, 33, 64, False),
]


def _fn(cfg: AttnConfig):
    return lambda q, k, v, causal: triton_attention(q, k, v, causal=causal, config=cfg)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}h{}/{}s{}d{}{}".format(*c[:5], "c" if c[5] else ""))
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label().replace(" ", ""))
def test_forward_and_backward_match_fp32_reference(case, cfg) -> None:
    b, hq, hkv, s, d, causal = case
    q, k, v = random_qkv(b, hq, hkv, s, s, d, torch.float16, DEVICE, seed=hash(case) % 1000)
    report = check_numerics(_fn(cfg), q, k, v, causal=causal, seed=3)
    assert report.ok, report
    assert report.worst < 2e-3  # fp16 inputs, fp32 accumulation


def test_non_square_non_causal_and_trainer_strides() -> None:
    # kv longer than q; q/k/v as views of one fused projection (the trainer's layout)
    b, s, hq, hkv, d = 1, 40, 2, 1, 16
    fused = torch.randn(b, s, (hq + 2 * hkv) * d, dtype=torch.float16)
    q, k, v = fused.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(b, s, hq, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)
    assert not q.is_contiguous()
    out = triton_attention(q, k, v, causal=True, config=CONFIGS[1])
    ref = reference_attention(q, k, v, causal=True)
    assert (out.float() - ref).abs().max().item() < 2e-3
    kl = torch.randn(1, 50, 1, 16, dtype=torch.float16)
    vl = torch.randn(1, 50, 1, 16, dtype=torch.float16)
    out = triton_attention(q.contiguous(), kl, vl, causal=False, config=CONFIGS[0])
    ref = reference_attention(q, kl, vl, causal=False)
    assert (out.float() - ref).abs().max().item() < 2e-3


def test_numerics_check_rejects_a_wrong_kernel() -> None:
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16, torch.float16, DEVICE, seed=5)
    # forgetting the causal mask is a real, plausible bug: the check must catch it
    wrong = lambda q, k, v, causal: triton_attention(q, k, v, causal=False, config=CONFIGS[0])  # noqa: E731
    report = check_numerics(wrong, q, k, v, causal=True)
    assert not report.ok and report.out > 0.05


def test_bad_inputs_raise_one_line_errors() -> None:
    q, k, v = random_qkv(1, 3, 2, 16, 16, 16, torch.float16, DEVICE, seed=1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        triton_attention(q, k, v, causal=False)
    q, k, v = random_qkv(1, 2, 2, 16, 16, 24, torch.float16, DEVICE, seed=1)
    with pytest.raises(ValueError, match="head_dim 24"):
        triton_attention(q, k, v, causal=False)
    q, k, v = random_qkv(1, 2, 2, 16, 16, 16, torch.float32, DEVICE, seed=1)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        triton_attention(q, k, v, causal=False)


def test_router_uses_cached_choice_and_leaves_the_rest_to_torch() -> None:
    q, k, v = random_qkv(1, 4, 2, 40, 40, 16, torch.float16, DEVICE, seed=9)
    prob = problem_of(q, k, v, True)
    assert prob == AttentionProblem(1, 4, 2, 40, 40, 16, "f16", True, "bshd")
    choice = AttentionChoice("triton", CONFIGS[1])
    router = AttentionRouter({prob.key(): choice})
    qg = q.clone().requires_grad_(True)
    out = router(qg, k, v, True)
    assert out is not None
    assert (out.float() - reference_attention(q, k, v, causal=True)).abs().max().item() < 2e-3
    out.sum().backward()  # the Triton backward runs through autograd
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    assert router(q, k, v, False) is None  # not cached: torch's default
    assert router(q[:, :20], k[:, :20], v[:, :20], True) is None
    summary = router.summary()
    assert summary["routed"][prob.key()]["calls"] == 1
    assert sum(summary["default"].values()) == 2
    # a choice tuned for the kv-expanded problem (as traces of the trainer show GQA) applies
    expanded = AttentionProblem(1, 4, 4, 40, 40, 16, "f16", True, "bshd")
    gqa_router = AttentionRouter({expanded.key(): choice})
    assert gqa_router(q, k, v, True) is not None
    assert gqa_router.summary()["routed"][prob.key()] == {"calls": 1, "choice": choice.label()}
    # torch's default measured fastest: the router leaves the call to the dispatch
    assert AttentionRouter({prob.key(): AttentionChoice("sdpa:default")})(q, k, v, True) is None


def test_choice_round_trips_through_its_solution_dict() -> None:
    import json

    for choice in (AttentionChoice("triton", CONFIGS[2]), AttentionChoice("sdpa:cudnn")):
        data = json.loads(json.dumps(choice.to_solution()))
        assert AttentionChoice.from_solution(data) == choice
    with pytest.raises(ValueError):
        AttentionChoice("sdpa:nope")
    with pytest.raises(ValueError):
        AttentionChoice.from_solution({"backend": "triton", "fwd": {"block_q": 1}})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_real_sizes_bf16_fp16(dtype, causal) -> None:
    if not ON_GPU:
        pytest.skip("needs a GPU without TRITON_INTERPRET")
    from primus_perf.tuner.attention.configs import known_good

    for cfg in [AttnConfig(), *known_good("nvidia", 128)]:
        q, k, v = random_qkv(2, 8, 2, 1000, 1000, 128, dtype, "cuda", seed=11)
        report = check_numerics(_fn(cfg), q, k, v, causal=causal)
        assert report.ok, (cfg.label(), report)


def _result(selected: str, versions: dict | None = None):
    from primus_perf.devices import DeviceIdentity
    from primus_perf.tuner.attention.search import SearchResult
    from primus_perf.tuner.attention.select import BackendTiming
    from primus_perf.tuner.attention.tune import AttentionTuneResult

    prob = AttentionProblem(1, 4, 2, 40, 40, 16, "f16", True, "bshd")
    cfg = CONFIGS[1]
    timings = {
        "sdpa:default": BackendTiming("sdpa:default", 1.0, 2.0),
        "sdpa:cudnn": BackendTiming("sdpa:cudnn", 0.9, 1.9),
        "triton": BackendTiming("triton", 0.8, 1.8),
    }
    return AttentionTuneResult(
        problem=prob,
        device=DeviceIdentity("NVIDIA H100 80GB HBM3", "nvidia", "sm_90", 132),
        versions=versions or {"torch": "2.11.0", "triton": "3.6.0"},
        search=SearchResult("grid", cfg, 0.8, 1.8, 16, 8),
        timings=timings,
        selected=selected,
        config=cfg,
        numerics_error=1e-3,
    )


def test_cache_entry_round_trip_to_the_router() -> None:
    from primus_perf.errors import CacheError
    from primus_perf.tuner.attention.cache_io import entry_fields, router_from_entries

    res = _result("triton")
    assert res.speedup == pytest.approx(3.0 / 2.6)
    fields = entry_fields(res)
    assert fields["kind"] == "attention" and fields["problem_key"] == res.problem.key()
    assert fields["times"] == {"tuned_ms": pytest.approx(2.6), "default_ms": pytest.approx(3.0)}
    other = {**entry_fields(_result("sdpa:cudnn")), "problem_key": "attn|other"}
    gemm = {"kind": "gemm", "problem_key": "gemm:x", "solution": {"config": {}, "blob": b"x"}}
    router = router_from_entries([fields, other, gemm])
    assert router is not None
    assert router.choices[res.problem.key()] == AttentionChoice("triton", CONFIGS[1])
    assert router.choices["attn|other"] == AttentionChoice("sdpa:cudnn")
    q, k, v = random_qkv(1, 4, 2, 40, 40, 16, torch.float16, DEVICE, seed=2)
    out = router(q, k, v, True)
    assert out is not None
    assert (out.float() - reference_attention(q, k, v, causal=True)).abs().max().item() < 2e-3
    assert router_from_entries([gemm]) is None
    broken = {**fields, "solution": {"config": {"backend": "triton"}, "blob": b""}}
    with pytest.raises(CacheError, match="attention cache entry"):
        router_from_entries([broken])


def test_tuning_cache_file_round_trip_and_trainer_activation(tmp_path) -> None:
    runtime = pytest.importorskip("primus_perf.cache.runtime")
    from primus_perf.cache.store import TuningCache
    from primus_perf.trainer import dispatch
    from primus_perf.tuner.attention.cache_io import running_versions, save_results

    path = tmp_path / "tuning.cache"
    res = _result("triton", running_versions())
    stale = _result("sdpa:cudnn", {"torch": "0.0", "triton": "0.0"})
    stale.problem = AttentionProblem(1, 4, 2, 40, 40, 16, "f16", False, "bshd")
    assert save_results([res, stale], path) == 2
    entries = TuningCache(path).entries("attention")
    assert {e.problem_key for e in entries} == {res.problem.key(), stale.problem.key()}
    mine = next(e for e in entries if e.problem_key == res.problem.key())
    assert mine.solution["config"] == AttentionChoice("triton", CONFIGS[1]).to_solution()
    assert mine.times["tuned_ms"] == pytest.approx(2.6) and mine.error == pytest.approx(1e-3)

    act = runtime.activate(path, device=res.device)
    try:
        assert act.usable == {"attention": 1}  # the entry with other versions is stale
        assert any("stale" in line for line in act.start_lines())
        q, k, v = random_qkv(1, 4, 2, 40, 40, 16, torch.float16, DEVICE, seed=4)
        out = dispatch.attention(q, k, v, causal=True)  # routed to the cached Triton config
        assert (out.float() - reference_attention(q, k, v, causal=True)).abs().max().item() < 2e-3
        dispatch.attention(q, k, v, causal=False)  # stale entry: torch's default
        summary = act.end_summary()["attention"]
        assert summary["routed"][res.problem.key()]["calls"] == 1
        assert summary["default"] == {stale.problem.key(): 1}
    finally:
        act.deactivate()
    assert dispatch.get_attention_router() is None
