"""Expert-parallel runs in the analyzer and the report: the all-to-allv sizes of every call
from the recorded shapes, one bandwidth row per group for them instead of one per size,
each rank's all-to-all time, bytes and bandwidth, and the expert load the run recorded
(missing and malformed entries left out with a note); the page in headless Chromium; a
profiled MoE run records its tokens per expert. The two-rank run is written event by event
(:mod:`moe_ep_traces`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_report import check_in_chromium

from moe_ep_traces import EXPERTS, TOKENS, calls, manifest, write_run
from primus_perf.tracelens import report as rp
from primus_perf.tracelens.analyses.collectives import SIZES_VARY
from primus_perf.tracelens.analyses.expert_load import expert_load
from primus_perf.tracelens.analyze import Analysis, analyze
from primus_perf.tracelens.report_html import write_html
from trainer_runs import _run

TRACES = Path(__file__).parents[1] / "data" / "traces"


@pytest.fixture(scope="module")
def ep2(tmp_path_factory: pytest.TempPathFactory) -> Analysis:
    return analyze([write_run(tmp_path_factory.mktemp("ep2") / "run")])


def _v_calls(rank: int) -> list[Any]:
    return [c for c in calls(rank) if c.in_splits is not None]


def test_all_to_allv_sizes_of_every_call(ep2: Analysis) -> None:
    """Input (sent) and output (received) bytes of each call from the c10d op's shapes; the
    message the larger of the two; split sizes make it an all_to_allv."""
    ev = ep2.collective_events.sort_values(["rank", "ts_us"], ignore_index=True)
    want = [(rank, "all_to_all" if c.in_splits is None else "all_to_allv", c.in_bytes, c.out_bytes,
             max(c.in_bytes, c.out_bytes), 2, c.dur_us) for rank in (0, 1) for c in calls(rank)]
    got = list(ev[["rank", "collective", "in_bytes", "out_bytes", "bytes", "group_size", "dur_us"]]
               .itertuples(index=False, name=None))
    assert got == want
    assert len({c.in_bytes for r in (0, 1) for c in _v_calls(r)} | {c.out_bytes for r in (0, 1) for c in _v_calls(r)}
               ) > 2  # sizes that change by step and rank


def test_all_to_allv_is_one_row_per_group_with_its_bytes_over_its_time(ep2: Analysis) -> None:
    bw = ep2.collective_bandwidth
    assert sorted(bw["collective"]) == ["all_to_all", "all_to_allv"]
    v = bw[bw["collective"] == "all_to_allv"].iloc[0]
    sizes = [max(c.in_bytes, c.out_bytes) for r in (0, 1) for c in _v_calls(r)]
    per_rank = [sum(max(c.in_bytes, c.out_bytes) for c in _v_calls(r)) / (sum(c.dur_us for c in _v_calls(r)) * 1e-6)
                / 1e9 for r in (0, 1)]
    assert (v["group_size"], v["ranks"], v["calls"], v["sizes"]) == (2, 2, 4.0, len(set(sizes)))
    assert v["bytes"] == round(np.mean(sizes))
    assert v["algbw_gbs"] == pytest.approx(np.median(per_rank)) and v["busbw_gbs"] == pytest.approx(v["algbw_gbs"] / 2)
    assert (v["min_busbw_gbs"], v["max_busbw_gbs"]) == pytest.approx((min(per_rank) / 2, max(per_rank) / 2))
    # calls of different sizes on the two ranks are still matched: rank 1 starts 3 us later
    assert v["mean_skew_us"] == pytest.approx(3.0) and v["last_rank"] == 1
    # the hotspots keep one row for them, not one per size
    comm = ep2.hotspots[ep2.hotspots["op"] == "nccl:all_to_all"].set_index("shape")
    assert sorted(comm.index) == sorted([SIZES_VARY, "8 i64"]) and comm.loc[SIZES_VARY, "calls"] == 4.0


def test_all_to_all_time_bytes_and_bandwidth_per_rank(ep2: Analysis) -> None:
    t = ep2.collective_ranks
    assert list(t["collective"]) == ["all_to_allv"] * 2 + ["all_to_all"] * 2 and list(t["rank"]) == [0, 1, 0, 1]
    v = t[t["collective"] == "all_to_allv"].set_index("rank")
    steps = len(ep2.steps)
    for rank in (0, 1):
        cs = _v_calls(rank)
        message, seconds = sum(max(c.in_bytes, c.out_bytes) for c in cs), sum(c.dur_us for c in cs) * 1e-6
        r = v.loc[rank]
        assert r["calls"] == len(cs) / steps and r["time_s"] == pytest.approx(seconds / steps)
        assert (r["bytes"], r["in_bytes"], r["out_bytes"]) == (message / steps, sum(c.in_bytes for c in cs) / steps,
                                                               sum(c.out_bytes for c in cs) / steps)
        assert r["algbw_gbs"] == pytest.approx(message / seconds / 1e9) and r["busbw_gbs"] == r["algbw_gbs"] / 2
    assert v.loc[0, "bytes"] != v.loc[1, "bytes"]  # rank 0 receives more in the dispatch of step 1


def _layers(table: Any) -> list[dict[str, Any]]:
    return table.drop(columns="load").to_dict(orient="records")


def test_expert_load_over_the_profiled_steps() -> None:
    table, notes = expert_load(manifest())
    assert notes == []
    steps = np.array([TOKENS[1], TOKENS[2]], dtype=float)  # the active steps only: not baseline, warm-up, after
    mean = steps.mean(axis=0)
    assert [list(x) for x in table["load"]] == [list(m) for m in mean]
    assert _layers(table) == [
        {"layer": 1, "experts": EXPERTS, "steps": 2, "tokens": 128.0, "min": 11.0, "median": 16.0, "max": 23.0,
         "imbalance": 23 / 16, "worst_step_imbalance": 24 / 16, "idle": 0},
        {"layer": 2, "experts": EXPERTS, "steps": 2, "tokens": 128.0, "min": 0.0, "median": 18.5, "max": 28.0,
         "imbalance": 28 / 16, "worst_step_imbalance": 30 / 16, "idle": 2}]


def test_a_run_without_moe_layers_has_no_expert_load() -> None:
    dense = json.loads((TRACES / "h100_llama3-8b_l4_s4096_run" / "manifest.json").read_text())
    for m in (dense, {}, {"steps": "x"}, {"steps": [1, "x", {"phase": "active"}]}):
        table, notes = expert_load(m)
        assert table.empty and notes == [], m


@pytest.mark.parametrize("bad", ["x", None, {"layer": [1]}, [], [[]], [[1, -1]], [[1, True]], [[1.5, 2]],
                                 [[3, 2, 1]], [[1, 2]] * 3])
def test_malformed_counts_are_left_out_with_one_note(bad: Any) -> None:
    """A step whose counts are not a list per layer of token counts, or of another number
    of layers or experts than the first step's, is left out."""
    steps = [{"index": 2, "phase": "active", "tokens_per_expert": [[4, 0], [1, 3]]},
             {"index": 3, "phase": "active", "tokens_per_expert": bad},
             {"index": 4, "phase": "active"}]  # one that recorded none
    table, notes = expert_load({"steps": steps})
    assert len(table) == 2 and (table["steps"] == 1).all() and list(table["idle"]) == [1, 0]
    assert len(notes) == 2
    assert notes[0] == ("expert load: 1 of 3 profiled steps did not record tokens_per_expert; the table is of the "
                        "other 2")
    assert notes[1].startswith("expert load: tokens_per_expert of step 4 is not a list per MoE layer") and \
        notes[1].endswith("left out, 1 step(s) remain")


