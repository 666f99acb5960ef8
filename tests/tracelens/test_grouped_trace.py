"""Grouped GEMMs (MoE experts) in traces: the grouped dispatch's annotation, the analyzer's grouped
problems (exact FLOPs, the GPU time of the kernels under the call, the per-expert GEMMs
inside it kept out of the dense problems), another program's ``aten::_grouped_mm`` (skew
unknown), the problems file, tune-next and the report, and ``primus-tune grouped-gemm
--trace`` tuning a real CPU trace of ``tiny-moe``."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from primus_perf.base.errors import UserError
from primus_perf.cache.store import TuningCache
from primus_perf.cli.profile import app as profile_app
from primus_perf.cli.tune import app as tune_app
from primus_perf.kinds import GROUPED
from primus_perf.problems import (
    GroupedGemmProblem,
    grouped_trace_name,
    load_problems,
    parse_grouped_trace_name,
)
from primus_perf.profiler.capture import Schedule, profile_steps
from primus_perf.tracelens import report as rp
from primus_perf.tracelens.analyze import Analysis, analyze
from primus_perf.tracelens.shapes import problems_document, write_problems
from primus_perf.trainer.config import load_config
from primus_perf.trainer.flops import gemm_flops_per_step, model_expert_gemms, model_gemms
from primus_perf.trainer.loop import Trainer
from primus_perf.trainer.moe import grouped_mm
from primus_perf.tuner.problems_input import gather_problems
from trainer_runs import routing

OVERRIDES = ["model.n_layers=2", "train.seq_len=24", "train.micro_batch=2", "train.device=cpu"]
ACTIVE = 2


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> tuple[Path, list[list[list[int]]]]:
    """A real torch.profiler trace of ``tiny-moe`` on the CPU (loop backend, 2 recorded steps)
    and the tokens per expert of each recorded step."""
    torch.set_num_threads(1)
    trainer = Trainer(load_config("tiny-moe", OVERRIDES))
    seen = []

    def step():
        m = trainer.train_step()
        seen.append(m.tokens_per_expert)
        return m

    try:
        res = profile_steps(step, tmp_path_factory.mktemp("moe"),
                            Schedule(active=ACTIVE, warmup=1, wait=0, baseline=0, after=0))
    finally:
        trainer.close()
    assert res.trace is not None
    return res.trace, seen[-ACTIVE:]


@pytest.fixture(scope="module")
def moe(moe_run) -> Analysis:
    return analyze([moe_run[0]])


def _events(trace: Path) -> list[dict[str, Any]]:
    return json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]


# ---- the annotation -----------------------------------------------------------------------


def test_trace_name_spells_the_problem_and_tokens_exactly() -> None:
    p = GroupedGemmProblem.from_counts([5, 0, 1, 19, 0, 8, 1, 30], 7168, 4096, dtype="bf16",
                                       trans_w=True, phase="dgrad")
    name = grouped_trace_name(p, 64)
    assert name == "primus_perf::grouped_gemm ggemm:dgrad|g8|k7168|n4096|t64|s4|bf16|wT tokens=64"
    assert parse_grouped_trace_name(name) == (p, 64)
    for skew in (1.0, 1.25, 1.5, 2.0, 3.0, 96.0):
        q = GroupedGemmProblem(groups=128, k=2048, n=1536, tokens=16384, skew=skew, dtype="f32", phase="wgrad")
        assert GroupedGemmProblem.from_key(q.key()) == q
    for bad in ("primus_perf::grouped_gemm", "primus_perf::gemm", name.replace("tokens=64", "tokens=x"),
                name.replace("|g8|", "|g8x|"), name.replace("|t64|", "|t65|"), name + " extra"):
        assert parse_grouped_trace_name(bad) is None, bad


def test_the_dispatch_annotates_only_while_the_profiler_records(monkeypatch) -> None:
    """The trainer's grouped GEMM on its configured backend (the dispatch's, as the trainer
    holds it): each pass's call is annotated with its problem only under the profiler."""
    x, w = torch.randn(37, 16, requires_grad=True), torch.randn(4, 16, 24, requires_grad=True)
    counts = [10, 0, 20, 7]

    def refuse(name):
        raise AssertionError(f"annotated outside the profiler: {name}")

    with routing(GROUPED.name, backend="loop"):
        with monkeypatch.context() as m:
            m.setattr(torch.autograd.profiler, "record_function", refuse)
            grouped_mm(x, w, counts).sum().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            grouped_mm(x, w, counts).sum().backward()
    names = Counter(e.name for e in prof.events() if e.name.startswith("primus_perf::grouped_gemm"))
    fwd = GroupedGemmProblem.from_counts(counts, 16, 24, dtype="f32")
    assert names == {grouped_trace_name(fwd.with_phase(ph), 37): 1 for ph in ("fwd", "dgrad", "wgrad")}


