"""The report's sections experts look for first (step time per rank and step, tune next,
hotspots with their kernels, collectives), its stable colours and its number formatting;
rendered in headless Chromium for a ROCm trace and a 2-rank run."""

from __future__ import annotations

import gzip
import html
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_report import _chromium, check_in_chromium
from test_tracelens_bad_input import rocm_version_of

from primus_perf.problems import (
    AttentionProblem,
    GemmProblem,
    GroupedGemmProblem,
    problem_from_item,
)
from primus_perf.tracelens import report as rp
from primus_perf.tracelens.analyses.tune_next import tune_command, tune_next
from primus_perf.tracelens.analyze import Analysis, analyze
from primus_perf.tracelens.colors import category_colors
from primus_perf.tracelens.report_html import _asset, write_html

TRACES = Path(__file__).parents[1] / "data" / "traces"
H100 = TRACES / "h100_llama3-8b_l2_s1024_cudnn.json.gz"
TP2 = TRACES / "h200_tp2"
NEW_SECTIONS = ("Step time per rank and step", "Tune next", "Hotspots")


@pytest.fixture(scope="module")
def tp2() -> Analysis:
    return analyze([TP2])


@pytest.fixture(scope="module")
def rocm(tmp_path_factory: pytest.TempPathFactory) -> Analysis:
    h100 = analyze([H100])
    trace = json.loads(gzip.decompress(H100.read_bytes()))
    gemm = set(h100.kernels.loc[h100.kernels["category"] == "gemm", "name"].astype(str))
    path = tmp_path_factory.mktemp("rocm") / "mi300x.json.gz"
    path.write_bytes(gzip.compress(json.dumps(rocm_version_of(trace, gemm)).encode()))
    return analyze([path])


def _tables(dom: str) -> dict[str, int]:
    """Table name -> rows of data it was given."""
    return {m.group(2): int(m.group(1)) for m in re.finditer(r'data-rows="(\d+)" data-table="([^"]*)"', dom)}


def _check_page(a: Analysis, path: Path, sections: tuple[str, ...]) -> tuple[dict, str]:
    d = rp.report_from_analysis(a)
    res = check_in_chromium(write_html(d, path))
    assert res.console_errors == [] and res.selfcheck.startswith("ok"), (res.console_errors, res.selfcheck)
    for title in sections:
        assert f"<h2>{title}</h2>" in res.dom, title
        # the section's region of the screenshot has text, rules and bars in it
        assert res.section_ink[title] > 0.03, (title, res.section_ink)
    tables = _tables(res.dom)
    for name in ("temporal", "tune-next", "hotspots"):
        assert tables[name] > 0, tables
    assert res.chart_ink["temporal"] > 0.1, res.chart_ink
    # no number written like 9.20e-3 anywhere on the page
    text = re.sub(r"<script.*?</script>", "", res.dom, flags=re.S)
    assert not re.search(r">[^<]*\d\.\d+e[-+]\d+[^<]*<", text)
    return d, res.dom


def test_rocm_report_in_chromium(rocm: Analysis, tmp_path: Path) -> None:
    d, dom = _check_page(rocm, tmp_path / "rocm.html", NEW_SECTIONS)
    assert d["header"]["device"] == "AMD Instinct MI300X"
    # kernel names under the hotspots: the hipBLASLt kernels of the top GEMM row
    gemm = next(r for r in d["hotspots"] if r["category"] == "gemm")
    names = [d["kernel_names"][i] for i, _ in gemm["kernels"]]
    assert names and all(n.startswith("Cijk_") for n in names)
    assert sum(share for _, share in gemm["kernels"]) <= 1.0 + 1e-9
    assert html.escape(names[0]) in dom and 'class="detail"' in dom
    # the tune-next commands are on the page
    assert "primus-tune gemm --problems" in dom and "primus-tune attention --problem 1,32,32,1024,128,causal" in dom
    assert "Collectives" not in re.findall(r"<h2>([^<]*)</h2>", dom)  # one GPU: no collectives section


