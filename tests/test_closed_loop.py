"""The README's command 1 on a machine without a GPU: ``primus-tune loop`` trains the tiny
preset under the profiler, analyzes the trace, writes the HTML report and says that tuning
needs a GPU (the GPU half runs in ``scripts/gpu_check.sh loop``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from primus_perf.cli.tune import app
from primus_perf.trainer.config import load_config
from primus_perf.trainer.flops import model_gemms

OVERRIDES = ["model.n_layers=2", "train.seq_len=64", "train.micro_batch=2", "train.device=cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU half of the loop")
def test_loop_on_cpu_writes_the_report_and_says_tuning_needs_a_gpu(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    out = tmp_path / "quickstart"
    res = CliRunner().invoke(app, ["loop", "--config", "tiny", "--out", str(out), "--steps", "2", *OVERRIDES])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "no tuning: tuning measures GPU kernels and needs a CUDA or ROCm GPU" in text
    cfg = load_config("tiny", OVERRIDES)
    n_gemm = len({c.problem.key() for c in model_gemms(cfg.model, 2, 64)})
    assert re.search(rf"cpu: .* {n_gemm} GEMM and 1 attention problems; report: ", text), text
    page = (out / "report.html").read_text()
    data = json.loads(re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
                      .group(1).replace("<\\/", "</"))
    assert data["header"]["cpu_only"] and data["header"]["device"] == "cpu"
    assert len(data["gemm"]) == n_gemm and all(r["time_ms"] > 0 for r in data["gemm"])
    assert (out / "profile" / "manifest.json").is_file()
    assert not (out / "tuning_cache.json").exists()
