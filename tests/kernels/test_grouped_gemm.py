"""Grouped GEMM: the problem type, every backend (fwd, dgrad, wgrad) against an fp64
reference including empty and one-token groups, every Triton config the search can pick
(under TRITON_INTERPRET=1 on the CPU), and the trainer's grouped GEMM (``trainer.moe.grouped_mm``:
``torch._grouped_mm``) through the grouped dispatch's aten override, on each backend."""

from __future__ import annotations

import pytest
import torch

from primus_perf.kernels.grouped import BACKENDS, problem_of
from primus_perf.kernels.grouped.backends import triton_backend
from primus_perf.kernels.grouped.configs import GroupedGemmConfig, config_invalid
from primus_perf.kinds import GROUPED
from primus_perf.problems import GroupedGemmProblem, skew_bucket, tokens_bucket
from primus_perf.runtime import dispatch
from primus_perf.trainer.moe import grouped_mm
from primus_perf.tuner.grouped.space import default_space, tiny_space
from trainer_runs import routing

COUNTS = [5, 0, 1, 19, 0, 8, 1]  # empty groups, one-token groups, unaligned starts


def _reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, counts: list[int]):
    """fp64 forward, input gradient and weight gradient, one group at a time."""
    x, w, dy = x.double(), w.double(), dy.double()
    y, dx, dw, start = [], [], [], 0
    for g, c in enumerate(counts):
        rows = slice(start, start + c)
        y.append(x[rows] @ w[g])
        dx.append(dy[rows] @ w[g].t())
        dw.append(x[rows].t() @ dy[rows])
        start += c
    return torch.cat(y), torch.cat(dx), torch.stack(dw)


def _operands(counts: list[int], k: int, n: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = sum(counts)
    x = torch.randn(T, k, generator=g).to(dtype)
    w = torch.randn(len(counts), k, n, generator=g).to(dtype)
    dy = torch.randn(T, n, generator=g).to(dtype)
    return x, w, dy


def _check_backend(backend, counts: list[int], k: int, n: int, dtype=torch.float32, tol=1e-4):
    x, w, dy = _operands(counts, k, n, dtype)
    y_ref, dx_ref, dw_ref = _reference(x, w, dy, counts)
    scale = k**0.5 * max(1.0, max(counts, default=1) ** 0.5)
    checks = (
        (backend.mm(x, w, counts), y_ref),
        (backend.mm(dy, w.transpose(1, 2), counts), dx_ref),
        (backend.wgrad(x, dy, counts), dw_ref),
    )
    for got, want in checks:
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol * scale, rtol=tol)


# ---- the problem ----------------------------------------------------------------------------


def test_problem_buckets_hold_small_moves_and_change_with_regime() -> None:
    a = GroupedGemmProblem.from_counts([250, 260, 240, 274], 64, 128)
    b = GroupedGemmProblem.from_counts([255, 255, 245, 269], 64, 128)
    assert a.key() == b.key() and a.tokens == 1024
    collapsed = GroupedGemmProblem.from_counts([900, 40, 40, 44], 64, 128)
    assert collapsed.key() != a.key() and collapsed.skew == 4.0
    more = GroupedGemmProblem.from_counts([600, 600, 600, 600], 64, 128)
    assert more.key() != a.key() and more.tokens == 4096
    assert tokens_bucket(1024) == 1024 and tokens_bucket(1025) == 2048 and tokens_bucket(0) == 0
    assert skew_bucket([4, 4, 4, 4]) == 1.0 and skew_bucket([0, 0, 0, 0]) == 1.0
    assert skew_bucket([16, 0, 0, 0]) == 4.0