def test_two_rank_report_in_chromium(tp2: Analysis, tmp_path: Path) -> None:
    d, dom = _check_page(tp2, tmp_path / "tp2.html", (*NEW_SECTIONS, "Collectives"))
    assert _tables(dom)["collectives"] == len(d["collectives"]) == 4
    assert [r["label"] for r in d["temporal"]] == ["rank 0 step 1", "rank 0 step 2", "rank 1 step 1", "rank 1 step 2"]
    for r, t in zip(d["temporal"], tp2.temporal.itertuples(index=False), strict=True):
        assert sum(r["parts"].values()) == pytest.approx(r["span_ms"]) == pytest.approx(t.span_s * 1e3)
        assert r["wall_ms"] > 0
    ag = next(r for r in d["collectives"] if r["collective"] == "all_gather")
    assert ag["bytes"] == 131334144 * 2 and ag["group_size"] == 2
    # formatted for people: 250.5 MiB as 251, GB/s with 3 significant digits, ranks waited on
    assert ">251 MiB<" in dom and re.search(r">\d{3} GB/s<", dom) and ">rank 1<" in dom
    assert d["header"]["world_size"] == 2 and d["header"]["wall_step_time_ms"] > 0
    assert d["header"]["wall_step_source"] == "the median ProfilerStep span in the trace"  # no manifest


def test_category_colours_are_the_same_in_every_report(tp2: Analysis, rocm: Analysis, tmp_path: Path) -> None:
    a, b = rp.report_from_analysis(tp2), rp.report_from_analysis(rocm)
    assert a["categories"] != b["categories"]  # other categories, in another order
    for cat in set(a["categories"]) & set(b["categories"]):
        assert a["colors"][cat] == b["colors"][cat]
    assert len(set(category_colors(["gemm", "attention_fwd", "communication", "elementwise"]).values())) == 4
    # a category no table knows gets the same colour every time
    assert category_colors(["conv_fwd"]) == category_colors(["conv_fwd"])
    # and the page draws what the data says: the gemm chip of both pages
    for name, data in (("a", a), ("b", b)):
        dom = check_in_chromium(write_html(data, tmp_path / f"{name}.html")).dom
        chips = set(re.findall(r'data-category="gemm"><i class="chip" style="background:([^"]+)"', dom))
        assert chips == {a["colors"]["gemm"]}, chips


FORMAT_CASES = [
    ("num", 0.0092, "0.0092"), ("num", 12.345, "12.3"), ("num", 1234.5, "1,235"), ("num", 47757.3, "47,757"),
    ("num", 0, "0"), ("num", 3e-7, "<0.0001"), ("num", None, "–"), ("num", 99.96, "100"),
    ("ms", 174.03, "174 ms"), ("ms", 9.2, "9.2 ms"), ("ms", 0.0092, "9.2 µs"), ("ms", 0.25, "0.25 ms"),
    ("us", 550.69, "551 µs"), ("us", 7273.3, "7.27 ms"),
    ("pct", 0.4270, "42.7%"), ("spct", -0.061, "-6.1%"), ("spct", 0.004, "+0.4%"),
    ("count", 2, "2"), ("count", 0.2, "0.2"), ("count", 12000, "12,000"),
    ("bytes", 4, "4 B"), ("bytes", 16777216, "16 MiB"), ("bytes", 262668288, "251 MiB"), ("bytes", 2101346304, "1.96 GiB"),
    ("gbs", 238.68, "239 GB/s"), ("tflops", 989.4, "989 TFLOP/s"),
]


def test_number_formatting(tmp_path: Path) -> None:
    page = tmp_path / "fmt.html"
    cases = json.dumps([[f, v] for f, v, _ in FORMAT_CASES])
    page.write_text(f"<!DOCTYPE html><html><body><pre id='out'></pre><script>{_asset('format.js')}\n"
                    f"document.getElementById('out').textContent = JSON.stringify({cases}.map(([f, v]) => "
                    f"PrimusFormat[f](v)));</script></body></html>")
    dom = _chromium(["--virtual-time-budget=5000", "--dump-dom", page.as_uri()], str(tmp_path / "profile")).stdout
    got = json.loads(html.unescape(re.search(r"<pre id=\"out\">(.*?)</pre>", dom, re.S).group(1)))
    assert got == [want for _, _, want in FORMAT_CASES]


# --------------------------------------------------------------------------- tune next


def _gemm(m: int) -> GemmProblem:
    return GemmProblem.from_row_major(m, 4096, 4096, b_transposed=True)


def _table(rows: list[tuple]) -> pd.DataFrame:
    cols = ["problem", "direction", "calls", "time_s", "pct_roofline"]
    df = pd.DataFrame(rows, columns=cols)
    df["key"] = [p.key() for p in df["problem"]]
    df["label"] = [str(p) for p in df["problem"]]
    return df


