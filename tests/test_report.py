from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from primus_perf.problems import AttentionProblem, GemmProblem
from primus_perf.tracelens import report as rp
from primus_perf.tracelens.report_html import render_html, write_html

CATS = ["gemm", "attention", "elementwise", "nccl"]


@dataclass
class FakeAnalysis:
    """The attributes of tracelens.analyze.Analysis that the report reads."""

    kernels: pd.DataFrame
    gemm_problems: pd.DataFrame
    attention_problems: pd.DataFrame
    hotspots: pd.DataFrame = field(default_factory=pd.DataFrame)
    summary: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return self.summary


def synthetic_kernels(n_per_step: int = 400, ranks: int = 2, steps: int = 3, seed: int = 0,
                      scale: dict[str, float] | None = None) -> pd.DataFrame:
    """A kernel table like ``Analysis.kernels``: four categories, two streams, back to back."""
    rng = np.random.default_rng(seed)
    scale = scale or {}
    shapes = {"gemm": ["4096x4096x4096", "4096x14336x4096", "4096x4096x14336"],
              "attention": ["b4 h32/8 s4096 d128"], "elementwise": ["4096x4096"], "nccl": [""]}
    ops = {"gemm": "aten::mm", "attention": "aten::_scaled_dot_product_flash_attention",
           "elementwise": "aten::add", "nccl": "nccl:all_reduce"}
    i = np.arange(n_per_step)
    cat_idx = np.where(i % 7 == 0, 0, i % 4)
    cats = np.array(CATS, dtype=object)[cat_idx]
    shape = np.array([shapes[c][j % len(shapes[c])] for j, c in enumerate(cats)], dtype=object)
    op = np.array([ops[c] for c in CATS], dtype=object)[cat_idx]
    name = np.array([f"kernel_{c}_{j % 3}" for j, c in enumerate(cats)], dtype=object)
    stream = np.where(cat_idx == 3, 20, 7)
    factor = np.array([scale.get(c, 1.0) for c in CATS])[cat_idx]
    frames = []
    for rank in range(ranks):
        for step in range(steps):
            dur = rng.uniform(5, 60, n_per_step) * factor
            gap = rng.uniform(0, 8, n_per_step)
            ts = 1e6 * step + np.concatenate(([0.0], np.cumsum(dur + gap)[:-1]))
            frames.append(pd.DataFrame({
                "rank": rank, "step": step, "stream": stream, "ts_us": ts, "dur_us": dur,
                "name": name, "category": cats, "op": op, "shape": shape,
            }))
    return pd.concat(frames, ignore_index=True)


def synthetic_analysis(**kw: Any) -> FakeAnalysis:
    k = synthetic_kernels(**kw)
    gp = [GemmProblem.from_row_major(4096, 4096, 4096), GemmProblem.from_row_major(4096, 14336, 4096)]
    gemm = pd.DataFrame({
        "problem": gp, "calls": [300, 300], "time_s": [0.02, 0.03],
        "flops": [p.flops for p in gp], "bytes": [p.bytes_moved for p in gp],
        "arithmetic_intensity": [p.arithmetic_intensity for p in gp],
        "tflops": [610.0, 702.0], "pct_roofline": [0.62, 0.71],
    })
    ap = [AttentionProblem(4, 32, 8, 4096, 4096, 128)]
    attn = pd.DataFrame({
        "problem": ap, "calls": [100], "time_s": [0.01], "flops": [ap[0].forward_flops],
        "bytes": [ap[0].bytes_moved], "arithmetic_intensity": [ap[0].arithmetic_intensity],
        "tflops": [401.0], "pct_roofline": [40.5],
    })
    summary = {"device": {"name": "NVIDIA H100 80GB HBM3"}, "versions": {"torch": "2.11.0", "cuda": "13.0"},
               "manifest": {"tokens_per_s": 12345.0, "mfu": 0.41, "step_time_s": 1.2}}
    return FakeAnalysis(k, gemm, attn, summary=summary)


