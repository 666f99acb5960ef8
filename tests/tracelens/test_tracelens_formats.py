"""Traces of other tools and versions: fields of unexpected types are converted or dropped
and reported once; 2021 Kineto category names; GPU work belongs to the step of its launch;
thousands of distinct shapes; convolution, grouped GEMM and memory-bound models; peaks."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from primus_perf.base.devices import lookup_peaks
from primus_perf.problems import GroupedGemmProblem
from primus_perf.tracelens import load as L
from primus_perf.tracelens.analyze import analyze
from primus_perf.tracelens.perf_models import model_op

TRACES = Path(__file__).parents[1] / "data" / "traces"


def _write(path: Path, events: list[dict[str, Any]], **head: Any) -> Path:
    path.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, **head, "traceEvents": events}).encode()))
    return path


def _step(n: int, ts: float, dur: float, cat: str = "user_annotation") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def _launch(corr: Any, ts: float, op: str | None = None, cat: str = "cuda_runtime", **args: Any) -> list[dict]:
    ev = [{"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts, "dur": 2,
           "args": {"correlation": corr, **args}}]
    if op:
        ev.insert(0, {"ph": "X", "cat": "cpu_op", "name": op, "pid": 1, "tid": 1, "ts": ts - 1, "dur": 5})
    return ev


def _kernel(corr: Any, ts: float, dur: float, name: str = "vectorized_elementwise_kernel", cat: str = "kernel",
            **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": 7, "device": 0, **args}}


def test_fields_of_unexpected_types_are_converted_and_reported_once(tmp_path: Path) -> None:
    events = [_step(1, 0, 100), *_launch("11", 10, "aten::add"), _kernel(11, 20, 10, stream="0x7"),
              *_launch(12, 30, "aten::copy_", bytes="616"), _kernel(12.0, 40, 5, name="Memcpy DtoD", cat="gpu_memcpy"),
              *_launch(13, 50, "aten::mul"), _kernel(13, 60, "4", bytes=None, device="x")]
    rt = L.load(_write(tmp_path / "t.json.gz", events))
    assert rt.fixes[("args.stream", "converted string-typed")] == 1
    assert rt.fixes[("args.correlation", "converted string-typed")] == 1
    assert rt.fixes[("args.correlation", "converted float-typed")] == 1
    assert ("args.bytes", "converted string-typed") not in rt.fixes  # no figure reads a memcpy's bytes
    assert rt.fixes[("args.device", "dropped non-numeric string-typed")] == 1
    assert sorted(rt.stream[rt.kind == L.KIND_KERNEL].tolist()) == [7, 7]
    a = analyze([tmp_path / "t.json.gz"])
    notes = [n for n in a.notes if "value(s)" in n]
    assert "converted 1 string-typed `args.stream` value(s) for their events" in notes
    assert len(notes) == len(set(notes)) == 5  # stream, correlation x2, device, dur
    assert float(a.kernels["dur_us"].sum()) == 19.0  # the string duration "4" converted
    assert (a.kernels["step"] == 1).all()


@pytest.mark.parametrize("form", ["gzip", "plain", "plain array"])
def test_a_piece_cut_inside_a_string_is_joined_with_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            form: str) -> None:
    """Read 100 bytes at a time and cut every 256: some cuts fall inside the name below. An
    uncompressed file's pieces are read by the helper processes themselves (by their place
    in the file), a compressed one's are sent to them."""
    tricky = "op}, {with braces"
    events = [_step(1, 0, 1000)]
    for i in range(200):
        events += _launch(i, 10 + i, tricky if i % 7 == 0 else "aten::add")
        events.append(_kernel(i, 20 + 4 * i, 2))
    if form == "gzip":
        path = _write(tmp_path / "t.json.gz", events)
    else:
        path = tmp_path / "t.json"
        text = json.dumps(events if form == "plain array" else {"schemaVersion": 1, "traceEvents": events})
        path.write_text(text)
    whole = L.load(path)
    monkeypatch.setattr(L, "READ_BYTES", 100)
    small = L.load(path, chunk_bytes=256)
    assert len(whole) == len(small) and np.array_equal(whole.ts, small.ts)
    assert whole.names == small.names and tricky in small.names
    # the pieces decoded in helper processes (a big file where CPUs are idle): the same trace
    helped = L.load(path, chunk_bytes=256, workers=2)
    for col in ("kind", "name", "thread", "ts", "dur", "correlation", "stream", "device", "seq", "shape"):
        assert np.array_equal(getattr(helped, col), getattr(whole, col)), col
    assert helped.names == whole.names and helped.shape_values == whole.shape_values
    assert helped.fixes == whole.fixes and helped.dropped == whole.dropped


