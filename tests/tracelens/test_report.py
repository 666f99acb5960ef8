from __future__ import annotations

import copy
import gzip
import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from primus_perf.tracelens import report as rp
from primus_perf.tracelens.analyze import Analysis, analyze
from primus_perf.tracelens.report_html import render_html, write_html

TRACES = Path(__file__).parents[1] / "data" / "traces"
H100 = TRACES / "h100_llama3-8b_l2_s1024_cudnn.json.gz"
RUN = TRACES / "h100_llama3-8b_l4_s4096_run"


@pytest.fixture(scope="module")
def h100() -> Analysis:
    return analyze([H100])


@pytest.fixture(scope="module")
def run() -> Analysis:
    return analyze([RUN])


# --------------------------------------------------------------------------- headless Chromium


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    why = "chromium is not installed (Debian: apt-get install chromium; scripts/test.sh as root installs it)"
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"{why}: CI runs the browser tests")
    pytest.skip(f"{why}: the report's browser test is skipped")


def _chromium(args: list[str], profile: str, timeout: int = 90) -> subprocess.CompletedProcess[str]:
    cmd = [chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@dataclass
class BrowserCheck:
    selfcheck: str
    console_errors: list[str]
    charts: list[dict[str, Any]]
    chart_ink: dict[str, float]  # chart name -> fraction of non-background pixels
    dom: str
    section_ink: dict[str, float]  # section title -> fraction of pixels that are not plain white


def check_in_chromium(html_path: Path, width: int = 1200, height: int = 5000) -> BrowserCheck:
    """Open the page headless: DOM after scripts ran, console errors, and a screenshot."""
    from PIL import Image

    url = html_path.resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="primus-chromium-") as tmp:
        size = f"--window-size={width},{height}"
        dom = _chromium(["--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", size,
                         "--dump-dom", url], tmp + "/p1")
        shot = Path(tmp) / "shot.png"
        _chromium([size, f"--screenshot={shot}", url], tmp + "/p2")
        assert shot.is_file(), "chromium wrote no screenshot"
        img = Image.open(shot).convert("RGB")
        pixels = np.asarray(img).astype(np.int32)
    # The page logs nothing when all is well: every console message (errors, uncaught
    # exceptions, the self-check's failure report) counts against it.
    errors = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    m = re.search(r'data-selfcheck="([^"]*)"', dom.stdout)
    charts_m = re.search(r"data-charts=\"([^\"]*)\"", dom.stdout)
    charts = json.loads(charts_m.group(1).replace("&quot;", '"')) if charts_m else []
    def region(r: dict[str, Any]) -> np.ndarray:
        x0, y0 = int(r["x"]), int(r["y"])
        x1, y1 = min(x0 + int(r["w"]), pixels.shape[1]), min(y0 + int(r["h"]), pixels.shape[0])
        return pixels[y0:y1, x0:x1]

    ink = {}
    for c in charts:
        px = region(c)
        # "ink": pixels that are clearly coloured (not white/grey background or gridlines)
        ink[c["name"]] = float(((px.max(axis=2) - px.min(axis=2)) > 40).mean()) if px.size else 0.0
    sections_m = re.search(r"data-sections=\"([^\"]*)\"", dom.stdout)
    sections = json.loads(html.unescape(sections_m.group(1))) if sections_m else []
    # text, rules, bars: anything darker than the near-white section background
    section_ink = {}
    for sec in sections:
        px = region(sec)
        section_ink[sec["title"]] = float((px.min(axis=2) < 200).mean()) if px.size else 0.0
    return BrowserCheck(m.group(1) if m else "", errors, charts, ink, dom.stdout, section_ink)


# --------------------------------------------------------------------------- tests


