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
from primus_perf.loop.pipeline import trace_problems, tunable_problems
from primus_perf.problems import load_problems
from primus_perf.tracelens.analyze import analyze
from primus_perf.tracelens.shapes import write_problems
from primus_perf.trainer.config import load_config
from primus_perf.trainer.flops import model_gemms
from primus_perf.tuner.kinds import default_tuners

OVERRIDES = ["model.n_layers=2", "train.seq_len=64", "train.micro_batch=2", "train.device=cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU half of the loop")
def test_loop_on_cpu_writes_the_report_and_says_tuning_needs_a_gpu(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    out = tmp_path / "quickstart"
    res = CliRunner().invoke(app, ["loop", "--config", "tiny", "--out", str(out), "--steps", "2", "--step",
                                   "--step-budget-min", "0.1", *OVERRIDES])
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
    # --step: the step tuner after the kernels (here with no cache: a CPU), in its own run folder
    assert (out / "step" / "plan.yaml").is_file() and (out / "step" / "manifest.json").is_file()
    assert "step plan for tiny" in text and "kernel_cache not here: no kernel cache given" in text


def _op(name: str, dims: list, dtype: str, ts: int, dur: int, causal: tuple[int, str] | None = None) -> dict:
    concrete = [""] * 16
    if causal is not None:
        concrete[causal[0]] = causal[1]
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": {"Input Dims": dims, "Input type": [dtype] * len(dims), "Concrete Inputs": concrete}}


def _ranking_trace(path: Path) -> Path:
    """A GEMM of 10 us; an attention problem whose forward and backward take 8 us each
    (together the most expensive problem, apart each cheaper than the GEMM); a small fp32
    attention."""
    q = [1, 4, 64, 16]
    events = [
        _op("aten::mm", [[64, 32], [32, 16]], "float", 0, 10),
        _op("aten::scaled_dot_product_attention", [q] * 3, "c10::BFloat16", 20, 8, (5, "True")),
        _op("aten::_scaled_dot_product_flash_attention_backward", [q] * 5, "c10::BFloat16", 40, 8, (11, "True")),
        _op("aten::scaled_dot_product_attention", [[1, 2, 32, 16]] * 3, "float", 60, 1, (5, "False")),
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_the_loop_takes_the_problems_in_the_problems_files_order(tmp_path: Path) -> None:
    """The loop tunes what ``primus-profile shapes`` would write, in its order: an attention
    problem ranks by its forward and backward together."""
    analysis = analyze([_ranking_trace(tmp_path / "trace.json")])
    problems = trace_problems(analysis)
    assert [p.key() for p in problems] == [p.key() for p in load_problems(write_problems(analysis, tmp_path / "p.json"))]
    assert [str(p) for p in problems] == ["b1 h4 s64 d16 bf16 causal", "64x16x32 f32 NN", "b1 h2 s32 d16 f32 full"]


def test_what_its_kinds_plugin_does_not_take_is_a_note(tmp_path: Path) -> None:
    """Each problem is checked by its kind's plugin (the loop then tunes it with that same
    plugin); what the plugin does not take (the Triton kernel has no fp32) is a note."""
    tuners = default_tuners()
    problems = trace_problems(analyze([_ranking_trace(tmp_path / "trace.json")]))
    tunable, notes = tunable_problems(problems, tuners)
    assert [str(p) for p in tunable] == ["b1 h4 s64 d16 bf16 causal", "64x16x32 f32 NN"]
    assert notes == ["not tuned: b1 h2 s32 d16 f32 full: attention tuning needs bf16 or f16, not f32"]


def test_the_loops_measurement_and_confirmation_run_a_cache_in_the_trainers_steps(tmp_path: Path) -> None:
    """Steps 4 and 5 of the loop on the CPU (on a GPU they follow the tuning): the confirmation
    times the cache's routed choice in the trainer's steps and writes its verdict, and the
    measurement interleaves blocks with the cache enabled and suspended in one trainer."""
    import dataclasses

    from primus_perf.base.devices import current_device
    from primus_perf.cache.store import CacheEntry, TuningCache
    from primus_perf.kernels.attention.router import library_versions
    from primus_perf.trainer.flops import attention_problem
    from primus_perf.tuner.cache_check import confirm_trainer, measure_speedup

    torch.set_num_threads(1)
    cfg = load_config("tiny", OVERRIDES)
    p = attention_problem(cfg.model, 2, 64, dtype="f32")
    p = dataclasses.replace(p, heads_kv=p.heads_q)  # the trainer expands kv heads before SDPA
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(CacheEntry(kind="attention", problem_key=p.key(), problem=p.to_dict(),
                                      device=current_device().to_dict(), versions=library_versions(),
                                      solution={"config": {"backend": "sdpa:math"}, "blob": b""}))
    run = confirm_trainer("tiny", OVERRIDES, cache, steps=3)
    # attention is confirmed with its backward; 2 steps of 2 layers are too few pairs for a verdict
    assert run.exit_code == 0 and [r.verdict.status for r in run.rows] == ["unconfirmed"]
    m = measure_speedup("tiny", OVERRIDES, cache, blocks=2, block_steps=2)
    assert len(m.default_s) == len(m.tuned_s) == 2 and m.losses_match
    assert m.loss_tuned == pytest.approx(m.loss_default, rel=1e-5)  # one batch, the same weights
    # routed: the 2 warm-up steps (enabled) and the tuned blocks' (settling + 2) steps, a call a layer
    assert m.routed_calls == (2 + 2 * 3) * cfg.model.n_layers


def test_the_final_check_leaves_a_cache_that_loses_the_step_routing_nothing(tmp_path: Path) -> None:
    """The loop's last stage is a gate: an attention choice whose backward is slower loses the
    tiny trainer's step, so its entry becomes torch's own SDPA and the cache routes nothing
    (no measurement of it: "1.00x: torch's own kernels kept")."""
    import dataclasses

    from enable_fakes import slow_backward_kinds
    from primus_perf.base.devices import current_device
    from primus_perf.cache.store import CacheEntry, TuningCache
    from primus_perf.kernels.attention.router import library_versions
    from primus_perf.runtime.activate import activate
    from primus_perf.trainer.flops import attention_problem
    from primus_perf.tuner.cache_check import check_cache
    from primus_perf.tuner.final_check import NOTHING_KEPT

    torch.set_num_threads(1)
    cfg = load_config("tiny", OVERRIDES)
    p = dataclasses.replace(attention_problem(cfg.model, 2, 64, dtype="f32"), heads_kv=cfg.model.n_heads)
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(CacheEntry(kind="attention", problem_key=p.key(), problem=p.to_dict(),
                                      device=current_device().to_dict(), versions=library_versions(),
                                      solution={"config": {"backend": "sdpa:math"}, "blob": b""}))
    said: list[str] = []
    check, measurement = check_cache("tiny", OVERRIDES, cache, blocks=2, block_steps=2,
                                     router_kinds=slow_backward_kinds(), log=said.append)
    assert measurement is None and check.kept == () and check.dropped == {"attention": 1}
    assert [r.kinds for r in check.rounds] == [("attention",)] and not check.rounds[0].verdict.kept
    assert check.lines()[-1] == f"speedup with the cache: {NOTHING_KEPT}" and said
    entry = TuningCache(cache).entries("attention")[0]
    assert entry.solution["config"] == {"backend": "sdpa:default"} and entry.in_step["scope"] == "step"
    assert activate(cache).routers["attention"].idle()  # the next run installs no override


def test_the_loss_check_compares_one_batch_and_fails_a_kernel_that_computes_something_else() -> None:
    from primus_perf.tuner.cache_check import SpeedupMeasurement

    def m(default: float, tuned: float) -> SpeedupMeasurement:
        return SpeedupMeasurement([1.0], [1.0], 1, 0, default, tuned)

    assert m(10.0, 10.05).losses_match  # bf16 kernels summing in another order
    assert not m(10.0, 10.2).losses_match  # 2%: a different result
    assert not m(10.0, float("nan")).losses_match