# --------------------------------------------------------------------------- headless Chromium


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("chromium is not installed (Debian: apt-get install chromium); the report test needs it")


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
    ink = {}
    for c in charts:
        x0, y0 = int(c["x"]), int(c["y"])
        x1, y1 = min(x0 + int(c["w"]), pixels.shape[1]), min(y0 + int(c["h"]), pixels.shape[0])
        region = pixels[y0:y1, x0:x1]
        if region.size == 0:
            ink[c["name"]] = 0.0
            continue
        # "ink": pixels that are clearly coloured (not white/grey background or gridlines)
        spread = region.max(axis=2) - region.min(axis=2)
        ink[c["name"]] = float((spread > 40).mean())
    return BrowserCheck(m.group(1) if m else "", errors, charts, ink, dom.stdout)


# --------------------------------------------------------------------------- tests


def test_report_data_from_analysis() -> None:
    d = rp.report_from_analysis(synthetic_analysis())
    h = d["header"]
    assert h["device"] == "NVIDIA H100 80GB HBM3"
    assert h["ranks"] == [0, 1] and h["steps"] == 3
    assert h["tokens_per_s"] == 12345.0 and h["mfu"] == pytest.approx(0.41)
    assert len(d["breakdown"]["rows"]) == 6
    assert set(d["categories"]) == set(CATS)
    # hotspot shares sum to one; per-step times sum to the mean step time
    assert sum(r["share"] for r in d["hotspots"]) == pytest.approx(1.0)
    mean_step = np.mean([r["total_ms"] for r in d["breakdown"]["rows"]])
    assert sum(r["time_ms"] for r in d["hotspots"]) == pytest.approx(mean_step)
    # roofline against the H100 bf16 roofs
    assert d["roofline"]["peak_tflops"] == pytest.approx(989.4) and d["roofline"]["hbm_tb_s"] == 3.35
    assert len(d["roofline"]["points"]) == 3
    assert d["gemm"][0]["time_ms"] >= d["gemm"][1]["time_ms"]
    assert d["attention"][0]["pct_roofline"] == pytest.approx(0.405)  # percent normalised to a fraction
    assert d["gemm"][0]["tuned"] is None  # no cache given
    tl = d["timeline"]
    assert tl["rank"] == 0 and {s["stream"] for s in tl["streams"]} == {"7", "20"}
    busy = sum(seg[3] for s in tl["streams"] for seg in s["segments"])
    one_step = next(r["total_ms"] for r in d["breakdown"]["rows"] if r["rank"] == 0 and r["step"] == tl["step"])
    assert busy / 1e3 == pytest.approx(one_step)


def test_cache_marks_flow_into_problem_tables() -> None:
    a = synthetic_analysis()
    inp = rp.inputs_from_analysis(a)
    key = a.gemm_problems["problem"][1].key()
    d = rp.report_from_inputs(inp, marks={key: 1.07}, cache_info={"path": "c.json", "entries": 1})
    by_key = {r["key"]: r for r in d["gemm"]}
    assert by_key[key]["tuned"] is True and by_key[key]["speedup"] == 1.07
    other = next(r for r in d["gemm"] if r["key"] != key)
    assert other["tuned"] is False and other["speedup"] is None
    assert d["cache"] == {"path": "c.json", "entries": 1}


def test_large_trace_gives_bounded_report(tmp_path: Path) -> None:
    # 8 ranks x 5 steps x 50k kernels = 2M kernels (a trace of several GB); the page stays small.
    a = synthetic_analysis(n_per_step=50000, ranks=8, steps=5)
    d = rp.report_from_analysis(a)
    for s in d["timeline"]["streams"]:
        assert len(s["segments"]) <= rp.TIMELINE_BINS + 1
    out = write_html(d, tmp_path / "big.html")
    assert out.stat().st_size < 1_000_000


def test_html_is_self_contained() -> None:
    page = render_html(rp.report_from_analysis(synthetic_analysis()))
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<script src" not in page and "@import" not in page


def test_script_end_tag_in_data_is_escaped() -> None:
    a = synthetic_analysis()
    a.kernels.loc[0, "shape"] = "</script><script>alert(1)</script>"
    page = render_html(rp.report_from_analysis(a))
    assert page.count("</script>") == 2  # the data block's and the code block's own