def test_tune_next_ranks_by_time_times_distance_to_the_roof() -> None:
    a, b, c, d = _gemm(1024), _gemm(2048), _gemm(4096), _gemm(8192)
    gemm = _table([(a, "fwd", 1, 0.010, 0.90),  # 1 ms to gain
                   (b, "fwd", 1, 0.004, 0.25),  # 3 ms
                   (c, "fwd", 2, 0.002, np.nan),  # roof unknown: counts as 2 ms
                   (d, "fwd", 1, 0.020, 1.20)])  # above the roof (clipped): nothing to gain
    att = AttentionProblem(2, 32, 8, 4096, 4096, 128, "bf16", True, "bshd")
    attn = _table([(att, "fwd", 4, 0.003, 0.50), (att, "bwd", 4, 0.005, 0.60)])  # 1.5 + 2 = 3.5 ms, one row
    up = GroupedGemmProblem(groups=8, k=4096, n=2048, tokens=8192, skew=2)
    grouped = _table([(up, "fwd", 2, 0.005, 0.50), (up.with_phase("wgrad"), "wgrad", 2, 0.004, 0.875)])  # 2.5, 0.5 ms
    t = tune_next({"gemm": gemm, "grouped_gemm": grouped, "attention": attn})
    assert list(t["key"]) == [att.key(), b.key(), up.key(), c.key(), a.key(), up.with_phase("wgrad").key(), d.key()]
    assert t["score"].tolist() == pytest.approx([0.0035, 0.003, 0.0025, 0.002, 0.001, 0.0005, 0.0])
    assert t["kind"].tolist() == ["attention", "gemm", "grouped_gemm", "gemm", "gemm", "grouped_gemm", "gemm"]
    assert t.loc[0, "time_s"] == pytest.approx(0.008) and t.loc[0, "pct_roofline"] == pytest.approx(1 - 0.0035 / 0.008)
    assert np.isnan(t.loc[3, "pct_roofline"])
    assert list(tune_next({"gemm": gemm, "attention": attn}, top=2)["key"]) == [att.key(), b.key()]
    assert tune_next({"gemm": gemm.iloc[:0], "attention": attn.iloc[:0]}).empty


def test_tune_commands_name_exactly_the_problem() -> None:
    from primus_perf.cli.tune_attention import parse_attention_spec as parse_problem_spec

    att = AttentionProblem(2, 32, 8, 4096, 4096, 128, "bf16", True, "bshd")
    cmd = tune_command("attention", att)
    spec, dtype = re.fullmatch(r"primus-tune attention --problem (\S+) --dtype (\S+)", cmd).groups()
    assert parse_problem_spec(spec, dtype).key() == att.key()
    # a GEMM with packed operands: the short row-major spelling; one with a leading dimension
    # of its own (a view): every field; both read back as the same problem
    packed = _gemm(1024)
    view = GemmProblem(**{**packed.to_dict(), "lda": packed.lda * 2})
    cross = AttentionProblem(1, 16, 16, 128, 4096, 64, "bf16", False, "bshd")
    grouped = GroupedGemmProblem(groups=32, k=7168, n=4096, tokens=8192, skew=1.5, trans_w=True, phase="dgrad")
    for kind, command, p in (("gemm", "gemm", packed), ("gemm", "gemm", view), ("attention", "attention", cross),
                             ("grouped_gemm", "grouped-gemm", grouped)):
        cmd = tune_command(kind, p)
        doc, name, name2 = re.fullmatch(rf"echo '(.*)' > (\S+\.json) && primus-tune {command} --problems (\S+)",
                                        cmd).groups()
        assert name == name2
        items = json.loads(doc)
        assert len(items) == 1 and problem_from_item(items[0]).key() == p.key()
    assert '"M":' in tune_command("gemm", packed) and '"lda":' in tune_command("gemm", view)


def test_report_of_a_real_run_lists_what_to_tune_next() -> None:
    a = analyze([TRACES / "h100_llama3-8b_l4_s4096_run"])
    rows = rp.report_from_analysis(a)["tune_next"]
    assert len(rows) == len(a.gemm_problems) + 1  # 15 GEMMs and one attention problem (fwd + bwd)
    assert all(x["saving_ms"] >= y["saving_ms"] for x, y in itertools.pairwise(rows))
    assert rows[0]["kind"] == "attention" and rows[0]["command"].startswith("primus-tune attention --problem 2,32,32,")