def test_report_data_of_a_real_trace(h100: Analysis) -> None:
    d = rp.report_from_analysis(h100)
    h = d["header"]
    assert h["device"] == "NVIDIA H100 80GB HBM3" and h["ranks"] == [0] and h["steps"] == 2
    assert h["tokens_per_s"] is None and h["mfu"] is None  # a bare trace: no manifest
    # one step time: the temporal breakdown's span
    assert h["step_time_ms"] == pytest.approx(h100.temporal["span_s"].median() * 1e3)
    assert h["gpu_kernel_ms"] == pytest.approx(h100.totals["gpu_kernel_s_per_step"] * 1e3)
    rows = d["breakdown"]["rows"]
    assert [r["label"] for r in rows] == ["rank 0 step 1", "rank 0 step 2"]
    assert d["categories"][0] == "optimizer" and {"gemm", "attention_fwd", "attention_bwd"} <= set(d["categories"])
    # hotspot shares sum to one; per-step times sum to the mean step's GPU event time
    assert sum(r["share"] for r in d["hotspots"]) == pytest.approx(1.0)
    mean_step = np.mean([r["total_ms"] for r in rows])
    assert sum(r["time_ms"] for r in d["hotspots"]) == pytest.approx(mean_step) == h["gpu_kernel_ms"]
    # calls are op calls per step, as in the analysis: each of the 2 layers' QKV GEMMs once
    mm = next(r for r in d["hotspots"] if r["op"] == "aten::mm" and r["shape"] == "1024x4096, 4096x6144 bf16")
    assert mm["calls"] == 2.0
    assert [r["calls"] for r in d["gemm"]] == list(h100.gemm_problems["calls"])
    # roofline against the H100 bf16 roofs
    assert d["roofline"]["peak_tflops"] == pytest.approx(989.4) and d["roofline"]["hbm_tb_s"] == 3.35
    assert len(d["roofline"]["points"]) == len(d["gemm"]) + len(d["attention"]) == 17
    assert all(0.5 < r["pct_roofline"] < 1.0 for r in d["gemm"])  # fractions, as the analysis gives them
    assert d["gemm"][0]["time_ms"] >= d["gemm"][1]["time_ms"]
    assert d["gemm"][0]["tuned"] is None  # no cache given
    tl = d["timeline"]
    busy = sum(seg[3] for s in tl["streams"] for seg in s["segments"])
    one_step = next(r["total_ms"] for r in rows if r["step"] == tl["step"])
    assert busy / 1e3 == pytest.approx(one_step)


def test_report_pages_stay_small(run: Analysis, tmp_path: Path) -> None:
    d = rp.report_from_analysis(run)
    for s in d["timeline"]["streams"]:
        assert len(s["segments"]) <= rp.TIMELINE_BINS + 1
    out = write_html(d, tmp_path / "run.html")
    assert out.stat().st_size < 1_000_000


def test_html_is_self_contained(h100: Analysis) -> None:
    page = render_html(rp.report_from_analysis(h100))
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<script src" not in page and "@import" not in page


def test_script_end_tag_in_data_is_escaped(h100: Analysis) -> None:
    a = copy.copy(h100)
    a.hotspots = h100.hotspots.copy()
    a.hotspots.loc[0, "shape"] = "</script><script>alert(1)</script>"
    page = render_html(rp.report_from_analysis(a))
    assert page.count("</script>") == 2  # the data block's and the code block's own


def test_report_of_a_run_without_gpu_kernels_shows_its_problems_with_cpu_times(tmp_path: Path) -> None:
    from primus_perf.base.errors import UserError

    trace = json.loads(gzip.decompress(H100.read_bytes()))
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") not in ("kernel", "gpu_memcpy",
                                                                                      "gpu_memset")]
    cpu_only = tmp_path / "cpu_only.json"
    cpu_only.write_text(json.dumps(trace))
    data = rp.build_report([cpu_only])
    assert data["header"]["cpu_only"] and data["timeline"] is None and data["tune_next"] == []
    assert {r["key"] for r in data["gemm"]} == {r["key"] for r in rp.build_report([H100])["gemm"]}
    assert all(r["time_ms"] > 0 for r in data["gemm"])
    # neither GPU kernels nor ops with shapes: nothing to report
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") != "cpu_op"]
    cpu_only.write_text(json.dumps(trace))
    with pytest.raises(UserError, match="nothing to (report|analyze)"):
        rp.build_report([cpu_only])