def test_an_uncompressed_trace_with_an_event_longer_than_the_search_window(tmp_path: Path) -> None:
    """The helper processes read their pieces by place; the boundary after a cut is searched
    past an event of 200 kB (three search windows) and past the last one to the end."""
    events = [_step(1, 0, 1000)]
    for i in range(40):
        events += _launch(i, 10 + i, "aten::" + ("x" * 200_000 if i == 20 else "add"))
        events.append(_kernel(i, 20 + 4 * i, 2))
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"traceEvents": events, "deviceProperties": [{"id": 0, "name": "NVIDIA H100"}]}))
    whole = L.load(path)
    helped = L.load(path, chunk_bytes=512, workers=2)
    for col in ("kind", "name", "thread", "ts", "dur", "correlation"):
        assert np.array_equal(getattr(helped, col), getattr(whole, col)), col
    assert helped.names == whole.names and helped.device_properties == whole.device_properties == [
        {"id": 0, "name": "NVIDIA H100"}]


def test_a_piece_whose_file_went_away_is_one_error_line(tmp_path: Path) -> None:
    from primus_perf.base.errors import TraceError

    path = tmp_path / "gone.json"
    path.write_text('{"traceEvents": [{"ph": "X"}, {"ph": "X"}]}')
    span = L._Span(str(path), 17, 28)
    assert bytes(span.text()) == b'[{"ph": "X"}]'
    path.write_text('{"traceEvents": []}')  # shorter now
    with pytest.raises(TraceError, match="became shorter"):
        span.text()
    path.unlink()
    with pytest.raises(TraceError, match="cannot read trace"):
        span.text()


def test_kineto_2021_categories_and_step_ops(tmp_path: Path) -> None:
    events = [_step(5, 0, 100, cat="Operator"),
              {"ph": "X", "cat": "Operator", "name": "aten::conv2d", "pid": 1, "tid": "1", "ts": 9, "dur": 5},
              {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": "1", "ts": 10, "dur": 2,
               "args": {"correlation": 3}},
              _kernel(3, 20, 10, name="volta_scudnn_128x64_relu_interior_nn_v1", cat="Kernel"),
              {"ph": "X", "cat": "Memset", "name": "Memset (Device)", "pid": 0, "tid": "stream 7", "ts": 40,
               "dur": 1, "args": {"correlation": 3, "stream": 7, "device": 0}}]
    a = analyze([_write(tmp_path / "old.json.gz", events)])
    assert a.steps == [5]
    assert dict(a.category_seconds() * 1e6) == pytest.approx({"convolution": 10.0, "memset": 1.0})
    assert not any("no CPU ops" in n for n in a.notes)


