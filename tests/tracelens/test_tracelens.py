"""Trace analysis on real traces: the trainer's GEMM FLOPs and problems come out exactly,
categories, breakdowns and problems are consistent, the CLI and the problems file work."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from primus_perf.cli.profile import app
from primus_perf.problems import AttentionProblem, GemmProblem, load_problems
from primus_perf.profiler.capture import Schedule, profile_steps
from primus_perf.tracelens import categories as C
from primus_perf.tracelens.analyses.breakdown import union_length
from primus_perf.tracelens.analyze import analyze
from primus_perf.tracelens.shapes import write_problems
from primus_perf.trainer.config import load_config
from primus_perf.trainer.flops import (
    attention_flops_per_step,
    attention_problem,
    gemm_flops_per_step,
    model_gemms,
)
from primus_perf.trainer.loop import Trainer

TRACES = Path(__file__).parents[1] / "data" / "traces"
H100_CUDNN = TRACES / "h100_llama3-8b_l2_s1024_cudnn.json.gz"
H100_FLASH = TRACES / "h100_llama3-8b_l2_s1024_flash.json.gz"
# the config the H100 fixtures were captured with
H100_OVERRIDES = ["model.n_layers=2", "train.seq_len=1024", "train.micro_batch=1"]
CPU_OVERRIDES = ["model.n_layers=2", "train.seq_len=64", "train.micro_batch=2", "train.device=cpu"]


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory) -> Path:
    """A real torch.profiler trace of the tiny trainer on the CPU: 2 active steps."""
    torch.set_num_threads(1)
    trainer = Trainer(load_config("tiny", CPU_OVERRIDES))
    try:
        res = profile_steps(trainer.train_step, tmp_path_factory.mktemp("trace"),
                            Schedule(active=2, warmup=1, wait=0, baseline=0, after=0))
    finally:
        trainer.close()
    assert res.trace is not None
    return res.trace


def _problem_set(df) -> set[str]:
    return set(df["key"])


def test_cpu_trace_gemm_flops_and_problems_are_the_models(cpu_trace: Path) -> None:
    cfg = load_config("tiny", CPU_OVERRIDES)
    a = analyze([cpu_trace])
    assert a.steps and len(a.steps) == 2
    mb, seq = cfg.train.micro_batch, cfg.train.seq_len
    assert a.totals["gemm_flops_per_step"] == gemm_flops_per_step(cfg.model, mb, seq)
    expected = {c.problem.key() for c in model_gemms(cfg.model, mb, seq, dtype="f32")}
    assert _problem_set(a.gemm_problems) == expected
    # every GEMM of the model runs once per step, in its pass: a CPU trace has no kernels to
    # link, the backward nodes of autograd say which calls run in the backward pass
    calls = model_gemms(cfg.model, mb, seq, dtype="f32")
    assert a.gemm_problems["calls"].sum() == len(calls)
    passes = {c.problem.key(): c.kind for c in calls}  # here a token count (128) is also a feature size:
    found = dict(zip(a.gemm_problems["key"], a.gemm_problems["direction"]))  # "bwd" where shapes cannot tell
    assert all(d == passes[k] or (d == "bwd" and passes[k] != "fwd") for k, d in found.items()), found
    assert {"fwd", "dgrad", "wgrad"} <= set(found.values())
    # attention: the trainer expands kv heads before SDPA, so the trace has heads_kv == heads_q
    assert a.totals["attention_flops_per_step"] == attention_flops_per_step(cfg.model, mb, seq)
    p = attention_problem(cfg.model, mb, seq, dtype="f32")
    assert set(a.attention_problems["key"]) == {
        AttentionProblem(p.batch, p.heads_q, p.heads_q, p.seq_q, p.seq_kv, p.head_dim, "f32", True).key()
    }
    assert set(a.attention_problems["direction"]) == {"fwd", "bwd"}
    assert any("no GPU events" in n for n in a.notes)


def test_h100_trace_matches_the_model_exactly() -> None:
    cfg = load_config("llama3-8b", H100_OVERRIDES)
    a = analyze([H100_CUDNN])
    assert a.device["name"] == "NVIDIA H100 80GB HBM3" and a.device["peaks"] == "h100-sxm"
    assert a.steps == [1, 2]
    assert a.totals["gemm_flops_per_step"] == gemm_flops_per_step(cfg.model, 1, 1024)
    assert _problem_set(a.gemm_problems) == {c.problem.key() for c in model_gemms(cfg.model, 1, 1024)}
    assert a.totals["attention_flops_per_step"] == attention_flops_per_step(cfg.model, 1, 1024)
    # GEMM kernels on an H100 in bf16: between 50% and 100% of the roofline
    pct = a.gemm_problems["pct_roofline"]
    assert (pct > 0.5).all() and (pct < 1.0).all()
    cats = set(a.kernels["category"].astype(str))
    assert {C.GEMM, C.ATTENTION_FWD, C.ATTENTION_BWD, C.OPTIMIZER, C.ELEMENTWISE, C.NORMALIZATION} <= cats
    # cuDNN attention kernels are attributed to the SDPA ops, forward and backward
    attn = a.kernels[a.kernels["category"] == C.ATTENTION_FWD]
    assert attn["name"].astype(str).str.contains("sdpa").any()
    assert set(attn["op"].astype(str)) == {"aten::_scaled_dot_product_cudnn_attention"}
    bwd = a.kernels[a.kernels["category"] == C.ATTENTION_BWD]
    assert set(bwd["fwd_op"].astype(str)) == {"aten::scaled_dot_product_attention"}
    # weight-gradient GEMMs map back to the trainer's linear Function through the sequence number
    gemm_bwd = a.kernels[(a.kernels["category"] == C.GEMM) & (a.kernels["fwd_op"] != "")]
    assert set(gemm_bwd["fwd_op"].astype(str)) == {"_Linear"}


def test_h100_breakdowns_add_up() -> None:
    a = analyze([H100_CUDNN])
    t = a.temporal
    assert len(t) == 2
    total = t["compute_s"] + t["exposed_comm_s"] + t["exposed_memcpy_s"] + t["idle_s"]
    assert np.allclose(total, t["span_s"], rtol=1e-9, atol=1e-9)
    # the category breakdown sums the kernel table
    k = a.kernels[a.kernels["step"] >= 0]
    assert a.breakdown["seconds"].sum() == pytest.approx(k["dur_us"].sum() / 1e6)
    # hotspots cover all GPU time once, per step; so does the category breakdown per step
    per_step = k["dur_us"].sum() / 1e6 / a.rank_steps
    assert a.hotspots["time_s"].sum() == pytest.approx(per_step)
    assert a.category_seconds().sum() == pytest.approx(per_step) == a.totals["gpu_kernel_s_per_step"]
    assert a.hotspots["share"].sum() == pytest.approx(1.0)
    # calls are op calls: each linear layer's mm is one call per step however many kernels it launches
    mm = a.hotspots[(a.hotspots["op"] == "aten::mm") & (a.hotspots["category"] == C.GEMM)]
    assert (mm["calls"] <= mm["kernels"]).all() and (mm["calls"] == mm["calls"].round()).all()
    assert a.gemm_problems["calls"].sum() == mm["calls"].sum()
    # the step time is the temporal breakdown's span, one definition
    assert a.totals["step_time_s"] == pytest.approx(t["span_s"].median())
    assert list(a.rank_summary["step_time_s"]) == [pytest.approx(t["span_s"].median())]
    # inclusive op time: the profiler step contains all GPU time launched from the main thread
    incl = a.op_times.set_index("op")["inclusive_s"]
    assert incl["aten::mm"] <= incl["autograd::engine::evaluate_function: _LinearBackward"] + incl["_Linear"] + 1e-6


def test_union_length_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(200):
        ivs = [(s := rng.randint(0, 100), s + rng.randint(0, 30)) for _ in range(rng.randint(0, 12))]
        covered = {x for s, e in ivs for x in range(s, e)}
        got = union_length(np.array([s for s, _ in ivs], dtype=float), np.array([e for _, e in ivs], dtype=float))
        assert got == len(covered)


def test_json_summary_has_the_documented_keys() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["analyze", str(H100_CUDNN), "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    for key in ("device", "steps", "breakdown", "gemm_problems", "attention_problems", "totals"):
        assert key in data
    assert {"gemm_flops_per_step", "attention_flops_per_step", "gpu_busy_s_per_step"} <= set(data["totals"])
    g = data["gemm_problems"][0]
    assert {"m", "n", "k", "calls", "time_s", "tflops"} <= set(g)
    assert data["breakdown"]["gemm"] > 0
    res = runner.invoke(app, ["analyze", str(H100_CUDNN), "--top", "5"])
    assert res.exit_code == 0 and "hotspots" in res.stdout


def test_shapes_file_feeds_the_gemm_tuner(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "problems.json"
    res = runner.invoke(app, ["shapes", str(H100_CUDNN), "-o", str(out)])
    assert res.exit_code == 0, res.output
    cfg = load_config("llama3-8b", H100_OVERRIDES)
    expected = {c.problem.key() for c in model_gemms(cfg.model, 1, 1024)}
    problems = load_problems(out)
    assert {p.key() for p in problems if isinstance(p, GemmProblem)} == expected
    attn = [p for p in problems if isinstance(p, AttentionProblem)]
    assert len(attn) == 1 and attn[0].causal
    counts = [it["count"] for it in json.loads(out.read_text())["problems"] if it["kind"] == "attention"]
    assert counts == [4]
    # the file is ranked by time
    times = [it["time_s"] for it in json.loads(out.read_text())["problems"]]
    assert times == sorted(times, reverse=True)


def test_two_ranks_give_per_rank_rows_and_gz_equals_plain(tmp_path: Path) -> None:
    plain = tmp_path / "trace_rank1.json"
    plain.write_bytes(gzip.decompress(H100_FLASH.read_bytes()))
    a = analyze([H100_CUDNN, plain])
    assert a.ranks == [0, 1]
    assert set(a.rank_summary["rank"]) == {0, 1} and a.rank_summary["slowest"].sum() >= 1
    one = analyze([plain])
    assert one.totals["gemm_flops_per_step"] == a.totals["gemm_flops_per_step"]
    assert set(one.attention_problems["key"]) == set(a.attention_problems["key"])


def test_write_problems_reports_unwritable_path(tmp_path: Path) -> None:
    from primus_perf.base.errors import UserError

    a = analyze([H100_CUDNN])
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError):
        write_problems(a, tmp_path / "f" / "problems.json")


def test_cuda_graph_replay_kernels_link_to_the_graph_launch() -> None:
    """benchmarks/profiler/capture_graph_trace.py on the H100: a linear + relu captured in a CUDA graph
    and replayed under ``record_function("graph_replay")``, then run eagerly."""
    from primus_perf.tracelens import load as L
    from primus_perf.tracelens.link import link

    path = TRACES / "h100_cuda_graph.json.gz"
    rt = L.load(path)
    lk = link(rt)
    assert len(lk.gpu) == 12 and (lk.launch >= 0).all() and (lk.step >= 0).all()
    launches = {rt.names[rt.name[r]] for r in lk.launch}
    assert "cudaGraphLaunch" in launches
    graph = [i for i, r in enumerate(lk.launch) if rt.names[rt.name[r]] == "cudaGraphLaunch"]
    assert len(graph) == 6  # 3 kernels per replay, 2 profiled steps
    # the op around the graph launch ("graph_replay") launched none of its kernels itself:
    # each graph kernel goes by its own name, in the hotspots too
    assert (lk.leaf_op[graph] == -1).all()
    a = analyze([path])
    k = a.kernels.iloc[graph]
    assert (k["op"].astype(str) == k["name"].astype(str)).all()
    # graph kernels get categories from their names; the eager run also from its ops
    assert list(k["category"].astype(str)) == ["memset", "gemm", "elementwise"] * 2
    assert set(k["name"].astype(str)) <= set(a.hotspots["op"])
    assert len(a.gemm_problems) == 1 and a.gemm_problems["calls"].iloc[0] == 1


@pytest.mark.parametrize("mode", ["tp2", "dp2"])
def test_two_rank_nccl_runs(mode: str) -> None:
    """benchmarks/profiler/capture_tp_traces.py under torchrun on 2x H200 (NCCL): llama3-8b, 2 layers,
    seq 1024, tensor parallel (tp2) or data parallel (dp2)."""
    tp = 2 if mode == "tp2" else 1
    cfg = load_config("llama3-8b", [*H100_OVERRIDES, f"parallel.tp={tp}"])
    a = analyze([TRACES / f"h200_{mode}"])
    assert a.ranks == [0, 1] and a.steps == [1, 2] and a.device["peaks"] == "h200"
    # per rank and step: each TP rank runs 1/tp of every GEMM
    assert a.totals["gemm_flops_per_step"] == gemm_flops_per_step(cfg.model, 1, 1024, tp)
    assert _problem_set(a.gemm_problems) == {c.problem.key() for c in model_gemms(cfg.model, 1, 1024, tp)}
    assert (a.kernels["category"] == C.COMMUNICATION).any()
    t = a.temporal
    assert len(t) == 4 and (t["exposed_comm_s"] > 0).all()
    total = t["compute_s"] + t["exposed_comm_s"] + t["exposed_memcpy_s"] + t["idle_s"]
    assert np.allclose(total, t["span_s"], rtol=1e-9, atol=1e-9)
    assert len(a.rank_summary) == 2 and a.rank_summary["slowest"].sum() == 1
    c = a.collectives
    assert len(c) >= 1 and c["name"].str.contains("nccl").all()
    assert (c["max_skew_us"] >= c["mean_skew_us"]).all() and set(c["last_rank"]) <= {0, 1}
    js = a.to_json()
    assert js["breakdown"]["communication"] > 0 and len(js["collectives"]) == len(c)


def test_analyze_jobs_option_runs_ranks_in_processes_with_the_same_result(tmp_path: Path) -> None:
    runner = CliRunner()
    results = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"a{jobs}.json"
        res = runner.invoke(app, ["analyze", str(Path(__file__).parents[1] / "data" / "traces" / "h200_tp2"),
                                  "-j", jobs, "--json", str(out)])
        assert res.exit_code == 0, res.output
        results[jobs] = json.loads(out.read_text())
    assert results["1"]["ranks"] == results["2"]["ranks"] == [0, 1]
    assert results["1"]["totals"] == results["2"]["totals"] and results["1"]["breakdown"] == results["2"]["breakdown"]
    assert CliRunner().invoke(app, ["analyze", str(H100_CUDNN), "-j", "0"]).exit_code == 2


def test_attention_on_the_math_path_is_one_attention_problem_not_its_bmms(tmp_path: Path) -> None:
    """SDPA's math path runs bmm, softmax, bmm inside the attention op: those bmms are part of
    its call (as a grouped GEMM's per-group GEMMs are of its), so the forward is one attention
    problem with the causal FLOPs and no batched 64x64x32 GEMM of its own."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)

    def step() -> None:
        with sdpa_kernel(SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        (o @ w).sum().backward()

    profile_steps(step, tmp_path, Schedule(active=2, warmup=1, wait=0, baseline=0, after=0))
    tables = analyze([tmp_path]).problem_tables()
    attn = tables["attention"]
    assert list(attn["key"]) == ["attn|b2|hq4|hkv4|sq64|skv64|d32|f32|causal|bshd"], attn["key"].tolist()
    assert attn.loc[0, "direction"] == "fwd" and attn.loc[0, "flops"] == pytest.approx(4 * 2 * 4 * 64 * 64 * 32 / 2,
                                                                                          rel=0.05)
    gemm = tables["gemm"]
    # the forward's bmms are attention's; the backward's (autograd's own ops) stay GEMMs
    assert not ((gemm["direction"] == "fwd") & gemm["key"].str.contains(r"\|b8\|")).any(), gemm["key"].tolist()
    assert ((gemm["direction"] == "fwd") & gemm["key"].str.contains(r"\|b1\|")).any()  # o @ w


def test_cpus_busy_are_the_tasks_running_now_where_the_load_average_still_counts_ended_work() -> None:
    from primus_perf.tracelens.analyze import busy_cpus, idle_cpus

    assert busy_cpus(1.8, "1.80 1.10 0.90 1/80 4242") == 0  # only this process runs: the load is past work
    assert busy_cpus(0.4, "0.40 0.30 0.20 3/80 4242") == 0.4  # two more run now, briefly: the average
    assert busy_cpus(1.5, None) == busy_cpus(1.5, "garbage") == 1.5  # no /proc: the load average
    assert 1 <= idle_cpus() <= (os.cpu_count() or 1)
