"""Traces of shapes the analyzer had not seen, one class each: expert-parallel communication
kernels outside NCCL/RCCL, the JSON Array Format and old device-property keys, traces
without GPU events, bytes models that cannot exceed the roofline, and the peak table."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from primus_perf.base.devices import PEAK_TABLE, lookup_peaks
from primus_perf.tracelens import load as L
from primus_perf.tracelens.analyze import analyze
from primus_perf.tracelens.categories import (
    COMMUNICATION,
    classify,
    communication_rule,
    expert_parallel_kind,
)
from primus_perf.tracelens.perf_models import model_bytes
from primus_perf.tracelens.roofline import OVER_NOTES, explain_over, roofline


def _write(path: Path, events: list[dict[str, Any]], **head: Any) -> Path:
    path.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, **head, "traceEvents": events}).encode()))
    return path


def _op(name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _launch(corr: int, ts: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def _kernel(corr: int, ts: float, dur: float, name: str, stream: int = 7) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0}}


def _step(n: int, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": ts,
            "dur": dur}


# ---------------------------------------------------------------- 1. expert-parallel communication

# kernel names as the profiler writes them (demangled), one or more per library
EP_KERNELS = {
    "void deep_ep::internode::dispatch<true, 8, 4, 7168>(int4*, float*, int*, SourceMeta*)": "dispatch",
    "void deep_ep::internode::combine<__nv_bfloat16, 8, 4>(int4*, float*, bool const*)": "combine",
    "void deep_ep::intranode::notify_dispatch<8>(int const*, int*, int const*, int*, int, int)": "dispatch",
    "void deep_ep::intranode::cached_notify_combine<8>(void**, int*, int, int, int, int**, int)": "combine",
    "void deep_ep::internode_ll::dispatch<true, false, 7168>(void*, float*, int*, long*)": "dispatch",
    "void deep_ep::internode_ll::combine<false, 7168, 9>(void*, void*, int*, void const*)": "combine",
    "void deep_ep::internode::cached_notify(int, int, int, int, int, int*, int)": "all_to_all",
    "void pplx::(anonymous namespace)::dispatchKernel<8, true>(int, unsigned long, float const*)": "dispatch",
    "void pplx::(anonymous namespace)::combineKernel<__nv_bfloat16, float>(unsigned long)": "combine",
    "void mori::moe::EpDispatchIntraNodeKernel<__hip_bfloat16>(mori::moe::EpDispatchCombineArgs<__hip_bfloat16>)":
        "dispatch",
    "void mori::moe::EpCombineInterNodeKernel<float>(mori::moe::EpDispatchCombineArgs<float>)": "combine",
    "void mscclpp::ep::internode_ll::dispatch<true>(void*)": "dispatch",
    "void uccl::internode_ll::combine<7168>(void*)": "combine",
    "void ep::internode::dispatch<true, 8>(int4*, float*)": "dispatch",  # another library's EP namespace
    "void ep::intranode::cached_notify_combine<8>(void**, int*)": "combine",
    "notify_dispatch<8>(int const*, int*)": "dispatch",
}


@pytest.mark.parametrize("name", sorted(EP_KERNELS))
def test_expert_parallel_kernels_are_communication_with_their_kind(name: str) -> None:
    assert classify("kernel", name, None, None, False) == COMMUNICATION
    assert expert_parallel_kind(name) == EP_KERNELS[name]
    assert communication_rule(name).reason  # every rule says why


@pytest.mark.parametrize("name", [
    "void deep_ep::layout::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*)",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<dispatch_policy>>(Params)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, Fn)",
    "void moe_align_block_size_kernel<int>(int const*, int*)",
])
def test_local_kernels_are_not_communication(name: str) -> None:
    assert classify("kernel", name, None, None, False) != COMMUNICATION
    assert expert_parallel_kind(name) is None


def test_nvshmem_and_rccl_kernels_are_communication() -> None:
    for name in ("nvshmemi_proxy_kernel", "void nvshmemx_barrier_all_on_stream_kernel()",
                 "void rocshmem::internal::put_kernel()", "mscclpp::allreduce_kernel<float>"):
        assert classify("kernel", name, None, "aten::copy_", False) == COMMUNICATION, name


def _ep_trace(path: Path) -> Path:
    """A DeepSeek-style step: a GEMM, then a DeepEP dispatch and combine (launched under no
    aten op) on a second stream while the compute stream waits: exposed communication."""
    ev: list[dict[str, Any]] = [_step(1, 0, 1000)]
    ev += [_op("aten::mm", 10, 20), _launch(1, 12), _kernel(1, 100, 200, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT")]
    ev += [_launch(2, 40), _kernel(2, 300, 150, "void deep_ep::internode::dispatch<true, 8, 4, 7168>(int4*)", 9)]
    ev += [_launch(3, 50), _kernel(3, 450, 100, "void deep_ep::internode::combine<__nv_bfloat16, 8, 4>(int4*)", 9)]
    ev += [_launch(4, 60), _kernel(4, 560, 10, "void deep_ep::intranode::notify_dispatch<8>(int const*)", 9)]
    return _write(path, ev, deviceProperties=[{"id": 0, "name": "NVIDIA H800"}])


def test_deep_ep_step_counts_communication_exposed_and_collectives(tmp_path: Path) -> None:
    a = analyze([_ep_trace(tmp_path / "ep.json.gz")])
    by = a.category_seconds()
    assert by[COMMUNICATION] == pytest.approx(260e-6)
    assert "other" not in by
    t = a.temporal.iloc[0]
    assert t["exposed_comm_s"] == pytest.approx(260e-6)  # nothing else runs while they do
    kinds = sorted(a.collective_events["collective"])
    assert kinds == ["combine", "dispatch", "dispatch"]
    assert (a.collective_events["bytes"] == -1).all()  # sizes not recorded
    rows = a.to_json()["collective_bandwidth"]
    assert {r["collective"] for r in rows} == {"dispatch", "combine"}
    assert all(r["bytes"] is None for r in rows)
    assert a.device["peaks"] == "h800"


# ---------------------------------------------------------------- 2. JSON Array Format, old keys


def _array_events() -> list[dict[str, Any]]:
    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
        _step(1, 0, 500), _op("aten::add", 10, 20), _launch(1, 12),
        _kernel(1, 50, 40, "void at::native::vectorized_elementwise_kernel<4, AddFunctor>()"),
    ]
    return ev


@pytest.mark.parametrize("closing", ["]", "]\n", "", ",\n"])
def test_a_trace_that_is_one_array_of_events_loads(tmp_path: Path, closing: str) -> None:
    text = "[\n" + ",\n".join(json.dumps(e) for e in _array_events()) + closing
    path = tmp_path / "old.json"
    path.write_text(text)
    rt = L.load(path)
    assert (rt.kind == L.KIND_KERNEL).sum() == 1
    a = analyze([path])
    assert a.category_seconds()["elementwise"] == pytest.approx(40e-6)


def test_an_array_trace_read_in_small_pieces_is_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = [_step(1, 0, 10_000)]
    for i in range(300):
        events += [_op("aten::mul", 10 + 30 * i, 5), _launch(i, 11 + 30 * i),
                   _kernel(i, 20 + 30 * i, 3, "elementwise_kernel")]
    path = tmp_path / "arr.json.gz"
    path.write_bytes(gzip.compress(json.dumps(events).encode()))
    whole = L.load(path)
    monkeypatch.setattr(L, "READ_BYTES", 100)
    small = L.load(path, chunk_bytes=512)
    assert len(whole) == len(small) == 1 + 300 * 3 and whole.names == small.names


def test_an_array_trace_cut_inside_an_event_is_one_error(tmp_path: Path) -> None:
    from primus_perf.base.errors import TraceError

    path = tmp_path / "cut.json"
    path.write_text("[" + json.dumps(_step(1, 0, 5))[:-7])
    with pytest.raises(TraceError, match="truncated"):
        L.load(path)


def test_old_compute_properties_key_names_the_device(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json.gz", _array_events(),
                  computeProperties=[{"id": 0, "name": "Tesla V100-SXM2-16GB", "computeMajor": 7}])
    a = analyze([path])
    assert a.device["name"] == "Tesla V100-SXM2-16GB" and a.device["peaks"] == "v100-sxm2"


# ---------------------------------------------------------------- 3. no GPU events: no roofline


def test_a_trace_without_gpu_events_shows_no_roofline_figures(tmp_path: Path) -> None:
    """An fp32 A100 trace recorded without CUDA activity: the mm's CPU duration would give
    thousands of TFLOP/s; the problem is listed with its FLOPs and CPU time, nothing more."""
    mm = _op("aten::mm", 10, 1.0, **{"Input Dims": [[4096, 4096], [4096, 4096]], "Input type": ["float", "float"],
                                      "Input Strides": [[4096, 1], [4096, 1]]})
    path = _write(tmp_path / "cpu.json.gz", [_step(1, 0, 100), mm],
                  deviceProperties=[{"id": 0, "name": "NVIDIA A100-SXM4-40GB"}])
    a = analyze([path])
    g = a.gemm_problems
    assert len(g) == 1 and g["flops"].iloc[0] == 2 * 4096**3
    assert g[["tflops", "tb_s", "pct_roofline"]].isna().all().all()
    assert any("not shown (they need the device's kernel time)" in n for n in a.notes)
    rec = a.to_json()["gemm_problems"][0]
    assert rec["tflops"] is None and rec["pct_roofline"] is None


# ---------------------------------------------------------------- 4. bytes models within the roofline



def _args(dims: list, types: list, concrete: list | None = None) -> L.ShapeArgs:
    return L.ShapeArgs(dims, types, [], concrete or [""] * len(dims))


N = 32 * 256 * 56 * 56


def test_an_out_form_counts_its_output_once() -> None:
    """clamp_min(self, min, *, out): read self, write out; the functional form the same."""
    out_form = model_bytes(_args([[32, 256, 56, 56], [], [32, 256, 56, 56]], ["float", "Scalar", "float"]),
                           "aten::clamp_min")
    functional = model_bytes(_args([[32, 256, 56, 56], []], ["float", "Scalar"]), "aten::clamp_min")
    assert out_form.bytes == functional.bytes == 2 * N * 4


def test_a_converting_copy_reads_its_source_and_writes_self_in_their_dtypes() -> None:
    m = model_bytes(_args([[16, 559, 1024], [16, 559, 1024], []], ["c10::BFloat16", "float", "Scalar"]),
                    "aten::copy_")
    n = 16 * 559 * 1024
    assert m.bytes == n * 4 + n * 2  # read f32, write bf16
    fill = model_bytes(_args([[1024, 4096], []], ["float", "Scalar"]), "aten::fill_")
    assert fill.bytes == 1024 * 4096 * 4  # written only
    add_ = model_bytes(_args([[1024, 4096], [1024, 4096], []], ["float", "float", "Scalar"]), "aten::add_")
    assert add_.bytes == 3 * 1024 * 4096 * 4  # in place: self read and written, other read


def test_an_indexing_op_reads_the_rows_it_selects() -> None:
    m = model_bytes(_args([[151936, 1024], [], [8944]], ["c10::BFloat16", "Scalar", "long int"], ["", "0", ""]),
                    "aten::index_select")
    assert m.bytes == 2 * 8944 * 1024 * 2 + 8944 * 8


def test_rows_above_the_roofline_are_flagged_with_their_reason() -> None:
    peaks = lookup_peaks("NVIDIA A100-SXM4-80GB")
    flops = np.array([2 * 4096**3, 1e12, 0, 0])
    nbytes = np.array([3 * 4096**2 * 4, 1e9, 2e6, 4e9])
    time_s = np.array([2 * 4096**3 / 60e12, 1e12 / 200e12, 2e6 / 3e12, 4e9 / 3e12])
    dtypes, kinds = ["f32", "f32", "f32", "f32"], ["gemm", "convolution", "memory", "memory"]
    _, pct = roofline(flops, nbytes, time_s, dtypes, peaks)
    assert (pct > 1).all()
    fixed, notes = explain_over(pct, flops, nbytes, time_s, dtypes, kinds, np.ones(4), peaks)
    assert notes == [OVER_NOTES["tf32"], OVER_NOTES["winograd"], OVER_NOTES["cache"], OVER_NOTES["model"]]
    assert fixed[0] == pytest.approx(60 / 156)  # against the TF32 roof
    assert np.isnan(fixed[1:]).all()  # above even the TF32 peak, or the HBM roof by more than 10%: only the caveat
    _, under = explain_over(np.array([0.5]), flops[:1], nbytes[:1], time_s[:1], ["f32"], ["gemm"], np.ones(1), peaks)
    assert under == [""]


def test_regions_get_no_bytes_model_while_their_aten_ops_do(tmp_path: Path) -> None:
    """A compiled region's recorded inputs are its graph's: its own kernels (the rest run under
    the aten ops inside it) are not measured against them."""
    big = {"Input Dims": [[4, 4096, 2798], [4, 4096, 2798]], "Input type": ["float", "float"]}
    ev: list[dict[str, Any]] = [_step(1, 0, 1000), _op("CompiledFunctionBackward", 10, 100, **big),
                                _launch(1, 12), _kernel(1, 200, 5, "triton_poi_fused_mul_0"),
                                _op("aten::mul", 40, 10, **big), _launch(2, 42),
                                _kernel(2, 300, 400, "void at::native::vectorized_elementwise_kernel<4>()")]
    a = analyze([_write(tmp_path / "c.json.gz", ev, deviceProperties=[{"id": 0, "name": "NVIDIA A100-SXM4-80GB"}])])
    h = a.hotspots.set_index("op")
    assert np.isnan(h.loc["CompiledFunctionBackward", "pct_roofline"])
    assert 0 < h.loc["aten::mul", "pct_roofline"] < 1  # 3 x 183 MB in 400 us of a 2 TB/s roof


def test_a_convolution_dtype_is_read_past_its_int_list_arguments(tmp_path: Path) -> None:
    from primus_perf.tracelens.tables import shape_label

    args = _args([[], [32, 256, 14, 14], [256, 256, 3, 3]], ["GenericList", "float", "float"])
    assert shape_label(args) == "32x256x14x14, 256x256x3x3 f32"


# ---------------------------------------------------------------- 5. the peak table


@pytest.mark.parametrize(("name", "key"), [
    ("NVIDIA H800", "h800"), ("NVIDIA GH200 480GB", "gh200"), ("Tesla T4", "t4"),
    ("AMD Instinct MI350X", "mi350x"), ("NVIDIA L40S", "l40s"), ("NVIDIA A10G", None), ("NVIDIA A10", "a10"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"), ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A800-SXM4-80GB", "a800-sxm"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA B300 SXM6 AC", "b300"),
    ("AMD Instinct MI100", "mi100"), ("AMD Instinct MI250X/MI250", "mi250"), ("NVIDIA L40", "l40"),
    ("NVIDIA A30", "a30"), ("NVIDIA A40", "a40"), ("NVIDIA RTX A6000", "rtx-a6000"),
])
def test_devices_of_three_generations_have_peaks(name: str, key: str | None) -> None:
    p = lookup_peaks(name)
    assert (p.key if p else None) == key  # A10G: no vendor datasheet, no row (never a guessed roof)


def test_every_peak_row_is_sourced_dense_and_ordered() -> None:
    keys = [r.key for r in PEAK_TABLE]
    assert len(keys) == len(set(keys))
    for r in PEAK_TABLE:
        assert r.source and r.hbm_tb_s > 0 and r.tflops["f32"] > 0, r.key
        assert lookup_peaks(r.key.replace("-", " ").upper()) is not None or r.key  # patterns compile
        # dense tensor peaks: fp8 twice bf16, tf32 half of bf16, where the device has them
        if "f8e4m3" in r.tflops:
            assert r.tflops["f8e4m3"] == pytest.approx(2 * r.tflops["bf16"], rel=0.02), r.key
        if "tf32" in r.tflops and r.key not in ("l40",):
            assert r.tflops["tf32"] == pytest.approx(r.tflops["bf16"] / 2, rel=0.02), r.key


# ---------------------------------------------------------------- 9. CSV and Excel export


def test_every_table_exports_as_csv_and_as_one_sheet_each(tmp_path: Path) -> None:
    import pandas as pd

    from primus_perf.tracelens.export import analysis_tables, write_csv, write_xlsx

    a = analyze([_ep_trace(tmp_path / "ep.json.gz")])
    tables = analysis_tables(a)
    assert {"kernels", "hotspots", "breakdown", "temporal", "collective_events", "collective_bandwidth",
            "gemm_problems", "totals", "device"} <= set(tables)
    paths = write_csv(a, tmp_path / "csv")
    assert {p.stem for p in paths} == set(tables)
    k = pd.read_csv(tmp_path / "csv" / "kernels.csv")
    assert len(k) == len(a.kernels) and set(k["category"]) == {"gemm", COMMUNICATION}
    book = write_xlsx(a, tmp_path / "a.xlsx")
    sheets = pd.read_excel(book, sheet_name=None)
    assert set(sheets) == set(tables)
    assert len(sheets["kernels"]) == len(a.kernels)
    assert sheets["collective_events"]["collective"].tolist() == a.collective_events["collective"].tolist()


def test_the_analyze_command_writes_csv_and_xlsx(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from primus_perf.cli.profile import app

    trace = _ep_trace(tmp_path / "ep.json.gz")
    r = CliRunner().invoke(app, ["analyze", str(trace), "--csv", str(tmp_path / "out"), "--xlsx",
                                 str(tmp_path / "out.xlsx")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "hotspots.csv").is_file() and (tmp_path / "out.xlsx").is_file()

    from primus_perf.cli.common import run_app

    with pytest.raises(SystemExit) as exc:
        run_app(app, ["analyze", str(trace), "--xlsx", str(tmp_path / "no" / "dir" / "x.xlsx")])
    assert exc.value.code == 2