def test_gpu_work_belongs_to_the_step_of_its_launch(tmp_path: Path) -> None:
    """The GPU runs behind its host: step 1's second kernel runs during step 2; a kernel
    queued before profiling (no launch in the trace) is outside every step."""
    events = [_step(1, 0, 100), _step(2, 100, 100),
              _kernel(99, 5, 50),  # pre-queued: its launch is not in the trace
              *_launch(1, 10, "aten::add"), _kernel(1, 60, 40),
              *_launch(2, 90, "aten::mul"), _kernel(2, 150, 40),  # launched in step 1, runs in step 2
              *_launch(3, 110, "aten::add"), _kernel(3, 120, 20, name="ncclKernel_AllReduce"),
              *_launch(4, 150, "aten::add"), _kernel(4, 195, 5)]
    a = analyze([_write(tmp_path / "lag.json.gz", events)])
    k = a.kernels.sort_values("ts_us")
    assert k["step"].tolist() == [-1, 1, 2, 1, 2]
    assert a.totals["outside_steps_gpu_s"] == pytest.approx(50e-6)
    assert any(n.startswith("outside steps: 1 GPU events") for n in a.notes)
    t = a.temporal.set_index("step")
    # step 1: from 60 to the later of its last end (190) and step 2's first start (120)
    assert t.loc[1, "span_s"] == pytest.approx(130e-6) and t.loc[1, "idle_s"] == pytest.approx(50e-6)
    assert t.loc[2, "span_s"] == pytest.approx(80e-6) and t.loc[2, "exposed_comm_s"] == pytest.approx(20e-6)
    parts = t["compute_s"] + t["exposed_comm_s"] + t["exposed_memcpy_s"] + t["idle_s"]
    assert np.allclose(parts, t["span_s"]) and (a.temporal.select_dtypes("number") >= 0).all().all()
    assert float(a.breakdown["seconds"].sum()) == pytest.approx(105e-6)


