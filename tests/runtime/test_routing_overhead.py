"""Routing costs nothing where the cache keeps torch's choice, and little where it routes:
the router's flags, the GEMM dispatch's per-signature table (never a call routed to a kernel
resolved for another signature), its counts and failures, the BLAS-Lt kernel's per-signature
run, and the benchmark's modes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from enable_fakes import FAKE_TABLE, H100, gemm_entry
from primus_perf.kernels import gemm
from primus_perf.kernels.gemm import GemmRouter, problem_of
from primus_perf.runtime.gemm import GemmDispatch

ROOT = Path(__file__).resolve().parents[2]


class _Checked:
    """A kernel made for one problem that records every call whose operands are not of that
    problem (a wrong memo hit) and computes the product in float64."""

    wrong: ClassVar[list[str]] = []
    ran: ClassVar[int] = 0

    def __init__(self, problem, solution, device) -> None:
        self.problem, self.device = problem, device

    def __call__(self, a, b):
        _Checked.ran += 1
        try:
            got = problem_of(a, b)
        except ValueError as exc:
            got = str(exc)
        plain = dataclasses.replace(self.problem, epilogue="none")
        if got != plain or a.device != self.device or b.device != self.device:
            _Checked.wrong.append(f"kernel of {self.problem.key()} got {got} on {a.device}, {b.device}")
        return gemm.torch_mm(a.double(), b.double()).to(a.dtype)

    def close(self) -> None:
        pass


CHECKED = {"fakeblas": _Checked}


def _dispatch(router: GemmRouter) -> GemmDispatch:
    """A GEMM dispatch of its own (not the process's) routing to ``router``."""
    d = GemmDispatch("gemm")
    d.install(router)
    return d


def _router(*calls) -> GemmDispatch:
    """A dispatch whose router has a checked kernel for the problem of each ``(a, b)`` or
    ``(a, b, bias)``."""
    entries = {}
    for a, b, *bias in calls:
        p = problem_of(a, b)
        if bias and bias[0] is not None:
            p = dataclasses.replace(p, epilogue="bias")
        entries[p.key()] = gemm_entry(p, H100)
    _Checked.wrong.clear()
    return _dispatch(GemmRouter(list(entries.values()), CHECKED))


def _key(a, b, bias=None) -> str:
    p = problem_of(a, b)
    return (dataclasses.replace(p, epilogue="bias") if bias is not None else p).key()


def _routed(d: GemmDispatch, a, b, bias=None) -> bool:
    """Whether the dispatch ran the call on the router's kernel (the answer is checked against
    float64 either way)."""
    before = _Checked.ran
    try:
        out = d.gemm(a, b, bias)
    except RuntimeError:  # a call torch itself refuses (operands of two dtypes): torch's own error
        assert _Checked.ran == before
        return False
    if out.device == a.device == b.device:
        ref = a.double() @ b.double() + (0 if bias is None else bias.double())
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    return _Checked.ran > before


def test_a_router_of_torch_choices_routes_nothing() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    torch_entry = gemm_entry(problem_of(a, b), H100, source="torch")
    assert GemmRouter([torch_entry], FAKE_TABLE).idle()
    assert GemmRouter([], FAKE_TABLE).idle()
    tuned = gemm_entry(problem_of(torch.randn(4, 16), b), H100)
    assert not GemmRouter([torch_entry, tuned], FAKE_TABLE).idle()


def test_a_call_signature_is_resolved_once() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    router = GemmRouter([gemm_entry(problem_of(a, b), H100)], FAKE_TABLE)
    resolved = []
    real = router.resolve
    router.resolve = lambda *args: resolved.append(args) or real(*args)  # type: ignore[method-assign]
    d = _dispatch(router)
    for _ in range(5):
        torch.testing.assert_close(d.gemm(a, b), a @ b)
    d.gemm(a.t().contiguous().t(), b)  # another layout: another signature (no entry)
    assert len(resolved) == 2 and sum(d.routed.values()) == 5 and sum(d.fallback.values()) == 1


# pairs of calls that share shapes but not their signature: the first has an entry, the second
# none (or another one); each (a, b, bias)
_A, _B = torch.randn(8, 16), torch.randn(16, 16)
_SAME_SHAPE = {
    "a's strides": ((_A, _B), (torch.randn(16, 8).t(), _B)),
    "b transposed": ((_A, _B), (_A, torch.randn(16, 16).t())),
    "dtype": ((_A, _B), (_A.double(), _B.double())),
    "b's dtype only": ((_A, _B), (_A, _B.double())),
    "bias": ((_A, _B), (_A, _B, torch.randn(16))),
    "no bias": ((_A, _B, torch.randn(16)), (_A, _B)),
    "bias dtype": ((_A, _B, torch.randn(16)), (_A, _B, torch.randn(16).double())),
    "b's device": ((_A, _B), (_A, _B.to("meta"))),
    "batched rank": ((_A[None], _B[None]), (_A[None].expand(2, 8, 16), _B[None].expand(2, 16, 16))),
}


@pytest.mark.parametrize("case", sorted(_SAME_SHAPE))
@pytest.mark.parametrize("order", ["entry first", "other first"])
def test_a_memo_hit_never_routes_another_signature(case: str, order: str) -> None:
    tuned, other = _SAME_SHAPE[case]
    router = _router(tuned)
    calls = [tuned, other] if order == "entry first" else [other, tuned]
    ran = [_routed(router, *c) for _ in range(3) for c in calls]
    assert ran == [c is tuned for _ in range(3) for c in calls]
    assert _Checked.wrong == []
    assert router.summary()["routed"] == {_key(*tuned): 3}
    assert sum(router.summary()["fallback"].values()) == 3 and not router.summary()["failed"]


def test_each_signature_runs_its_own_problems_kernel_and_counts_exactly() -> None:
    """Four layouts of one shape, each with its own entry, and a batch-1 3-D call (the 2-D
    problem's kernel, output of its own rank): every call gets its own kernel; the counts
    per problem key are the calls made."""
    a_t, b_t = torch.randn(16, 8).t(), torch.randn(16, 16).t()
    calls = [(_A, _B), (a_t, _B), (_A, b_t), (a_t, b_t)]
    router = _router(*calls, (_A, _B, torch.randn(16)))
    expected: dict[str, int] = {}
    for i in range(12):
        a, b = calls[i % 4]
        assert _routed(router, a, b)
        expected[_key(a, b)] = expected.get(_key(a, b), 0) + 1
    bias = torch.randn(16)
    assert _routed(router, _A, _B, bias) and _routed(router, _A[None], _B[None])
    expected[_key(_A, _B, bias)] = 1
    expected[_key(_A, _B)] += 1
    assert router.gemm(_A[None], _B[None]).shape == (1, 8, 16)
    expected[_key(_A, _B)] += 1
    assert _Checked.wrong == []
    assert router.summary() == {"routed": expected, "fallback": {}, "failed": []}
    assert len(router.router._slots) == 5  # one kernel per problem, whatever its signatures


def test_torch_choices_count_as_routed_and_unsupported_layouts_as_fallback() -> None:
    _Checked.wrong.clear()
    d = _dispatch(GemmRouter([gemm_entry(problem_of(_A, _B), H100, source="torch")], CHECKED))
    overlapping = _A[None].expand(2, 8, 16)  # a batch stride of 0: no BLAS-Lt layout
    for _ in range(2):
        assert not _routed(d, _A, _B) and not _routed(d, overlapping, _B[None].expand(2, 16, 16))
    assert d.summary() == {"routed": {_key(_A, _B): 2}, "fallback": {"unsupported": 2}, "failed": []}


def test_a_failed_kernel_sends_every_signature_of_its_problem_to_torch() -> None:
    """A kernel that raises: its problem's memoized signatures (and later ones) go to torch,
    counted as fallback; another problem's calls still run."""
    class Failing(_Checked):
        def __call__(self, a, b):
            if a.dtype == torch.float32 and a.stride() == (16, 1):
                raise RuntimeError("planted")
            return super().__call__(a, b)

    a_t = torch.randn(16, 8).t()
    p, q = problem_of(_A, _B), problem_of(a_t, _B)
    d = _dispatch(GemmRouter([gemm_entry(p, H100), gemm_entry(q, H100)], {"fakeblas": Failing}))
    assert _routed(d, a_t, _B)
    before = _Checked.ran
    torch.testing.assert_close(d.gemm(_A, _B), _A @ _B)  # raised: reported once, then torch's
    assert _Checked.ran == before
    assert not _routed(d, _A, _B) and not _routed(d, _A.clone(), _B)
    assert _routed(d, a_t, _B)
    assert d.summary() == {"routed": {q.key(): 2}, "fallback": {p.key(): 3}, "failed": [p.key()]}


class _FakePlan:
    """What BlasLtKernel reads of a plan, with a launcher that records its arguments."""

    def __init__(self, problem) -> None:
        self.problem = problem
        self.lt = SimpleNamespace(t=SimpleNamespace(pointer_alignment=256))
        self.launches: list[tuple] = []
        self.closed = False

    def launcher(self, algo, workspace):
        return lambda *args: self.launches.append(args)

    def close(self) -> None:
        self.closed = True


def test_blaslt_kernel_runs_with_arguments_settled_per_signature(monkeypatch) -> None:
    """The per-signature run hands the library torch's b as BLAS A, a as B, a fresh output
    of the call's rank as D, the device's workspace and the current stream; a view whose
    pointer is less aligned runs torch's GEMM (counted) and reaches no library call."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)

    def aligned(*shape):  # a view whose pointer is 256-byte aligned, and its storage
        buf = torch.randn(torch.Size(shape).numel() + 64)
        start = (-buf.data_ptr() % 256) // 4
        return buf[start : start + torch.Size(shape).numel()].view(shape), buf, start

    a, big, start = aligned(8, 16)
    b = aligned(16, 16)[0]
    kernel = gemm.BlasLtKernel(_FakePlan(problem_of(a, b)), b"algo")
    ws = gemm._workspace(a.device)
    out = kernel(a, b)
    assert out.shape == (8, 16)
    assert kernel.plan.launches == [(b.data_ptr(), a.data_ptr(), out.data_ptr(), ws, 999)]
    assert kernel.for_call(a, b) is kernel.for_call(a, b)  # settled once
    out3 = kernel(a[None], b[None])
    assert out3.shape == (1, 8, 16) and kernel.plan.launches[-1][2] == out3.data_ptr()
    assert kernel.for_call(a[None], b[None]) is not kernel.for_call(a, b)
    shifted = big[start + 1 : start + 1 + 8 * 16].view(8, 16)  # 4 bytes past an aligned pointer
    torch.testing.assert_close(kernel(shifted, b), shifted @ b)
    assert kernel.unaligned == 1 and len(kernel.plan.launches) == 2
    kernel.close()
    assert kernel.plan.closed


def test_routing_overhead_benchmark_smoke() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "runtime" / "routing_overhead.py"), "--smoke"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    per_call = data["per_call"]
    assert per_call["routed_host"]["n"] == per_call["plain_host"]["n"] == 3
    assert per_call["overhead_host_us"] == per_call["routed_host"]["median_us"] - per_call["plain_host"]["median_us"]
    layers = per_call["host_breakdown"]
    assert set(layers) == {"torch_mm", "kernel", "dispatch", "override", "new_empty", "torch_mm_out"}
    assert all(v["n"] == 3 for v in layers.values())
    default = data["all_default_cache"]
    assert default["entries"] > 0 and default["gemm_override_installed"] is False
    assert default["on"]["n"] == default["off"]["n"] == 1
    path = data["python_path"]
    assert path["dispatch_us"]["n"] == path["torch_mm_us"]["n"] > 1
    assert path["override_adds_us"] == path["override_us"]["median_us"] - path["kernel_us"]["median_us"]


@pytest.mark.gpu
def test_blaslt_router_keeps_same_shape_signatures_apart_on_the_gpu() -> None:
    """The library's kernels through the router: four layouts of one shape, each with its
    own heuristic algorithm, a bias call and a batch-1 3-D call, interleaved; each answer
    matches the fp32 product, the counts per problem are the calls made, and a call with
    an operand on the host goes to torch."""
    from primus_perf.base.devices import current_device
    from primus_perf.cache.store import CacheEntry
    from primus_perf.kernels.blaslt.binding import load

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    a, b, a_t, b_t = bf16(64, 128), bf16(128, 128), bf16(128, 64).t(), bf16(128, 128).t()
    bias = bf16(128)
    calls = [(a, b, None), (a_t, b, None), (a, b_t, None), (a_t, b_t, None), (a, b, bias)]
    entries = []
    for x, y, z in calls:
        p = problem_of(x, y)
        with load().plan(p) as plan:
            algo = plan.heuristics(1, gemm.WORKSPACE_BYTES)[0].algo
        p = dataclasses.replace(p, epilogue="bias") if z is not None else p
        entries.append(CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(),
                                  device=current_device().to_dict(), versions={},
                                  solution={"config": {"source": "cublaslt"}, "blob": algo}))
    router = GemmRouter(entries)
    d = _dispatch(router)
    expected: dict[str, int] = {}
    for _ in range(3):
        for x, y, z in [*calls, (a[None], b[None], None)]:
            out = d.gemm(x, y, z)
            ref = x.float() @ y.float() + (0 if z is None else z.float())
            assert out is not None and out.shape == ref.shape
            assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
            key = _key(x[0] if x.dim() == 3 else x, y[0] if y.dim() == 3 else y, z)
            expected[key] = expected.get(key, 0) + 1
    assert router.route(a, b.cpu())[1] is None
    assert d.summary() == {"routed": expected, "fallback": {}, "failed": []}
    router.close()


def test_an_all_default_cache_of_any_kind_installs_no_override(tmp_path: Path) -> None:
    """Entries that all name torch's own kernel (SDPA's default; ``grouped_mm`` for a
    program's ``aten::_grouped_mm``) leave the program's calls to torch: no override and
    bit-identical results (a program whose grouped backend is another, primus-train's loop,
    still routes them: ``idle("loop")`` is False). An empty cache still intercepts: it counts
    the calls."""
    import torch.nn.functional as F

    import primus_perf
    from enable_fakes import attention_entry
    from primus_perf.base.devices import current_device
    from primus_perf.cache.store import TuningCache
    from primus_perf.kernels.attention.router import AttentionChoice, AttentionRouter, problem_of
    from primus_perf.kernels.grouped.router import GroupedChoice, GroupedGemmRouter
    from primus_perf.problems import GroupedGemmProblem
    from primus_perf.runtime import dispatch
    from primus_perf.runtime.handle import NO_ENTRIES

    q = k = v = torch.randn(1, 2, 8, 4)
    prob = problem_of(q, k, v, True)
    assert AttentionRouter({prob.key(): AttentionChoice("sdpa:default")}).idle()
    assert not AttentionRouter({}).idle()  # no choice: it stays, counting the calls
    assert not AttentionRouter({prob.key(): AttentionChoice("sdpa:math")}).idle()
    gkey = GroupedGemmProblem.from_counts([4, 4], 8, 8).key()
    assert GroupedGemmRouter({gkey: GroupedChoice("grouped_mm")}).idle("grouped_mm")
    assert not GroupedGemmRouter({gkey: GroupedChoice("grouped_mm")}).idle("loop")  # a program whose backend is the loop
    assert not GroupedGemmRouter({}).idle("grouped_mm")
    assert not GroupedGemmRouter({gkey: GroupedChoice("loop")}).idle("grouped_mm")

    cache = tmp_path / "default.json"
    TuningCache(cache).put_many([attention_entry(prob, current_device(), choice=AttentionChoice("sdpa:default"))])
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with primus_perf.enable(cache, kinds=("attention", "grouped_gemm"), device_type="cpu", log=None) as handle:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert not dispatch.of("attention").intercepting  # its router is in place, no call reaches it
        assert handle.summary()["attention"]["fallback"] == 0 and "no override of the program's calls" in handle.end_lines()[0]
        assert handle.summary()["attention"]["intercepted"] is False
        # a kind the tuned cache holds nothing for is left alone, and says so
        assert dispatch.of("grouped_gemm").router is None
        assert handle.summary()["grouped_gemm"] == {"available": False, "note": NO_ENTRIES, "entries": 0}
    assert torch.equal(out, ref)
    grouped = tmp_path / "grouped.json"
    TuningCache(grouped).put_many([dataclasses.replace(
        attention_entry(prob, current_device()), kind="grouped_gemm", problem_key=gkey,
        problem=GroupedGemmProblem.from_key(gkey).to_dict(),
        solution={"config": {"name": "grouped_mm", **GroupedChoice("grouped_mm").to_solution()}, "blob": b""})])
    with primus_perf.enable(grouped, kinds=("grouped_gemm",), device_type="cpu", log=None) as handle:
        assert not dispatch.of("grouped_gemm").intercepting  # unless a program's backend is another
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with primus_perf.enable(empty, kinds=("attention",), device_type="cpu", log=None) as handle:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert dispatch.of("attention").intercepting and handle.summary()["attention"]["fallback"] == 1