def test_all_counts_malformed_leave_no_table_and_one_note() -> None:
    steps = [{"index": i, "phase": "active", "tokens_per_expert": "corrupt"} for i in range(5)]
    table, notes = expert_load({"steps": steps})
    assert table.empty and len(notes) == 1
    assert "of steps 1, 2, 3 and 2 more is not" in notes[0] and notes[0].endswith("no expert load is shown")


def test_analyze_prints_all_to_all_per_rank_and_the_expert_load(tmp_path: Path) -> None:
    """The terminal tables and --json; a malformed step is one note, not a traceback."""
    steps = manifest()["steps"]
    steps[3]["tokens_per_expert"] = [[1, 2]]  # profiled step 2: one layer of two experts
    run = write_run(tmp_path / "run", steps)
    out = tmp_path / "a.json"
    r = subprocess.run([sys.executable, "-m", "primus_perf.cli.profile", "analyze", str(run), "--json", str(out)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "all-to-all per rank (per step)" in r.stdout and "collective bandwidth" in r.stdout
    per_rank = r.stdout.split("all-to-all per rank (per step)")[1]
    rows = [line for line in per_rank.splitlines() if line.startswith("│ all_to_allv ")]
    cells = [c.strip() for c in rows[0].strip("│ ").split("│")]
    assert len(rows) == 2 and cells == ["all_to_allv", "0", "4", "0.153", "67 KiB", "65 KiB", "65 KiB", "0.448",
                                        "0.224"], r.stdout
    assert "Expert load over 1 profiled step(s), 2 MoE layer(s) of 8 experts: most imbalanced layer 2, max/mean " \
           "1.88 (worst step 1.88); 2 idle expert(s)" in r.stdout
    assert "note: expert load: tokens_per_expert of step 4 is not a list" in " ".join(r.stderr.split())
    doc = json.loads(out.read_text())
    assert [x["rank"] for x in doc["collective_ranks"]] == [0, 1, 0, 1]
    assert [x["layer"] for x in doc["expert_load"]] == [1, 2] and doc["collective_bandwidth"][0]["sizes"] == 3


def test_report_shows_all_to_all_per_rank_and_the_expert_load(ep2: Analysis, tmp_path: Path) -> None:
    d = rp.report_from_analysis(ep2)
    assert [(r["collective"], r["rank"]) for r in d["collective_ranks"]] == \
        [("all_to_allv", 0), ("all_to_allv", 1), ("all_to_all", 0), ("all_to_all", 1)]
    load = d["expert_load"]
    assert [x["layer"] for x in load["layers"]] == [1, 2] and len(load["layers"][1]["load"]) == EXPERTS
    res = check_in_chromium(write_html(d, tmp_path / "ep2.html"))
    assert res.console_errors == [] and res.selfcheck.startswith("ok"), (res.console_errors, res.selfcheck)
    tables = {m.group(2): int(m.group(1)) for m in re.finditer(r'data-rows="(\d+)" data-table="([^"]*)"', res.dom)}
    assert tables["collective-ranks"] == 4 and tables["expert-load"] == 2
    for title in ("Collectives", "Collectives per rank", "Expert load"):
        assert res.section_ink[title] > 0.03, res.section_ink
    assert res.chart_ink["expert-load"] > 0.1, res.chart_ink
    assert "(mean of 3 sizes)" in res.dom and "Expert load over 2 profiled step(s)" in res.dom
    assert ">output (received)/step<" in res.dom and ">67 KiB<" in res.dom


def test_profile_run_of_an_moe_model_records_its_tokens_per_expert(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = _run(["run", "--config", "tiny-moe", "--out", str(out), "--steps", "2", "--wait", "0", "--baseline", "1",
              "--after", "1", "train.seq_len=64", "train.micro_batch=2"],
             module="primus_perf.cli.profile")
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    tokens = 2 * 64 * 2  # micro-batch x sequence x top-k
    for s in m["steps"]:
        assert [len(layer) for layer in s["tokens_per_expert"]] == [8, 8], s
        assert [sum(layer) for layer in s["tokens_per_expert"]] == [tokens, tokens]
    table = analyze([out]).expert_load
    assert list(table["layer"]) == [1, 2] and (table["steps"] == 2).all() and (table["tokens"] == tokens).all()
