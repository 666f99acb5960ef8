"""The native GEMM dispatch (runtime/native.py, native_gemm.cpp): built here with the
machine's compiler, it answers aten::mm/bmm/addmm from its table of call signatures. On the
CPU the table runs the fake kernel table's rows in Python (kind PYTHON) and torch's choices
in C++; the GPU tests run the cuBLASLt/hipBLASLt launch itself and time it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import primus_perf
from enable_fakes import FAKE_KINDS, H100, gemm_entry, launched
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.gemm import problem_of, torch_mm
from primus_perf.kernels.grouped.passes import inside
from primus_perf.runtime import dispatch, native
from primus_perf.runtime.gemm import GemmDispatch


@pytest.fixture(scope="module")
def ext():
    module = native.load()
    assert module is not None, native.why_not()
    return module


@pytest.fixture
def cpu_device(monkeypatch):
    monkeypatch.setattr("primus_perf.runtime.activate.current_device", lambda: H100)


def _cache(tmp_path: Path, *pairs, torch_choice=()) -> Path:
    cache = tmp_path / "cache.json"
    entries = [gemm_entry(problem_of(a, b), H100) for a, b in pairs]
    entries += [gemm_entry(problem_of(a, b), H100, source="torch") for a, b in torch_choice]
    TuningCache(cache).put_many(entries)
    return cache


def _enable(cache: Path):
    return primus_perf.enable(cache, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS, log=None)


def test_routes_from_the_table_once_per_signature(tmp_path, ext, cpu_device) -> None:
    a, b = torch.randn(16, 32), torch.randn(32, 24)
    kept = (torch.randn(8, 32), torch.randn(32, 24))  # torch's own choice in the cache
    cache = _cache(tmp_path, (a, b), torch_choice=[kept])
    launched.clear()
    with _enable(cache) as handle:
        assert native.installed() and f"  gemm: {GemmDispatch.path(dispatch.of('gemm'))}" in handle.start_lines()
        assert "native dispatch" in handle.paths["gemm"]
        for _ in range(5):
            out = torch.mm(a, b)
            torch.mm(*kept)
            torch.mm(torch.randn(4, 5), torch.randn(5, 6))  # no entry
        assert native.signatures() == 3  # three signatures, each resolved by the router once
        s = handle.summary()["gemm"]
    assert not native.installed()
    torch.testing.assert_close(out, a @ b)
    assert launched[problem_of(a, b).key()] == 5
    assert s["routed"] == 10 and s["fallback"] == 5 and not s["failed"]


def test_addmm_bias_epilogue_and_other_addmm(tmp_path, ext, cpu_device) -> None:
    lin = torch.nn.Linear(32, 24)
    a, b, bias = torch.randn(16, 32), lin.weight.detach().t(), torch.randn(24)
    cache = tmp_path / "cache.json"
    p = problem_of(a, b)
    import dataclasses

    TuningCache(cache).put(gemm_entry(dataclasses.replace(p, epilogue="bias"), H100))
    launched.clear()
    with _enable(cache) as handle:
        out = torch.addmm(bias, a, b)
        scaled = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)  # not the epilogue: torch's addmm
        y = torch.nn.functional.linear(a, lin.weight, lin.bias)
        s = handle.summary()["gemm"]
    torch.testing.assert_close(out, torch.addmm(bias, a, b))
    torch.testing.assert_close(scaled, torch.addmm(bias, a, b, beta=0.5, alpha=2.0))
    torch.testing.assert_close(y, torch.nn.functional.linear(a, lin.weight, lin.bias))
    assert sum(launched.values()) == 2  # the epilogue call and the linear (the same problem)
    assert s["routed"] == 2


def test_backward_and_batched_calls(tmp_path, ext, cpu_device) -> None:
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(24, 32, requires_grad=True)
    g = torch.randn(16, 24)
    q, k = torch.randn(3, 8, 16), torch.randn(3, 16, 8)
    cache = _cache(tmp_path, (x.detach(), w.detach().t()), (g, w.detach()), (g.t(), x.detach()), (q, k))
    launched.clear()
    with _enable(cache) as handle:
        y = x @ w.t()
        y.backward(g)
        z = torch.bmm(q, k)
        s = handle.summary()["gemm"]
    torch.testing.assert_close(z, torch.bmm(q, k))
    torch.testing.assert_close(x.grad, g @ w.detach())
    torch.testing.assert_close(w.grad, g.t() @ x.detach())
    assert s["routed"] == 4 and len(launched) == 4


def test_a_grouped_gemms_own_gemms_and_a_confirmation_go_through_python(tmp_path, ext, cpu_device) -> None:
    a, b = torch.randn(16, 32), torch.randn(32, 24)
    cache = _cache(tmp_path, (a, b))
    launched.clear()
    with _enable(cache) as handle:
        torch.mm(a, b)  # in the table now
        with inside:
            torch.mm(a, b)  # torch's, counted nowhere (as the Python route does)
        assert launched[problem_of(a, b).key()] == 1
        calls = []

        class Confirmer:
            def call(self, owner, key, choice, baseline, probe, **timing):
                calls.append(key)
                return choice()

        gemm = dispatch.of("gemm")
        gemm.interpose(Confirmer())
        try:
            torch.mm(a, b)  # the confirmer sees it: the table is detached
        finally:
            gemm.interpose(None)
        assert len(calls) == 1
        torch.mm(a, b)  # attached again
        s = handle.summary()["gemm"]
    assert s["routed"] == 3 and launched[problem_of(a, b).key()] == 3


def test_a_failing_kernel_falls_back_once_and_says_so(tmp_path, ext, cpu_device, capsys) -> None:
    from enable_fakes import FAKE_TABLE

    a, b = torch.randn(16, 32), torch.randn(32, 24)
    cache = _cache(tmp_path, (a, b))

    class Broken:
        def __call__(self, a, b):
            raise RuntimeError("kernel launch refused")

        def close(self):
            pass

    original = FAKE_TABLE["fakeblas"]
    FAKE_TABLE["fakeblas"] = lambda problem, solution, device: Broken()
    try:
        with _enable(cache) as handle:
            outs = [torch.mm(a, b) for _ in range(3)]
            s = handle.summary()["gemm"]
    finally:
        FAKE_TABLE["fakeblas"] = original
    for out in outs:
        torch.testing.assert_close(out, a @ b)
    assert s["failed"] == [problem_of(a, b).key()] and s["fallback"] == 3 and s["routed"] == 0
    assert capsys.readouterr().err.count("kernel launch refused") == 1


def test_calls_routed_before_a_failure_stay_routed_and_none_is_torchs(tmp_path, ext, cpu_device) -> None:
    from enable_fakes import FAKE_TABLE

    a, b = torch.randn(16, 32), torch.randn(32, 24)
    c, d = torch.randn(8, 32), torch.randn(32, 24)
    cache = _cache(tmp_path, (a, b), (c, d))

    class FailsThird:
        def __init__(self, problem):
            self.key, self.calls = problem.key(), 0

        def __call__(self, x, y):
            if self.key == problem_of(c, d).key():
                return None  # "not mine": torch runs it
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("third call refused")
            return torch_mm(x, y)  # past the overrides, as a library kernel

        def close(self):
            pass

    original = FAKE_TABLE["fakeblas"]
    FAKE_TABLE["fakeblas"] = lambda problem, solution, device: FailsThird(problem)
    try:
        with _enable(cache) as handle:
            outs = [torch.mm(a, b) for _ in range(5)]
            other = torch.mm(c, d)
            s = handle.summary()["gemm"]
    finally:
        FAKE_TABLE["fakeblas"] = original
    for out in outs:
        torch.testing.assert_close(out, a @ b)
    torch.testing.assert_close(other, c @ d)
    assert s["problems"]["routed"] == {problem_of(a, b).key(): 2, problem_of(c, d).key(): 1}
    assert s["problems"]["fallback"] == {problem_of(a, b).key(): 3}


def test_operands_of_another_rank_get_torchs_error(tmp_path, ext, cpu_device) -> None:
    a, b = torch.randn(16, 32), torch.randn(32, 24)
    cache = _cache(tmp_path, (a, b))
    with _enable(cache):
        torch.mm(a, b)
        for call in (lambda: torch.mm(a.unsqueeze(0), b.unsqueeze(0)), lambda: torch.bmm(a, b),
                     lambda: torch.mm(torch.tensor(1.0), b), lambda: torch.addmm(torch.randn(24), a.unsqueeze(0), b)):
            with pytest.raises(RuntimeError):
                call()


def test_profiled_calls_show_the_routed_op(tmp_path, ext, cpu_device) -> None:
    a, b = torch.randn(16, 32), torch.randn(32, 24)
    cache = _cache(tmp_path, (a, b))
    with _enable(cache) as handle:
        torch.mm(a, b)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.mm(a, b)
        torch.mm(a, b)
        s = handle.summary()["gemm"]
    names = {e.name for e in prof.events()}
    assert "primus_perf::gemm" in names
    assert s["routed"] == 3


def test_switched_off_by_the_environment(tmp_path) -> None:
    code = ("from primus_perf.runtime import native; print(native.load() is None, native.why_not())")
    env = {**os.environ, native.ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", f"{native.ENV}=0"]


def test_a_program_that_exits_enabled_exits_cleanly(tmp_path, ext) -> None:
    """The table holds Python objects: a program that never disables must still exit 0
    (they are released while Python runs, not by C++ destructors after it)."""
    code = f"""
