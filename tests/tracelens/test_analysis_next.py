"""What to do next (recommendations), kernel efficiency and the memory view, and the host
side (CPU against GPU time, launches, each step's critical path): on synthetic traces of
the shape Kineto writes, whose answers are worked out by hand, and on a real H100 run of
the trainer whose compile saving was measured."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from primus_perf.cli.profile import app
from primus_perf.tracelens import report as rp
from primus_perf.tracelens.analyses.recommendations import COLUMNS
from primus_perf.tracelens.analyze import analyze
from primus_perf.tracelens.report_html import write_html

TRACES = Path(__file__).parents[1] / "data" / "traces"
RUN = TRACES / "h100_llama3-8b_l4_s4096_run"  # llama3-8b, 4 layers, seq 4096, mb 2, H100: 173 ms a step
H100 = {"deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}]}
BF16 = "c10::BFloat16"


def _write(path: Path, events: list[dict[str, Any]], **head: Any) -> Path:
    path.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, **H100, **head, "traceEvents": events}).encode()))
    return path


def _x(cat: str, name: str, ts: float, dur: float, pid: int = 1, tid: int = 1, **args: Any) -> dict[str, Any]:
    ev = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if args:
        ev["args"] = args
    return ev


def _op(name: str, ts: float, dur: float, dims: list | None = None, types: list | None = None) -> dict[str, Any]:
    args = {"Input Dims": dims, "Input type": types, "Input Strides": [], "Concrete Inputs": []} if dims else {}
    return _x("cpu_op", name, ts, dur, **args)


def _launch(corr: int, ts: float, dur: float = 2) -> dict[str, Any]:
    return _x("cuda_runtime", "cudaLaunchKernel", ts, dur, correlation=corr)


def _kernel(corr: int, ts: float, dur: float, name: str, stream: int = 7, **args: Any) -> dict[str, Any]:
    return _x("kernel", name, ts, dur, pid=0, tid=stream, correlation=corr, stream=stream, device=0, **args)


def _step(ts: float = 0, dur: float = 1000, n: int = 1) -> dict[str, Any]:
    return _x("user_annotation", f"ProfilerStep#{n}", ts, dur)


# --------------------------------------------------------------------------- recommendations

SQUARE = [[1024, 1024], [1024, 1024]]


def _next_trace(tmp_path: Path) -> Path:
    """One H100 step: a mul and an add of 1024x1024 bf16 back to back (a chain of two
    elementwise ops, 100 us each), a foreach optimizer kernel (60 us), then an all-reduce
    on its own stream that nothing overlaps (50 us)."""
    return _write(tmp_path / "next.json.gz", [
        _step(),
        _op("aten::mul", 10, 5, SQUARE, [BF16, BF16]), _launch(1, 11),
        _kernel(1, 100, 100, "void at::native::vectorized_elementwise_kernel<4, MulFunctor>"),
        _op("aten::add", 20, 5, SQUARE, [BF16, BF16]), _launch(2, 21),
        _kernel(2, 200, 100, "void at::native::vectorized_elementwise_kernel<4, AddFunctor>"),
        _x("user_annotation", "Optimizer.step#AdamW.step", 30, 30), _op("aten::_foreach_add_", 31, 9), _launch(3, 32),
        _kernel(3, 300, 60, "void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>>"),
        _op("nccl:all_reduce", 45, 5), _launch(4, 46),
        _kernel(4, 360, 50, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", stream=9),
    ])


def test_recommendations_rank_fusion_optimizer_and_communication_by_their_saving(tmp_path: Path) -> None:
    a = analyze([_next_trace(tmp_path)])
    r = a.recommendations
    assert list(r.columns) == COLUMNS
    assert list(r["category"]) == ["fusion", "communication", "optimizer"]
    # fusion: each op reads two 2 MiB bf16 inputs and writes one (12 MiB); the add reads what the mul
    # wrote, an intermediate a fused kernel does not read back (2 MiB): 10 MiB, 3.56 us at 88% of 3.35 TB/s
    fused_us = (2 * 3 - 1) * 2 * 1024 * 1024 / (0.88 * 3.35e12) * 1e6
    assert a.chains["intermediate"].tolist() == [2 * 1024 * 1024]
    assert r.loc[0, "estimated_saving_ms"] == pytest.approx((200 - fused_us) / 1e3, rel=1e-6)
    assert "torch.compile" in r.loc[0, "action"] and "88% of the 3.35 TB/s peak" in r.loc[0, "method"]
    assert "train.compile" not in r.loc[0, "action"]  # not a primus-train run: code advice
    # the all-reduce runs alone: all 50 us exposed (the upper bound, said so)
    assert r.loc[1, "estimated_saving_ms"] == pytest.approx(0.05)
    assert "upper bound" in r.loc[1, "method"] and "all_reduce" in r.loc[1, "evidence"]
    # a foreach step (multi_tensor_apply): a fused one, a third less, a rule of thumb
    assert r.loc[2, "estimated_saving_ms"] == pytest.approx(0.06 / 3)
    assert "foreach" in r.loc[2, "evidence"] and "fused=True" in r.loc[2, "action"]
    assert "rule of thumb" in r.loc[2, "method"]
    # the GPU never idles inside the step: nothing for the host to gain, whatever its launch delays
    assert "host" not in set(r["category"])


def test_a_primus_train_run_gets_the_trainers_config_keys(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _next_trace(run)
    config = {"model": {"name": "llama3-8b"}, "train": {"compile": False, "micro_batch": 2}, "parallel": {"tp": 1}}
    (run / "manifest.json").write_text(json.dumps({"schema": "primus-perf-run/1", "traces": {"0": "next.json.gz"},
                                                   "config": config}))
    r = analyze([run]).recommendations
    assert r.loc[0, "category"] == "fusion" and r.loc[0, "action"].startswith("set train.compile=block")


def _block_saving_per_two_sequences() -> float:
    """train.compile=block's saving on llama3-8b, 4 layers, seq 4096, on an H100, as the step
    tuner measured it over a step of 16 sequences (benchmarks/results/step_tuner/h100.json),
    per 2 sequences: a step of these traces (micro-batch 2, one micro-batch a step)."""
    doc = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "step_tuner"
                      / "h100.json").read_text())
    row = next(r for r in doc["rows"] if r["case"] == "llama3-8b-1gpu")
    lever = next(lv for lv in row["levers"] if lv["lever"] == "compile")
    block = next(m for m in lever["measured"] if m["value"] == "block" and m["status"] == "kept")
    return block["measured_ms"] * 2 / 16


def _moe_trace(tmp_path: Path) -> Path:
    """One H100 step of an MoE layer's forward: a grouped GEMM, the experts' SwiGLU (silu, mul:
    100 us each), the second grouped GEMM, then the combine: a mul (100 us), an index_add
    (a scatter, 100 us) and an add (100 us), each on 1024x1024 bf16."""
    g_in = {"Input Dims": [[4096, 1024], [8, 1024, 2048], [8]], "Input type": [BF16, BF16, "int"]}
    ev = [_step(0, 2000)]
    ops = [("aten::_grouped_mm", g_in, "nvjet_grouped_gemm"),
           ("aten::silu", {"Input Dims": [[1024, 1024]], "Input type": [BF16]}, "silu_kernel"),
           ("aten::mul", {"Input Dims": SQUARE, "Input type": [BF16, BF16]}, "MulFunctor"),
           ("aten::_grouped_mm", g_in, "nvjet_grouped_gemm"),
           ("aten::mul", {"Input Dims": SQUARE, "Input type": [BF16, BF16]}, "MulFunctor"),
           ("aten::index_add", {"Input Dims": [[1024, 1024], [], [1024], [1024, 1024]],
                                "Input type": [BF16, "Scalar", "long int", BF16]}, "index_add_kernel"),
           ("aten::add", {"Input Dims": SQUARE, "Input type": [BF16, BF16]}, "AddFunctor")]
    for i, (name, args, kernel) in enumerate(ops):
        ev += [_x("cpu_op", name, 10 + 10 * i, 5, **args), _launch(i + 1, 11 + 10 * i),
               _kernel(i + 1, 100 + 200 * i, 100, f"void at::native::vectorized_elementwise_kernel<4, {kernel}>"
                       if "grouped" not in kernel else kernel)]
    return _write(tmp_path / "moe.json.gz", ev)


def test_fusion_leaves_out_the_experts_activation_and_ends_chains_at_indexed_ops(tmp_path: Path) -> None:
    a = analyze([_moe_trace(tmp_path)])
    ch = a.chains.set_index("ops")
    # silu, mul between the grouped GEMMs: a chain of the experts, estimated at nothing
    assert bool(ch.loc["silu, mul", "experts"])
    # the combine's mul and add are not one chain: the index_add between them ends it (each alone: no chain)
    assert list(ch.index) == ["silu, mul"]
    assert a.recommendations.empty or "fusion" not in set(a.recommendations["category"])


def test_the_fusion_estimate_is_an_upper_bound_where_the_step_waits_on_host_syncs() -> None:
    """The committed H100 MoE run reads its token counts on the host in every layer: compiled
    blocks break their graphs there, so the GPU time fusion saves is an upper bound of the
    step's saving, and the advice says so; the dense run has no such syncs."""
    moe = analyze([Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "advice_check" / "h100" / "moe"])
    dense = analyze([RUN])
    for a, bound in ((moe, True), (dense, False)):
        fusion = a.recommendations[a.recommendations["category"] == "fusion"].iloc[0]
        assert ("upper bound" in fusion["method"]) is bound
        assert ("synchronizing calls a step" in fusion["evidence"]) is bound


