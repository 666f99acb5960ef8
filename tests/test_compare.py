from __future__ import annotations

from pathlib import Path

import pytest

from primus_perf.errors import UserError
from primus_perf.tracelens import compare as cmp
from primus_perf.tracelens.report_html import write_html
from test_report import check_in_chromium, synthetic_analysis


def _pair():
    base = synthetic_analysis(seed=1)
    cand = synthetic_analysis(seed=1, scale={"gemm": 0.8})
    return base, cand


def test_faster_gemms_give_a_faster_verdict() -> None:
    base, cand = _pair()
    d = cmp.compare_analyses(base, cand)
    bd = {r["category"]: r for r in d["breakdown"]}
    assert bd["gemm"]["rel"] == pytest.approx(-0.2, abs=1e-9)
    assert bd["attention"]["rel"] == pytest.approx(0.0, abs=1e-12)
    assert d["header"]["step_change"] < -0.01
    assert d["verdict"].startswith("candidate ") and "faster per step" in d["verdict"]
    assert "gemm -20.0%" in d["verdict"] and "attention +0.0%" in d["verdict"]
    assert d["only_in_base"] == [] and d["only_in_candidate"] == []
    assert all(r["side"] == "both" for r in d["ops"])
    # the largest absolute delta comes first and is a GEMM
    assert d["ops"][0]["category"] == "gemm" and d["ops"][0]["delta_ms"] < 0


def test_matching_ignores_kernel_names_and_reports_one_sided_ops() -> None:
    base, cand = _pair()
    cand.kernels["name"] = cand.kernels["name"] + "_v2_renamed"
    cand.kernels.loc[cand.kernels["op"] == "aten::add", ["op", "shape"]] = ["aten::add_", "4096x4096"]
    d = cmp.compare_analyses(base, cand)
    assert all(r["side"] == "both" for r in d["ops"] if r["op"] == "aten::mm")
    assert [r["op"] for r in d["only_in_base"]] == ["aten::add"]
    assert [r["op"] for r in d["only_in_candidate"]] == ["aten::add_"]
    only = d["only_in_base"][0]
    assert only["candidate_ms"] == 0.0 and only["rel"] is None and only["base_ms"] > 0


def test_identical_runs_compare_equal() -> None:
    base, _ = _pair()
    d = cmp.compare_analyses(base, base)
    assert d["header"]["step_change"] == 0.0
    assert d["verdict"].startswith("candidate as fast as base")
    assert all(r["delta_ms"] == 0 for r in d["ops"])


def test_different_step_counts_compare_per_step() -> None:
    base = synthetic_analysis(seed=3, steps=2)
    cand = synthetic_analysis(seed=3, steps=4)
    d = cmp.compare_analyses(base, cand)
    assert len(d["steps"]) == 4 and d["steps"][3]["base_ms"] is None
    bd = {r["category"]: r for r in d["breakdown"]}
    assert abs(bd["gemm"]["rel"]) < 0.1  # same distribution, per-step normalised


def test_trace_files_of_a_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    for name in ("traces/rank1.pt.trace.json", "traces/rank0.pt.trace.json.gz", "manifest.json"):
        (run / name).write_text("{}")
    files = cmp.trace_files(run)
    assert [Path(f).name for f in files] == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json"]
    with pytest.raises(UserError, match="not found"):
        cmp.trace_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no trace files"):
        cmp.trace_files(tmp_path / "empty")


def test_diff_html_renders_in_chromium(tmp_path: Path) -> None:
    base, cand = _pair()
    d = cmp.compare_analyses(base, cand, base_label="runs/base", candidate_label="runs/tuned")
    res = check_in_chromium(write_html(d, tmp_path / "diff.html"))
    assert res.console_errors == []
    assert res.selfcheck.startswith("ok"), res.selfcheck
    assert [c["name"] for c in res.charts] == ["breakdown-delta"]
    assert res.chart_ink["breakdown-delta"] > 0.02
    assert "faster per step" in res.dom


LOOP = Path(__file__).parents[1] / "benchmarks" / "results" / "closed_loop_h100"


def test_real_runs_with_and_without_a_tuning_cache(tmp_path: Path) -> None:
    """Two H100 runs of the trainer, the second with tuned GEMMs routed to cuBLASLt
    (``primus_perf::gemm`` ops): every op matches its counterpart by shape."""
    d = cmp.compare(LOOP / "base", LOOP / "tuned")
    assert d["only_in_base"] == [] and d["only_in_candidate"] == []
    gemm = [r for r in d["ops"] if r["category"] == "gemm"]
    assert len(gemm) >= 12 and all(r["op"] == "aten::mm" and r["side"] == "both" for r in gemm)
    assert d["verdict"].startswith("candidate ") and "; gemm " in d["verdict"] and ", attention " in d["verdict"]
    assert d["header"]["base_steps"] == d["header"]["candidate_steps"] == 3
    res = check_in_chromium(write_html(d, tmp_path / "diff.html"))
    assert res.console_errors == [] and res.selfcheck.startswith("ok"), (res.console_errors, res.selfcheck)
    assert res.chart_ink["breakdown-delta"] > 0.02, res.chart_ink
    assert d["verdict"] in res.dom