import sys
import time
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
import torch
import primus_perf
import primus_perf.runtime.activate as activate
from enable_fakes import FAKE_KINDS, H100, gemm_entry
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.gemm import problem_of
activate.current_device = lambda: H100
a, b = torch.randn(16, 32), torch.randn(32, 24)
TuningCache({str(tmp_path / "cache.json")!r}).put(gemm_entry(problem_of(a, b), H100))
primus_perf.enable({str(tmp_path / "cache.json")!r}, kinds=("gemm",), device_type="cpu",
                   router_kinds=FAKE_KINDS, log=None)
torch.mm(a, b)
print("routed", primus_perf.runtime.native.signatures())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["routed", "1"]


# ---- GPU: the cuBLASLt/hipBLASLt launch from the table ----------------------------------


def _heuristic_cache(tmp_path: Path, pairs) -> Path:
    from primus_perf.base.devices import current_device
    from primus_perf.cache.store import CacheEntry
    from primus_perf.kernels import gemm
    from primus_perf.kernels.blaslt.binding import load

    lt = load()
    entries = []
    for a, b in pairs:
        p = problem_of(a, b)
        with lt.plan(p) as plan:
            algo = plan.heuristics(1, gemm.WORKSPACE_BYTES)[0].algo
        entries.append(CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(),
                                  device=current_device().to_dict(), versions=gemm.library_versions(lt),
                                  solution={"config": {"name": "heur0", "source": lt.t.source}, "blob": algo},
                                  times={}, tuner_version="test"))
    cache = tmp_path / "cache.json"
    TuningCache(cache).put_many(entries)
    return cache