def test_problem_round_trip_flops_and_validation() -> None:
    p = GroupedGemmProblem(groups=32, k=7168, n=4096, tokens=8192, skew=3.0, phase="wgrad")
    assert GroupedGemmProblem.from_dict(p.to_dict()) == p
    assert p.flops == 2 * 8192 * 7168 * 4096
    assert p.bytes_moved == 2 * (8192 * (7168 + 4096) + 32 * 7168 * 4096)
    assert "wgrad" in str(p) and p.key().startswith("ggemm:wgrad|g32|k7168|n4096|t8192|s3|")
    assert p.with_phase("fwd").key() != p.key()
    for bad, needle in (
        ({"groups": 0}, "groups"),
        ({"tokens": 1000}, "power of two"),
        ({"skew": 1.1}, "bucket"),
        ({"skew": 64.0}, "exceeds"),
        ({"phase": "bwd"}, "phase"),
        ({"dtype": "int8"}, "dtype"),
        ({"k": True}, "k"),
    ):
        with pytest.raises(ValueError, match=needle):
            GroupedGemmProblem(**{**p.to_dict(), **bad})
    with pytest.raises(ValueError, match="unknown"):
        GroupedGemmProblem.from_dict({**p.to_dict(), "m": 3})


@pytest.mark.parametrize(
    "groups,tokens,skew", [(32, 8192, 3.0), (8, 16384, 1.5), (128, 16384, 4.0), (8, 1024, 1.25)]
)
def test_example_counts_fall_in_their_buckets(groups: int, tokens: int, skew: float) -> None:
    p = GroupedGemmProblem(groups=groups, k=64, n=64, tokens=tokens, skew=skew)
    counts = p.example_counts()
    assert len(counts) == groups and sum(counts) == tokens
    assert GroupedGemmProblem.from_counts(counts, 64, 64) == p


# ---- backends --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize(
    "counts",
    [COUNTS, [4, 8, 0, 12], [1], [0, 0, 3], [0, 0]],
    ids=["mixed", "aligned", "one", "empty-first", "all-empty"],
)
def test_backend_matches_reference(name: str, counts: list[int]) -> None:
    backend = BACKENDS[name]
    assert backend.unsupported(torch.device("cpu"), torch.float32, 24, 40) is None
    _check_backend(backend, counts, k=24, n=40)


@pytest.mark.parametrize("name", ["loop", "grouped_mm", "padded_bmm"])
def test_bf16_backends_match_reference(name: str) -> None:
    """bf16 with group starts off the 8-row (16-byte) alignment (COUNTS)."""
    _check_backend(BACKENDS[name], COUNTS, k=32, n=48, dtype=torch.bfloat16, tol=2e-2)


