"""Bad traces, one class each: events out of range or written twice are dropped with a count
in one note; inputs that broke the reader (huge ids, deep nesting, a CPU-only rank beside a
GPU rank, a manifest of the wrong shape, NaN, a lone surrogate) give the right message or an
analysis, never a traceback; manifest paths stay in the run folder; exported cells are never
formulas; ``report`` and ``analyze`` count the same steps."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from test_tracelens_unseen import _kernel, _launch, _op, _step, _write

from primus_perf.base.errors import TraceError
from primus_perf.tracelens.analyze import analyze
from primus_perf.tracelens.export import write_csv
from primus_perf.tracelens.report import build_report

GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"
MM_ARGS = {"Input Dims": [[1024, 4096], [4096, 4096]], "Input type": ["c10::BFloat16", "c10::BFloat16"],
           "Input Strides": [[4096, 1], [4096, 1]], "Concrete Inputs": ["", ""]}


def _steps(n: int = 2, name: str = "aten::mm") -> list[dict[str, Any]]:
    """``n`` steps of one GEMM each (1 ms apart), with shapes."""
    ev: list[dict[str, Any]] = []
    for i in range(n):
        t = 1_000_000.0 + 1000 * i
        ev += [_step(i + 1, t, 900), _op(name, t + 10, 30, **MM_ARGS), _launch(i + 1, t + 12),
               _kernel(i + 1, t + 100, 500, GEMM)]
    return ev


def _h100(path: Path, events: list[dict[str, Any]]) -> Path:
    return _write(path, events, deviceProperties=[{"id": 0, "name": "NVIDIA H100 80GB HBM3"}])


@pytest.mark.parametrize("field,value", [("dur", -500.0), ("dur", 1e30), ("ts", 1e300), ("ts", -1_001_100.0)])
def test_events_out_of_range_are_dropped_with_a_count(tmp_path: Path, field: str, value: float) -> None:
    ev = _steps(2)
    ev[7][field] = value  # the second step's kernel
    a = analyze([_h100(tmp_path / "t.json.gz", ev)])
    assert a.totals["gemm_s_per_step"] == pytest.approx(500e-6 / 2)  # one kernel of two steps left
    notes = [n for n in a.notes if n.startswith("dropped")]
    assert notes == ["dropped 1 event(s): 1 a negative, non-finite or out-of-range ts or dur"]


def test_a_trace_written_twice_counts_each_event_once(tmp_path: Path) -> None:
    ev = _steps(2)
    once = analyze([_h100(tmp_path / "once.json.gz", ev)])
    twice = analyze([_h100(tmp_path / "twice.json.gz", ev + json.loads(json.dumps(ev)))])
    assert twice.totals["gemm_s_per_step"] == once.totals["gemm_s_per_step"] == pytest.approx(500e-6)
    assert twice.gemm_problems["calls"].tolist() == once.gemm_problems["calls"].tolist() == [1.0]
    assert [n for n in twice.notes if n.startswith("dropped")] == [
        "dropped 8 event(s): 8 duplicated (the same event written again)"]


def test_host_ops_with_the_same_span_are_not_duplicates(tmp_path: Path) -> None:
    """Two host ops of one name at one microsecond (nested, whole-microsecond clocks) are two
    calls when nothing else in the trace repeats."""
    ev = [*_steps(1), _op("aten::empty", 1_000_050, 0), _op("aten::empty", 1_000_050, 0)]
    a = analyze([_h100(tmp_path / "t.json.gz", ev)])
    assert not any(n.startswith("dropped") for n in a.notes)
    assert a.cpu_ops.set_index("op").loc["aten::empty", "calls"] == 2


def test_huge_ids_and_dims_are_dropped_for_their_event(tmp_path: Path) -> None:
    ev = _steps(2)
    ev[6]["args"]["correlation"] = 2**70  # the second step's launch
    ev[5]["args"]["Input Dims"] = [[2**40, 2**40], [2**40, 2**40]]  # its op
    a = analyze([_h100(tmp_path / "t.json.gz", ev)])
    assert "dropped 1 out-of-range `args.correlation` value(s) for their events" in a.notes
    assert "dropped 2 out-of-range `Input Dims` value(s) for their events" in a.notes
    assert a.totals["gemm_flops_per_step"] == pytest.approx(2 * 1024 * 4096 * 4096 / 2)  # the first step's


def test_deep_nesting_nan_and_lone_surrogates_get_the_right_message(tmp_path: Path) -> None:
    text = json.dumps({"traceEvents": _steps(2)})
    deep = tmp_path / "deep.json"
    deep.write_text(text.replace('[[1024, 4096], [4096, 4096]]', "[" * 100_000 + "]" * 100_000, 1))
    with pytest.raises(TraceError, match=r"deep.json: malformed trace events \(nested more than \d+ levels deep\)"):
        analyze([deep])
    nan = tmp_path / "nan.json"
    nan.write_text(text.replace('"ts": 1000100.0', '"ts": NaN', 1))
    with pytest.raises(TraceError, match=r"nan.json: malformed trace events \(JSON is malformed: invalid character"):
        analyze([nan])
    lone = tmp_path / "lone.json"
    lone.write_text(text.replace('"name": "aten::mm"', '"name": "aten::mm\\ud800"', 1))
    a = analyze([lone])
    assert "replaced 1 lone-surrogate `string` value(s) for their events" in a.notes
    assert a.totals["gemm_s_per_step"] == pytest.approx(500e-6)


def test_a_cpu_only_rank_beside_a_gpu_rank(tmp_path: Path) -> None:
    gpu = _h100(tmp_path / "rank0.json.gz", _steps(2))
    cpu = _write(tmp_path / "rank1.json.gz", [e for e in _steps(2) if e["cat"] != "kernel"])
    a = analyze([gpu, cpu])
    assert a.ranks == [0, 1] and a.cpu_ranks == [1]
    assert a.totals["gemm_s_per_step"] == pytest.approx(500e-6)  # over the GPU rank's steps
    assert a.gemm_problems["time_s"].sum() == pytest.approx(500e-6)  # no CPU time among GPU times
    assert any(n.startswith("rank(s) 1: no GPU events") for n in a.notes)
    build_report([gpu, cpu])


BAD_VALUES = [[], "x", 3, None, {"a": []}, [1, "2"], -1.5]


@pytest.mark.parametrize("key", ["overhead", "config", "steps", "device", "versions", "world_size", "traces",
                                 "step_time_s", "tokens_per_s", "mfu", "interrupted", "measured", "fp8_layers"])
def test_manifest_fields_of_any_type_give_an_analysis(tmp_path: Path, key: str) -> None:
    _h100(tmp_path / "rank0.json.gz", _steps(2))
    for value in BAD_VALUES:
        manifest = {"schema": "primus-perf-run/1", "traces": {"0": "rank0.json.gz"}, key: value}
        if key == "traces":
            manifest[key] = {"0": "rank0.json.gz"} if not isinstance(value, dict) else value
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        try:
            a = analyze([tmp_path])
        except TraceError as exc:  # only a manifest that lists missing traces is refused
            assert key == "traces" and "missing" in str(exc)
            continue
        json.dumps(a.to_json(details=True), default=str)
        build_report([tmp_path])


@pytest.mark.parametrize("name", ["../../x.json", "/etc/passwd", "sub/../../x.json"])
def test_manifest_paths_stay_inside_the_run_folder(tmp_path: Path, name: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"traces": {"0": name}}))
    with pytest.raises(TraceError, match="outside its run folder"):
        analyze([run])


def test_exported_cells_are_never_formulas(tmp_path: Path) -> None:
    ev = _steps(1, name="=HYPERLINK(\"http://x\")")
    ev[3]["name"] = "@SUM(A1)"  # the kernel
    a = analyze([_h100(tmp_path / "t.json.gz", ev)])
    cells = []
    for f in write_csv(a, tmp_path / "csv"):
        with open(f, newline="") as fh:
            cells += [c for row in csv.reader(fh) for c in row]
    assert not [c for c in cells if c[:1] in ("=", "+", "@")]
    assert "'=HYPERLINK(\"http://x\")" in cells and "'@SUM(A1)" in cells


def test_report_and_analyze_count_the_same_steps_on_a_graph_trace(tmp_path: Path) -> None:
    """A torch.compile + hipGraph trace without ProfilerStep markers: one step in both."""
    ev = [_op("CompiledFunction", 10, 100), {**_launch(1, 20), "name": "hipGraphLaunch"},
          _kernel(1, 50, 30, "triton_poi_fused_add_0"), _kernel(1, 90, 40, GEMM)]
    path = _write(tmp_path / "graph.json.gz", ev)
    a = analyze([path])
    assert a.n_steps == build_report([path])["header"]["steps"] == 1