@pytest.mark.gpu
def test_gpu_library_launch_from_the_table(tmp_path, ext) -> None:
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(512, 256, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(384, 256, device=dev, dtype=bf, requires_grad=True)
    g = torch.randn(512, 384, device=dev, dtype=bf)
    q, k = torch.randn(4, 128, 64, device=dev, dtype=bf), torch.randn(4, 64, 96, device=dev, dtype=bf)
    pairs = [(x.detach(), w.detach().t()), (g, w.detach()), (g.t(), x.detach()), (q, k)]
    cache = _heuristic_cache(tmp_path, pairs)
    with primus_perf.enable(cache, kinds=("gemm",), log=None) as handle:
        assert native.installed(), native.why_not()
        y = x @ w.t()
        y.backward(g)
        z = torch.bmm(q, k)
        storage = torch.randn(512 * 256 + 1, device=dev, dtype=bf)
        shifted = storage[1:].view(512, 256)  # a pointer the stored algorithm was not chosen for
        s_out = shifted @ w.detach().t()
        torch.cuda.synchronize()
        s = handle.summary()["gemm"]
        unaligned = sum(k.unaligned for k in handle.routers["gemm"]._slots)  # torch ran the shifted call
    xf, wf, gf = x.detach().float(), w.detach().float(), g.float()
    for got, ref in ((y, xf @ wf.t()), (x.grad, gf @ wf), (w.grad, gf.t() @ xf), (z, q.float() @ k.float()),
                     (s_out, shifted.float() @ wf.t())):
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert s["routed"] == 5 and s["fallback"] == 0 and not s["failed"]
    assert unaligned == 1


@pytest.mark.gpu
def test_gpu_routed_call_costs_no_more_than_torchs(tmp_path, ext) -> None:
    """Host time of a routed call against torch.mm on the same operands, interleaved rounds:
    the native table adds at most 3 us (``benchmarks/runtime/routing_overhead.py`` reports it)."""
    import statistics
    import time

    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 16, device="cuda", dtype=torch.bfloat16)
    cache = _heuristic_cache(tmp_path, [(a, b)])

    def per_call(calls=2000):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        host = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
        return host

    plain, routed = [], []
    for _ in range(5):
        plain.append(per_call())
        with primus_perf.enable(cache, kinds=("gemm",), log=None):
            torch.mm(a, b)
            routed.append(per_call())
    overhead_us = (statistics.median(routed) - statistics.median(plain)) * 1e6
    assert overhead_us <= 3.0, (overhead_us, plain, routed)