# ---- a real trace of tiny-moe -------------------------------------------------------------


def test_moe_trace_gives_the_grouped_problems_with_exact_flops(moe: Analysis, moe_run) -> None:
    cfg = load_config("tiny-moe", OVERRIDES)
    steps = moe_run[1]
    calls = [c for counts in steps for c in model_expert_gemms(cfg.model, counts, dtype="f32")]
    g = moe.grouped_gemm_problems
    assert len(moe.steps) == ACTIVE and len(g)
    expected_calls = Counter(c.problem.key() for c in calls)
    assert dict(zip(g["key"], g["calls"] * ACTIVE)) == expected_calls
    for r in g.itertuples(index=False):
        assert (r.groups, r.k, r.n, r.tokens, r.skew, r.direction) == (
            r.problem.groups, r.problem.k, r.problem.n, r.problem.tokens, r.problem.skew, r.problem.phase)
        # exact FLOPs: 2 * T * K * N of each call's own tokens, not of the bucket
        exact = sum(c.flops for c in calls if c.problem.key() == r.key)
        assert r.flops * r.calls * ACTIVE == pytest.approx(exact, rel=1e-12)
        assert r.skew_known and r.time_s > 0 and "skew unknown" not in r.label
    assert set(g["direction"]) == {"fwd", "dgrad", "wgrad"}
    assert moe.totals["grouped_gemm_flops_per_step"] == sum(c.flops for c in calls) / ACTIVE
    assert all(sum(c.counts) < c.problem.tokens for c in calls)  # 96 tokens in the bucket of 128


def test_per_expert_gemms_stay_out_of_the_dense_problems(moe: Analysis, moe_run) -> None:
    cfg = load_config("tiny-moe", OVERRIDES)
    mb, seq = 2, 24
    dense = model_gemms(cfg.model, mb, seq, dtype="f32")
    # exactly the dense GEMMs of the model (attention, router, shared expert, head), once each
    assert set(moe.gemm_problems["key"]) == {c.problem.key() for c in dense}
    assert moe.gemm_problems["calls"].sum() == len(dense)
    assert moe.totals["gemm_flops_per_step"] == gemm_flops_per_step(cfg.model, mb, seq)
    # while the trace holds the loop's per-expert aten::mm calls, inside the annotations
    events = _events(moe_run[0])
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
             if e.get("ph") == "X" and e["name"].startswith("primus_perf::grouped_gemm ")]
    inner = [e for e in events if e.get("ph") == "X" and e["name"] == "aten::mm"
             and any(s <= e["ts"] < t for s, t, _ in spans)]
    assert len(inner) > len(spans)
    # a grouped call's time is its own (CPU here, no kernels), counted once
    steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    in_steps = [(s, t, n) for s, t, n in spans if any(p["ts"] <= s < p["ts"] + p["dur"] for p in steps)]
    by_key: Counter[str] = Counter()
    for s, t, n in in_steps:
        problem, _ = parse_grouped_trace_name(n)
        by_key[problem.key()] += t - s
    times = dict(zip(moe.grouped_gemm_problems["key"], moe.grouped_gemm_problems["time_s"]))
    assert times == pytest.approx({k: v / 1e6 / ACTIVE for k, v in by_key.items()}, rel=1e-5)