@pytest.mark.parametrize("any_start", [True, False])
def test_grouped_mm_pads_group_starts_only_where_the_kernel_needs_it(any_start: bool, monkeypatch) -> None:
    """Unaligned group starts go to torch as they are where the vendor's kernel takes them
    (the padding copy halved the backend's speed on an H100), padded elsewhere; both match
    the fp32 reference on every pass."""
    from primus_perf.kernels.grouped import backends

    monkeypatch.setitem(backends.ANY_GROUP_START, "cpu", any_start)
    padded = []
    scatter = backends._scatter_index
    monkeypatch.setattr(backends, "_scatter_index", lambda *a: padded.append(1) or scatter(*a))
    x, w, dy = _operands(COUNTS, 32, 48, torch.float32)
    y_ref, dx_ref, dw_ref = _reference(x, w, dy, COUNTS)
    b = BACKENDS["grouped_mm"]
    for got, want in ((b.mm(x, w, COUNTS), y_ref), (b.mm(dy, w.transpose(1, 2), COUNTS), dx_ref),
                      (b.wgrad(x, dy, COUNTS), dw_ref)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert len(padded) == (0 if any_start else 3)


def test_grouped_mm_says_why_it_cannot_run() -> None:
    cpu = torch.device("cpu")
    assert "multiples of 8" in BACKENDS["grouped_mm"].unsupported(cpu, torch.bfloat16, 20, 32)
    assert "bf16 and fp32" in BACKENDS["grouped_mm"].unsupported(cpu, torch.float16, 32, 32)


def _distinct_arithmetic(configs: list[GroupedGemmConfig]) -> list[GroupedGemmConfig]:
    """Warps, stages and the ROCm options change scheduling, not the arithmetic, and the
    interpreter ignores them: one config per tile shape and group order is checked."""
    seen: dict[tuple, GroupedGemmConfig] = {}
    for cfg in configs:
        seen.setdefault((cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.group_order), cfg)
    return list(seen.values())


# space -> (arch, space, a small case whose sizes admit the space's largest tiles)
SEARCHED = {
    "nvidia": ("sm_90", default_space("nvidia"), [0, 1, 140, 37, 0, 78], 64, 256),
    "amd": ("gfx942", default_space("amd"), [0, 1, 140, 37, 0, 78], 64, 256),
    "tiny": ("cpu", tiny_space(), [0, 1, 20, 9, 0, 13], 32, 48),
}


@pytest.mark.parametrize("space", list(SEARCHED))
def test_every_searchable_triton_config_matches_reference(space: str) -> None:
    """Every config the search can pick for a small problem (groups with 0, 1 and many
    tokens), all three passes."""
    arch, search, counts, k, n = SEARCHED[space]
    problem = GroupedGemmProblem.from_counts(counts, k, n, dtype="bf16")
    configs = set()
    for phase in ("fwd", "dgrad", "wgrad"):
        configs |= set(search.configs(problem.with_phase(phase), arch))
    assert configs, "the search space produced no valid config"
    for cfg in _distinct_arithmetic(sorted(configs, key=GroupedGemmConfig.label)):
        _check_backend(triton_backend(cfg), counts, k, n)


def test_config_validity_rules() -> None:
    p = GroupedGemmProblem(groups=8, k=4096, n=4096, tokens=4096)
    assert config_invalid(GroupedGemmConfig(), p, "sm_90") is None
    big = GroupedGemmConfig(block_m=256, block_n=256, block_k=128, num_stages=4)
    assert config_invalid(big, p, "sm_90") == "shared memory"
    assert (
        config_invalid(GroupedGemmConfig(block_m=256, block_n=256, num_warps=4), p, "sm_90")
        == "registers"
    )
    assert config_invalid(GroupedGemmConfig(block_k=48), p, "sm_90") is not None
    assert config_invalid(GroupedGemmConfig(group_order="random"), p, "sm_90") is not None
    assert config_invalid(GroupedGemmConfig(group_m=0), p, "sm_90") is not None
    small = GroupedGemmProblem(groups=8, k=32, n=32, tokens=64)
    assert "block_n" in config_invalid(GroupedGemmConfig(block_n=128), small, "sm_90")
    assert GroupedGemmConfig.from_dict(big.to_dict()) == big


# ---- the grouped dispatch -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BACKENDS))
def test_grouped_mm_autograd_matches_reference(name: str) -> None:
    """Each backend as the dispatch's (the trainer's configured one) runs all three passes."""
    x, w, dy = _operands(COUNTS, 16, 24, seed=1)
    y_ref, dx_ref, dw_ref = _reference(x, w, dy, COUNTS)
    x.requires_grad_(True)
    w.requires_grad_(True)
    with routing(GROUPED.name, backend=name):
        y = grouped_mm(x, w, COUNTS)
        y.backward(dy)
    for got, want in ((y, y_ref), (x.grad, dx_ref), (w.grad, dw_ref)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_router_sees_all_three_passes_and_its_answer_is_used() -> None:
    x, w, dy = _operands(COUNTS, 16, 24, seed=2)
    seen: list[GroupedGemmProblem] = []

    class Router:
        def route(self, phase, a, b, offsets, baseline):
            seen.append(problem_of(phase, a, b, offsets.counts()))
            return seen[-1].key(), None

    x.requires_grad_(True)
    w.requires_grad_(True)
    with routing(GROUPED.name, Router(), backend="loop"):
        grouped_mm(x, w, COUNTS).backward(dy)
    expected = GroupedGemmProblem.from_counts(COUNTS, 16, 24, dtype="f32")
    # each pass once (the backward's two in autograd's order: its formula for _grouped_mm)
    assert sorted(seen, key=GroupedGemmProblem.key) == sorted(
        (expected.with_phase(phase) for phase in ("fwd", "dgrad", "wgrad")), key=GroupedGemmProblem.key)

    class Zeros:
        def route(self, phase, a, b, offsets, baseline):
            return "zeros", lambda: torch.zeros(a.shape[0], b.shape[-1])

    with routing(GROUPED.name, Zeros(), backend="loop"):
        assert torch.equal(grouped_mm(x.detach(), w.detach(), COUNTS), torch.zeros(x.shape[0], 24))


def test_problem_of_reads_a_transposed_weight() -> None:
    x = torch.randn(6, 16)
    w_nk = torch.randn(3, 24, 16)  # nn.Linear layout, used transposed
    p = problem_of("fwd", x, w_nk.transpose(1, 2), [2, 2, 2])
    assert (p.k, p.n, p.trans_w) == (16, 24, True)
    dgrad = problem_of("dgrad", torch.randn(6, 24), w_nk, [2, 2, 2])
    assert (dgrad.k, dgrad.n, dgrad.trans_w) == (16, 24, True)


def test_grouped_mm_rejects_counts_that_do_not_fit() -> None:
    x, w, _ = _operands([2, 2], 8, 8)
    with pytest.raises(ValueError, match="counts"):
        grouped_mm(x, w, [2, 1])
    with pytest.raises(ValueError, match="counts"):
        grouped_mm(x, w, [2, 1, 1])
    with pytest.raises(ValueError, match="backend"):
        dispatch.of(GROUPED.name).set_backend("cublas")
    assert dispatch.of(GROUPED.name).backend == "grouped_mm"


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BACKENDS))
def test_backends_on_gpu_bf16(name: str) -> None:
    """bf16 on the GPU (torch._grouped_mm's CUTLASS kernel, the compiled Triton kernel),
    unaligned group starts and empty groups included."""
    device = torch.device("cuda")
    backend = BACKENDS[name]
    counts = [0, 1, 300, 77, 0, 129, 8, 1]
    k, n = 256, 512
    why = backend.unsupported(device, torch.bfloat16, k, n)
    assert why is None, why
    x, w, dy = (t.to(device) for t in _operands(counts, k, n, torch.bfloat16))
    y_ref, dx_ref, dw_ref = _reference(x, w, dy, counts)
    for got, want in (
        (backend.mm(x, w, counts), y_ref),
        (backend.mm(dy, w.transpose(1, 2), counts), dx_ref),
        (backend.wgrad(x, dy, counts), dw_ref),
    ):
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < 2e-2, (name, err)