def test_a_router_installed_over_another_is_the_one_the_table_asks(tmp_path, ext, cpu_device) -> None:
    """The table's routes follow the router in the dispatch: a tool's router installed over the
    cache's answers its calls, and once it is closed and out no call reaches its kernels."""
    from enable_fakes import FakeKernel
    from primus_perf.kernels.gemm import GemmRouter
    from primus_perf.runtime import dispatch

    a, b = torch.randn(16, 32), torch.randn(32, 24)
    ran: list[str] = []

    class Tagged(FakeKernel):
        def __init__(self, problem) -> None:
            super().__init__(problem)
            self.closed = False

        def __call__(self, x, y):
            ran.append("closed" if self.closed else "B")
            return torch_mm(x, y)

        def close(self) -> None:
            self.closed = True

    with _enable(_cache(tmp_path, (a, b))) as handle:
        torch.mm(a, b)  # the cache's router: in the table
        other = GemmRouter(list(handle.routers["gemm"].entries.values()), {"fakeblas": lambda p, s, d: Tagged(p)})
        with dispatch.routing({"gemm": other}, "cpu"):
            torch.mm(a, b)
        other.close()
        torch.mm(a, b)
        assert native.installed() and dispatch.of("gemm").router is handle.routers["gemm"]
    assert ran == ["B"]


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_on_for_ever(tmp_path, capsys) -> None:
    """torch's build lock outlives a build that was killed (seen: a suite stopped mid-build left
    the next one waiting with no end): one older than a build takes is removed, with a line;
    a fresh one is waited on until its build ends."""
    import threading

    from primus_perf.runtime import native

    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - native.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    native._clear_stale_lock(lock, None, poll_s=0.001)
    assert not lock.exists() and "removed the build lock" in capsys.readouterr().err

    lock.touch()  # a live build: released by its owner
    done = threading.Event()
    threading.Thread(target=lambda: (done.wait(5), lock.unlink())).start()
    done.set()
    native._clear_stale_lock(lock, None, poll_s=0.001)
    assert not lock.exists()
