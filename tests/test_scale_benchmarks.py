"""The scale-out benchmarks run end to end in their ``--smoke`` CPU modes (tiny model on
gloo; CPU tuning workers), so the scripts the GPU machine runs are tested here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _smoke(script: str, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out)],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_multi_gpu_tuning_smoke(tmp_path: Path) -> None:
    data = _smoke("gemm/multi_gpu_tuning.py", tmp_path / "mg.json")
    assert data["problems"] == 16 and data["gpus"] == 2 and not data["failures"]
    assert data["choices"]["problems"] == 16 and data["speedup"] > 0
    assert {r["one_gpu"] for r in data["choices"]["rows"]} <= {"torch", "mm_out"}
    assert [w["problems"] for w in data["one_gpu_workers"]] == [16]
    assert [w["gpu"] for w in data["multi_gpu_workers"]] == [0, 1]
    assert sum(w["problems"] for w in data["multi_gpu_workers"]) == 16
    ready = [w["startup_s"] for w in data["multi_gpu_workers"] if w["startup_s"] is not None]
    assert data["multi_gpu_startup_s"] == max(ready) > 0


@pytest.mark.slow
def test_fsdp2_benchmark_smoke(tmp_path: Path) -> None:
    data = _smoke("trainer/fsdp2_llama3_8b.py", tmp_path / "fsdp2.json")
    for run in ("fsdp2_eager", "fsdp2_compile"):
        assert data[run]["median_tokens_per_s"] > 0 and "parallel.dp_shard=2" in data[run]["cmd"]
    assert "train.compile=true" in data["fsdp2_compile"]["cmd"]
    assert len(data["match_ddp"]["losses"]) == len(data["match_fsdp2"]["losses"]) == 10
    assert data["match_max_rel_loss_diff"] <= 1e-4


@pytest.mark.slow
def test_eight_gpus_benchmark_smoke_on_two_ranks(tmp_path: Path) -> None:
    """The script the 8-GPU machine runs, over 2 gloo ranks, for its EP layout (the one with
    every part: FSDP2 and TP run the same code with other overrides, and their losses are
    tests/trainer's): traced on every rank and analyzed, its losses against one process,
    its trace tuned."""
    out = tmp_path / "two"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(BENCHMARKS / "trainer" / "eight_gpus.py"), "--smoke", "--gpus", "2",
                             "--layouts", "ep", "--skip", "preflight", "multi-gpu", "--out", str(out)],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((out / "summary.json").read_text())
    assert list(data["layouts"]) == ["ep"]
    layout = data["layouts"]["ep"]
    assert layout["profiled"]["ranks"] == [0, 1] and layout["profiled"]["report_returncode"] == 0
    assert (out / "ep" / "report.html").exists() and (out / "ep" / "analysis.json").exists()
    assert layout["losses"]["max_rel_loss_diff"] <= 1e-4, layout["losses"]
    assert len(layout["profiled"]["expert_load"]) == 2  # tiny-moe's two MoE layers
    tuning = data["layouts"]["ep"]["tuning"]
    assert tuning["tuned_problems"] > 0 and tuning["median_tokens_per_s"]["tuned"] > 0