def test_report_without_kernels_is_a_user_error() -> None:
    from primus_perf.errors import UserError

    a = synthetic_analysis()
    a.kernels = a.kernels.iloc[:0]
    with pytest.raises(UserError, match="no GPU kernels"):
        rp.report_from_analysis(a)


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    a = synthetic_analysis()
    d = rp.report_from_inputs(rp.inputs_from_analysis(a), marks={a.gemm_problems["problem"][0].key(): 1.1},
                              cache_info={"path": "cache.json", "entries": 1})
    page = write_html(d, tmp_path / "report.html")
    res = check_in_chromium(page)
    assert res.console_errors == []
    assert res.selfcheck.startswith("ok"), res.selfcheck
    assert "tables=3" in res.selfcheck
    names = {c["name"] for c in res.charts}
    assert names == {"breakdown", "roofline", "timeline"}
    # Coloured pixels inside each chart's box (axes, gridlines and text are grey/black).
    assert res.chart_ink["breakdown"] > 0.1, res.chart_ink
    assert res.chart_ink["timeline"] > 0.05, res.chart_ink
    assert res.chart_ink["roofline"] > 0.003, res.chart_ink
    assert "cached speedup" in res.dom and "tuned" in res.dom


def test_chromium_harness_sees_script_errors(tmp_path: Path) -> None:
    page = render_html(rp.report_from_analysis(synthetic_analysis()))
    bad = tmp_path / "bad.html"
    bad.write_text(page.replace('<script>"use strict";', '<script>"use strict"; undefinedFunction();'))
    res = check_in_chromium(bad)
    assert any("undefinedFunction" in e for e in res.console_errors)
    assert res.selfcheck == ""  # the renderer never ran


def test_many_ranks_breakdown_becomes_per_rank_means() -> None:
    a = synthetic_analysis(n_per_step=20, ranks=90, steps=3)  # 270 (rank, step) pairs
    d = rp.report_from_analysis(a)
    rows = d["breakdown"]["rows"]
    assert d["breakdown"]["per_rank_means"] and len(rows) == 90
    assert rows[5]["label"] == "rank 5 (mean of 3 steps)"
    k = a.kernels
    want = k[k["rank"] == 5].groupby("step")["dur_us"].sum().mean() / 1e3
    assert rows[5]["total_ms"] == pytest.approx(want)


# --------------------------------------------------------------------------- a real run


RUN = Path(__file__).parent / "data" / "traces" / "h100_llama3-8b_l4_s4096_run"


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
                       times={"tuned_ms": 1.0, "default_ms": 9.0}, tuner_version="test", created=1e10)
    TuningCache(path).put_many([e, other])
    return path


def test_report_of_a_real_h100_run_in_chromium(tmp_path: Path) -> None:
    """The committed H100 run (trace + manifest of `primus-profile run`): every section is
    filled from the real analysis, the page renders without console errors, tables sort."""
    from primus_perf.tracelens.analyze import analyze

    a = analyze([RUN])
    top = a.gemm_problems.sort_values("time_s", ascending=False).iloc[0]
    cache = _cache_for(top, "NVIDIA H100 80GB HBM3", tmp_path / "cache.json", 1.25)
    d = rp.build_report([RUN], cache=cache)
    h = d["header"]
    assert h["device"] == "NVIDIA H100 80GB HBM3" and h["steps"] == 3
    assert h["tokens_per_s"] > 40000 and 0.3 < h["mfu"] < 0.6  # from the manifest
    assert h["versions"]["torch"].startswith("2.11")
    assert len(d["gemm"]) == 15 and len(d["attention"]) == 2
    assert sorted(r["direction"] for r in d["attention"]) == ["bwd", "fwd"]
    marked = [r for r in d["gemm"] if r["tuned"]]
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
    assert res.selfcheck == "ok charts=3 tables=3", res.selfcheck
    assert res.chart_ink["breakdown"] > 0.1 and res.chart_ink["timeline"] > 0.05, res.chart_ink
    assert res.chart_ink["roofline"] > 0.003, res.chart_ink
    for text in ("47,7", "42.7%", "aten::_scaled_dot_product_cudnn_attention_backward", ">bwd<", ">tuned<", "1.25×"):
        assert text in res.dom, text