def test_the_top_recommendation_of_the_h100_run_is_its_measured_compile_saving() -> None:
    """llama3-8b, 4 layers, seq 4096, micro-batch 2 on an H100: 173 ms a step, and
    train.compile=true (then pointwise, the one scope) measured 1.059x (about 9.5 ms saved a
    step). The advice is train.compile=block, which fuses what pointwise does and more: the
    step tuner measured it at 101.7 ms over 16 sequences, 12.7 ms per step of these."""
    a = analyze([RUN])
    top = a.recommendations.iloc[0]
    assert top["category"] == "fusion" and "train.compile=block" in top["action"]
    assert 9.5 <= top["estimated_saving_ms"] == pytest.approx(_block_saving_per_two_sequences(), rel=0.3)
    # the GEMM and attention tuning estimates stay small (tuning this run's GEMMs measured
    # 1.000x-1.007x: at most 1.2 ms a step)
    tuning = a.recommendations[a.recommendations["category"].str.startswith("tuning")].set_index("category")
    assert set(tuning.index) == {"tuning: gemm", "tuning: attention"}
    assert (tuning["estimated_saving_ms"] < top["estimated_saving_ms"]).all()
    assert tuning.loc["tuning: gemm", "estimated_saving_ms"] < 2.5
    assert tuning.loc["tuning: gemm", "command"].startswith("primus-tune gemm --trace ")
    assert tuning.loc["tuning: attention", "command"].startswith("primus-tune attention --trace ")
    # FP8 changes the numerics: after every change that keeps them, however large
    fp8 = a.recommendations.iloc[-1]
    assert fp8["category"] == "fp8" and fp8["changes_numerics"] and "primus-tune loop --fp8" in fp8["command"]


