"""primus_perf.enable on the CPU: an unmodified model (``enable_fakes.Block``, not the trainer) routes
its forward, input-gradient and weight-gradient GEMMs and its SDPA calls to the cache's
choices (a fake kernel table stands in for cuBLASLt), leaves everything else to torch
bit for bit, reports stale entries, and compiles without graph breaks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import primus_perf
from enable_fakes import (
    BLOCK_ATTENTION,
    FAKE_KINDS,
    H100,
    Block,
    attention_entry,
    gemm_entry,
    launched,
    run,
)
from primus_perf.base.devices import current_device
from primus_perf.base.errors import CacheError, UserError
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.attention.router import library_versions as attention_versions
from primus_perf.kernels.gemm import problem_of
from primus_perf.runtime import dispatch


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    return Block(), torch.randn(2, 8, 32)


def test_stale_entries_leave_the_run_bit_identical(tmp_path: Path, model_and_input) -> None:
    model, x = model_and_input
    x2 = x.reshape(-1, 32)
    cache = tmp_path / "cache.json"
    fwd = problem_of(x2, model.qkv.weight.t())
    TuningCache(cache).put_many([gemm_entry(fwd, H100), attention_entry(BLOCK_ATTENTION, H100, attention_versions())])
    ref_y, ref_g = run(model, x)
    with primus_perf.enable(cache, device_type="cpu", router_kinds=FAKE_KINDS, log=None) as tuned:
        y, g = run(model, x)
        summary = tuned.summary()
    assert torch.equal(y, ref_y) and all(torch.equal(a, b) for a, b in zip(g, ref_g))
    assert summary["gemm"]["stale"] == 1 and summary["attention"]["stale"] == 1
    # no usable gemm entry: the GEMM operators are not overridden at all, so nothing is counted
    assert summary["gemm"]["routed"] == 0 and summary["gemm"]["fallback"] == 0
    assert summary["attention"]["routed"] == 0 and summary["attention"]["fallback"] == 1
    assert summary["grouped_gemm"] == {"available": False, "note": "not available in this installation", "entries": 0}
    # disabled: torch's kernels again, nothing counted
    run(model, x)
    assert tuned.summary()["attention"]["fallback"] == 1 and primus_perf.runtime.active() is None


def test_routes_exact_problems_fwd_dgrad_wgrad(tmp_path: Path) -> None:
    torch.manual_seed(1)
    lin = nn.Linear(32, 48, bias=False)
    x = torch.randn(16, 32, requires_grad=True)
    g = torch.randn(16, 48)
    fwd = problem_of(x, lin.weight.t())
    dgrad = problem_of(g, lin.weight)
    wgrad = problem_of(g.t(), x)
    other = problem_of(torch.randn(16, 32), torch.randn(32, 8))
    cache = tmp_path / "cache.json"
    TuningCache(cache).put_many([gemm_entry(p, current_device()) for p in (fwd, dgrad, wgrad)])
    launched.clear()
    with primus_perf.enable(cache, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS, log=None) as tuned:
        y = lin(x)
        y.backward(g)
        z = torch.randn(16, 32) @ torch.randn(32, 8)  # no entry: torch
        s = tuned.summary()["gemm"]
    assert dict(launched) == {fwd.key(): 1, dgrad.key(): 1, wgrad.key(): 1}
    assert s["problems"]["routed"] == {fwd.key(): 1, dgrad.key(): 1, wgrad.key(): 1}
    assert s["problems"]["fallback"] == {other.key(): 1} and s["unusable"] == 0
    torch.testing.assert_close(y, x @ lin.weight.t())
    torch.testing.assert_close(lin.weight.grad, g.t() @ x)
    assert z.shape == (16, 8)


def test_torch_choice_entries_are_not_routed_at_all(tmp_path: Path) -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    p = problem_of(a, b)
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(gemm_entry(p, current_device(), source="torch"))
    with primus_perf.enable(cache, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS, log=None) as tuned:
        assert not dispatch.of("gemm").intercepting  # every entry is torch's: no override is installed
        out = torch.mm(a, b)
    assert torch.equal(out, a @ b)
    assert tuned.summary()["gemm"]["routed"] == 0
    # beside a tuned entry the torch entry's calls go through the override and count as routed
    other = problem_of(torch.randn(4, 16), torch.randn(16, 4))
    TuningCache(cache).put(gemm_entry(other, current_device()))
    with primus_perf.enable(cache, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS, log=None) as tuned:
        out = torch.mm(a, b)
    assert torch.equal(out, a @ b)
    assert tuned.summary()["gemm"]["routed"] == 1


def test_enable_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown kind"):
        primus_perf.enable(tmp_path / "x.json", kinds=("gemm", "conv"))
    with pytest.raises(CacheError, match="not found"):
        primus_perf.enable(tmp_path / "missing.json")
    cache = tmp_path / "c.json"
    TuningCache(cache).put(gemm_entry(problem_of(torch.randn(2, 2), torch.randn(2, 2)), H100))
    with primus_perf.enable(cache, device_type="cpu", router_kinds=FAKE_KINDS, log=None), \
            pytest.raises(UserError, match="already active"):
        primus_perf.enable(cache, device_type="cpu", router_kinds=FAKE_KINDS, log=None)


def test_enable_from_six_threads_at_once_enables_once(tmp_path: Path) -> None:
    """One thread enables; the five others get the one line that it is already active (the check
    and the install are one step under a lock: without it two could both find none active)."""
    import threading

    cache = tmp_path / "c.json"
    TuningCache(cache).put(gemm_entry(problem_of(torch.randn(2, 2), torch.randn(2, 2)), H100))
    start, handles, errors = threading.Barrier(6), [], []

    def go() -> None:
        start.wait()
        try:
            handles.append(primus_perf.enable(cache, device_type="cpu", router_kinds=FAKE_KINDS, log=None))
        except UserError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(handles) == 1 and len(errors) == 5 and all("already active" in e for e in errors)
    finally:
        for h in handles:
            h.disable()
    assert primus_perf.runtime.handle.active() is None


def test_compile_has_no_graph_break_and_routes(tmp_path: Path, model_and_input) -> None:
    model, x = model_and_input
    x2 = x.reshape(-1, 32)
    problems = [problem_of(x2, model.qkv.weight.t()), problem_of(x2, model.up.weight.t())]
    cache = tmp_path / "cache.json"
    TuningCache(cache).put_many([gemm_entry(p, current_device()) for p in problems])
    torch._dynamo.reset()
    with primus_perf.enable(cache, device_type="cpu", router_kinds=FAKE_KINDS, log=None) as tuned:
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        launched.clear()
        compiled = torch.compile(model, backend="aot_eager")
        y = compiled(x)
        y.square().mean().backward()
        routed = tuned.summary()["gemm"]["problems"]["routed"]
    torch._dynamo.reset()
    assert {p.key() for p in problems} <= set(launched)
    assert sum(routed.values()) >= 2
    torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-5)


def test_inductor_routes_compiled_gemms(tmp_path: Path) -> None:
    pytest.importorskip("torch._inductor")
    torch.manual_seed(2)
    lin = nn.Linear(32, 48, bias=False)
    x = torch.randn(16, 32)
    p = problem_of(x, lin.weight.t())
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(gemm_entry(p, current_device()))
    torch._dynamo.reset()
    launched.clear()
    with primus_perf.enable(cache, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS, log=None):
        try:
            y = torch.compile(lin)(x)
        except Exception as exc:  # no C++ compiler for Inductor's CPU code here
            pytest.skip(f"Inductor cannot compile on this machine: {type(exc).__name__}")
    torch._dynamo.reset()
    assert launched[p.key()] == 1
    torch.testing.assert_close(y, lin(x))


def test_dispatch_overhead_per_gemm_is_small(tmp_path: Path) -> None:
    """The per-call cost of the override and a router with no entry for the call (CPU, 8x8
    GEMMs): printed for the report; bounded by the Python calls a GEMM makes (what load on
    a shared machine cannot change), not by its time."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(gemm_entry(problem_of(torch.randn(3, 3), torch.randn(3, 3)), current_device()))

    def per_call(n: int = 3000) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                torch.mm(a, b)
            best = min(best, (time.perf_counter() - t0) / n)
        return best

    def python_calls(n: int = 200) -> float:
        seen = [0]
        sys.setprofile(lambda _frame, event, _arg: seen.__setitem__(0, seen[0] + (event in ("call", "c_call"))))
        try:
            for _ in range(n):
                torch.mm(a, b)
        finally:
            sys.setprofile(None)
        return seen[0] / n

    plain, plain_calls = per_call(), python_calls()
    with primus_perf.enable(cache, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS, log=None):
        routed, routed_calls = per_call(), python_calls()
    print(f"\ntorch.mm 8x8: {plain * 1e6:.2f} us plain, {routed * 1e6:.2f} us under enable"
          f" (+{(routed - plain) * 1e6:.2f} us per GEMM); Python calls a GEMM {plain_calls:.1f} and {routed_calls:.1f}")
    assert routed_calls - plain_calls < 10


