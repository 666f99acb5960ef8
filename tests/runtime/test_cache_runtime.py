"""A tuning cache -> routers (``runtime.activate``, without the trainer) -> the trainer
installs them: usable entries are routed, stale ones are not."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from primus_perf.base.devices import DeviceIdentity, current_device
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.kernels.attention.router import AttentionRouter, library_versions
from primus_perf.problems import GemmProblem
from primus_perf.trainer.config import load_config
from primus_perf.trainer.flops import attention_problem


def attention_entry(device: DeviceIdentity, versions: dict[str, str]) -> CacheEntry:
    cfg = load_config("tiny")
    p = attention_problem(cfg.model, cfg.train.micro_batch, cfg.train.seq_len, dtype="f32")
    # the trainer expands the kv heads before SDPA: its calls (and traces) are of this problem
    prob = dataclasses.replace(p, heads_kv=p.heads_q)
    return CacheEntry(
        kind="attention",
        problem_key=prob.key(),
        problem=prob.to_dict(),
        device=device.to_dict(),
        versions=versions,
        # "sdpa:flash" has a CPU kernel too, so the route is exercised for real
        solution={"config": {"backend": "sdpa:flash", "config": None}, "blob": b""},
        times={"tuned_ms": 1.0, "default_ms": 1.2},
        tuner_version="test",
    )


def run_tiny(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "primus_perf.cli.train", "--config", "tiny", "--steps", "3",
         f"tuning.cache={cache}"],
        capture_output=True, text=True, timeout=240,
    )


def test_trainer_routes_cached_attention_and_reports_counts(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(attention_entry(current_device(), library_versions()))
    result = run_tiny(cache)
    assert result.returncode == 0, result.stderr
    assert "attention: 1 of 1 entries usable" in result.stdout
    n_layers = load_config("tiny").model.n_layers
    assert f"{3 * n_layers} calls used a cached choice, 0 fell back" in result.stdout


def test_stale_entries_are_not_used(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    other = DeviceIdentity("NVIDIA H100 80GB HBM3", "nvidia", "sm_90", 132)
    old_versions = {**library_versions(), "triton": "0.0.1"}
    TuningCache(cache).put_many(
        [attention_entry(other, library_versions()), attention_entry(current_device(), old_versions)]
    )
    result = run_tiny(cache)
    assert result.returncode == 0, result.stderr
    assert "attention: 0 of 2 entries usable" in result.stdout
    assert "H100" in result.stdout and "triton 0.0.1 ->" in result.stdout


def test_corrupt_cache_stops_the_trainer_with_one_line(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    cache.write_text('{"schema": 1, "entries": [{"kind"')
    result = run_tiny(cache)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "corrupt" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_activate_returns_routers_without_importing_the_trainer(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(attention_entry(current_device(), library_versions()))
    gp = GemmProblem.from_row_major(64, 64, 64)
    gemm = CacheEntry(kind="gemm", problem_key=gp.key(), problem=gp.to_dict(), device=current_device().to_dict(),
                      versions={"cublasLt": "0.0.0"}, solution={"config": {}, "blob": b"1"})
    TuningCache(cache).put(gemm)
    code = (
        "import json, sys\n"
        "from primus_perf.runtime.activate import activate\n"
        f"act = activate({str(cache)!r})\n"
        "print(json.dumps({'routers': {k: type(r).__name__ for k, r in act.routers.items()},"
        " 'lines': act.start_lines(),"
        " 'trainer': sorted(m for m in sys.modules if m.startswith('primus_perf.trainer')),"
        " 'tuner': sorted(m for m in sys.modules if m.startswith('primus_perf.tuner'))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["routers"] == {"attention": AttentionRouter.__name__}
    assert data["trainer"] == [] and data["tuner"] == []
    # the GEMM entry is not routed: stale on a GPU, and without one there is no BLAS-Lt
    # library to match, which the start lines say
    if current_device().vendor == "cpu":
        assert any("gemm: 1 entries, not usable here" in line for line in data["lines"])