def test_benchmark_script_runs_in_smoke_mode(tmp_path) -> None:
    """benchmarks/moe/moe_grouped_gemm.py --smoke: every case and pass, every backend timed and
    equal to the per-expert loop, the JSON with device and versions."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "smoke.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(root / "benchmarks" / "moe" / "moe_grouped_gemm.py"), "--smoke"]
    result = subprocess.run(
        [*cmd, "--reps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["device"]["vendor"] == "cpu" and "torch" in data["versions"]
    timed = [r for r in data["rows"] if "median_s" in r]
    assert {(r["case"], r["phase"]) for r in timed} == {
        (c["name"], p) for c in data["cases"] for p in ("fwd", "dgrad", "wgrad")
    }
    assert len(data["cases"]) == 5 and {r["backend"] for r in timed} == set(BACKENDS)
    assert all(r["max_rel_err_vs_loop"] < 1e-5 and r["tflops"] > 0 for r in timed)
    assert len(data["summary"]) == 15


def test_layout_benchmark_runs_in_smoke_mode(tmp_path) -> None:
    """benchmarks/moe/grouped_mm_layouts.py --smoke: torch's kernel on the counts' own offsets and
    both weight layouts, the backend, Triton; every op of every pass equal to the fp32
    product."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "layouts.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "moe" / "grouped_mm_layouts.py"), "--smoke", "--reps",
                             "1", "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["phase"], r["op"]) for r in rows} >= {("fwd", "raw wN"), ("fwd", "raw wT"), ("dgrad", "raw wT"),
                                                     ("wgrad", "raw"), ("fwd", "backend grouped_mm wN")}
    assert all(r["error"] < 1e-5 and r["unaligned_group_starts"] > 0 for r in rows), rows
