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
import torch.nn.functional as F

from primus_perf.kernels.attention.configs import AttnConfig, BwdConfig, FwdConfig
from primus_perf.kernels.attention.function import triton_attention
from primus_perf.kernels.attention.reference import (
    check_numerics,
    random_qkv,
    reference_attention,
    relative_error,
    tolerance,
)
from primus_perf.kernels.attention.router import AttentionChoice, AttentionRouter, problem_of
from primus_perf.kernels.routing import OWN
from primus_perf.problems import AttentionProblem

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


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_numerics_check_runs_inside_an_evaluation_step(mode: str) -> None:
    """Online tuning validates a new problem's candidates when its first call comes, which
    may be inside a program's no_grad or inference_mode evaluation step."""
    make = lambda: random_qkv(1, 2, 2, 32, 32, 16, torch.float32, "cpu", seed=6)  # noqa: E731
    fn = lambda q, k, v, causal: reference_attention(q, k, v, causal=causal)  # noqa: E731
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        report = check_numerics(fn, *make(), causal=True)
    assert report.ok and max(report.dq, report.dk, report.dv) < 1e-5


def test_relative_error_and_tolerance() -> None:
    """The one measure every attention check uses (the search's forward check included):
    max error over the reference's max, never NaN (a NaN result is infinitely wrong)."""
    ref = torch.tensor([1.0, -4.0])
    assert relative_error(torch.tensor([1.0, -3.0], dtype=torch.float16), ref) == pytest.approx(0.25)
    assert relative_error(torch.tensor([float("nan"), -4.0]), ref) == float("inf")
    assert (tolerance(torch.bfloat16), tolerance(torch.float16), tolerance(torch.float32)) == (2.5e-2, 5e-3, 1e-3)


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
    key, run = router.route(qg, k, v, True)
    assert key == prob.key() and callable(run)
    out = run()
    assert (out.float() - reference_attention(q, k, v, causal=True)).abs().max().item() < 2e-3
    out.sum().backward()  # the Triton backward runs through autograd
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    assert router.route(q, k, v, False)[1] is None  # not cached: torch's default
    assert router.route(q[:, :20], k[:, :20], v[:, :20], True)[1] is None
    # a choice tuned for the kv-expanded problem (as traces of the trainer show GQA) applies
    expanded = AttentionProblem(1, 4, 4, 40, 40, 16, "f16", True, "bshd")
    gqa_router = AttentionRouter({expanded.key(): choice})
    assert gqa_router.route(q, k, v, True)[0] == prob.key() and callable(gqa_router.route(q, k, v, True)[1])
    # torch's default measured fastest: the router answers that the call is torch's own
    default_router = AttentionRouter({prob.key(): AttentionChoice("sdpa:default")})
    assert default_router.route(q, k, v, True) == (prob.key(), OWN)


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
    from primus_perf.tuner.attention.space import known_good

    for cfg in [AttnConfig(), *known_good("nvidia", 128)]:
        q, k, v = random_qkv(2, 8, 2, 1000, 1000, 128, dtype, "cuda", seed=11)
        report = check_numerics(_fn(cfg), q, k, v, causal=causal)
        assert report.ok, (cfg.label(), report)


def _entry(problem: AttentionProblem, choice: AttentionChoice, versions: dict, device=None):
    from primus_perf.base.devices import DeviceIdentity
    from primus_perf.cache.store import CacheEntry

    device = device or DeviceIdentity("NVIDIA H100 80GB HBM3", "nvidia", "sm_90", 132)
    return CacheEntry(kind="attention", problem_key=problem.key(), problem=problem.to_dict(),
                      device=device.to_dict(), versions=versions,
                      solution={"config": {"name": choice.backend, **choice.to_solution()}, "blob": b""},
                      times={"tuned_ms": 2.6, "default_ms": 3.0}, error=1e-3)


def test_router_from_cache_entries() -> None:
    from primus_perf.base.errors import CacheError

    prob = AttentionProblem(1, 4, 2, 40, 40, 16, "f16", True, "bshd")
    other = AttentionProblem(1, 4, 2, 40, 40, 16, "f16", False, "bshd")
    mine = _entry(prob, AttentionChoice("triton", CONFIGS[1]), {})
    router = AttentionRouter.from_entries([mine, _entry(other, AttentionChoice("sdpa:cudnn"), {})])
    assert router is not None
    assert router.choices == {prob.key(): AttentionChoice("triton", CONFIGS[1]),
                              other.key(): AttentionChoice("sdpa:cudnn")}
    q, k, v = random_qkv(1, 4, 2, 40, 40, 16, torch.float16, DEVICE, seed=2)
    out = router.route(q, k, v, True)[1]()
    assert (out.float() - reference_attention(q, k, v, causal=True)).abs().max().item() < 2e-3
    assert AttentionRouter.from_entries([]).choices == {}
    mine.solution = {"config": {"backend": "triton"}, "blob": b""}
    with pytest.raises(CacheError, match="attention cache entry"):
        AttentionRouter.from_entries([mine])


def test_tuning_cache_file_round_trip_and_trainer_activation(tmp_path) -> None:
    from primus_perf.cache.store import TuningCache
    from primus_perf.kernels.attention.router import library_versions
    from primus_perf.runtime import activate as runtime
    from primus_perf.runtime import dispatch

    path = tmp_path / "tuning.cache"
    prob = AttentionProblem(1, 4, 2, 40, 40, 16, "f16", True, "bshd")
    stale = AttentionProblem(1, 4, 2, 40, 40, 16, "f16", False, "bshd")
    TuningCache(path).put_many([_entry(prob, AttentionChoice("triton", CONFIGS[1]), library_versions()),
                                _entry(stale, AttentionChoice("sdpa:cudnn"), {"torch": "0.0", "triton": "0.0"})])
    device = _entry(prob, AttentionChoice("sdpa:cudnn"), {}).device_identity
    act = runtime.activate(path, device=device)
    attention = dispatch.of("attention")
    assert attention.router is None  # activate installs nothing
    attention.reset()
    attention.install(act.routers["attention"])
    attention.keep_overrides(act, DEVICE)
    try:
        assert act.usable == {"attention": 1}  # the entry with other versions is stale
        assert any("stale" in line for line in act.start_lines())
        q, k, v = random_qkv(1, 4, 2, 40, 40, 16, torch.float16, DEVICE, seed=4)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # a program's SDPA layout
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).transpose(1, 2)
        assert (out.float() - reference_attention(q, k, v, causal=True)).abs().max().item() < 2e-3
        F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # stale entry: torch's default
        assert attention.summary() == {"routed": {prob.key(): 1}, "fallback": {stale.key(): 1}, "failed": []}
    finally:
        attention.release(act)
        attention.install(None)
        act.close()
    assert attention.router is None and not attention.intercepting