def test_thousands_of_distinct_shapes(tmp_path: Path) -> None:
    events = [_step(1, 0, 1e6)]
    for i in range(1500):
        ts = 10.0 + 20 * i
        events.append({"ph": "X", "cat": "cpu_op", "name": "fbgemm::jagged_op", "pid": 1, "tid": 1, "ts": ts,
                       "dur": 5, "args": {"Input Dims": [[i + 1, 8], []], "Input type": ["float", "Scalar"],
                                          "Concrete Inputs": ["", str(i)]}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": ts + 1, "dur": 1, "args": {"correlation": i}})
        events.append(_kernel(i, ts + 3, 2, name="jagged_kernel"))
    a = analyze([_write(tmp_path / "many.json.gz", events)])
    assert a.hotspots["shape"].nunique() == 1500 and a.hotspots["calls"].sum() == 1500
    # the concrete integers are not part of the shape key
    same = [{**e, "args": {**e["args"], "Input Dims": [[4, 8], []]}} if e.get("cat") == "cpu_op" else e
            for e in events]
    b = analyze([_write(tmp_path / "same.json.gz", same)])
    assert b.hotspots["shape"].tolist() == ["4x8 f32"]


def _args(dims: list, types: list, concrete: list | None = None) -> L.ShapeArgs:
    return L.ShapeArgs(dims, types, [], concrete or [])


def test_convolution_models() -> None:
    x, w = [8, 64, 56, 56], [128, 64, 3, 3]
    fwd = model_op("aten::convolution", _args([x, w, [128], [], [], [], [], [], []],
                                              ["c10::BFloat16"] * 3, ["", "", "", "[1, 1]", "[1, 1]", "[1, 1]",
                                                                      "False", "[0, 0]", "1"]))
    assert fwd is not None and fwd.kind == "convolution"
    assert fwd.flops == 2 * 8 * 128 * 56 * 56 * 64 * 9
    strided = model_op("aten::convolution", _args([x, w], ["float"] * 2, ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]"]))
    assert strided is not None and strided.flops == 2 * 8 * 128 * 28 * 28 * 64 * 9
    assert model_op("aten::cudnn_convolution", _args([x, w, [], []], ["float", "float"])) is None  # no stride: unknown
    go = [8, 128, 56, 56]
    bwd = model_op("aten::convolution_backward", _args([go, x, w], ["float"] * 3))
    assert bwd is not None and bwd.direction == "bwd" and bwd.flops == 2 * fwd.flops
    dgrad = model_op("aten::cudnn_convolution_backward_input", _args([[], go, w], ["", "float", "float"]))
    assert dgrad is not None and dgrad.flops == fwd.flops


def test_grouped_gemm_and_bytes_models() -> None:
    g = model_op("aten::_grouped_mm", _args([[4096, 2048], [8, 2048, 768], [8]], ["c10::BFloat16"] * 2 + ["int"]))
    assert g is not None and g.kind == "grouped_gemm" and g.flops == 2 * 4096 * 2048 * 768
    assert g.problem == GroupedGemmProblem(groups=8, k=2048, n=768, tokens=4096, dtype="bf16") and g.assumed
    from primus_perf.tracelens.perf_models import model_bytes

    m = model_bytes(_args([[1024, 4096], [4096], []], ["c10::BFloat16", "c10::BFloat16", "Scalar"]))
    assert m is not None and m.flops is None and m.bytes == (1024 * 4096 + 4096 + 1024 * 4096) * 2


@pytest.mark.parametrize(("name", "key"), [
    ("NVIDIA B200", "b200"), ("NVIDIA GB200", "gb200"), ("NVIDIA H20", "h20"), ("NVIDIA H200", "h200"),
    ("Tesla V100-SXM2-16GB", "v100-sxm2"), ("Tesla V100-PCIE-32GB", "v100-pcie"), ("NVIDIA A10", "a10"),
    ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("AMD Instinct MI210", "mi210"),
    ("AMD Instinct MI250X", "mi250x"), ("AMD Instinct MI300A", "mi300a"), ("AMD Instinct MI300X VF", "mi300x"),
    ("NVIDIA A100-PG509-200", "a100-sxm"), ("NVIDIA GeForce RTX 2080 Ti", None), ("AMD Radeon Graphics", None),
    ("NVIDIA A10G", None), ("", None)])
def test_peak_table_names(name: str, key: str | None) -> None:
    p = lookup_peaks(name)
    assert (p.key if p else None) == key
    if p is not None:
        assert p.hbm_tb_s > 0 and p.peak_tflops("f16") and p.peak_tflops("f32")


def test_a_kernel_launched_directly_in_a_step_goes_by_its_kernel_name(tmp_path: Path) -> None:
    """A step marker is no op: a kernel launched inside it but outside every op (a custom
    extension's launcher, a graph replay) is labeled and categorized by its kernel name."""
    events = [_step(3, 0, 100), *_launch(1, 10), _kernel(1, 20, 30, name="spin_kernel(long)"),
              *_launch(2, 40), _kernel(2, 60, 10, name="triton_red_fused_sum_0"),
              *_launch(3, 80, "aten::add"), _kernel(3, 90, 5)]
    a = analyze([_write(tmp_path / "bare.json.gz", events)])
    ops = dict(zip(a.kernels["name"].astype(str), a.kernels["op"].astype(str), strict=True))
    assert ops == {"spin_kernel(long)": "spin_kernel(long)", "triton_red_fused_sum_0": "triton_red_fused_sum_0",
                   "vectorized_elementwise_kernel": "aten::add"}
    assert "ProfilerStep" not in set(a.hotspots["op"])
    assert dict(a.category_seconds() * 1e6) == pytest.approx({"other": 30.0, "reduction": 10.0, "elementwise": 5.0})
    assert a.steps == [3] and (a.kernels["step"] == 3).all()


def _negatives(x: Any, path: str = "") -> list[str]:
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in _negatives(v, f"{path}.{k}")]
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in _negatives(v, f"{path}[{i}]")]
    return [path] if isinstance(x, (int, float)) and not isinstance(x, bool) and x < 0 else []


def test_collective_sizes_a_trace_does_not_record_are_null_in_json(tmp_path: Path) -> None:
    """An NCCL all-reduce without recorded shapes or group: its bytes and group size are
    unknown, written as null, never as the tables' -1."""
    events = [_step(1, 0, 100), *_launch(1, 10, "nccl:all_reduce"),
              _kernel(1, 20, 30, name="ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)")]
    a = analyze([_write(tmp_path / "comm.json.gz", events)])
    assert (a.collective_bandwidth["bytes"] == -1).all()  # the table's convention, as the report reads it
    js = json.loads(json.dumps(a.to_json()))
    (bw,) = js["collective_bandwidth"]
    assert bw["bytes"] is None and bw["group_size"] is None and bw["calls"] == 1.0
    (rk,) = js["collective_ranks"]
    assert rk["bytes"] is None and rk["group_size"] is None
    assert _negatives(js) == []


def test_device_events_of_unknown_categories_are_named_in_a_note(tmp_path: Path) -> None:
    """Another accelerator's device events (or CUPTI range profiler records) are not read:
    a note names their category and count instead of a silent 'no GPU events'; Python
    frames, profiler spans and sync waits are skipped without a note."""
    events = [_step(1, 0, 100), *_launch(1, 10, "aten::add"), _kernel(1, 20, 30),
              *({"ph": "X", "cat": "mtia_ccp_events", "name": "pe_exe", "pid": 17, "tid": 3, "ts": 30 + i, "dur": 1,
                 "args": {"stream": 1}} for i in range(3)),
              {"ph": "X", "cat": "python_function", "name": "train.py(10): step", "pid": 1, "tid": 1, "ts": 1,
               "dur": 90},
              {"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": 0, "tid": 7, "ts": 60, "dur": 2},
              {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "x", "ts": 0,
               "dur": 100}]
    rt = L.load(_write(tmp_path / "t.json.gz", events))
    assert dict(rt.unread) == {"mtia_ccp_events": 3}
    a = analyze([tmp_path / "t.json.gz"])
    unread = [n for n in a.notes if n.startswith("not read")]
    assert len(unread) == 1 and unread[0].startswith("not read: 3 `mtia_ccp_events` duration event(s)")
    assert float(a.kernels["dur_us"].sum()) == 30.0


def _rocm_props(major: int, minor: int, units: int, gib: int) -> list[dict[str, Any]]:
    return [{"id": 0, "name": "", "totalGlobalMem": gib << 30, "computeMajor": major, "computeMinor": minor,
             "numSms": units, "warpSize": 64}]


@pytest.mark.parametrize(("props", "device", "peaks"), [
    (_rocm_props(9, 4, 304, 192), "AMD Instinct MI300X (unnamed in the trace: gfx94x, 304 CUs, 192 GiB)", "mi300x"),
    (_rocm_props(9, 4, 304, 256), "AMD Instinct MI325X (unnamed in the trace: gfx94x, 304 CUs, 256 GiB)", "mi325x"),
    (_rocm_props(9, 5, 256, 288), "unknown", None),  # MI350X or MI355X: different peaks, so unknown
    ([{"id": 0, "name": ""}], "unknown", None)])
def test_an_unnamed_rocm_device_is_known_by_its_properties_when_only_one_fits(
        tmp_path: Path, props: list[dict[str, Any]], device: str, peaks: str | None) -> None:
    events = [_step(1, 0, 100), *_launch(1, 10, "aten::add"), _kernel(1, 20, 30)]
    a = analyze([_write(tmp_path / "t.json.gz", events, deviceProperties=props, roctracer_version=4)])
    assert a.device["name"] == device and a.device["peaks"] == peaks


def test_analysis_imports_no_torch() -> None:
    """A trace is analyzed (the details too) without importing torch: op schemas come from
    torchgen's native_functions.yaml (mul's out= form writes its third argument)."""
    import subprocess
    import sys

    code = ("import sys; from primus_perf.tracelens.analyze import analyze; "
            "from primus_perf.tracelens.perf_models import _schema_writes as w; "
            f"analyze([{str(TRACES / 'h100_llama3-8b_l2_s1024_cudnn.json.gz')!r}]).to_json(details=True); "
            "assert w('aten::mul', 3) == {2} and w('aten::add_', 3) == {0}, (w('aten::mul', 3), w('aten::add_', 3)); "
            "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('torch')][:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