def test_many_ranks_breakdown_becomes_per_rank_means(monkeypatch: pytest.MonkeyPatch) -> None:
    a = analyze([TRACES / "h200_tp2"])  # 2 ranks x 2 steps
    monkeypatch.setattr(rp, "MAX_BREAKDOWN_ROWS", 3)
    rows = rp.report_from_analysis(a)["breakdown"]["rows"]
    assert [r["label"] for r in rows] == ["rank 0 (mean of 2 steps)", "rank 1 (mean of 2 steps)"]
    want = a.breakdown[a.breakdown["rank"] == 1].groupby("step")["seconds"].sum().mean() * 1e3
    assert rows[1]["total_ms"] == pytest.approx(want)


def test_chromium_harness_sees_script_errors(h100: Analysis, tmp_path: Path) -> None:
    page = render_html(rp.report_from_analysis(h100))
    bad = tmp_path / "bad.html"
    bad.write_text(page.replace('<script>"use strict";', '<script>"use strict"; undefinedFunction();'))
    res = check_in_chromium(bad)
    assert any("undefinedFunction" in e for e in res.console_errors)
    assert res.selfcheck == ""  # the renderer never ran


# --------------------------------------------------------------------------- a real run


def _cache_for(problem_row: pd.Series, device: str, path: Path, speedup: float) -> Path:
    from primus_perf.cache.store import CacheEntry, TuningCache

    p = problem_row["problem"]
    h100 = {"name": device, "vendor": "nvidia", "arch": "sm_90", "compute_units": 132}
    mi300 = {"name": "AMD Instinct MI300X", "vendor": "amd", "arch": "gfx942", "compute_units": 304}
    e = CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(), device=h100,
                   versions={"cublasLt": "13.1.0"}, solution={"config": {"source": "cublaslt"}, "blob": b""},
                   times={"tuned_ms": 1.0, "default_ms": speedup}, tuner_version="test")
    other = CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(), device=mi300,
                       versions={"hipblaslt": "1"}, solution={"config": {}, "blob": b""},
                       times={"tuned_ms": 1.0, "default_ms": 9.0}, tuner_version="test", created=1.7e9)
    TuningCache(path).put_many([e, other])
    return path


def test_report_of_a_real_h100_run_in_chromium(run: Analysis, tmp_path: Path) -> None:
    """The committed H100 run (trace + manifest of `primus-profile run`): every section is
    filled from the real analysis, the page renders without console errors, tables sort."""
    top = run.gemm_problems.sort_values("time_s", ascending=False).iloc[0]
    cache = _cache_for(top, "NVIDIA H100 80GB HBM3", tmp_path / "cache.json", 1.25)
    d = rp.build_report([RUN], cache=cache)
    # the committed run predates BLAS-Lt versions in the manifest: its GEMM entry matches by device
    assert d["cache"] == {"path": str(cache), "entries": 2, "versions_unchecked": 1}
    h = d["header"]
    assert h["device"] == "NVIDIA H100 80GB HBM3" and h["steps"] == 3
    assert h["tokens_per_s"] > 40000 and 0.3 < h["mfu"] < 0.6  # from the manifest
    assert h["wall_step_time_ms"] == pytest.approx(run.manifest["step_time_s"] * 1e3)
    assert h["versions"]["torch"].startswith("2.11")
    assert len(d["gemm"]) == 15 and len(d["attention"]) == 2
    assert sorted(r["direction"] for r in d["attention"]) == ["bwd", "fwd"]
    marked = [r for r in d["gemm"] if r["tuned"]]
    assert all(r["tuned"] is False and r["speedup"] is None for r in d["gemm"] if r not in marked)
    assert [r["key"] for r in marked] == [top["problem"].key()] and marked[0]["speedup"] == pytest.approx(1.25)
    assert len(d["roofline"]["points"]) == 17 and d["roofline"]["peak_tflops"] == pytest.approx(989.4)
    # the timeline of the chosen step accounts for all of its kernel time
    tl = d["timeline"]
    busy = sum(seg[3] for s in tl["streams"] for seg in s["segments"])
    step_ms = next(r["total_ms"] for r in d["breakdown"]["rows"] if r["step"] == tl["step"])
    assert busy / 1e3 == pytest.approx(step_ms, rel=1e-6)
    assert 20 < sum(len(s["segments"]) for s in tl["streams"]) <= rp.TIMELINE_BINS
    page = write_html(d, tmp_path / "report.html")
    res = check_in_chromium(page)
    assert res.console_errors == []
    # charts: temporal, breakdown, roofline, timeline, critical path; tables: those of the step
    # time, tune next, hotspots, GEMM and attention problems, then the host side (critical
    # path, launches, launch delays, synchronizing calls, CPU against GPU) and kernel efficiency
    assert res.selfcheck == "ok charts=5 tables=11", res.selfcheck
    assert res.chart_ink["breakdown"] > 0.1 and res.chart_ink["timeline"] > 0.05, res.chart_ink
    assert res.chart_ink["roofline"] > 0.003, res.chart_ink
    for text in ("47,7", "42.7%", "aten::_scaled_dot_product_cudnn_attention_backward", ">bwd<", ">tuned<", "1.25×",
                 "cached speedup", ">GPU step time<", ">wall-clock step<", "174 ms", "47,757"):
        assert text in res.dom, text