def test_launcher_runs_a_script_with_enable(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        "import sys, torch, primus_perf.runtime as rt\n"
        "print('args', sys.argv[1:])\n"
        "print('active', rt.active() is not None)\n"
        "q, kv = torch.randn(2, 4, 8, 8), torch.randn(2, 2, 8, 8)\n"
        "torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)\n"
    )
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(attention_entry(BLOCK_ATTENTION, current_device()))
    out = subprocess.run([sys.executable, "-m", "primus_perf.launch", "--cache", str(cache), "--",
                          str(script), "--flag", "x"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "args ['--flag', 'x']" in out.stdout and "active True" in out.stdout
    assert "attention: 1 calls used a cached choice" in out.stderr
    assert "online tuning" not in out.stderr and "spent tuning" not in out.stderr
    # --online
    online = subprocess.run([sys.executable, "-m", "primus_perf.launch", "--cache", str(tmp_path / "new.json"),
                             "--online", "--", str(script)], capture_output=True, text=True, timeout=120)
    assert online.returncode == 0, online.stderr
    if torch.cuda.is_available():  # problems without a usable entry are tuned (the launcher says so, and counts)
        assert "online tuning: problems without a usable entry are tuned" in online.stderr
        assert "calls spent tuning" in online.stderr
    else:  # online tuning times device events: without a GPU it says it is off, and the script runs
        assert "online tuning: off: it times kernels with CUDA/ROCm events" in online.stderr
        assert "spent tuning" not in online.stderr
    bad = subprocess.run([sys.executable, "-m", "primus_perf.launch", "--cache", str(tmp_path / "no.json"), "--",
                          str(script)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "not found" in bad.stderr


def test_example_and_overhead_benchmark_run_on_the_cpu() -> None:
    """The GPU benchmark's --smoke mode: the example model, interleaved blocks, the JSON."""
    import json

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "runtime" / "enable_overhead.py"), "--smoke", "--pairs", "1",
                          "--block", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["off"]["n"] == 1 and data["on"]["n"] == 1
    assert data["calls"]["attention"]["seen_per_step"] == data["calls"]["attention"]["model_per_step"] == 2


def test_environment_variable_hook_enables_through_the_pth_file(tmp_path: Path) -> None:
    """``site`` processes ``primus_perf_enable.pth`` (here from the source folder, as from
    site-packages): with PRIMUS_PERF_CACHE set the program runs under enable, unmodified."""
    import os

    src = Path(__file__).resolve().parents[2] / "src"
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(attention_entry(BLOCK_ATTENTION, current_device()))
    code = (f"import site; site.addsitedir({str(src)!r})\n"
            "import torch, primus_perf.runtime as rt\n"
            "print('active', rt.active() is not None)\n"
            "torch.nn.functional.scaled_dot_product_attention(*[torch.randn(2, 4, 8, 8)] * 3, is_causal=True)\n")
    env = {**os.environ, "PRIMUS_PERF_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "active True" in out.stdout and "attention: 0 calls used a cached choice, 1 fell" in out.stderr
    env.pop("PRIMUS_PERF_CACHE")
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "active False" in off.stdout
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "PRIMUS_PERF_CACHE": str(tmp_path / "none.json")})
    assert bad.returncode == 0 and "not enabled" in bad.stderr and "Traceback" not in bad.stderr


def test_the_environment_module_reads_each_variable_as_its_table_says(monkeypatch) -> None:
    import os

    from primus_perf.base import environment

    for name in ("RANK", "PRIMUS_PERF_NATIVE", "PRIMUS_PERF_ONLINE", "CUDA_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert (environment.get("RANK"), environment.get("PRIMUS_PERF_NATIVE"), environment.get("PRIMUS_PERF_ONLINE"),
            environment.get("CUDA_HOME")) == (0, True, False, "/usr/local/cuda")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("PRIMUS_PERF_NATIVE", "0")
    monkeypatch.setenv("PRIMUS_PERF_ONLINE", "1")
    assert (environment.get("RANK"), environment.get("PRIMUS_PERF_NATIVE"), environment.get("PRIMUS_PERF_ONLINE")) == \
        (3, False, True)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(UserError, match="RANK='x' is not a whole number"):
        environment.get("RANK")
    with environment.changed({"RANK": None, "PRIMUS_PERF_TEST": "1"}):
        assert "RANK" not in os.environ and environment.copy({"A_B": "2"})["A_B"] == "2"
    assert os.environ["RANK"] == "x" and "PRIMUS_PERF_TEST" not in os.environ


def test_an_enable_that_fails_leaves_no_router_and_a_disabled_handle_stays_off(tmp_path: Path, monkeypatch) -> None:
    from enable_fakes import BLOCK_ATTENTION, attention_entry
    from primus_perf.runtime.attention import AttentionDispatch
    from primus_perf.runtime.handle import active

    a, b = torch.randn(16, 32), torch.randn(32, 24)
    cache = tmp_path / "cache.json"
    TuningCache(cache).put_many([gemm_entry(problem_of(a, b), current_device()),
                                 attention_entry(BLOCK_ATTENTION, current_device())])

    def refused(self, lib, key):
        raise RuntimeError("override refused")

    with monkeypatch.context() as m:
        m.setattr(AttentionDispatch, "overrides", refused)
        with pytest.raises(RuntimeError, match="override refused"):
            primus_perf.enable(cache, device_type="cpu", router_kinds=FAKE_KINDS, log=None)
    for kind in ("gemm", "attention"):
        assert dispatch.of(kind).router is None and not dispatch.of(kind).intercepting
    assert active() is None
    handle = primus_perf.enable(cache, device_type="cpu", router_kinds=FAKE_KINDS, log=None)
    handle.disable()
    with pytest.raises(UserError, match="cannot be resumed"):
        handle.resume()
    assert not dispatch.of("gemm").intercepting
