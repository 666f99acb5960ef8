"""Routing costs nothing where the cache keeps torch's choice, and little where it routes:
the router's flags and memo, and the benchmark's --smoke mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from enable_fakes import FAKE_TABLE, H100, gemm_entry
from primus_perf.kernels.gemm import GemmRouter, problem_of

ROOT = Path(__file__).resolve().parents[1]


def test_a_router_of_torch_choices_routes_nothing() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    torch_entry = gemm_entry(problem_of(a, b), H100, source="torch")
    assert GemmRouter([torch_entry], FAKE_TABLE).routes_nothing
    assert GemmRouter([], FAKE_TABLE).routes_nothing
    tuned = gemm_entry(problem_of(torch.randn(4, 16), b), H100)
    assert not GemmRouter([torch_entry, tuned], FAKE_TABLE).routes_nothing


def test_a_call_signature_is_resolved_once() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    router = GemmRouter([gemm_entry(problem_of(a, b), H100)], FAKE_TABLE)
    resolved = []
    real = router._resolve
    router._resolve = lambda *args: resolved.append(args) or real(*args)  # type: ignore[method-assign]
    for _ in range(5):
        torch.testing.assert_close(router(a, b), a @ b)
    assert router(a.t().contiguous().t(), b) is None  # another layout: another signature (no entry)
    assert len(resolved) == 2 and sum(router.routed.values()) == 5 and sum(router.fallback.values()) == 1


def test_routing_overhead_benchmark_smoke() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "routing_overhead.py"), "--smoke"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    per_call = data["per_call"]
    assert per_call["routed_host"]["n"] == per_call["plain_host"]["n"] == 3
    assert per_call["overhead_host_us"] == per_call["routed_host"]["median_us"] - per_call["plain_host"]["median_us"]
    default = data["all_default_cache"]
    assert default["entries"] > 0 and default["gemm_override_installed"] is False
    assert default["on"]["n"] == default["off"]["n"] == 1