def test_analyze_prints_and_writes_the_grouped_problems(moe_run) -> None:
    trace = str(moe_run[0])
    res = CliRunner().invoke(profile_app, ["analyze", trace, "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rows = doc["grouped_gemm_problems"]
    assert rows and {r["direction"] for r in rows} == {"fwd", "dgrad", "wgrad"}
    assert all(r["problem"]["groups"] == 8 and r["skew_known"] for r in rows)
    res = CliRunner().invoke(profile_app, ["analyze", trace, "--top", "50"])
    assert res.exit_code == 0 and "grouped GEMM problems (per step)" in res.stdout
    assert "· grouped GEMM " in " ".join(res.stdout.split())  # its FLOPs in the header line


def test_shapes_writes_grouped_items_the_tuner_reads(moe: Analysis, moe_run, tmp_path: Path) -> None:
    out = tmp_path / "problems.json"
    res = CliRunner().invoke(profile_app, ["shapes", str(moe_run[0]), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert f"{len(moe.grouped_gemm_problems)} grouped GEMM" in res.stdout
    items = [it for it in json.loads(out.read_text())["problems"] if it["kind"] == "grouped_gemm"]
    assert len(items) == len(moe.grouped_gemm_problems) and all("skew_known" not in it for it in items)
    assert sum(it["count"] for it in items) == moe.grouped_gemm_problems["calls"].sum() * ACTIVE
    wanted = set(moe.grouped_gemm_problems["key"])
    assert {p.key() for p in load_problems(out) if isinstance(p, GroupedGemmProblem)} == wanted
    assert {p.key() for p in gather_problems("grouped_gemm", files=[out])} == wanted
    assert {p.key() for p in gather_problems("grouped_gemm", traces=[moe_run[0]])} == wanted


def test_tune_grouped_gemm_from_the_trace_on_the_cpu(moe: Analysis, moe_run, tmp_path: Path) -> None:
    run_dir = str(moe_run[0].parent)  # a run directory, as primus-profile run writes it
    listed = CliRunner().invoke(tune_app, ["grouped-gemm", "--trace", run_dir, "--dry-run"])
    assert listed.exit_code == 0, listed.output
    wanted = set(moe.grouped_gemm_problems["key"])
    assert {line.split("  ")[1] for line in listed.stdout.splitlines()[:-1]} == wanted
    cache = tmp_path / "cache.json"
    res = CliRunner().invoke(tune_app, ["grouped-gemm", "--trace", run_dir, "--device", "cpu", "--no-triton",
                                        "--budget-s", "0.01", "--cache", str(cache)])
    assert res.exit_code == 0, res.output
    entries = TuningCache(cache).entries()
    assert {e.problem_key for e in entries} == wanted and {e.kind for e in entries} == {"grouped_gemm"}
    bad = CliRunner().invoke(tune_app, ["grouped-gemm", "--trace", run_dir, "--device", "tpu"])
    assert isinstance(bad.exception, UserError) and "--device must be one of cuda, cpu" in str(bad.exception)
    for gpus_args, text in ((["--device", "cpu", "--gpus", "2"], "--device cpu tunes in this process"),
                            (["--gpus", "2"], "only 0 GPU(s) visible")):
        bad = CliRunner().invoke(tune_app, ["grouped-gemm", "--trace", run_dir, *gpus_args])
        assert isinstance(bad.exception, UserError) and text in str(bad.exception), bad.output


# ---- synthetic traces: GPU kernels, another program's _grouped_mm -------------------------


def _op(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _launched(name: str, ts: float, corr: int, kernel_us: float, **args: Any) -> list[dict[str, Any]]:
    """An op that launches one kernel (at ``ts + 100``, ``kernel_us`` long)."""
    return [_op(name, ts, 10, **args), _op("cudaLaunchKernel", ts + 2, 3, cat="cuda_runtime", correlation=corr),
            {"ph": "X", "cat": "kernel", "name": f"gemm_kernel_{corr}", "pid": 0, "tid": 7, "ts": ts + 100,
             "dur": kernel_us, "args": {"correlation": corr, "stream": 7, "device": 0}}]


def _mm(m: int, k: int, n: int) -> dict[str, Any]:
    return {"Input Dims": [[m, k], [k, n]], "Input type": ["c10::BFloat16"] * 2,
            "Input Strides": [[k, 1], [n, 1]]}


def _write(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events,
                                "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}]}))
    return path


def _gpu_trace(tmp_path: Path) -> tuple[Path, GroupedGemmProblem]:
    """One annotated grouped GEMM (3 experts, one aten::mm kernel each) and one dense GEMM."""
    counts = [300, 100, 200]
    p = GroupedGemmProblem.from_counts(counts, 1024, 2048, dtype="bf16")
    events = [_op(grouped_trace_name(p, 600), 0, 50, cat="user_annotation")]
    for i, c in enumerate(counts):
        events += _launched("aten::mm", 1 + 10 * i, 10 + i, 20.0 + i, **_mm(c, 1024, 2048))
    events += _launched("aten::mm", 60, 20, 7.0, **_mm(600, 1024, 2048))  # a dense GEMM of the same shape
    return _write(tmp_path / "gpu.json", events), p


def test_kernels_under_the_annotation_are_the_grouped_calls_time(tmp_path: Path) -> None:
    trace, p = _gpu_trace(tmp_path)
    a = analyze([trace])
    g = a.grouped_gemm_problems
    assert list(g["key"]) == [p.key()] and g.loc[0, "calls"] == 1
    assert g.loc[0, "time_s"] == pytest.approx(63e-6)  # 20 + 21 + 22 us: its kernels, once
    assert g.loc[0, "flops"] == 2 * 600 * 1024 * 2048 and g.loc[0, "bytes"] == p.bytes_of(600)
    assert g.loc[0, "tflops"] == pytest.approx(2 * 600 * 1024 * 2048 / 63e-6 / 1e12)
    assert g.loc[0, "pct_roofline"] > 0  # the H100's bf16 roof
    # the per-expert mm calls are not GEMM problems; the dense one outside is, with its own time
    assert list(a.gemm_problems["calls"]) == [1] and a.gemm_problems.loc[0, "m"] == 2048
    assert a.gemm_problems.loc[0, "time_s"] == pytest.approx(7e-6)
    hot = a.hotspots.set_index("op")
    assert hot.loc["primus_perf::grouped_gemm", "calls"] == 1 and hot.loc["aten::mm", "calls"] == 1
    assert hot.loc["primus_perf::grouped_gemm", "time_s"] == pytest.approx(63e-6)
    assert hot.loc["primus_perf::grouped_gemm", "problem"] == str(p)
    assert a.totals["grouped_gemm_flops_per_step"] == 2 * 600 * 1024 * 2048
    assert a.totals["gemm_flops_per_step"] == 2 * 600 * 1024 * 2048


def test_report_shows_the_grouped_problems_and_tune_next_commands(tmp_path: Path) -> None:
    trace, p = _gpu_trace(tmp_path)
    d = rp.report_from_analysis(analyze([trace]))
    assert [r["key"] for r in d["grouped_gemm"]] == [p.key()] and d["grouped_gemm"][0]["direction"] == "fwd"
    cmd = next(r["command"] for r in d["tune_next"] if r["kind"] == "grouped_gemm")
    assert "primus-tune grouped-gemm --problems" in cmd and p.key() in {
        it.key() for it in gather_problems("grouped_gemm", files=[_tune_file(cmd, tmp_path)])}


def _tune_file(cmd: str, where: Path) -> Path:
    doc = cmd.split("'")[1]
    path = where / "one.json"
    path.write_text(doc)
    return path


def test_report_page_has_the_grouped_section(tmp_path: Path) -> None:
    from test_report import check_in_chromium
    from test_report_sections import _tables

    from primus_perf.tracelens.report_html import write_html

    trace, _ = _gpu_trace(tmp_path)
    res = check_in_chromium(write_html(rp.report_from_analysis(analyze([trace])), tmp_path / "r.html"))
    assert res.console_errors == [] and res.selfcheck.startswith("ok"), (res.console_errors, res.selfcheck)
    assert "<h2>Grouped GEMM problems</h2>" in res.dom and _tables(res.dom)["grouped-gemm"] == 1


def test_another_programs_grouped_mm_gives_balanced_assumed_problems(tmp_path: Path) -> None:
    """Forward ``x[T, K] @ W[G, K, N]``; in the backward pass ``dy @ W^T`` (the weight's
    transposed view) and the weight gradient ``x^T[K, T] @ dy[T, N]`` over ``offs[G]``."""
    T, K, N, G = 3000, 512, 256, 8
    bf = ["c10::BFloat16", "c10::BFloat16", "int"]
    bwd = "autograd::engine::evaluate_function: GroupedMmBackward0"
    events = [
        _op("aten::_grouped_mm", 0, 10, **{"Input Dims": [[T, K], [G, K, N], [G]], "Input type": bf,
                                          "Input Strides": [[K, 1], [K * N, N, 1], [1]]}),
        _op(bwd, 100, 50, tid=2),
        _op("aten::_grouped_mm", 101, 10, tid=2, **{"Input Dims": [[T, N], [G, N, K], [G]], "Input type": bf,
                                                   "Input Strides": [[N, 1], [K * N, 1, N], [1]]}),
        _op("aten::_grouped_mm", 120, 10, tid=2, **{"Input Dims": [[K, T], [T, N], [G]], "Input type": bf,
                                                   "Input Strides": [[1, K], [N, 1], [1]]}),
    ]
    a = analyze([_write(tmp_path / "foreign.json", events)])
    g = a.grouped_gemm_problems.set_index("direction")
    fwd = GroupedGemmProblem(groups=G, k=K, n=N, tokens=4096, skew=1.0, dtype="bf16")
    assert g.loc["fwd", "problem"] == fwd
    assert g.loc["dgrad", "problem"] == fwd.with_phase("dgrad")
    assert g.loc["wgrad", "problem"] == fwd.with_phase("wgrad")
    assert not g["skew_known"].any() and all("skew unknown: balanced assumed" in s for s in g["label"])
    assert (g["flops"] == 2 * T * K * N).all()
    items = problems_document(a)["problems"]
    assert [it["skew_known"] for it in items] == [False] * 3
    path = write_problems(a, tmp_path / "p.json")
    assert {p.key() for p in load_problems(path)} == {fwd.with_phase(ph).key() for ph in ("fwd", "dgrad", "wgrad")}
    # under the dispatch's annotation the same op is a part of the annotated call, not a problem
    ann = GroupedGemmProblem.from_counts([3000 - 7 * 100] + [100] * 7, K, N, dtype="bf16")
    inside = [_op(grouped_trace_name(ann, T), 0, 20, cat="user_annotation"), {**events[0], "ts": 1}]
    b = analyze([_write(tmp_path / "inside.json", inside)])
    assert list(b.grouped_gemm_problems["key"]) == [ann.key()] and bool(b.grouped_gemm_problems["skew_known"][0])


def test_equal_groups_3d_grouped_mm_backward_is_dgrad_and_wgrad(tmp_path: Path) -> None:
    """Equal groups as 3-D batches: forward ``x[G, T/G, K] @ W[G, K, N]``; in the backward
    pass ``dy @ W^T`` (the input gradient) and ``x^T[G, K, T/G] @ dy`` (the weight
    gradient: its first operand is the activations' transposed view)."""
    G, Tg, K, N = 8, 512, 1024, 256
    bf = ["c10::BFloat16", "c10::BFloat16"]
    bwd = "autograd::engine::evaluate_function: GroupedMmBackward0"
    events = [
        _op("aten::_grouped_mm", 0, 10, **{"Input Dims": [[G, Tg, K], [G, K, N]], "Input type": bf,
                                          "Input Strides": [[Tg * K, K, 1], [K * N, N, 1]]}),
        _op(bwd, 100, 50, tid=2),
        _op("aten::_grouped_mm", 101, 10, tid=2, **{"Input Dims": [[G, Tg, N], [G, N, K]], "Input type": bf,
                                                   "Input Strides": [[Tg * N, N, 1], [K * N, 1, N]]}),
        _op("aten::_grouped_mm", 120, 10, tid=2, **{"Input Dims": [[G, K, Tg], [G, Tg, N]], "Input type": bf,
                                                   "Input Strides": [[Tg * K, 1, K], [Tg * N, N, 1]]}),
    ]
    g = analyze([_write(tmp_path / "batched.json", events)]).grouped_gemm_problems.set_index("direction")
    fwd = GroupedGemmProblem(groups=G, k=K, n=N, tokens=G * Tg, skew=1.0, dtype="bf16")
    assert g.loc["fwd", "problem"] == fwd
    assert g.loc["dgrad", "problem"] == fwd.with_phase("dgrad")
    assert g.loc["wgrad", "problem"] == fwd.with_phase("wgrad")
    assert g["skew_known"].all() and (g["flops"] == 2 * G * Tg * K * N).all()