def test_cache_marks_follow_the_runtime_rule_device_and_library_versions(tmp_path: Path) -> None:
    from primus_perf.cache.store import CacheEntry, TuningCache
    from primus_perf.problems import GemmProblem

    dev = {"name": "NVIDIA H100 80GB HBM3", "vendor": "nvidia", "arch": "sm_90", "compute_units": 132}
    other_dev = {**dev, "name": "NVIDIA H200"}
    probs = [GemmProblem.from_row_major(1024, 1024 * (i + 1), 1024, b_transposed=True) for i in range(3)]

    def entry(p, device, lib):
        return CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(), device=device,
                          versions={"cublasLt": lib}, solution={"config": {"name": "heur1"}, "blob": b"x"},
                          times={"tuned_ms": 1.0, "default_ms": 1.1})

    cache = tmp_path / "cache.json"
    TuningCache(cache).put_many([entry(probs[0], dev, "13.1.0"), entry(probs[1], dev, "12.0.0"),
                                 entry(probs[2], other_dev, "13.1.0")])
    marks, n, unchecked = rp.cache_marks(cache, dev["name"], {"cublasLt": "13.1.0", "torch": "2.11.0"})
    assert n == 3 and set(marks) == {probs[0].key()} and unchecked == 0
    assert marks[probs[0].key()] == pytest.approx(1.1)
    # a run that did not record its BLAS-Lt version: matched by device, and said so
    marks, _, unchecked = rp.cache_marks(cache, dev["name"], {"torch": "2.11.0"})
    assert set(marks) == {probs[0].key(), probs[1].key()} and unchecked == 2


def test_cache_marks_take_the_entry_the_cache_ranks_first(tmp_path: Path) -> None:
    """Two entries of one problem that the run matches (it did not record the BLAS-Lt
    version), created at the same time: the cache's order (:meth:`CacheEntry.rank`) puts the
    faster tuned time first, whatever their order in the file."""
    from primus_perf.cache.store import CacheEntry, TuningCache
    from primus_perf.problems import GemmProblem

    dev = {"name": "NVIDIA H100 80GB HBM3", "vendor": "nvidia", "arch": "sm_90", "compute_units": 132}
    p = GemmProblem.from_row_major(1024, 1024, 1024, b_transposed=True)

    def entry(lib: str, tuned_ms: float) -> CacheEntry:
        return CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(), device=dev, versions={"cublasLt": lib},
                          solution={"config": {"name": lib}, "blob": b"x"},
                          times={"tuned_ms": tuned_ms, "default_ms": 2.0}, created=1000.0)

    cache = tmp_path / "cache.json"
    TuningCache(cache).put_many([entry("13.1.0", 0.5), entry("13.0.0", 1.0)])  # the faster one first in the file
    assert [e.times["tuned_ms"] for e in TuningCache(cache).entries()] == [0.5, 1.0]
    marks, n, unchecked = rp.cache_marks(cache, dev["name"], {"torch": "2.11.0"})
    assert n == 2 and unchecked == 1 and marks == {p.key(): pytest.approx(4.0)}