def test_analyze_json_carries_the_recommendations(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    res = CliRunner().invoke(app, ["analyze", str(_next_trace(tmp_path)), "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    recs = doc["recommendations"]
    # the kernels of this trace record no launch resources, nor has it memory events
    assert doc["kernel_efficiency"] == [] and doc["memory_peaks"] == [] and doc["memory_by_op"] == []
    assert len(doc["critical_path"]) == 1 and len(doc["launches"]) == 1
    assert [r["category"] for r in recs] == ["fusion", "communication", "optimizer"]
    assert all({"category", "evidence", "action", "estimated_saving_ms", "method"} <= set(r) for r in recs)
    assert "what to do next" in res.output and "1. fusion: save ~0.20 ms per step" in res.output


# --------------------------------------------------------------------------- kernel efficiency, memory


def _resources(grid: list[int], block: list[int], regs: int, shared: int, per_sm: float, occ: float) -> dict:
    return {"grid": grid, "block": block, "registers per thread": regs, "shared memory": shared,
            "blocks per SM": per_sm, "est. achieved occupancy %": occ}


def _memory(ts: float, nbytes: int, total: int | None, device_type: int = 1) -> dict[str, Any]:
    args: dict[str, Any] = {"Bytes": nbytes, "Device Type": device_type, "Device Id": 0 if device_type else -1}
    if total is not None:
        args["Total Allocated"] = total
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts,
            "args": args}


def test_kernel_efficiency_and_memory_view(tmp_path: Path) -> None:
    small = _resources([4, 1, 1], [128, 1, 1], 32, 0, 0.03, 6)
    events = [
        _step(0, 1000),
        _op("aten::zeros", 4, 6), _op("aten::empty", 5, 3), _memory(6, 1000, 1000),
        _op("aten::mul", 10, 5), _launch(1, 11), _memory(12, 3000, 4000),
        _kernel(1, 100, 250, "small_kernel", **small),
        _op("aten::mul", 16, 3), _launch(2, 17), _memory(20, -1000, 3000),
        _kernel(2, 350, 250, "small_kernel", **{**small, "est. achieved occupancy %": 10}),
        _memory(30, 500, 3500),  # outside every op
        _op("aten::add", 40, 3), _launch(3, 41),
        _kernel(3, 600, 100, "big_kernel", **_resources([1024, 1, 1], [256, 1, 1], 16, 0, 7.76, 100)),
        _op("aten::mm", 50, 3), _launch(4, 51),
        _kernel(4, 700, 200, "gemm_kernel", **_resources([2, 66, 1], [384, 1, 1], 168, 213188, 1.0, 0)),
    ]
    a = analyze([_write(tmp_path / "t.json.gz", events)])
    e = a.kernel_efficiency().set_index("name")
    assert list(e.index) == ["small_kernel", "gemm_kernel", "big_kernel"]  # by time
    s = e.loc["small_kernel"]
    assert (s["launches"], s["time_s"], s["grid"], s["block"], s["threads"], s["registers"]) == (
        2, 500e-6, "4,1,1", "128,1,1", 128, 32)
    assert s["occupancy_pct"] == pytest.approx(8.0)  # time-weighted: 6% and 10%, 250 us each
    assert s["flag"] == "low occupancy, small grid"
    assert e.loc["big_kernel", "flag"] == "" and e.loc["big_kernel", "blocks_per_sm"] == pytest.approx(7.76)
    # Kineto's 0% (no answer from its occupancy calculator) is unknown, not low
    assert np.isnan(e.loc["gemm_kernel", "occupancy_pct"]) and e.loc["gemm_kernel", "flag"] == ""
    curve, peaks, by_op = a.memory()
    assert curve["allocated"].tolist() == [1000, 4000, 3000, 3500]
    p = peaks.iloc[0]
    assert (p["device"], p["peak_bytes"], p["peak_ts_us"], p["allocations"], p["frees"], p["recorded_total"]) == (
        "gpu 0", 4000, 12, 3, 1, True)
    # each allocation goes to the innermost op running on its thread
    assert by_op.set_index("op")["bytes"].to_dict() == {"aten::mul": 3000, "aten::empty": 1000, "(no op)": 500}


def test_memory_curve_of_an_old_trace_without_totals_is_relative(tmp_path: Path) -> None:
    events = [_step(0, 100), _op("aten::add", 1, 3), _launch(1, 2), _kernel(1, 10, 5, "k"),
              _memory(3, 64, None, 0), _memory(4, 32, None, 0), _memory(5, -64, None, 0)]
    curve, peaks, _ = analyze([_write(tmp_path / "old.json.gz", events)]).memory()
    assert curve["allocated"].tolist() == [64, 96, 32]
    assert peaks.iloc[0]["device"] == "cpu" and not peaks.iloc[0]["recorded_total"]


def test_a_trace_without_resources_or_memory_events_has_empty_tables(tmp_path: Path) -> None:
    a = analyze([_write(tmp_path / "t.json.gz", [_step(0, 100), _op("aten::add", 1, 3), _launch(1, 2),
                                                 _kernel(1, 10, 5, "k")])])
    assert a.kernel_efficiency().empty and all(t.empty for t in a.memory())


# --------------------------------------------------------------------------- host side


def _host_trace(tmp_path: Path) -> Path:
    """Kernel A (launched at 10, runs 20-50), B (launched at 15, queued behind A: 50-80), a
    cudaStreamSynchronize from 20 to 81 that waits for B, then C (launched at 90, 100-110)."""
    return _write(tmp_path / "host.json.gz", [
        _step(0, 200),
        _op("aten::a", 8, 5), _launch(1, 10), _kernel(1, 20, 30, "kernel_a"),
        _op("aten::b", 14, 4), _launch(2, 15), _kernel(2, 50, 30, "kernel_b"),
        _op("aten::item", 19, 63), _x("cuda_runtime", "cudaStreamSynchronize", 20, 61),
        _op("aten::c", 88, 7), _launch(3, 90), _kernel(3, 100, 10, "kernel_c"),
    ])


def test_critical_path_launch_statistics_and_cpu_against_gpu(tmp_path: Path) -> None:
    a = analyze([_host_trace(tmp_path)])
    cp = a.critical_path.iloc[0]
    # back from C's end (110): C 10 us on the GPU, its launch delay 10 (90 -> 100), the host
    # from the sync's return (81) to the launch (9), the sync's return after B ended (1), B
    # 30 and A 30 back to back (B was queued before A ended), A's launch delay (10 -> 20) and
    # the host from the step's start to A's launch (10)
    assert cp["path_s"] * 1e6 == pytest.approx(110)
    assert (cp["gpu_s"] * 1e6, cp["launch_s"] * 1e6, cp["cpu_s"] * 1e6, cp["wait_s"] * 1e6) == pytest.approx(
        (70, 20, 20, 0))
    assert cp["events"] == 3
    lt = a.launches.iloc[0]
    assert lt["launches"] == 3  # the sync launched nothing
    assert (lt["delay_p50_us"], lt["delay_max_us"], lt["queue_p50"], lt["queue_max"]) == (10, 35, 0, 1)
    hist = a.launch_delays.set_index("lo_us")["launches"]
    assert (hist[10.0], hist[20.0], hist.sum()) == (2, 1, 3)
    ops = a.cpu_ops.set_index("op")
    assert ops.loc["aten::item", "cpu_s"] == pytest.approx(63e-6) and ops.loc["aten::item", "gpu_s"] == 0
    assert ops.loc["aten::a", "cpu_s"] == pytest.approx(5e-6) and ops.loc["aten::a", "gpu_s"] == pytest.approx(30e-6)
    # the sync drained the queue (B ended at 80) and the GPU idled until C started (100):
    # replayed without the wait, C is launched during B and starts as B ends (80): 20 us,
    # the step's GPU idle time (20-110 with 70 busy)
    host = a.recommendations.set_index("category").loc["host: syncs"]
    assert host["estimated_saving_ms"] == pytest.approx(0.02)
    assert "aten::item: 1 per step, 0.02 ms idle after" in host["evidence"]
    sy = a.syncs.iloc[0]
    assert (sy["site"], sy["calls"], sy["idle_after_s"] * 1e6) == ("aten::item", 1, pytest.approx(20))


def _burst(first: int, launch_at: float, gpu_at: float, n: int, kernel_us: float, gap_us: float = 5) -> list:
    """``n`` launches from ``launch_at``, ``gap_us`` apart, of kernels of ``kernel_us`` that
    run back to back from ``gpu_at`` (or each at its launch + 5 when the GPU waits)."""
    out, t = [], gpu_at
    for i in range(n):
        lt = launch_at + i * gap_us
        t = max(t, lt + 5)
        out += [_op("aten::mul", lt - 1, 3), _launch(first + i, lt), _kernel(first + i, t, kernel_us, "k_mul")]
        t += kernel_us
    return out


def _copy(corr: int, ts: float, dur: float, gpu_at: float, direction: str = "DtoH") -> list:
    kind = "Device -> Pinned" if direction == "DtoH" else "Pageable -> Device"
    return [_x("cuda_runtime", "cudaMemcpyAsync", ts, dur, correlation=corr),
            _x("gpu_memcpy", f"Memcpy {direction} ({kind})", gpu_at, 2, pid=0, tid=7, correlation=corr, stream=7,
               device=0)]


def test_a_gpu_bound_step_has_its_critical_path_on_the_gpu(tmp_path: Path) -> None:
    """The host launches 40 kernels of 100 us in 200 us (a deep queue), then reads the loss
    (``.item()``: a DtoH copy into pageable memory whose call returns only after the copy,
    4 ms later), then launches one more kernel."""
    ev = [_step(0, 4200), *_burst(1, 10, 20, 40, 100),
          _op("aten::item", 300, 3740), *_copy(100, 305, 3730, 4020),
          _op("aten::add", 4038, 4), _launch(101, 4040), _kernel(101, 4050, 10, "k_add")]
    a = analyze([_write(tmp_path / "gpu_bound.json.gz", ev)])
    cp = a.critical_path.iloc[0]
    lt = a.launches.iloc[0]
    assert lt["queue_p50"] >= 15 and lt["delay_p50_us"] > 1000  # the host runs far ahead
    # the path: the first kernel's launch (10 us of host, 10 of delay), 40 kernels and the
    # copy on the GPU back to back (4002 us), the copy call's return (8 us), the host to the
    # last launch (10), its delay (10) and the last kernel (10)
    assert cp["path_s"] * 1e6 == pytest.approx(4060)
    assert cp["gpu_s"] / cp["path_s"] > 0.98
    assert (cp["cpu_s"] * 1e6, cp["launch_s"] * 1e6) == pytest.approx((28, 20))
    # whatever the host does, it gives back almost nothing
    host = a.recommendations[a.recommendations["category"].str.startswith("host")]
    assert (host["estimated_saving_ms"] < 0.05).all()


def test_a_launch_bound_step_has_its_critical_path_on_the_host(tmp_path: Path) -> None:
    """30 kernels of 10 us, launched 50 us apart: the GPU waits for every launch."""
    a = analyze([_write(tmp_path / "host_bound.json.gz", [_step(0, 1600), *_burst(1, 10, 0, 30, 10, gap_us=50)])])
    cp = a.critical_path.iloc[0]
    assert (cp["cpu_s"] + cp["launch_s"]) / cp["path_s"] > 0.75 and cp["gpu_s"] * 1e6 == pytest.approx(10)
    lt = a.launches.iloc[0]
    assert lt["queue_p50"] == 0 and lt["delay_p50_us"] == pytest.approx(5)
    r = a.recommendations.set_index("category")
    assert "host: syncs" not in r.index
    # without the host's launch time the 30 kernels are queued at once and run back to back
    # after the first one's 5 us delay: 305 us instead of 1475, at most the GPU idle time
    # (1460 from the first kernel's start, 300 busy)
    launch = r.loc["host: launches"]
    assert launch["estimated_saving_ms"] == pytest.approx(1.16)
    assert "CUDA graphs" in launch["action"] and "30 launches per step" in launch["evidence"]


def _sync_bound_trace(tmp_path: Path) -> Path:
    """Three rounds of: 10 kernels of 100 us launched in 50 us (the queue fills), the token
    counts read on the host (``aten::item`` inside ``aten::bincount``: a DtoH copy and a
    cudaStreamSynchronize that waits until the queue drained), then 200 us of host work
    before the next round's launches."""
    ev: list = [_step(0, 5000)]
    t, gpu, corr = 10.0, 20.0, 1
    for _ in range(3):
        ev += _burst(corr, t, gpu, 10, 100)
        corr += 10
        drained = gpu + 1000
        ev += [_op("aten::bincount", t + 60, drained - t - 50 + 10), _op("aten::item", t + 62, drained - t - 52 + 5),
               *_copy(corr, t + 63, 5, drained), _x("cuda_runtime", "cudaStreamSynchronize", t + 70, drained - t - 65)]
        corr += 1
        t = drained + 7 + 200  # the sync returns 5 us after the copy; 200 us of host work
        gpu = t + 5
    return _write(tmp_path / "sync_bound.json.gz", ev)


def test_a_sync_bound_step_names_its_syncs_and_what_they_cost(tmp_path: Path) -> None:
    a = analyze([_sync_bound_trace(tmp_path)])
    r = a.recommendations.set_index("category")
    sync = r.loc["host: syncs"]
    assert "aten::item in aten::bincount (DtoH): 3 per step" in sync["evidence"]
    # the GPU idles after each of the first two syncs from the drain (the copy's end) to the
    # next round's first kernel (210 us); without waiting, the host launches the next round
    # while the GPU still runs the last: the two gaps go
    assert a.syncs["idle_after_s"].sum() * 1e6 == pytest.approx(2 * 210)
    assert sync["estimated_saving_ms"] == pytest.approx(0.420, rel=0.02)
    assert "per-expert token counts on the host" in sync["evidence"]
    assert "keep the values on the device" in sync["action"]
    # launching faster does not help while each sync drains the queue
    assert r.loc["host: launches", "estimated_saving_ms"] < sync["estimated_saving_ms"] / 2
    # the report's host section lists the call sites
    site = rp.sync_sites(a)[0]
    assert (site["site"], site["calls"], site["idle_after_ms"]) == (
        "aten::item in aten::bincount (DtoH)", 3, pytest.approx(0.42))


def test_critical_path_parts_add_up_on_real_traces() -> None:
    for path in (RUN, TRACES / "h200_tp2", TRACES / "h100_cuda_graph.json.gz"):
        a = analyze([path])
        cp = a.critical_path
        assert len(cp) and (cp[["cpu_s", "launch_s", "gpu_s", "wait_s"]] >= 0).all().all(), path
        parts = cp["cpu_s"] + cp["launch_s"] + cp["gpu_s"] + cp["wait_s"]
        assert parts.to_numpy() == pytest.approx(cp["path_s"].to_numpy()), path
        # the replay as recorded reproduces each step's span (scaled to a shorter unprofiled
        # step where the manifest measured one); without syncs or launch time it is no longer
        rp = a.host_replay
        assert len(rp), path
        same = rp["host_scale"] == 1.0
        assert rp.loc[same, "replay_s"].to_numpy() == pytest.approx(rp.loc[same, "span_s"].to_numpy(), rel=1e-6)
        # within a nanosecond (timestamps since the epoch are floats of a quarter-microsecond resolution)
        assert (rp["replay_s"] <= rp["span_s"] + 1e-9).all(), path
        assert (rp[["no_sync_s", "no_host_s"]].to_numpy() <= rp[["replay_s"]].to_numpy() + 1e-9).all(), path


# --------------------------------------------------------------------------- the report


def test_report_shows_the_new_sections_in_chromium(tmp_path: Path) -> None:
    from test_report import check_in_chromium

    for a, want in ((analyze([RUN]), ("What to do next", "Host side: critical path and launches", "Kernel efficiency")),
                    (analyze([_write(tmp_path / "mem.json.gz", [
                        _step(0, 1000), _op("aten::mul", 10, 5), _launch(1, 11), _memory(12, 3 << 20, 3 << 20),
                        _kernel(1, 100, 250, "small_kernel", **_resources([4, 1, 1], [128, 1, 1], 32, 0, 0.03, 6)),
                        _memory(300, -(1 << 20), 2 << 20)])]), ("Memory",))):
        d = rp.report_from_analysis(a)
        res = check_in_chromium(write_html(d, tmp_path / "r.html"), height=12000)  # the detail sections come last
        assert res.console_errors == [] and res.selfcheck.startswith("ok"), (res.console_errors, res.selfcheck)
        titles = re.findall(r"<h2>([^<]*)</h2>", res.dom)
        for title in want:
            assert title in titles, titles
            assert res.section_ink[title] > 0.03, (title, res.section_ink)
    # the last page drew the allocation curve; the first listed its recommendations, largest first
    assert res.chart_ink["memory"] > 0.001
    assert d["memory"]["devices"][0]["peak_bytes"] == 3 << 20


def test_top_recommendations_of_the_h100_trainer_runs_agree_with_their_measured_savings() -> None:
    """The trainer's own H100 runs (benchmarks/results/advice_check/h100): the top recommendation's
    estimate against the saving measured by applying it in interleaved runs on the same
    machine: dense llama3-8b, train.compile=block (the step tuner's measurement per step of
    these; advice_check.json measured pointwise, which fuses less: a floor); MoE qwen3-30b-a3b,
    train.micro_batch=2 per base step's tokens (recommendation_check/h100.json). Within 30%."""
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    root = results / "advice_check" / "h100"
    pointwise = json.loads((root / "dense" / "advice_check.json").read_text())["measured_saving_ms"]["compile"]
    measured = {
        "dense": ("fusion", "train.compile=block", _block_saving_per_two_sequences()),
        "moe": ("host: launches", "train.micro_batch=2",
                json.loads((results / "recommendation_check" / "h100.json").read_text())["measured_saving_ms"]),
    }
    for name, (category, key, saved_ms) in measured.items():
        top = analyze(root / name).recommendations.iloc[0]
        assert top["category"] == category and key in top["action"], (name, top["category"], top["action"])
        assert abs(top["estimated_saving_ms"] - saved_ms) <= 0.3 * saved_ms, (name, top["estimated_saving_ms"], saved_ms)
        if name == "dense":
            assert top["estimated_saving_ms"] >= pointwise


def test_attention_tuning_is_capped_where_the_kernels_are_already_cudnns() -> None:
    """The same H100 llama3-8b step with cuDNN's and with flash attention's kernels: tuning
    chose cuDNN again at 1.000x on such a problem, so the cuDNN run's advice is at most 2% of
    its attention time (here below the noise: none); the flash run's is not capped."""
    for name, capped in (("cudnn", True), ("flash", False)):
        a = analyze([TRACES / f"h100_llama3-8b_l2_s1024_{name}.json.gz"])
        k = a.kernels[a.kernels["category"].astype(str).str.startswith("attention") & (a.kernels["step"] >= 0)]
        attention_ms = float(k["dur_us"].sum()) / 1e3 / a.rank_steps
        rows = a.recommendations[a.recommendations["category"] == "tuning: attention"]
        saving = float(rows["estimated_saving_ms"].sum())
        if capped:
            assert saving <= 0.02 * attention_ms
        else:
            assert saving > 0.5 * attention_ms and "cuDNN" not in rows["method"].iloc[0]


def test_host_tables_made_in_a_forked_process_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A big trace analyzed with a CPU to spare has its host tables made in a forked process
    while the rest of the analysis goes on: the same tables as made in this process."""
    import pandas as pd

    import primus_perf.tracelens.analyze as A

    monkeypatch.setattr(A, "idle_cpus", lambda: 2)
    monkeypatch.setattr(A, "HOST_ASIDE_EVENTS", 10**12)
    here = analyze([RUN])
    monkeypatch.setattr(A, "HOST_ASIDE_EVENTS", 0)
    forks, fork = [], A._host_aside
    monkeypatch.setattr(A, "_host_aside", lambda *args: forks.append(1) or fork(*args))
    aside = analyze([RUN])
    assert forks == [1]
    for name in ("cpu_ops", "launches", "launch_delays", "critical_path", "syncs", "host_replay", "recommendations"):
        pd.testing.assert_frame_equal(getattr(here, name), getattr(aside, name))
    assert len(aside.host_replay) and len(aside.critical_path)


# --------------------------------------------------------------------------- a CPU run

F32 = "float"


def _cpu_run(tmp_path: Path, step_plan: bool) -> Path:
    """A CPU run folder as ``primus-profile run`` writes it (no GPU events; the manifest holds
    the steps' wall-clock times), and as ``primus-tune step`` leaves it (``step_plan.json``)."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    events = []
    for n in (1, 2):
        t0 = n * 30_000
        events += [_step(t0, 25_000, n), _op("aten::mm", t0 + 10, 4000, [[128, 256], [256, 512]], [F32, F32]),
                   _x("user_annotation", "Optimizer.step#AdamW.step", t0 + 5000, 2000)]
    (run / "rank0.json.gz").write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": events}).encode()))
    config = {"model": {"name": "tiny"}, "train": {"compile": "off", "micro_batch": 1}, "parallel": {"tp": 1}}
    (run / "manifest.json").write_text(json.dumps({
        "schema": "primus-perf-run/1", "traces": {"0": "rank0.json.gz"}, "device": {"name": "cpu"},
        "step_time_s": 0.0196, "config": config}))
    if step_plan:
        (run / "step_plan.json").write_text(json.dumps({"schema": "primus-perf-step-plan/1", "measured": [
            {"lever": "train.micro_batch", "value": "4", "changes": {"train.micro_batch": "4"},
             "against": "the default", "status": "kept", "kept": True, "speedup": 1.5, "measured_ms": 6.53},
            {"lever": "train.optimizer", "value": "foreach", "changes": {"train.optimizer": "foreach"},
             "against": "train.micro_batch=4", "status": "dropped", "kept": False, "speedup": 0.95,
             "measured_ms": -0.66}]}))
    return run


def test_a_cpu_runs_header_next_steps_and_step_tuner_measurements(tmp_path: Path) -> None:
    """A CPU run (README: primus-profile run -- examples/llama_train.py, then analyze): the
    header's step time is the manifest's wall clock, said so; what to do next says why nothing
    is estimated and shows what the step tuner measured (step_plan.json, read, not ignored);
    the HTML report's section holds the same, from the same function (report.next_steps)."""
    run = _cpu_run(tmp_path, step_plan=True)
    out = CliRunner().invoke(app, ["analyze", str(run)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "step 19.600 ms wall clock (the median profiled step in manifest.json) · no GPU events" in out.output
    said = out.output[out.output.index("what to do next"):]
    assert rp.NO_GPU_ESTIMATES in said and rp.MEASURE_HERE not in said  # the step tuner ran already
    assert "train.micro_batch=4 against the default: 1.500x, +6.53 ms a step saved (kept)" in said
    assert "train.optimizer=foreach against train.micro_batch=4: 0.950x, -0.66 ms a step saved (dropped)" in said
    assert "ignored" not in out.output
    a = analyze([run])
    d = rp.report_from_analysis(a)
    nxt = rp.next_steps(a)
    assert (d["recommendations"], d["measured_unadvised"], d["next_note"]) == (nxt["rows"], nxt["measured"],
                                                                              nxt["note"])
    assert [m["lever"] for m in nxt["measured"]] == ["train.micro_batch=4", "train.optimizer=foreach"]
    assert d["header"]["wall_step_time_ms"] == pytest.approx(19.6)

    # before the step tuner: the hint to run it; a bare trace: the wall clock of its ProfilerSteps
    plain = _cpu_run(tmp_path / "plain", step_plan=False)
    out = CliRunner().invoke(app, ["analyze", str(plain)], env={"COLUMNS": "200"})
    assert rp.NO_GPU_ESTIMATES + rp.MEASURE_HERE in out.output
    bare = tmp_path / "bare.json.gz"  # no manifest beside it
    bare.write_bytes((plain / "rank0.json.gz").read_bytes())
    out = CliRunner().invoke(app, ["analyze", str(bare)], env={"COLUMNS": "200"})
    assert "step 25.000 ms wall clock (the median ProfilerStep span in the trace)" in out.output, out.output


def test_a_cpu_runs_next_steps_in_chromium(tmp_path: Path) -> None:
    """The HTML report's What to do next of a CPU run: why nothing is estimated and the step
    tuner's measurements in a table, as the terminal prints them."""
    from test_report import check_in_chromium

    d = rp.report_from_analysis(analyze([_cpu_run(tmp_path, step_plan=True)]))
    res = check_in_chromium(write_html(d, tmp_path / "cpu.html"))
    assert res.console_errors == [] and res.selfcheck.startswith("ok"), (res.console_errors, res.selfcheck)
    assert "<h2>What to do next</h2>" in res.dom and rp.NO_GPU_ESTIMATES in res.dom
    assert 'data-rows="2" data-table="step-tuner"' in res.dom and "train.optimizer=foreach" in res.dom
    assert '<div class="card" title="the median profiled step in manifest.json"><b>19.6 ms</b><span>wall-clock step' \
        in res.dom
